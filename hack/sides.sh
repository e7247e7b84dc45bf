#!/usr/bin/env bash
# Prints what atomic policy changes through two policy sides per identifier
# would cost (not built yet; the design is in the README's tiers section):
# a trie lookup through the side's map slot against a direct one, and the
# grace period a change would wait. Root, clang.
set -euo pipefail
cd "$(dirname "$0")/.."
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
clang -O2 -g -target bpf -I/usr/include/x86_64-linux-gnu -c hack/sides/bpf/sides.c -o "$tmp/sides.o"
go build -o "$tmp/sides" ./hack/sides
taskset -c "${BENCH_CPU:-0}" "$tmp/sides" -obj "$tmp/sides.o"
