#!/usr/bin/env bash
# The main job for a newcomer. The CNI plugin is not built yet (issue 4);
# until then the demo runs the datapath's verdict table, which shows the
# programs allowing and denying real packets in the kernel.
set -euo pipefail
cd "$(dirname "$0")/.."
hack/deps.sh
echo "podfence demo: the CNI plugin is not there yet; running the datapath verdict table instead."
go test -count=1 -v -run 'TestVerdicts' ./bpf/ | grep -E '^(=== RUN|--- |ok|FAIL|PASS)|verdict_test' | sed 's/^=== RUN   /running: /'
