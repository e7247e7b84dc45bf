#!/usr/bin/env bash
# A `go test -exec` wrapper that runs one test binary in a qemu guest on one
# kernel of hack/kernels/versions, for working on a single test there:
#
#   CGO_ENABLED=0 KERNEL=5.10 go test -exec "$PWD/hack/kernels/exec.sh" -run TestVerdicts -v ./bpf/
#
# The binary must be static (CGO_ENABLED=0). Its output is printed once the
# guest has powered off, and its exit status is the wrapper's. Arguments
# must not contain spaces. make test-kernels (run.sh) runs the whole matrix.
set -euo pipefail
# shellcheck source=hack/kernels/lib.sh
source "$(dirname "$0")/lib.sh"
[ $# -ge 1 ] || kdie "usage: KERNEL=NAME $0 TEST-BINARY [ARGS...]"
bin=$1
shift
[ -n "${KERNEL:-}" ] || kdie "set KERNEL to one of: $(kernel_names | tr '\n' ' ')"
if grep -qa 'ld-linux-x86-64.so' "$bin"; then
	kdie "$bin is dynamically linked: build it with CGO_ENABLED=0"
fi
for a in "$@"; do
	[[ $a != *[[:space:]]* ]] || kdie "argument with a space is not supported: $a"
done

ensure_host_tools
resolve_kernel "$KERNEL"
prepare_kernel
kmsg "$KERNEL: $K_PKG $K_VER (uname -r $(cat "$K_DIR/kver"))"
ktmp
work=$KTMP
name=$(basename "$bin")
payload_cpio "$work/payload.cpio" "$name=$bin:$*"
rc=0
boot_guest "$K_DIR" "$work/payload.cpio" "$work/out" || rc=$?
grep -v '^@@podfence-kernels ' "$work/out/out.log" || true
status=$(awk -v b="$name" '$1 == "@@podfence-kernels" && $2 == "exit" && $3 == b {print $4}' "$work/out/out.log")
if [ -z "$status" ]; then
	kmsg "$KERNEL: $name did not finish (qemu status $rc); kernel console:"
	tail -n 40 "$work/out/console.log" | tr -d '\r' >&2
	exit 1
fi
exit "$status"
