package bpf

import (
	"encoding/binary"
	"fmt"
	"net/netip"
	"strings"
	"testing"

	"github.com/cilium/ebpf"

	"github.com/podfence/podfence/bpf/bound"
	"github.com/podfence/podfence/pkg/pinpath"
	"github.com/podfence/podfence/test/kernel"
	"github.com/podfence/podfence/test/netnsutil"
)

// BenchmarkLowerBound measures the programs of bpf/bound, which parse a
// packet and do no more than the map operations DESIGN.md prescribes for
// it, the same way BenchmarkDatapath measures podfence (an empty program
// measured the same way in this run is floor):
//
//   - ct-hit: parse, one conntrack lookup, the generation check and the
//     refresh of last_seen, repeated in the kernel;
//   - allow-new-1000cidr: parse, one lookup in a trie of 1,000 prefixes and
//     the insert of a new conntrack entry, a distinct tuple per run.
//
// What podfence costs above these figures is its own logic (wider parsing,
// ports, counters); what these cost above floor, no program on these maps
// can save. They have no targets of their own: hack/bench.sh prints them
// below podfence's, whose targets they show to be reachable or not.
func BenchmarkLowerBound(b *testing.B) {
	kernel.RequireRoot(b)
	floor := floorProgram(b)
	floorRepeat, floorSingle := measureFloor(b, floor)

	for _, fam := range []string{"v4", "v6"} {
		b.Run("ct-hit/"+fam, func(b *testing.B) {
			o := loadBound(b)
			frame := benchPacket(fam, 0, 1, 80).Marshal()
			fillBoundTrie(b, o, fam, 1)
			if ret, _, err := o.NewFlow.Test(frame); err != nil || ret != VerdictAllow {
				b.Fatalf("first packet: verdict %#x, err %v", ret, err)
			}
			if ret, _, err := o.CtHit.Test(frame); err != nil || ret != VerdictAllow {
				b.Fatalf("tracked packet not found: verdict %#x, err %v", ret, err)
			}
			report(b, o.CtHit, repeatRun(b, o.CtHit, frame), floorRepeat, 0)
		})
	}
	const n = 1000
	for _, fam := range []string{"v4", "v6"} {
		b.Run(fmt.Sprintf("allow-new-%dcidr/%s", n, fam), func(b *testing.B) {
			o := loadBound(b)
			fillBoundTrie(b, o, fam, n)
			runs := make([]float64, b.N)
			for i := 0; i < b.N; i++ {
				frame := benchPacket(fam, i%n, uint16(1024+i/n%60000), 80).Marshal()
				ret, d, err := o.NewFlow.Benchmark(frame, 1, nil)
				if err != nil || ret != VerdictAllow {
					b.Fatalf("packet %d: verdict %#x, err %v", i, ret, err)
				}
				runs[i] = float64(d.Nanoseconds())
			}
			report(b, o.NewFlow, median(runs), floorSingle, 0)
		})
	}
}

func loadBound(b *testing.B) *bound.Objects {
	b.Helper()
	o, err := bound.Load()
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { o.Close() })
	return o
}

// fillBoundTrie puts the first n prefixes of benchPrefix in the family's trie.
func fillBoundTrie(b *testing.B, o *bound.Objects, fam string, n int) {
	b.Helper()
	m := o.PolInV4
	if fam == "v6" {
		m = o.PolInV6
	}
	for i := 0; i < n; i++ {
		p := benchPrefix(fam, i)
		key := lpmKey(p)
		if err := m.Put(key, make([]byte, m.ValueSize())); err != nil {
			b.Fatalf("trie entry %s: %v", p, err)
		}
	}
}

