#!/usr/bin/env bash
# Runs the datapath benchmark (root) and prints each case's kernel time as a
# ratio to the empty program measured in the same run, beside its target.
set -euo pipefail
cd "$(dirname "$0")/.."
benchtime=${BENCHTIME:-500000x}
# One CPU for the whole run: the vCPUs of a shared VM differ by up to half in
# speed, and a ratio is only meaningful when floor and case ran on the same one.
cpu=${BENCH_CPU:-0}
go test -c -o /tmp/podfence-bpf.test ./bpf/
out=$(taskset -c "$cpu" /tmp/podfence-bpf.test -test.run '^$' -test.bench 'BenchmarkDatapath' -test.benchtime "$benchtime")
rm -f /tmp/podfence-bpf.test
echo "$out" | grep -E '^(goos|goarch|cpu|Benchmark)'
echo
echo "case                          kernel ns   x floor   target   verified insns"
echo "$out" | awk '/^BenchmarkDatapath/ {
	name=$1; sub(/^BenchmarkDatapath\//, "", name); sub(/-[0-9]+$/, "", name)
	ns=""; x=""; t="-"; ins=""
	for (i = 3; i < NF; i += 2) {
		if ($(i+1) == "ns/op") ns=$i
		if ($(i+1) == "x-floor") x=$i
		if ($(i+1) == "x-target") t="<= " $i
		if ($(i+1) == "insns") ins=$i
	}
	printf "%-28s %10s %9s %8s %12s\n", name, ns, x, t, ins
}'
