package bpf

import (
	"fmt"
	"net/netip"
	"testing"
	"time"

	"github.com/cilium/ebpf"

	"github.com/podfence/podfence/pkg/podid"
	"github.com/podfence/podfence/pkg/policy"
	"github.com/podfence/podfence/test/kernel"
)

// beforeTiers is layout 2's last build, the one before the cluster tiers.
const beforeTiers = "c704f0eb2a2c27bb60094a9c69ab20c9c6e13579"

// beforeSides is layout 3's last build, the one before the policy had two
// sides (struct id_state).
const beforeSides = "7ee03b579497ce6c327f5f62cac8ef3f1e6dfb6e"

// BenchmarkTiers reports what the cluster tiers cost a pod's new flow
// (egress, to a /24 its NetworkPolicy allows TCP/80 to), as the median
// kernel time of single runs, each a new flow, beside the build before
// tiers measured in this run ("x-previous"):
//
//   - previous: the build before tiers, the same policy;
//   - before-sides: the build before the policy's two sides, the same
//     policy ("x-before-sides" compares the cases with it);
//   - none: this build, no cluster policy selects the pod: it must cost
//     what previous and before-sides do;
//   - admin: one Admin rule that holds the address and passes it on (one
//     lookup more);
//   - admin-baseline: no NetworkPolicy; an Admin Pass, then a Baseline
//     Accept (two tier lookups, no policy lookup);
//   - admin-24: 24 Admin rules of distinct priorities hold the address,
//     the first 23 on other ports (the slot scan at its longest).
//
// ct-hit/admin is a tracked flow of the admin case: tiers must not change it.
func BenchmarkTiers(b *testing.B) {
	prev := previousEgress(b, beforeTiers)
	sides := previousEgress(b, beforeSides)
	h := newHarness(b)
	dst := netip.MustParsePrefix("10.9.0.0/24")
	frame := func(i int) []byte {
		return syn(tcp(pod4, "10.9.0.7", uint16(1024+i%60000), 80)).Marshal()
	}
	np := isolate(nil, rules(rule(dst.String(), tcpPort(80))))
	all := netip.MustParsePrefix("0.0.0.0/0")
	every := []policy.PortRange{{Last: 65535}}
	pass := policy.ClusterRule{CIDR: all, Ports: every, Action: policy.ActionPass, Priority: 100}
	accept := policy.ClusterRule{CIDR: all, Ports: every, Action: policy.ActionAccept}
	withTiers := func(set policy.Set, admin, baseline policy.TierRules) policy.Set {
		set.Cluster.Admin[policy.Egress], set.Cluster.Baseline[policy.Egress] = admin, baseline
		return set
	}
	var slots policy.TierRules
	for i := range policy.MaxTierRules - 1 {
		slots = append(slots, policy.ClusterRule{CIDR: all, Ports: []policy.PortRange{tcpPort(uint16(1000 + i))},
			Action: policy.ActionDeny, Priority: uint16(i)})
	}
	prev.program(b, np)
	sides.program(b, np)
	// The earlier builds check sources too: the pod's entry, as its ADD wrote it.
	src, err := Sources{Addrs: []netip.Addr{ip(pod4), ip(pod6)}}.encode()
	if err != nil {
		b.Fatal(err)
	}
	for _, p := range []*previousBuild{prev, sides} {
		if err := p.coll.Maps[mapSources].Update(uint32(testIfindex), &src, ebpf.UpdateAny); err != nil {
			b.Fatal(err)
		}
	}
	cases := []struct {
		name string
		set  policy.Set
	}{
		{"previous", np},
		{"before-sides", np},
		{"none", np},
		{"admin", withTiers(np, policy.TierRules{pass}, nil)},
		{"admin-baseline", withTiers(policy.Set{Mode: policy.ModeStandard}, policy.TierRules{pass}, policy.TierRules{accept})},
		{"admin-24", withTiers(np, append(slots, pass), nil)},
	}
	var base, baseSides float64
	for _, c := range cases {
		b.Run("allow-new/"+c.name, func(b *testing.B) {
			prog := h.id.Egress
			switch c.name {
			case "previous":
				prog = prev.egress
			case "before-sides":
				prog = sides.egress
			}
			h.apply(b, c.set)
			runs := make([]float64, b.N)
			for i := range b.N {
				if i%60000 == 0 {
					h.flushCT(b)
					prev.flush(b)
					sides.flush(b)
				}
				ret, d, err := prog.Benchmark(frame(i), 1, nil)
				if err != nil || ret != VerdictAllow {
					b.Fatalf("packet %d: verdict %#x, err %v", i, ret, err)
				}
				runs[i] = float64(d.Nanoseconds())
			}
			ns := median(runs)
			switch c.name {
			case "previous":
				base = ns
			case "before-sides":
				baseSides = ns
			}
			b.ReportMetric(ns, "ns/op")
			if base > 0 {
				b.ReportMetric(ns/base, "x-previous")
			}
			if baseSides > 0 {
				b.ReportMetric(ns/baseSides, "x-before-sides")
			}
		})
	}
	b.Run("ct-hit/admin", func(b *testing.B) {
		h.flushCT(b)
		h.apply(b, cases[2].set)
		first := syn(tcp(pod4, "10.9.0.7", 1, 80))
		if ret := h.run(b, policy.Egress, first.Marshal()); ret != VerdictAllow {
			b.Fatalf("first packet not allowed: %#x", ret)
		}
		ack := first
		ack.TCPFlags = 0x10
		floor := floorProgram(b)
		floorRepeat, _ := measureFloor(b, floor)
		report(b, h.id.Egress, repeatRun(b, h.id.Egress, ack.Marshal()), floorRepeat, 0)
	})
}

