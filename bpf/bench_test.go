package bpf

import (
	"bytes"
	"fmt"
	"math"
	"net/netip"
	"os/exec"
	"runtime"
	"sort"
	"sync"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/cilium/ebpf/features"
	"golang.org/x/sys/unix"

	"github.com/podfence/podfence/pkg/packet"
	"github.com/podfence/podfence/pkg/pinpath"
	"github.com/podfence/podfence/pkg/policy"
)

// BenchmarkDatapath reports the kernel's own per-packet run time (ns/op)
// from BPF_PROG_TEST_RUN, the verified instruction count of the program, and
// the ratio to an empty program ("floor") measured the same way in this run:
//
//   - floor, ct-hit, deny: one packet repeated inside the kernel, in chunks
//     of 20,000 runs; the fastest chunk's per-run time;
//   - allow-new-*: every packet is a new flow (distinct tuple) that inserts a
//     conntrack entry, so each is a run of its own; the median of the
//     kernel's durations of those runs, compared with the median single-run
//     duration of floor.
//
// hack/bench.sh prints the ratios against the targets of the datapath issue.
func BenchmarkDatapath(b *testing.B) {
	h := newHarness(b)
	floor := floorProgram(b)
	floorRepeat, floorSingle := measureFloor(b, floor)

	for _, fam := range []string{"v4", "v6"} {
		b.Run("floor/"+fam, func(b *testing.B) {
			frame := benchPacket(fam, 0, 1, 80).Marshal()
			ns := repeatRun(b, floor, frame)
			report(b, floor, ns, floorRepeat, 0)
			b.ReportMetric(floorSingle, "single-run-ns")
		})
	}

	allow80 := func(fam string, n int) policy.Set {
		var rs []policy.Rule
		for i := 0; i < n; i++ {
			rs = append(rs, rule(benchPrefix(fam, i).String(), tcpPort(80)))
		}
		return isolate(rs, nil)
	}

	for _, fam := range []string{"v4", "v6"} {
		b.Run("ct-hit/"+fam, func(b *testing.B) {
			h.flushCT(b)
			h.apply(b, allow80(fam, 1))
			syn := benchPacket(fam, 0, 1, 80)
			if ret := h.run(b, policy.Ingress, syn.Marshal()); ret != VerdictAllow {
				b.Fatalf("first packet not allowed: %#x", ret)
			}
			ack := syn
			ack.TCPFlags = 0x10
			report(b, h.id.Ingress, repeatRun(b, h.id.Ingress, ack.Marshal()), floorRepeat, 2.5)
		})
	}
	for _, fam := range []string{"v4", "v6"} {
		b.Run("deny/"+fam, func(b *testing.B) {
			h.flushCT(b)
			h.apply(b, allow80(fam, 1))
			frame := benchPacket(fam, 0, 1, 81).Marshal()
			if ret := h.run(b, policy.Ingress, frame); ret != VerdictDrop {
				b.Fatalf("packet not denied: %#x", ret)
			}
			report(b, h.id.Ingress, repeatRun(b, h.id.Ingress, frame), floorRepeat, 3.5)
		})
	}
	for _, n := range []int{1, 1000} {
		for _, fam := range []string{"v4", "v6"} {
			target := 0.0
			if n == 1000 {
				target = 7
			}
			b.Run(fmt.Sprintf("allow-new-%dcidr/%s", n, fam), func(b *testing.B) {
				h.flushCT(b)
				h.apply(b, allow80(fam, n))
				runs := make([]float64, b.N)
				for i := 0; i < b.N; i++ {
					// A distinct tuple per packet: the peer walks the n
					// prefixes, the source port counts.
					frame := benchPacket(fam, i%n, uint16(1024+i/n%60000), 80).Marshal()
					ret, d, err := h.id.Ingress.Benchmark(frame, 1, nil)
					if err != nil || ret != VerdictAllow {
						b.Fatalf("packet %d: verdict %#x, err %v", i, ret, err)
					}
					runs[i] = float64(d.Nanoseconds())
				}
				report(b, h.id.Ingress, median(runs), floorSingle, target)
			})
		}
	}
}

