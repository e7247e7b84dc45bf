#!/usr/bin/env bash
# Runs bpf2go with the flags every podfence object is built with; bpf/gen.go
# and bpf/bound/gen.go call it as: bpf2go.sh <stem> <source.c> [-type T]...
#
# The one input that differs between architectures is <asm/types.h>, which
# <linux/types.h> includes and Debian keeps under /usr/include/<multiarch>
# (x86_64-linux-gnu, aarch64-linux-gnu on Graviton). Its content is the same
# on both (asm-generic/int-ll64.h), so the output is byte for byte the same:
# hack/check-generated.sh also regenerates with the arm64 headers to show it.
# BPF_ASM_INCLUDE overrides the directory.
set -euo pipefail
if [ $# -lt 2 ]; then
	echo "usage: $0 <stem> <source.c> [bpf2go flags]" >&2
	exit 2
fi
stem=$1 src=$2
shift 2
inc=${BPF_ASM_INCLUDE:-}
if [ -z "$inc" ]; then
	multiarch=$(gcc -print-multiarch 2>/dev/null || true)
	inc=/usr/include/${multiarch:-$(uname -m)-linux-gnu}
fi
if [ ! -e "$inc/asm/types.h" ]; then
	echo "$inc/asm/types.h not found: install linux-libc-dev, or set BPF_ASM_INCLUDE" >&2
	exit 1
fi
exec go tool bpf2go -tags linux -target bpfel -cc clang \
	-cflags "-O2 -g -Wall -Werror -mcpu=v3 -I$inc" "$@" "$stem" "$src"
