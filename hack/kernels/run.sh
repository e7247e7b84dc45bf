#!/usr/bin/env bash
# make test-kernels: the kernel-facing tests (./bpf: verdicts, differential,
# loader, deny events; ./pkg/attach: TCX and clsact/cls_bpf attach with real
# traffic between network namespaces) on each kernel of hack/kernels/versions,
# booted under qemu with software emulation. Prints a table of each kernel's
# exact version, run time and pass/fail/skip counts, and exits non-zero if any
# kernel has a failing test or a test binary that did not finish.
#
# Environment:
#   KERNELS="5.10 6.1"  run only these (names from hack/kernels/versions)
#   KERNELS_JOBS=2      guests booted at once (default 1: a guest uses 2 vCPUs)
#   KERNELS_CACHE=DIR   downloads and builds (default ~/.cache/podfence/kernels,
#                       or $XDG_CACHE_HOME/podfence/kernels when that is set)
#   GUEST_TIMEOUT=300   seconds a guest may run; GUEST_MEM (MiB), GUEST_CPUS
#   KERNELS_APT_MAX_AGE=3600  seconds before the apt indices are refreshed
#   FAIL_DETAILS=3      failed tests per kernel whose output is printed
#   TEST_ARGS="-test.run=TestVerdicts"  more flags for both test binaries
set -euo pipefail
# shellcheck source=hack/kernels/lib.sh
source "$(dirname "$0")/lib.sh"
cd "$KERNELS_TOP"
t0=$(date +%s)

ensure_host_tools
command -v go >/dev/null || kdie "needs go on PATH"
if [ -n "${KERNELS:-}" ]; then
	read -r -a names <<<"$KERNELS"
else
	mapfile -t names < <(kernel_names)