// benchPrefix is the i-th /24 (v4) or /120 (v6) the allow-new policies list.
func benchPrefix(fam string, i int) netip.Prefix {
	if fam == "v6" {
		a := netip.MustParseAddr("fd01::").As16()
		a[12], a[13], a[14] = byte(i>>8), byte(i), 0
		return netip.PrefixFrom(netip.AddrFrom16(a), 120)
	}
	return netip.PrefixFrom(netip.AddrFrom4([4]byte{10, byte(i >> 8), byte(i), 0}), 24)
}

// benchPacket is a TCP SYN to the pod from a host inside benchPrefix(i).
func benchPacket(fam string, i int, sport, dport uint16) packet.Packet {
	p := benchPrefix(fam, i).Addr().As16()
	p[15] = 7
	if fam == "v6" {
		return syn(tcp(netip.AddrFrom16(p).String(), pod6, sport, dport))
	}
	return syn(tcp(netip.AddrFrom16(p).Unmap().String(), pod4, sport, dport))
}

// repeatRun runs one frame b.N times in the kernel, in chunks, and returns
// the kernel's per-run duration of the fastest chunk in ns. On a shared VM
// interference only ever adds time, so the minimum is the stable figure.
func repeatRun(b *testing.B, p *ebpf.Program, frame []byte) float64 {
	b.Helper()
	const chunk = 20000
	best := math.Inf(1)
	b.ResetTimer()
	for done := 0; done < b.N; done += chunk {
		_, d, err := p.Benchmark(frame, min(chunk, b.N-done), nil)
		if err != nil {
			b.Fatal(err)
		}
		best = min(best, float64(d.Nanoseconds()))
	}
	return best
}

func report(b *testing.B, p *ebpf.Program, ns, floor, target float64) {
	b.Helper()
	b.ReportMetric(ns, "ns/op")
	b.ReportMetric(ns/floor, "x-floor")
	if target > 0 {
		b.ReportMetric(target, "x-target")
	}
	if info, err := p.Info(); err == nil {
		if n, ok := info.VerifiedInstructions(); ok {
			b.ReportMetric(float64(n), "insns")
		}
	}
}

// floorProgram is the empty program the issue measures against: it returns
// TC_ACT_OK and does nothing else.
func floorProgram(b *testing.B) *ebpf.Program {
	b.Helper()
	p, err := ebpf.NewProgram(&ebpf.ProgramSpec{
		Name:         "floor",
		Type:         ebpf.SchedCLS,
		License:      "Dual BSD/GPL",
		Instructions: asm.Instructions{asm.Mov.Imm(asm.R0, 0), asm.Return()},
	})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { p.Close() })
	return p
}

// measureFloor returns the empty program's per-run kernel time repeated in
// the kernel, and the median of its single-run durations.
func measureFloor(b *testing.B, p *ebpf.Program) (repeat, single float64) {
	b.Helper()
	frame := benchPacket("v4", 0, 1, 80).Marshal()
	repeat = math.Inf(1)
	for i := 0; i < 50; i++ {
		_, d, err := p.Benchmark(frame, 20000, nil)
		if err != nil {
			b.Fatal(err)
		}
		repeat = min(repeat, float64(d.Nanoseconds()))
	}
	runs := make([]float64, 20000)
	for i := range runs {
		_, d, err := p.Benchmark(frame, 1, nil)
		if err != nil {
			b.Fatal(err)
		}
		runs[i] = float64(d.Nanoseconds())
	}
	return repeat, median(runs)
}

// median of single-run durations: the same statistic for floor and for the
// cases compared with it, and one that a few preempted runs do not move.
func median(runs []float64) float64 {
	sort.Float64s(runs)
	return runs[len(runs)/2]
}

