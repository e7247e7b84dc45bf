#!/usr/bin/env bash
# Checks that the committed bpf2go output matches bpf/*.c: regenerates it in
# a scratch copy of the module and compares byte for byte.
set -euo pipefail
top=$(cd "$(dirname "$0")/.." && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cp -r "$top/go.mod" "$top/go.sum" "$top/bpf" "$tmp/"
(cd "$tmp" && go generate ./bpf/ >/dev/null)
for f in "$top"/bpf/*_bpfel.go "$top"/bpf/*_bpfel.o; do
	if ! cmp -s "$f" "$tmp/bpf/$(basename "$f")"; then
		echo "generated file out of date: bpf/$(basename "$f") (run make generate)" >&2
		exit 1
	fi
done
echo "generated files are in sync with bpf/*.c"
