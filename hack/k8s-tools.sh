#!/usr/bin/env bash
# Builds kube-apiserver and etcd from hack/k8s-tools (their Go modules) into a
# cache outside the clone, keyed by that module's go.mod and go.sum, and
# prints the directory that holds them. A cold build takes about 12 minutes
# on a 2-core machine; later calls return at once.
#
#   hack/k8s-tools.sh            # build what is missing, print the directory
#   PODFENCE_CACHE=/some/dir ... # cache somewhere else (default ~/.cache/podfence)
set -euo pipefail
cd "$(dirname "$0")/k8s-tools"
key=$(cat go.mod go.sum | sha256sum | cut -c1-16)
dir=${PODFENCE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/podfence}/k8s-tools/$key
if [[ -x $dir/kube-apiserver && -x $dir/etcd ]]; then
	echo "$dir"
	exit 0
fi
mkdir -p "$dir"
tmp=$(mktemp -d "$dir/.build.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
echo "k8s-tools: building kube-apiserver and etcd into $dir (cold: about 12 minutes)" >&2
start=$SECONDS
# Static and without debug info: the tests only start them.
CGO_ENABLED=0 go build -trimpath -ldflags=-s -o "$tmp/etcd" go.etcd.io/etcd/server/v3
CGO_ENABLED=0 go build -trimpath -ldflags=-s -o "$tmp/kube-apiserver" k8s.io/kubernetes/cmd/kube-apiserver
mv "$tmp/etcd" "$tmp/kube-apiserver" "$dir/"
echo "k8s-tools: built in $((SECONDS - start)) s" >&2
echo "$dir"
