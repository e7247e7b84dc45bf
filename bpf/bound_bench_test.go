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
		if name == "egress_by_pod_v4" {
			// The post-DNAT prototype's map of maps: not the datapath's,
			// but its inner maps must be the datapath's egress tries.
			m, name = m.InnerMap, pinpath.MapPolEgV4
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

// BenchmarkPostDNATCost prices judging a pod's egress after Service
// translation instead of at its veth: new_flow_post_dnat finds the sending
// pod's egress trie by the packet's source address (a map of maps, one
// entry per pod of the node) before the trie lookup and the conntrack
// insert that new_flow does. Both run the same new flows (a distinct tuple
// per run) against tries of 1,000 prefixes; the post-DNAT one with its
// flows from one pod, and spread over 64 pods' tries (whose nodes then
// compete for the cache). "x-new-flow" is the ratio of the medians.
// Established flows are unchanged: one conntrack lookup wherever it runs.
func BenchmarkPostDNATCost(b *testing.B) {
	kernel.RequireRoot(b)
	const prefixes = 1000
	o := loadBound(b)
	fillBoundTrie(b, o, "v4", prefixes)
	cs, err := bound.Spec()
	if err != nil {
		b.Fatal(err)
	}
	// Each pod's trie holds the same 1,000 prefixes, the frames'
	// destinations among them; the frames' sources are the pods.
	for p := range 64 {
		inner, err := ebpf.NewMap(cs.Maps["egress_by_pod_v4"].InnerMap)
		if err != nil {
			b.Fatal(err)
		}
		for i := range prefixes {
			pfx := benchPrefix("v4", i)
			k := podfenceLpmKeyV4{Prefixlen: uint32(pfx.Bits()), Addr: pfx.Addr().As4()}
			if err := inner.Update(&k, &podfencePolicyValue{Count: 1}, ebpf.UpdateAny); err != nil {
				b.Fatal(err)
			}
		}
		if err := o.EgressByPodV4.Update(podAddr(p), inner, ebpf.UpdateAny); err != nil {
			b.Fatal(err)
		}
		inner.Close()
	}
	var base float64
	for _, c := range []struct {
		name string
		prog *ebpf.Program
		pods int // 0: new_flow, whose frames come from peers
	}{{"new-flow", o.NewFlow, 0}, {"post-dnat-1pod", o.NewFlowPostDnat, 1}, {"post-dnat-64pods", o.NewFlowPostDnat, 64}} {
		b.Run(c.name, func(b *testing.B) {
			runs := make([]float64, b.N)
			for i := 0; i < b.N; i++ {
				p := benchPacket("v4", i%prefixes, uint16(1024+i/prefixes%60000), 80)
				if c.pods > 0 {
					// From a pod to a peer in the i-th prefix.
					p.Src, p.Dst = netip.AddrFrom4(podAddrBytes(i%c.pods)), p.Src
				}
				ret, d, err := c.prog.Benchmark(p.Marshal(), 1, nil)
				if err != nil || ret != VerdictAllow {
					b.Fatalf("packet %d: verdict %#x, err %v", i, ret, err)
				}
				runs[i] = float64(d.Nanoseconds())
			}
			ns := median(runs)
			if c.pods == 0 {
				base = ns
			}
			b.ReportMetric(ns, "ns/op")
			b.ReportMetric(ns/base, "x-new-flow")
		})
	}
}

func podAddrBytes(p int) [4]byte { return [4]byte{10, 88, byte(p >> 8), byte(p)} }

// podAddr is the map key of pod p's address (network order in memory).
func podAddr(p int) uint32 {
	a := podAddrBytes(p)
	return binary.NativeEndian.Uint32(a[:])
}
