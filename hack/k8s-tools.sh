#!/usr/bin/env bash
# Builds what the tests start, from Go modules, into a cache outside the
# clone keyed by hack/k8s-tools' go.mod, go.sum and this script, and prints
# the directory that holds them:
#   etcd, kube-apiserver                     (test/kubeapi: every API test)
#   kube-controller-manager, kube-scheduler,
#   kubelet, kube-proxy, kubectl, pause,
#   agnhost, e2e.test                        (test/node: the real node, and
#                                             Kubernetes' NetworkPolicy suite)
#   coredns                                  (coredns/: its own module, with
#                                             the plugins the node uses)
#   network-policy-controller                (its own module, pinned here)
# A cold build takes about 17 minutes on a 2-core machine; later calls
# return at once. Binaries are static and stripped, with no DWARF: the
# tests only run them.
#
#   hack/k8s-tools.sh            # build what is missing, print the directory
#   hack/k8s-tools.sh etcd kube-apiserver  # only these (make test starts
#                                # the API tests on them, the rest building)
#   PODFENCE_CACHE=/some/dir ... # cache somewhere else (default ~/.cache/podfence)
set -euo pipefail
cd "$(dirname "$0")/k8s-tools"
controller=github.com/aws/amazon-network-policy-controller-k8s/cmd@v1.1.10
# The script's comments are left out: rewording one rebuilds nothing.
key=$( (cat go.mod go.sum pause/main.go coredns/go.mod coredns/go.sum coredns/main.go; grep -v '^[[:space:]]*#' ../k8s-tools.sh) | sha256sum | cut -c1-16)
dir=${PODFENCE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/podfence}/k8s-tools/$key
tools=(etcd kube-apiserver kube-controller-manager kube-scheduler kubelet kube-proxy kubectl pause agnhost e2e.test coredns network-policy-controller)
wanted=("${tools[@]}")
if (($#)); then
	for t in "$@"; do
		[[ " ${tools[*]} " == *" $t "* ]] || { echo "k8s-tools: no tool $t (tools: ${tools[*]})" >&2; exit 2; }
	done
	wanted=("$@")
fi
# need TOOL: true if TOOL was asked for and is not built yet.
need() { [[ " ${wanted[*]} " == *" $1 "* && ! -x $dir/$1 ]]; }
missing=0
for t in "${wanted[@]}"; do ! need "$t" || missing=1; done
if [[ $missing == 0 ]]; then
	echo "$dir"
	exit 0
fi
mkdir -p "$dir"
tmp=$(mktemp -d "$dir/.build.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
export CGO_ENABLED=0
# No DWARF: the linker's -s drops it from the binaries, and the compiler's
# -dwarf=false stops writing it into every package: kube-proxy's cold
# build took 202 s of wall time and 388 s of CPU without it, 231 s and
# 441 s with (/usr/bin/time, an empty GOCACHE each).
flags=(-trimpath -ldflags=-s -gcflags=all=-dwarf=false)

# Each build moves into $dir only what it finished, so an interrupted run
# leaves nothing half-built behind. They run one after another: side by side
# they took longer on two cores (1,832 s against 1,759 s), the Kubernetes
# build alone keeping both busy.
kube() { # the binaries of this module's graph, in one go build
	local out=$tmp/kube pkgs=()
	mkdir -p "$out"
	! need etcd || pkgs+=(go.etcd.io/etcd/server/v3)
	for cmd in kube-apiserver kube-controller-manager kube-scheduler kubelet kube-proxy kubectl; do
		! need "$cmd" || pkgs+=("k8s.io/kubernetes/cmd/$cmd")
	done
	! need pause || pkgs+=(./pause)
	! need agnhost || pkgs+=(k8s.io/kubernetes/test/images/agnhost)
	if ((${#pkgs[@]})); then
		go build "${flags[@]}" -o "$out/" "${pkgs[@]}"
		# go build names etcd after its module path without the major version.
		[[ ! -e $out/server ]] || mv "$out/server" "$out/etcd"
		mv "$out"/* "$dir/"
	fi
	if need e2e.test; then
		go test -c "${flags[@]}" -o "$tmp/e2e.test" k8s.io/kubernetes/test/e2e
		mv "$tmp/e2e.test" "$dir/"
	fi
}
# Modules of their own, with their own go.mod. CoreDNS's release links
# every plugin (218 s cold); coredns/ is its server with the Corefile's.
coredns() {
	need coredns || return 0
	(cd coredns && go build "${flags[@]}" -o "$tmp/coredns" .)
	mv "$tmp/coredns" "$dir/"
}
# The controller as its release builds it.
controller() {
	need network-policy-controller || return 0
	mkdir -p "$tmp/controller"
	GOBIN="$tmp/controller" GOFLAGS=-mod=mod go install "${flags[@]}" "$controller"
	mv "$tmp/controller/cmd" "$dir/network-policy-controller"
}
timed() { # name, function
	local start=$SECONDS
	"$2"
	echo "k8s-tools: $1 built in $((SECONDS - start)) s" >&2
}

echo "k8s-tools: building ${*:-every tool} into $dir (cold, all of them: about 17 minutes)" >&2
start=$SECONDS
timed "Kubernetes' binaries, etcd, agnhost, e2e.test" kube
timed coredns coredns
timed network-policy-controller controller
echo "k8s-tools: built in $((SECONDS - start)) s" >&2
echo "$dir"
