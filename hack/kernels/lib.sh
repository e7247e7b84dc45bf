# Shared by hack/kernels/run.sh and hack/kernels/exec.sh (sourced, not run):
# host tools, private apt configurations, kernel images from Debian's
# mirror, the guest's initramfs, and booting it under qemu.
#
# Everything that is downloaded or built lives below $KERNELS_CACHE:
#   apt/<release>/   a private apt configuration, state and cache per release
#   debs/            the kernel and busybox-static .deb files
#   busybox/         busybox from busybox-static, the guest's userland
#   kernels/<pkg>_<version>/  vmlinuz, uname -r, the base initramfs
#   logs/<name>/     the last run's output per kernel
# The host's /boot, apt configuration and lists, network and bpffs are never
# touched; the only host change is installing qemu, kmod and cpio with apt.

# shellcheck shell=bash

KERNELS_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck disable=SC2034 # used by the scripts that source this
KERNELS_TOP=$(cd "$KERNELS_DIR/../.." && pwd)
KERNELS_VERSIONS=${KERNELS_VERSIONS:-$KERNELS_DIR/versions}
# Outside the clone, as hack/k8s-tools.sh's: a fresh clone (every CI run)
# finds the kernels of the last one.
KERNELS_CACHE=${KERNELS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/podfence/kernels}

# Modules the guest loads, with their dependencies, in dependency order:
# the veth of the attach tests, clsact (sch_ingress) and cls_bpf for the
# legacy attach path, and conntrack/nftables/NAT for the service-VIP tests.
MODULES=(veth sch_ingress cls_bpf nf_conntrack nf_conntrack_netlink nf_tables nft_ct nf_nat nft_chain_nat nft_nat nft_masq)

# qemu: software emulation, 2 vCPUs. KVM is not usable inside this VM:
# /dev/kvm opens, but a guest stops in its decompressor with "KVM internal
# error ... emulation failure" (tried with -cpu max and host).
GUEST_MEM=${GUEST_MEM:-1536}
GUEST_CPUS=${GUEST_CPUS:-2}
GUEST_TIMEOUT=${GUEST_TIMEOUT:-300}

kmsg() { echo "kernels: $*" >&2; }

# Temporary directories (ktmp DIR-IN) are removed when the script exits.
KERNELS_TMPS=()
ktmp() {
	KTMP=$(mktemp -d "${1:-${TMPDIR:-/tmp}}/.podfence-kernels.XXXXXX")
	KERNELS_TMPS+=("$KTMP")
}
kernels_cleanup() {
	local d
	for d in "${KERNELS_TMPS[@]}"; do rm -rf "$d"; done
}
trap kernels_cleanup EXIT
kdie() {
	echo "kernels: error: $*" >&2
	exit 1
}

