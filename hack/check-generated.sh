#!/usr/bin/env bash
# Checks that the committed bpf2go output matches the C sources under bpf/:
# regenerates it in a scratch copy of the module and compares byte for byte.
set -euo pipefail
top=$(cd "$(dirname "$0")/.." && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cp -r "$top/go.mod" "$top/go.sum" "$top/bpf" "$tmp/"
(cd "$tmp" && go generate ./bpf/... >/dev/null)
cd "$top"
for f in $(find bpf -name '*_bpfel.go' -o -name '*_bpfel.o'); do
	if ! cmp -s "$f" "$tmp/$f"; then
		echo "generated file out of date: $f (run make generate)" >&2
		exit 1
	fi
done
echo "generated files are in sync with the C sources under bpf/"