// BenchmarkFlowBothWays runs the two directions of one tracked connection at
// once on two CPUs, as a pod's traffic and its replies often are: the
// ingress program on CPU 0 with the peer's segments, the egress program on
// CPU 1 with the pod's. Both hit the same conntrack entry. It reports each
// side's per-packet kernel time (the median of chunks of 2,000 runs, most
// of which overlap the other side's), which grows when the entry's cache
// line moves between the CPUs on every packet.
func BenchmarkFlowBothWays(b *testing.B) {
	if runtime.NumCPU() < 2 {
		b.Skip("needs two CPUs")
	}
	h := newHarness(b)
	h.apply(b, isolate(rules(rule("10.1.0.0/16", tcpPort(80))), nil))
	opening := syn(tcp(peer4, pod4, 40000, 80))
	if ret := h.run(b, policy.Ingress, opening.Marshal()); ret != VerdictAllow {
		b.Fatalf("SYN not allowed: %#x", ret)
	}
	sides := []struct {
		name  string
		cpu   int
		prog  *ebpf.Program
		frame []byte
	}{
		{"ingress-ns", 0, h.id.Ingress, tcp(peer4, pod4, 40000, 80).Marshal()},
		{"egress-ns", 1, h.id.Egress, tcp(pod4, peer4, 80, 40000).Marshal()},
	}
	ns := make([]float64, len(sides))
	errs := make([]error, len(sides))
	var wg sync.WaitGroup
	b.ResetTimer()
	// Both sides start together, once both threads sit on their CPUs.
	var ready, start sync.WaitGroup
	start.Add(1)
	for i, s := range sides {
		wg.Add(1)
		ready.Add(1)
		go func() {
			defer wg.Done()
			runtime.LockOSThread() // the thread ends with the goroutine, affinity and all
			var set unix.CPUSet
			set.Set(s.cpu)
			errs[i] = unix.SchedSetaffinity(0, &set)
			ready.Done()
			if errs[i] != nil {
				return
			}
			start.Wait()
			var chunks []float64
			for done := 0; done < b.N; done += 2000 {
				_, d, err := s.prog.Benchmark(s.frame, min(2000, b.N-done), nil)
				if err != nil {
					errs[i] = err
					return
				}
				chunks = append(chunks, float64(d.Nanoseconds()))
			}
			ns[i] = median(chunks)
		}()
	}
	ready.Wait()
	start.Done()
	wg.Wait()
	for i, s := range sides {
		if errs[i] != nil {
			b.Fatal(errs[i])
		}
		b.ReportMetric(ns[i], s.name)
	}
	b.ReportMetric(max(ns[0], ns[1]), "ns/op") // the slower side
}

// BenchmarkIdentifierMemory reports the kernel memory (memlock, as the
// kernel accounts it) of one identifier's maps with a policy of n ingress
// prefixes, each allowing one port. Nothing is timed.
func BenchmarkIdentifierMemory(b *testing.B) {
	for _, n := range []int{1, 1000} {
		b.Run(fmt.Sprintf("%dcidr", n), func(b *testing.B) {
			h := newHarness(b)
			var rs []policy.Rule
			for i := range n {
				rs = append(rs, rule(benchPrefix("v4", i).String(), tcpPort(80)))
			}
			h.apply(b, isolate(rs, nil))
			var total uint64
			for _, m := range h.id.maps() {
				info, err := m.Info()
				if err != nil {
					b.Fatal(err)
				}
				bytes, _ := info.Memlock()
				total += bytes
			}
			if total == 0 {
				b.Skip("the kernel reports no memlock")
			}
			b.ReportMetric(float64(total), "memlock-bytes")
			b.ReportMetric(0, "ns/op")
		})
	}
}

// previousObject is layout 1's last build (the one before the source
// check), whose datapath object BenchmarkSourceCheck reads from git.
const previousObject = "f9c911c0958f40e88f68041efdfe43ff56b127ee"

