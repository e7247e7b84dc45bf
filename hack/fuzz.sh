#!/usr/bin/env bash
# make fuzz: runs each fuzz target (PACKAGE:NAME) for FUZZTIME, one after
# another (go test fuzzes one target per call).
#
# Go's fuzz coordinator can fail a run that found nothing with a bare
# "context deadline exceeded" when -fuzztime ends: it compares the expired
# timeout with its own child context before the cancellation has reached
# the child (internal/fuzz, CoordinateFuzzing). A failure the fuzzer found
# always writes its input and says so ("Failing input written to ..."), so
# a run that ends on that line alone, with no input written, found nothing,
# and counts as passed, with a line saying so.
set -uo pipefail
usage() { echo "usage: hack/fuzz.sh FUZZTIME PACKAGE:NAME..." >&2; exit 2; }
[ $# -ge 2 ] || usage
fuzztime=$1
shift
log=$(mktemp)
trap 'rm -f "$log"' EXIT
for t in "$@"; do
	pkg=${t%%:*} name=${t##*:}
	echo "fuzz $name ($pkg, $fuzztime)"
	go test -run '^$' -fuzz "^$name\$" -fuzztime "$fuzztime" "$pkg" 2>&1 | tee "$log"
	[ "${PIPESTATUS[0]}" -eq 0 ] && continue
	if ! grep -q 'Failing input written to' "$log" && grep -qx '    context deadline exceeded' "$log"; then
		echo "fuzz $name: go ended the run with 'context deadline exceeded' and wrote no failing input: nothing was found"
		continue
	fi
	exit 1
done