// TestBoundMatchesDatapath keeps the lower bound honest: its maps must be
// the datapath's own, in type, key, value, size and flags.
func TestBoundMatchesDatapath(t *testing.T) {
	ours, err := loadPodfence()
	if err != nil {
		t.Fatal(err)
	}
	theirs, err := bound.Spec()
	if err != nil {
		t.Fatal(err)
	}
	names := []string{pinpath.MapCTv4, pinpath.MapCTv6, pinpath.MapPolInV4, pinpath.MapPolInV6, pinpath.MapState, pinpath.MapTickClock}
	for _, name := range names {
		if theirs.Maps[name] == nil {
			t.Errorf("map %s: not in the lower bound's object", name)
		}
	}
	for name, m := range theirs.Maps {
		if strings.HasPrefix(name, ".") {
			continue // .rodata and the like: each object's own constants
		}
		switch name {
		case "egress_by_pod_v4":
			// Design S's map of maps (BenchmarkEgressAfterNAT): not the
			// datapath's, but its inner maps must be the datapath's
			// egress tries.
			m, name = m.InnerMap, pinpath.MapPolEgV4
		case "judges":
			continue // designs M and M+C's tail calls: the datapath has none yet
		}
		want, ok := ours.Maps[name]
		if !ok {
			t.Errorf("map %s: not in the datapath", name)
			continue
		}
		if !sameShape(m, want) {
			t.Errorf("map %s: %v %d/%d max %d flags %#x, the datapath's is %v %d/%d max %d flags %#x", name,
				m.Type, m.KeySize, m.ValueSize, m.MaxEntries, m.Flags,
				want.Type, want.KeySize, want.ValueSize, want.MaxEntries, want.Flags)
		}
	}
}

func sameShape(a, b *ebpf.MapSpec) bool {
	return a.Type == b.Type && a.KeySize == b.KeySize && a.ValueSize == b.ValueSize &&
		a.MaxEntries == b.MaxEntries && a.Flags == b.Flags
}

// BenchmarkEgressAfterNAT compares three ways of judging a pod's egress
// after Service translation, where the packet leaves the node's routing,
// with today's judgement at the pod's veth, on the programs of bpf/bound.
// Each pod of the node is its own identifier (the worst case: no replicas
// share a trie), with a copy of the programs and a trie of 1,000 prefixes;
// conntrack, the judges and the source map are the node's. Every run is a
// new allowed flow (a distinct tuple) from the next pod in turn, so that
// with 110 pods each run meets another pod's trie, as a busy node does:
//
//   - veth-today: the trie lookup and the conntrack insert at the veth;
//   - mark-tailcall (design M): the veth stamps its slot in skb->mark, the
//     output device's program tail-calls that slot's judge, which reads its
//     identifier's own maps;
//   - source-map (design S): the output device's program finds the pod's
//     trie in a hash of maps keyed by the packet's source address;
//   - ct-kfunc+source-map (design C): S after a lookup and release of the
//     kernel's conntrack entry (bpf_skb_ct_lookup, 5.18 and later), which
//     gives the source a SNAT hid.
//
// "x-veth" is a design's median over today's, at the same pod count;
// "x-1pod" the 110-pod median over the 1-pod one, of the same design.
func BenchmarkEgressAfterNAT(b *testing.B) {
	kernel.RequireRoot(b)
	const prefixes = 1000
	// The conntrack entry design C finds, in a namespace of the run's own.
	ctFrom, ctTo := netip.MustParseAddrPort("10.88.0.1:40000"), netip.MustParseAddrPort("10.96.0.10:80")
	n := netnsutil.New(b)
	nsRun(b, n, "", "conntrack", "-I", "-p", "tcp",
		"-s", ctFrom.Addr().String(), "-d", ctTo.Addr().String(),
		"--sport", fmt.Sprint(ctFrom.Port()), "--dport", fmt.Sprint(ctTo.Port()),
		"--state", "ESTABLISHED", "--timeout", "600")
	one := map[string]float64{}
	for _, pods := range []int{1, 110} {
		b.Run(fmt.Sprintf("%dpods", pods), func(b *testing.B) {
			copies := afterNATCopies(b, pods, prefixes, ctFrom, ctTo)
			veth := 0.0
			for c, d := range []struct {
				name string
				prog func(o *bound.Objects) *ebpf.Program
			}{
				{"veth-today", func(o *bound.Objects) *ebpf.Program { return o.VethEgressNew }},
				{"mark-tailcall", func(o *bound.Objects) *ebpf.Program { return o.MarkThenJudge }},
				{"source-map", func(o *bound.Objects) *ebpf.Program { return o.SourceThenJudge }},
				{"ct-kfunc+source-map", func(o *bound.Objects) *ebpf.Program { return o.CtThenJudge }},
				{"mark+ct-kfunc", func(o *bound.Objects) *ebpf.Program { return o.MarkCtThenJudge }},
			} {
				b.Run(d.name, func(b *testing.B) {
					runs := make([]float64, b.N)
					netnsutil.Do(b, n, func() error {
						for i := 0; i < b.N; i++ {
							// From pod i%pods to a peer in the i-th prefix: a
							// source port per run (design C keys the flow on the
							// benchmark's one conntrack entry's destination) and
							// a destination port per design keep every flow new.
							p := benchPacket("v4", i%prefixes, uint16(1024+i%60000), uint16(80+c))
							p.Src, p.Dst = netip.AddrFrom4(podAddrBytes(i%pods)), p.Src
							ret, took, err := d.prog(copies[i%pods]).Benchmark(p.Marshal(), 1, nil)
							if err != nil || ret != VerdictAllow {
								return fmt.Errorf("packet %d: verdict %#x, err %v", i, ret, err)
							}
							runs[i] = float64(took.Nanoseconds())
						}
						return nil
					})
					ns := median(runs)
					if d.name == "veth-today" {
						veth = ns
					}
					if pods == 1 {
						one[d.name] = ns
					}
					b.ReportMetric(ns, "ns/op")
					b.ReportMetric(ns/veth, "x-veth")
					if one[d.name] > 0 {
						b.ReportMetric(ns/one[d.name], "x-1pod")
					}
				})
			}
		})
	}
}