// BenchmarkSourceCheck prices the source check where it is paid: a new
// flow from the pod. The same new flows (distinct tuples of TCP SYNs from
// pod4) run through this build's egress program and through that of the
// build before the check (its object read from git history, loaded with
// maps of its own), in two policies: egress not isolated (the shortcut
// most pods take) and egress isolated with a rule that allows them. It
// reports the median of the kernel's single-run durations of each, and
// "x-previous", this build's over the previous build's. "this-any" runs
// with the check off for the pod (sourceCheck false): the lookup without
// the comparison.
func BenchmarkSourceCheck(b *testing.B) {
	prev := previousEgress(b, previousObject)
	h := newHarness(b)
	dst := netip.MustParsePrefix("10.9.0.0/24")
	frame := func(i int) []byte {
		return syn(tcp(pod4, "10.9.0.7", uint16(1024+i%60000), 80)).Marshal()
	}
	for _, pol := range []struct {
		name string
		set  policy.Set
	}{
		{"egress-open", isolate(nil, nil)},
		{"egress-rule", isolate(nil, rules(rule(dst.String(), tcpPort(80))))},
	} {
		prev.program(b, pol.set)
		h.apply(b, pol.set)
		var base float64
		for _, build := range []struct {
			name string
			prog *ebpf.Program
			any  bool
		}{{"previous", prev.egress, false}, {"this", h.id.Egress, false}, {"this-any", h.id.Egress, true}} {
			b.Run(pol.name+"/"+build.name, func(b *testing.B) {
				h.flushCT(b)
				prev.flush(b)
				if err := h.id.SetSources(testIfindex, Sources{Addrs: []netip.Addr{ip(pod4), ip(pod6)}, Any: build.any}); err != nil {
					b.Fatal(err)
				}
				runs := make([]float64, b.N)
				for i := range b.N {
					ret, d, err := build.prog.Benchmark(frame(i), 1, nil)
					if err != nil || ret != VerdictAllow {
						b.Fatalf("packet %d: verdict %#x, err %v", i, ret, err)
					}
					runs[i] = float64(d.Nanoseconds())
				}
				ns := median(runs)
				if build.name == "previous" {
					base = ns
				}
				b.ReportMetric(ns, "ns/op")
				if base > 0 {
					b.ReportMetric(ns/base, "x-previous")
				}
			})
		}
	}
}

// earlierSpec is the datapath object committed at commit (in this clone's
// history; the test is skipped without it), unpinned, with its clock set
// as the loader sets this build's.
func earlierSpec(tb testing.TB, commit string) *ebpf.CollectionSpec {
	tb.Helper()
	obj, err := exec.Command("git", "show", commit+":bpf/podfence_bpfel.o").Output()
	if err != nil {
		tb.Skipf("the earlier build's object is not in this clone's history: %v", err)
	}
	cs, err := ebpf.LoadCollectionSpecFromReader(bytes.NewReader(obj))
	if err != nil {
		tb.Fatal(err)
	}
	for _, ms := range cs.Maps {
		ms.Pinning = ebpf.PinNone
	}
	if features.HaveProgramHelper(ebpf.SchedCLS, asm.FnKtimeGetCoarseNs) == nil {
		if err := cs.Variables["coarse_clock"].Set(uint32(1)); err != nil {
			tb.Fatal(err)
		}
	}
	return cs
}

// previousBuild is an earlier build's egress program (the object committed
// at a commit of this clone's history) with its own, unpinned maps.
type previousBuild struct {
	coll   *ebpf.Collection
	egress *ebpf.Program
}

func previousEgress(b *testing.B, commit string) *previousBuild {
	b.Helper()
	coll, err := ebpf.NewCollection(earlierSpec(b, commit))
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { coll.Close() })
	return &previousBuild{coll: coll, egress: coll.Programs[progEgress]}
}

// program writes what set says of egress into the previous build's maps,
// in its layout (which the state, trie keys and values share with this one).
func (p *previousBuild) program(b *testing.B, set policy.Set) {
	b.Helper()
	st := podfenceIdState{}
	if set.Egress.Isolated {
		st.Enforced = enforcePolicy << policy.Egress
	}
	if err := p.coll.Maps[mapState].Update(uint32(0), &st, ebpf.UpdateAny); err != nil {
		b.Fatal(err)
	}
	for _, r := range set.Egress.Rules {
		k := podfenceLpmKeyV4{Prefixlen: uint32(r.CIDR.Bits()), Addr: r.CIDR.Addr().As4()}
		v := podfencePolicyValue{Count: 1}
		v.Ranges[0] = podfencePortRange{Proto: uint8(r.Ports[0].Protocol), First: r.Ports[0].First, Last: r.Ports[0].Last}
		if err := p.coll.Maps[pinpath.MapPolEgV4].Update(&k, &v, ebpf.UpdateAny); err != nil {
			b.Fatal(err)
		}
	}
}

func (p *previousBuild) flush(b *testing.B) {
	b.Helper()
	m := p.coll.Maps[mapCTv4]
	var keys []podfenceCtKeyV4
	var k podfenceCtKeyV4
	var v podfenceCtValue
	it := m.Iterate()
	for it.Next(&k, &v) {
		keys = append(keys, k)
	}
	for _, k := range keys {
		_ = m.Delete(&k)
	}
}
