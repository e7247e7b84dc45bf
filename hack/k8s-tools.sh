#!/usr/bin/env bash
# Builds what the tests start, from Go modules, into a cache outside the
# clone keyed by hack/k8s-tools' go.mod, go.sum and this script, and prints
# the directory that holds them:
#   etcd, kube-apiserver                     (test/kubeapi: every API test)
#   kube-controller-manager, kube-scheduler,
#   kubelet, kube-proxy, kubectl, pause,
#   agnhost, e2e.test                        (test/node: the real node, and
#                                             Kubernetes' NetworkPolicy suite)
#   coredns, network-policy-controller       (their own modules, pinned here)
# A cold build takes about 30 minutes on a 2-core machine; later calls
# return at once. Binaries are static and stripped: the tests only run them.
#
#   hack/k8s-tools.sh            # build what is missing, print the directory
#   PODFENCE_CACHE=/some/dir ... # cache somewhere else (default ~/.cache/podfence)
set -euo pipefail
cd "$(dirname "$0")/k8s-tools"
coredns=github.com/coredns/coredns@v1.15.0
controller=github.com/aws/amazon-network-policy-controller-k8s/cmd@v1.1.10
key=$( (cat go.mod go.sum pause/main.go ../k8s-tools.sh) | sha256sum | cut -c1-16)
dir=${PODFENCE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/podfence}/k8s-tools/$key
tools=(etcd kube-apiserver kube-controller-manager kube-scheduler kubelet kube-proxy kubectl pause agnhost e2e.test coredns network-policy-controller)
missing=0
for t in "${tools[@]}"; do [[ -x $dir/$t ]] || missing=1; done
if [[ $missing == 0 ]]; then
	echo "$dir"
	exit 0
fi
mkdir -p "$dir"
tmp=$(mktemp -d "$dir/.build.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
export CGO_ENABLED=0
flags=(-trimpath -ldflags=-s)
step() { # name, then the command that builds it into $tmp
	local name=$1 start=$SECONDS
	shift
	if [[ -x $dir/$name ]]; then return; fi
	"$@"
	mv "$tmp/$name" "$dir/$name"
	echo "k8s-tools: $name in $((SECONDS - start)) s" >&2
}
echo "k8s-tools: building into $dir (cold: about 30 minutes)" >&2
start=$SECONDS
step etcd go build "${flags[@]}" -o "$tmp/etcd" go.etcd.io/etcd/server/v3
step kube-apiserver go build "${flags[@]}" -o "$tmp/kube-apiserver" k8s.io/kubernetes/cmd/kube-apiserver
for cmd in kube-controller-manager kube-scheduler kubelet kube-proxy kubectl; do
	step "$cmd" go build "${flags[@]}" -o "$tmp/$cmd" "k8s.io/kubernetes/cmd/$cmd"
done
step pause go build "${flags[@]}" -o "$tmp/pause" ./pause
step agnhost go build "${flags[@]}" -o "$tmp/agnhost" k8s.io/kubernetes/test/images/agnhost
step e2e.test go test -c "${flags[@]}" -o "$tmp/e2e.test" k8s.io/kubernetes/test/e2e
# Modules of their own, with their own go.mod: go install builds each as
# its release does.
step coredns env GOBIN="$tmp" GOFLAGS=-mod=mod go install "${flags[@]}" "$coredns"
install_controller() {
	GOBIN="$tmp" GOFLAGS=-mod=mod go install "${flags[@]}" "$controller"
	mv "$tmp/cmd" "$tmp/network-policy-controller"
}
step network-policy-controller install_controller
echo "k8s-tools: built in $((SECONDS - start)) s" >&2
echo "$dir"
