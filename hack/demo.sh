#!/usr/bin/env bash
# The main job for a newcomer (root): builds podfence and the stand-in
# primary CNI (ptp + host-local), then runs hack/demo, which chains them
# through libcni in network namespaces and shows a policy at work. It
# removes everything it creates.
set -euo pipefail
cd "$(dirname "$0")/.."
hack/deps.sh
bin=$(mktemp -d)
trap 'rm -rf "$bin"' EXIT
echo "building podfence, podfence-sweeper, ptp and host-local into $bin"
CGO_ENABLED=0 go build -o "$bin/podfence" ./plugins/podfence
CGO_ENABLED=0 go build -o "$bin/podfence-sweeper" ./sweeper
go build -o "$bin/ptp" github.com/containernetworking/plugins/plugins/main/ptp
go build -o "$bin/host-local" github.com/containernetworking/plugins/plugins/ipam/host-local
go run ./hack/demo -bin "$bin"
