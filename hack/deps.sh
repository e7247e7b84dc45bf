#!/usr/bin/env bash
# Installs what building and testing podfence needs on Debian (root), and
# mounts bpffs. Safe to run again.
set -euo pipefail
pkgs=(clang llvm libbpf-dev bpftool iproute2 iptables nftables conntrack iputils-ping strace gcc libc6-dev linux-libc-dev-arm64-cross containerd)
missing=()
for p in "${pkgs[@]}"; do
	dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
	echo "installing: ${missing[*]}"
	apt-get update -qq
	DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi
if ! mount | grep -q 'on /sys/fs/bpf type bpf'; then
	mount -t bpf bpf /sys/fs/bpf
fi
