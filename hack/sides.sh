#!/usr/bin/env bash
# Prints what the two policy sides per identifier (README, tiers section)
# cost and what their alternative would have: the grace period a change
# waits before it rewrites the side it left, and a trie lookup through an
# ARRAY_OF_MAPS slot against a direct one (the datapath names both sides'
# maps directly). Root, clang.
set -euo pipefail
cd "$(dirname "$0")/.."
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
clang -O2 -g -target bpf -I/usr/include/x86_64-linux-gnu -c hack/sides/bpf/sides.c -o "$tmp/sides.o"
go build -o "$tmp/sides" ./hack/sides
taskset -c "${BENCH_CPU:-0}" "$tmp/sides" -obj "$tmp/sides.o"
