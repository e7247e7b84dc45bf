#!/usr/bin/env bash
# Checks that the committed bpf2go output matches the C sources under bpf/:
# regenerates it in a scratch copy of the module and compares byte for byte.
set -euo pipefail
top=$(cd "$(dirname "$0")/.." && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# check <label> [env]: regenerate with env and compare with the committed files.
check() {
	local label=$1
	shift
	rm -rf "$tmp/m"
	mkdir -p "$tmp/m/hack"
	cp -r "$top/go.mod" "$top/go.sum" "$top/bpf" "$tmp/m/"
	cp "$top/hack/bpf2go.sh" "$tmp/m/hack/"
	(cd "$tmp/m" && env "$@" go generate ./bpf/... >/dev/null)
	for f in $(cd "$top" && find bpf -name '*_bpfel.go' -o -name '*_bpfel.o'); do
		if ! cmp -s "$top/$f" "$tmp/m/$f"; then
			echo "generated file out of date ($label): $f (run make generate)" >&2
			exit 1
		fi
	done
	echo "generated files are in sync with the C sources under bpf/ ($label)"
}
check "this machine's headers"
# Graviton nodes: the same object from arm64's headers (Debian's
# linux-libc-dev-arm64-cross, which hack/deps.sh installs).
arm64=/usr/aarch64-linux-gnu/include
if [ -e "$arm64/asm/types.h" ]; then
	check "arm64 headers" BPF_ASM_INCLUDE="$arm64"
else
	echo "arm64 headers missing ($arm64): install linux-libc-dev-arm64-cross" >&2
	exit 1
fi
