#!/usr/bin/env bash
# Runs one real-node test COUNT times in a row (stopping at the first
# failure) while `make race-prebuild` compiles from an empty GOCACHE, over
# and over, in a session of its own at the lowest priority, as make test
# runs it beside the tests: the CPU contention a race-prone test must
# survive in CI.
#
#   hack/repeat-realnode.sh TestAdoptionRacesRuntime      # 20 runs
#   COUNT=5 hack/repeat-realnode.sh TestChurn
set -euo pipefail
[ $# -eq 1 ] || { echo "usage: hack/repeat-realnode.sh TESTNAME" >&2; exit 2; }
cd "$(dirname "$0")/.."
tools=$(hack/k8s-tools.sh)
cache=$(mktemp -d)
# The loop's GOCACHE is emptied before each build, so every build is cold.
setsid sh -c 'echo 19 >/proc/self/autogroup 2>/dev/null; exec nice -n 19 sh -c "while :; do rm -rf \"$0\"/*; GOCACHE=\"$0\" make --no-print-directory race-prebuild >/dev/null 2>&1; done"' "$cache" &
pre=$!
trap 'kill -- -$pre 2>/dev/null || true; rm -rf "$cache"' EXIT
PODFENCE_K8S_TOOLS=$tools PODFENCE_REQUIRE_K8S=1 \
	go test -count="${COUNT:-20}" -failfast -v -timeout 3h -run "^$1\$" ./test/realnode/