// afterNATCopies loads one copy of bpf/bound per pod, each with its trie
// of the first n benchPrefix prefixes, its judge in the shared judges and
// its trie in the shared source map under the pod's address.
func afterNATCopies(b *testing.B, pods, n int, ctFrom, ctTo netip.AddrPort) []*bound.Objects {
	b.Helper()
	first, err := bound.LoadCopy(bound.CopyOptions{CTFrom: ctFrom, CTTo: ctTo})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { first.Close() })
	shared := map[string]*ebpf.Map{"ct_v4": first.CtV4, "judges": first.Judges, "egress_by_pod_v4": first.EgressByPodV4}
	copies := []*bound.Objects{first}
	for p := 1; p < pods; p++ {
		o, err := bound.LoadCopy(bound.CopyOptions{Slot: uint32(p), Shared: shared, CTFrom: ctFrom, CTTo: ctTo})
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { o.Close() })
		copies = append(copies, o)
	}
	for p, o := range copies {
		for i := range n {
			if err := o.PolInV4.Put(lpmKey(benchPrefix("v4", i)), make([]byte, o.PolInV4.ValueSize())); err != nil {
				b.Fatal(err)
			}
		}
		if err := first.Judges.Put(uint32(p), o.JudgeAfterNat); err != nil {
			b.Fatalf("judge of pod %d: %v", p, err)
		}
		if err := first.EgressByPodV4.Put(podAddr(p), o.PolInV4); err != nil {
			b.Fatalf("trie of pod %d: %v", p, err)
		}
	}
	return copies
}

func podAddrBytes(p int) [4]byte { return [4]byte{10, 88, byte(p >> 8), byte(p)} }

// podAddr is the map key of pod p's address (network order in memory).
func podAddr(p int) uint32 {
	a := podAddrBytes(p)
	return binary.NativeEndian.Uint32(a[:])
}