fi
[ ${#names[@]} -gt 0 ] || kdie "no kernels to run"
for n in "${names[@]}"; do kernel_line "$n" >/dev/null || exit 1; done

# The test binaries, static so that they run in a guest with no libc.
ktmp
work=$KTMP
kmsg "building static test binaries (./bpf, ./pkg/attach)"
CGO_ENABLED=0 go test -c -o "$work/bpf.test" ./bpf/
CGO_ENABLED=0 go test -c -o "$work/attach.test" ./pkg/attach/
# A test that hangs panics with its stack before the guest is killed.
# -test.short: the randomised and repeated tests (TestDifferential,
# TestApplyPolicyNeverMixesPolicies, TestTrialMatchesReference) run a
# quarter of their rounds: whole, they were two thirds of a guest's time,
# the same code paths repeated on other random policies; make test runs
# them in full on the host.
test_timeout=$((GUEST_TIMEOUT > 120 ? GUEST_TIMEOUT - 60 : GUEST_TIMEOUT * 3 / 4))
args="-test.v -test.short -test.count=1 -test.timeout=${test_timeout}s ${TEST_ARGS:-}"
binaries=(bpf.test attach.test)
t_built=$(date +%s)
# nft for the Service tests' DNAT rules (kube-proxy's, as nftables writes
# them): with it the guests judge Service traffic after the translation.
PAYLOAD_TOOLS=nft payload_cpio "$work/payload.cpio" "bpf.test=$work/bpf.test:$args" "attach.test=$work/attach.test:$args"

# Resolve and fetch every kernel first: a missing one fails before any runs.
declare -A pkg ver dir
for n in "${names[@]}"; do
	resolve_kernel "$n"
	prepare_kernel
	pkg[$n]=$K_PKG ver[$n]=$K_VER dir[$n]=$K_DIR
	kmsg "$n: $K_PKG $K_VER (uname -r $(cat "$K_DIR/kver"))"
done
prune_cache
t_fetched=$(date +%s)

# run_one NAME boots one guest and writes logs/NAME/{out,console}.log and
# logs/NAME/status (qemu's exit status and the seconds it ran).
logs=$KERNELS_CACHE/logs
run_one() {
	local n=$1 s e rc attempt
	for attempt in 1 2; do
		rc=0
		s=$(date +%s)
		boot_guest "${dir[$n]}" "$work/payload.cpio" "$logs/$n" || rc=$?
		e=$(date +%s)
		# A guest that timed out before its init wrote a line never got
		# to the tests: under tcg a boot hung so once, with the same
		# kernel booting in 100 s before and after. It boots once more,
		# and says so; a guest that started the tests is never rerun.
		if [ "$attempt" = 1 ] && { [ "$rc" = 124 ] || [ "$rc" = 137 ]; } && [ ! -s "$logs/$n/out.log" ]; then
			kmsg "$n: guest wrote nothing in ${GUEST_TIMEOUT}s (the boot hung): booting it again"
			continue
		fi
		break
	done
	echo "$rc $((e - s))" >"$logs/$n/status"
	if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
		kmsg "$n: guest timed out after ${GUEST_TIMEOUT}s"
	else
		kmsg "$n: guest finished in $((e - s))s"
	fi
}

jobs=${KERNELS_JOBS:-1}
FAIL_DETAILS=${FAIL_DETAILS:-3}
for n in "${names[@]}"; do
	mkdir -p "$logs/$n"
	rm -f "$logs/$n/status"
	kmsg "$n: booting ${pkg[$n]} (${GUEST_CPUS} vCPUs, ${GUEST_MEM} MiB, tcg)"
	if [ "$jobs" -gt 1 ]; then
		while [ "$(jobs -rp | wc -l)" -ge "$jobs" ]; do wait -n || true; done
		run_one "$n" &
	else
		run_one "$n"
	fi
done
wait

# parse LOG prints "key value..." lines: kernel, result counts, failed and
# skipped tests (with the reason the skipped test logged).
parse() {
	awk '
	/^@@podfence-kernels kernel / { print "kernel", $3; next }
	/^@@podfence-kernels begin / { cur = $3; delete reason; next }
	/^@@podfence-kernels / { next }
	/^=== (RUN|CONT) / { running = $3; next }
	/^ +[^ ]+\.go:[0-9]+: / && running != "" && !(running in reason) {
		r = $0; sub(/^ +[^ ]+\.go:[0-9]+: /, "", r); reason[running] = r
	}
	/^[ \t]*--- (PASS|FAIL|SKIP): / {
		res = $2; name = $3
		if (res == "PASS:") pass++
		if (res == "FAIL:") { fail++; print "failed", cur, name }
		if (res == "SKIP:") { skip++; print "skipped", cur, name, reason[name] }
	}
	END { print "counts", pass + 0, fail + 0, skip + 0 }
	' "$1"
}

summary=$work/summary
: >"$summary"
total_pass=0 total_fail=0 total_skip=0 bad=0
for n in "${names[@]}"; do
	out=$logs/$n/out.log
	[ -f "$out" ] || : >"$out"
	read -r qrc secs <"$logs/$n/status"
	kver=$(awk '/^@@podfence-kernels kernel /{print $3; exit}' "$out")
	read -r _ p f s < <(parse "$out" | grep '^counts ')
	problems=()
	for b in "${binaries[@]}"; do
		rc=$(awk -v b="$b" '$1 == "@@podfence-kernels" && $2 == "exit" && $3 == b {print $4}' "$out")
		if [ -z "$rc" ]; then
			problems+=("$b did not finish")
		elif [ "$rc" != 0 ]; then
			problems+=("$b exited $rc")
		fi
	done
	if [ "$qrc" = 124 ] || [ "$qrc" = 137 ]; then
		problems+=("timed out after ${GUEST_TIMEOUT}s")
	elif [ "$qrc" != 0 ]; then
		problems+=("qemu exited $qrc")
	fi
	result=ok
	if [ ${#problems[@]} -gt 0 ] || [ "$f" -gt 0 ]; then
		result="FAIL"
		bad=1
	fi
	ptext=
	if [ ${#problems[@]} -gt 0 ]; then
		ptext=$(printf '%s, ' "${problems[@]}")
		ptext=": ${ptext%, }"
	fi
	total_pass=$((total_pass + p)) total_fail=$((total_fail + f)) total_skip=$((total_skip + s))
	printf '%s\t%s\t%s\t%ss\t%s\t%s\t%s\t%s\n' "$n" "${kver:-?}" "${ver[$n]}" "$secs" "$p" "$f" "$s" \
		"$result$ptext" >>"$summary"
done

# Details of what failed: each failed top-level test's output, or the end
# of the output of a binary that did not finish, and the kernel's console.
for n in "${names[@]}"; do
	out=$logs/$n/out.log
	if grep -q '^--- FAIL: ' "$out"; then
		echo
		echo "==== $n: failed tests, the first $FAIL_DETAILS in full (long output: first and last 40 lines); all output: $out"
		awk -v max="$FAIL_DETAILS" '
		function flush(   i) {
			shown++
			if (shown > max) { rest = rest " " top; return }
			for (i = 0; i < n; i++) {
				if (n > 100 && i == 40) { print "        ... " n - 80 " lines ..."; i = n - 40 }
				print buf[i]
			}
		}
		/^@@podfence-kernels / { next }
		/^=== RUN   / { name = $3; sub(/\/.*/, "", name); if (name != top) { top = name; n = 0 } }
		{ buf[n++] = $0 }
		/^--- FAIL: / { flush(); n = 0 }
		/^--- (PASS|SKIP): / { n = 0 }
		END { if (rest != "") print "(not shown:" rest ")" }
		' "$out" | sed "s/^/$n | /"
	fi
	unfinished=0
	for b in "${binaries[@]}"; do
		grep -q "^@@podfence-kernels exit $b " "$out" || unfinished=1
	done
	read -r qrc _ <"$logs/$n/status"
	if [ "$unfinished" = 1 ] || ! grep -q '^@@podfence-kernels done' "$out" || [ "$qrc" != 0 ]; then
		echo
		echo "==== $n: last 40 lines of the test output ($out)"
		tail -n 40 "$out" | sed "s/^/$n | /"
		echo "==== $n: last 40 lines of the kernel console ($logs/$n/console.log)"
		tail -n 40 "$logs/$n/console.log" 2>/dev/null | tr -d '\r' | sed "s/^/$n | /"
	fi
	if grep -q '^@@podfence-kernels warning' "$out"; then
		grep '^@@podfence-kernels warning' "$out" | sed "s/^@@podfence-kernels /$n: /"
	fi
done

# A test-by-kernel matrix of the top-level tests: PASS, FAIL, SKIP, with
# the number of skipped subtests (the TCX variants before 6.6); "-": not run.
echo
matrix_in=$work/matrix
: >"$matrix_in"
for n in "${names[@]}"; do
	awk -v k="$n" '
	/^@@podfence-kernels begin / { cur = $3; sub(/\.test$/, "", cur); next }
	/^@@podfence-kernels / { next }
	/^--- (PASS|FAIL|SKIP): / { r = $2; sub(/:$/, "", r); print k "\t" cur "\t" $3 "\t" r; next }
	/^[ \t]+--- SKIP: / { split($3, p, "/"); print k "\t" cur "\t" p[1] "\tsubskip" }
	' "$logs/$n/out.log" >>"$matrix_in"
done
awk -F'\t' -v kernels="${names[*]}" '
BEGIN { nk = split(kernels, ks, " ") }
{
	key = $2 "\t" $3
	if (!(key in seen)) { seen[key] = 1; order[++n] = key }
	if ($4 == "subskip") subskip[$1, key]++
	else res[$1, key] = $4
}
END {
	printf "%-8s %-36s", "package", "test"
	for (i = 1; i <= nk; i++) printf " %-14s", ks[i]
	print ""
	for (j = 1; j <= n; j++) {
		split(order[j], f, "\t")
		printf "%-8s %-36s", f[1], f[2]
		for (i = 1; i <= nk; i++) {
			c = ((ks[i], order[j]) in res) ? res[ks[i], order[j]] : "-"
			if ((ks[i], order[j]) in subskip) c = c " (" subskip[ks[i], order[j]] " skip)"
			printf " %-14s", c
		}
		print ""
	}
}' "$matrix_in"

echo
echo "Skipped (with the reason the test logged):"
for n in "${names[@]}"; do
	parse "$logs/$n/out.log" | awk -v k="$n" '$1 == "skipped" { r = ""; for (i = 4; i <= NF; i++) r = r (i > 4 ? " " : "") $i; printf "  %-5s %-32s %s\n", k, $3, r }'
done
echo
t1=$(date +%s)
{
	printf 'kernel\tuname -r\tpackage version\ttime\tpassed\tfailed\tskipped\tresult\n'
	cat "$summary"
} | awk -F'\t' '{ printf "%-6s %-28s %-20s %6s %7s %7s %8s  %s\n", $1, $2, $3, $4, $5, $6, $7, $8 }'
echo
echo "test results count subtests; time is the guest's whole run (boot, modules, both binaries)."
echo "logs: $logs/<kernel>/{out,console}.log; wall time $((t1 - t0))s (build $((t_built - t0))s, resolve and fetch $((t_fetched - t_built))s, guests $((t1 - t_fetched))s)"
echo "kernels: $total_pass passed, $total_fail failed, $total_skip skipped"
exit "$bad"