# ensure_host_tools installs what the host needs to build and boot guests.
ensure_host_tools() {
	local -A need=([qemu-system-x86_64]=qemu-system-x86 [depmod]=kmod [modprobe]=kmod [cpio]=cpio
		[dpkg-deb]=dpkg [xz]=xz-utils [zstd]=zstd [timeout]=coreutils [nft]=nftables)
	local missing=() cmd
	for cmd in "${!need[@]}"; do
		command -v "$cmd" >/dev/null 2>&1 || PATH=$PATH:/usr/sbin:/sbin command -v "$cmd" >/dev/null 2>&1 || missing+=("${need[$cmd]}")
	done
	if [ ${#missing[@]} -gt 0 ]; then
		mapfile -t missing < <(printf '%s\n' "${missing[@]}" | sort -u)
		[ "$(id -u)" = 0 ] || kdie "needs ${missing[*]} (apt-get install ${missing[*]}, as root)"
		kmsg "installing ${missing[*]}"
		apt-get update -qq
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
	fi
	export PATH=$PATH:/usr/sbin:/sbin
}

# mirror_url prints the Debian mirror the machine's own apt sources name
# ("security": the security archive), or deb.debian.org's.
mirror_url() {
	local kind=$1 url
	url=$(cat /etc/apt/sources.list.d/*.sources /etc/apt/sources.list.d/*.list /etc/apt/sources.list 2>/dev/null | grep -v '^[[:space:]]*#' | grep -oE 'https?://[^ ]+' |
		sed 's:/*$::' | if [ "$kind" = security ]; then grep -E '/debian-security$'; else grep -E '/debian$'; fi | head -n1) || true
	if [ -z "$url" ]; then
		if [ "$kind" = security ]; then url=http://deb.debian.org/debian-security; else url=http://deb.debian.org/debian; fi
	fi
	echo "$url"
}

# apt_setup RELEASE writes a private apt configuration for one Debian
# release and sets APT_OPTS to use it. It reads the system's apt.conf.d (a
# proxy set there applies) but neither its sources, preferences, lists nor
# hooks.
declare -A APT_UPDATED=()
apt_setup() {
	local rel=$1 dir=$KERNELS_CACHE/apt/$1 main security
	main=${DEBIAN_MIRROR:-$(mirror_url main)}
	security=${DEBIAN_SECURITY_MIRROR:-$(mirror_url security)}
	mkdir -p "$dir/lists/partial" "$dir/cache/archives/partial" "$dir/sources.list.d" "$dir/preferences.d"
	touch "$dir/status"
	local key=/usr/share/keyrings/debian-archive-keyring.gpg
	cat >"$dir/sources.list" <<-EOF
		deb [signed-by=$key] $main $rel main
		deb [signed-by=$key] $main $rel-updates main
		deb [signed-by=$key] $security $rel-security main
	EOF
	cat >"$dir/apt.conf" <<-EOF
		Dir::Etc::SourceList "$dir/sources.list";
		Dir::Etc::SourceParts "$dir/sources.list.d";
		Dir::Etc::Preferences "$dir/preferences";
		Dir::Etc::PreferencesParts "$dir/preferences.d";
		Dir::State "$dir";
		Dir::State::Lists "$dir/lists";
		Dir::State::status "$dir/status";
		Dir::Cache "$dir/cache";
		Dir::Cache::pkgcache "pkgcache.bin";
		Dir::Cache::srcpkgcache "";
		APT::Architecture "amd64";
		APT::Architectures { "amd64"; };
		APT::Sandbox::User "root";
		Acquire::Languages "none";
		Acquire::IndexTargets::deb::DEP-11::DefaultEnabled "false";
		Acquire::IndexTargets::deb::DEP-11-icons-small::DefaultEnabled "false";
		Acquire::IndexTargets::deb::DEP-11-icons::DefaultEnabled "false";
		#clear APT::Update::Post-Invoke;
		#clear APT::Update::Post-Invoke-Success;
		#clear DPkg::Post-Invoke;
		#clear DPkg::Pre-Invoke;
	EOF
	APT_OPTS=(-c "$dir/apt.conf")
	# The indices are refreshed once per run, and at most every
	# KERNELS_APT_MAX_AGE seconds (default 3600; 0: always).
	local stamp=$dir/updated age
	age=$(($(date +%s) - $(stat -c %Y "$stamp" 2>/dev/null || echo 0)))
	if [ -z "${APT_UPDATED[$rel]:-}" ] && [ "$age" -lt "${KERNELS_APT_MAX_AGE:-3600}" ] && cmp -s "$dir/sources.list" "$dir/sources.list.used"; then
		APT_UPDATED[$rel]=1
	fi
	if [ -z "${APT_UPDATED[$rel]:-}" ]; then
		APT_UPDATED[$rel]=1
		kmsg "apt indices of $rel ($main, $security)"
		if ! apt-get "${APT_OPTS[@]}" -qq update >"$dir/update.log" 2>&1 || grep -qE '^(W|E): ' "$dir/update.log"; then
			if compgen -G "$dir/lists/*Packages*" >/dev/null; then
				kmsg "warning: apt-get update for $rel failed, using the indices of an earlier run:"
				sed 's/^/    /' "$dir/update.log" >&2
			else
				sed 's/^/    /' "$dir/update.log" >&2
				kdie "apt-get update for $rel failed and there are no earlier indices (see above)"
			fi
		else
			touch "$stamp"
			cp "$dir/sources.list" "$dir/sources.list.used"
		fi
	fi
}

# apt_download PKG=VERSION sets DEB to that package's .deb in the cache,
# downloading it first where needed.
apt_download() {
	local spec=$1 dest=$KERNELS_CACHE/debs pkg ver
	pkg=${spec%%=*} ver=${spec#*=}
	DEB=$dest/${pkg}_${ver//:/%3a}_amd64.deb
	[ -s "$DEB" ] && return
	mkdir -p "$dest"
	ktmp "$dest"
	kmsg "downloading $spec"
	if ! (cd "$KTMP" && apt-get "${APT_OPTS[@]}" -qq download "$spec" >"$KTMP/log" 2>&1); then
		sed 's/^/    /' "$KTMP/log" >&2
		kdie "could not download $spec from the mirror (see above)"
	fi
	mv "$KTMP"/*.deb "$DEB"
}

# candidate PKG prints the newest version of PKG in the current indices.
candidate() {
	apt-cache "${APT_OPTS[@]}" show --no-all-versions "$1" 2>/dev/null | awk '/^Version: /{print $2; exit}'
}

# kernel_line NAME prints NAME's line of the versions file.
kernel_line() {
	awk -v n="$1" '!/^[[:space:]]*(#|$)/ && $1 == n {print; found=1; exit} END {exit !found}' "$KERNELS_VERSIONS" ||
		kdie "no kernel named $1 in $KERNELS_VERSIONS (have: $(kernel_names | tr '\n' ' '))"
}

kernel_names() {
	awk '!/^[[:space:]]*(#|$)/ {print $1}' "$KERNELS_VERSIONS"
}

# resolve_kernel NAME sets K_NAME, K_PKG, K_VER (the image package and its
# Debian version) from the versions file and the mirror's indices.
resolve_kernel() {
	local line name rel meta series pin extra
	line=$(kernel_line "$1") || exit 1
	read -r name rel meta series pin extra <<<"$line"
	if [ -z "$pin" ] || [ -n "$extra" ]; then
		kdie "$KERNELS_VERSIONS: line of $1 needs 5 fields: name release package series pin"
	fi
	apt_setup "$rel"
	K_NAME=$name
	if [ "$pin" != - ]; then
		K_PKG=${pin%%=*} K_VER=${pin#*=}
		[ "$K_PKG" != "$pin" ] || kdie "$KERNELS_VERSIONS: pin of $name must be linux-image-...=VERSION or -, not $pin"
		if ! apt-cache "${APT_OPTS[@]}" madison "$K_PKG" 2>/dev/null | awk -v v="$K_VER" '$3 == v {f = 1} END {exit !f}'; then
			local have newest
			have=$(apt-cache "${APT_OPTS[@]}" madison "$K_PKG" 2>/dev/null | awk '{print $3}' | sort -u | tr '\n' ' ')
			newest=$(apt-cache "${APT_OPTS[@]}" depends "$meta" 2>/dev/null | awk '$1 == "Depends:" && $2 ~ /^linux-image-/ {print $2; exit}')
			kdie "kernel $name is pinned to $K_PKG=$K_VER in $KERNELS_VERSIONS, which the $rel mirror no longer has
    versions of $K_PKG there: ${have:-none}
    newest image of $meta: ${newest:-none}${newest:+ $(candidate "$newest")}
    update the pin, or set it to - to test the newest image"
		fi
	else
		K_PKG=$(apt-cache "${APT_OPTS[@]}" depends "$meta" 2>/dev/null | awk '$1 == "Depends:" && $2 ~ /^linux-image-/ {print $2; exit}')
		[ -n "$K_PKG" ] || kdie "kernel $name: $meta is not in the $rel indices, or names no linux-image package"
		K_VER=$(candidate "$K_PKG")
		[ -n "$K_VER" ] || kdie "kernel $name: $meta depends on $K_PKG, which the $rel indices do not have"
	fi
	case $K_VER in
	"$series".*) ;;
	*) kdie "kernel $name: $K_PKG=$K_VER is not Linux $series (the metapackage moved on?): fix $KERNELS_VERSIONS" ;;
	esac
}

# ensure_busybox sets BUSYBOX to a static busybox from bookworm's
# busybox-static (not installed on the host).
ensure_busybox() {
	BUSYBOX=$KERNELS_CACHE/busybox/busybox
	[ -x "$BUSYBOX" ] && return
	apt_setup bookworm
	local ver
	ver=$(candidate busybox-static)
	[ -n "$ver" ] || kdie "busybox-static is not in the bookworm indices"
	apt_download "busybox-static=$ver"
	mkdir -p "$KERNELS_CACHE/busybox"
	ktmp "$KERNELS_CACHE/busybox"
	dpkg-deb -x "$DEB" "$KTMP"
	mv "$KTMP/bin/busybox" "$BUSYBOX"
}

# prepare_kernel sets K_DIR to a directory with vmlinuz, kver (uname -r)
# and base.cpio (busybox, init, modules) for the resolved K_PKG=K_VER,
# downloading and building what the cache lacks.
prepare_kernel() {
	local key tmp root kver modroot m m_file line path out
	K_DIR=$KERNELS_CACHE/kernels/${K_PKG}_${K_VER//:/%3a}
	ensure_busybox
	key=$(cat "$KERNELS_DIR/init" "$BUSYBOX" <(printf '%s\n' "${MODULES[@]}") | sha256sum | cut -c1-16)
	if [ -s "$K_DIR/base.cpio" ] && [ "$(cat "$K_DIR/base.key" 2>/dev/null)" = "$key" ]; then
		touch "$K_DIR" "$KERNELS_CACHE/debs/${K_PKG}_${K_VER//:/%3a}_amd64.deb" 2>/dev/null || true
		return
	fi
	line=$(kernel_line "$K_NAME") || exit 1
	apt_setup "$(awk '{print $2}' <<<"$line")"
	apt_download "$K_PKG=$K_VER"
	kmsg "$K_NAME: unpacking $(basename "$DEB") and building its initramfs"
	mkdir -p "$KERNELS_CACHE/kernels"
	ktmp "$KERNELS_CACHE/kernels"
	tmp=$KTMP root=$KTMP/root
	dpkg-deb -x "$DEB" "$root"
	modroot=$root/lib/modules
	[ -d "$modroot" ] || modroot=$root/usr/lib/modules
	kver=$(ls "$modroot")
	if [ -z "$kver" ] || [ "$(wc -w <<<"$kver")" != 1 ]; then
		kdie "$DEB: expected one kernel in lib/modules, found: $kver"
	fi
	[ -f "$root/boot/vmlinuz-$kver" ] || kdie "$DEB: no boot/vmlinuz-$kver"
	[ "$modroot" = "$root/lib/modules" ] || { mkdir -p "$root/lib" && ln -s ../usr/lib/modules "$root/lib/modules"; }
	depmod -b "$root" "$kver"

	# The guest's root: busybox, init, modules (decompressed, loaded by
	# busybox insmod in the order of /etc/modules).
	local ir=$tmp/initrd
	mkdir -p "$ir"/{bin,dev,proc,sys,run,tmp,etc,lib/modules,payload,var}
	ln -s ../run "$ir/var/run"
	cp "$BUSYBOX" "$ir/bin/busybox"
	ln -s busybox "$ir/bin/sh"
	install -m 0755 "$KERNELS_DIR/init" "$ir/init"
	: >"$ir/etc/modules"
	for m in "${MODULES[@]}"; do
		out=$(modprobe -d "$root" -S "$kver" --show-depends "$m" 2>&1) || kdie "$K_NAME ($kver): module $m: $out"
		while read -r line; do
			case $line in
			builtin\ *) continue ;;
			insmod\ *) path=$(awk '{print $2}' <<<"$line") ;;
			*) kdie "$K_NAME ($kver): module $m: unexpected modprobe output: $line" ;;
			esac
			m_file=$(basename "$path")
			case $m_file in
			*.ko.xz) xz -dc "$path" >"$ir/lib/modules/${m_file%.xz}" ;;
			*.ko.zst) zstd -qdc "$path" >"$ir/lib/modules/${m_file%.zst}" ;;
			*.ko.gz) gzip -dc "$path" >"$ir/lib/modules/${m_file%.gz}" ;;
			*.ko) cp "$path" "$ir/lib/modules/" ;;
			*) kdie "$K_NAME ($kver): module $m: unknown file $path" ;;
			esac
			m_file=${m_file%.xz} m_file=${m_file%.zst} m_file=${m_file%.gz}
			grep -qxF "$m_file" "$ir/etc/modules" || echo "$m_file" >>"$ir/etc/modules"
		done <<<"$out"
	done
	echo "$kver" >"$ir/etc/kver"

	mkdir -p "$K_DIR"
	cp "$root/boot/vmlinuz-$kver" "$K_DIR/vmlinuz"
	echo "$kver" >"$K_DIR/kver"
	(cd "$ir" && find . -print0 | LC_ALL=C sort -z | cpio --null -o -H newc -R 0:0 --quiet) >"$K_DIR/base.cpio"
	echo "$key" >"$K_DIR/base.key"
	rm -rf "$tmp"
}

# prune_cache removes kernel images (and what was built from them) that no
# run has used for 30 days, such as those of superseded security updates.
prune_cache() {
	[ -d "$KERNELS_CACHE/kernels" ] && find "$KERNELS_CACHE/kernels" -mindepth 1 -maxdepth 1 -type d -mtime +30 -exec rm -rf {} +
	[ -d "$KERNELS_CACHE/debs" ] && find "$KERNELS_CACHE/debs" -maxdepth 1 -name 'linux-image-*.deb' -mtime +30 -delete
	return 0
}

# payload_cpio OUT NAME=BINARY[:ARGS]... writes the cpio of the guest's
# /payload: the binaries, and /payload/run, one "name args..." a line, which
# the guest's init runs in order.
payload_cpio() {
	local out=$1 tmp spec name rest bin args tool lib
	shift
	ktmp
	tmp=$KTMP
	mkdir -p "$tmp/payload"
	for spec in "$@"; do
		name=${spec%%=*} rest=${spec#*=}
		bin=${rest%%:*} args=
		[ "$bin" = "$rest" ] || args=${rest#*:}
		cp "$bin" "$tmp/payload/$name"
		chmod 0755 "$tmp/payload/$name"
		echo "$name $args" >>"$tmp/payload/run"
	done
	# PAYLOAD_TOOLS: host binaries the tests run (nft), into the guest's
	# /bin with the libraries they link at the paths they name: the guest
	# has no libc of its own to clash with.
	for tool in ${PAYLOAD_TOOLS:-}; do
		bin=$(command -v "$tool") || kdie "PAYLOAD_TOOLS: no $tool on this host"
		mkdir -p "$tmp/bin"
		cp -L "$bin" "$tmp/bin/$tool"
		! ldd "$bin" | grep -q 'not found' || kdie "PAYLOAD_TOOLS: $bin links a library this host lacks: $(ldd "$bin" | grep 'not found')"
		for lib in $(ldd "$bin" | grep -o '/[^ ]*'); do
			mkdir -p "$tmp/$(dirname "$lib")"
			cp -L "$lib" "$tmp/$lib"
		done
	done
	# Every directory is in the archive: the kernel's unpacker makes none.
	(cd "$tmp" && find . -mindepth 1 -printf '%P\0' | LC_ALL=C sort -z | cpio --null -o -H newc -R 0:0 --quiet) >"$out"
}

# boot_guest KDIR PAYLOAD OUTDIR boots the kernel in KDIR with its base
# initramfs and PAYLOAD. The guest's test output (second serial port) goes
# to OUTDIR/out.log, the kernel console to OUTDIR/console.log. Returns
# qemu's status (124: timed out after GUEST_TIMEOUT seconds).
boot_guest() {
	local kdir=$1 payload=$2 outdir=$3 rc=0
	mkdir -p "$outdir"
	rm -f "$outdir/out.log" "$outdir/console.log" "$outdir/initrd.cpio"
	cat "$kdir/base.cpio" "$payload" >"$outdir/initrd.cpio"
	timeout -k 10 "$GUEST_TIMEOUT" qemu-system-x86_64 \
		-accel tcg,thread=multi -cpu max -smp "$GUEST_CPUS" -m "$GUEST_MEM" \
		-nodefaults -no-user-config -display none -monitor none -no-reboot \
		-kernel "$kdir/vmlinuz" -initrd "$outdir/initrd.cpio" \
		-append "console=ttyS0 rdinit=/init panic=-1 quiet mitigations=off random.trust_cpu=on" \
		-serial "file:$outdir/console.log" -serial "file:$outdir/out.log" \
		</dev/null >"$outdir/qemu.log" 2>&1 || rc=$?
	rm -f "$outdir/initrd.cpio"
	# The guest's tty turns \n into \r\n.
	if [ -f "$outdir/out.log" ]; then
		tr -d '\r' <"$outdir/out.log" >"$outdir/out.log.tmp" && mv "$outdir/out.log.tmp" "$outdir/out.log"
	fi
	return "$rc"
}
