#!/usr/bin/env bash
# Builds the CNI plugins the real node's primary conflist uses (ptp,
# host-local, portmap, loopback) from containernetworking/plugins at the
# version podfence's go.mod pins, into a cache outside the clone, and
# prints the directory.
set -euo pipefail
cd "$(dirname "$0")/.."
version=$(go list -m -f '{{.Version}}' github.com/containernetworking/plugins)
dir=${PODFENCE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/podfence}/cni-plugins/$version
plugins=(main/ptp ipam/host-local meta/portmap main/loopback)
for p in "${plugins[@]}"; do
	if [[ ! -x $dir/$(basename "$p") ]]; then
		mkdir -p "$dir"
		# Its own module's dependencies (portmap needs some podfence's
		# do not), as its release builds them.
		(cd / && CGO_ENABLED=0 GOBIN="$dir" GOFLAGS=-mod=mod go install -trimpath -ldflags=-s "github.com/containernetworking/plugins/plugins/$p@$version")
	fi
done
echo "$dir"