// BenchmarkClusterChange measures what one change of a cluster-wide Admin
// policy, which selects every pod, costs a node of 100 identifiers: every
// identifier's maps reprogrammed (ApplyPolicy with the Deny added, then
// removed: two changes per op; reprogram-batched shares one grace period
// per 32 identifiers, as a push does), and the re-check each tracked flow pays on
// its next packet, as the kernel's time for that packet against the time
// of the same packet at the current generation (each after an ApplyPolicy,
// the second of which changes nothing).
func BenchmarkClusterChange(b *testing.B) {
	const identifiers = 100
	root := kernel.PinRoot(b)
	g, err := OpenGlobal(globalDir(root), GlobalOptions{})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { g.Close() })
	np := isolate(rules(rule(benchPrefix("v4", 0).String(), tcpPort(80))), nil)
	deny := np
	deny.Cluster.Admin[policy.Ingress] = policy.TierRules{{CIDR: netip.MustParsePrefix("192.0.2.0/24"),
		Ports: []policy.PortRange{{Last: 65535}}, Action: policy.ActionDeny, Priority: 10}}
	deny.Cluster.Admin[policy.Egress] = deny.Cluster.Admin[policy.Ingress]
	var ids []*Datapath
	for i := range identifiers {
		name := podid.ID(fmt.Sprintf("app-%d@default", i))
		id, err := OpenIdentifier(g, identDir(root, name), name)
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { id.Close() })
		if err := id.ApplyPolicy(np); err != nil {
			b.Fatal(err)
		}
		ids = append(ids, id)
	}
	b.Run("reprogram", func(b *testing.B) {
		start := time.Now()
		for i := 0; i < b.N; i++ {
			for _, set := range []policy.Set{deny, np} {
				for _, id := range ids {
					if err := id.ApplyPolicy(set); err != nil {
						b.Fatal(err)
					}
				}
			}
		}
		perChange := float64(time.Since(start).Nanoseconds()) / float64(2*b.N)
		b.ReportMetric(perChange/1e6, "ms/change")
		b.ReportMetric(perChange/identifiers/1e3, "µs/identifier")
	})
	// As a node-wide push does it (node.ReapplyPolicies): every
	// identifier of a batch of 32 switched, one wait, then each leveled.
	b.Run("reprogram-batched", func(b *testing.B) {
		start := time.Now()
		for i := 0; i < b.N; i++ {
			for _, set := range []policy.Set{deny, np} {
				for first := 0; first < len(ids); first += 32 {
					var pending []*Leveling
					for _, id := range ids[first:min(first+32, len(ids))] {
						lv, err := id.SwitchPolicy(set)
						if err != nil {
							b.Fatal(err)
						}
						if lv != nil {
							pending = append(pending, lv)
						}
					}
					if err := WaitForPrograms(); err != nil {
						b.Fatal(err)
					}
					for _, lv := range pending {
						if err := lv.Level(); err != nil {
							b.Fatal(err)
						}
					}
				}
			}
		}
		perChange := float64(time.Since(start).Nanoseconds()) / float64(2*b.N)
		b.ReportMetric(perChange/1e6, "ms/change")
		b.ReportMetric(perChange/identifiers/1e3, "µs/identifier")
	})
	b.Run("recheck", func(b *testing.B) {
		id := ids[0]
		if err := id.SetSources(testIfindex, Sources{Addrs: []netip.Addr{ip(pod4)}}); err != nil {
			b.Fatal(err)
		}
		syn := benchPacket("v4", 0, 1, 80)
		ack := syn
		ack.TCPFlags = 0x10
		frame := ack.Marshal()
		if ret, _, err := id.Ingress.Benchmark(syn.Marshal(), 1, nil); err != nil || ret != VerdictAllow {
			b.Fatalf("first packet: %#x, %v", ret, err)
		}
		stale, current := make([]float64, b.N), make([]float64, b.N)
		sets := []policy.Set{deny, np}
		for i := 0; i < b.N; i++ {
			// The second apply changes nothing: the packet after it
			// meets the same caches as the one after the change.
			for _, runs := range [][]float64{stale, current} {
				if err := id.ApplyPolicy(sets[i%2]); err != nil {
					b.Fatal(err)
				}
				ret, d, err := id.Ingress.Benchmark(frame, 1, nil)
				if err != nil || ret != VerdictAllow {
					b.Fatalf("packet %d: %#x, %v", i, ret, err)
				}
				runs[i] = float64(d.Nanoseconds())
			}
		}
		s, c := median(stale), median(current)
		b.ReportMetric(s, "stale-ns")
		b.ReportMetric(c, "current-ns")
		b.ReportMetric(s/c, "x-current")
	})
}
