package bpf

import (
	"flag"
	"fmt"
	"math/rand/v2"
	"net/netip"
	"slices"
	"testing"
	"time"

	"github.com/podfence/podfence/pkg/packet"
	"github.com/podfence/podfence/pkg/policy"
)

var (
	diffSeed  = flag.Uint64("seed", 0, "seed of TestDifferential (0 picks one from the clock)")
	diffSets  = flag.Int("diff.sets", 400, "random policy sets in TestDifferential (100 with -test.short)")
	diffPkts  = flag.Int("diff.packets", 60, "random packets per policy set in TestDifferential")
	protocols = []uint8{6, 17, 132, 1, 47}
)

// TestDifferential checks the programs against policy.Decide, the direct
// evaluation of the cluster tiers around NetworkPolicy, the node's
// exemption on ingress, and the source check, over random rule sets and
// random packets. Every packet is a new flow (its source port is unique
// within a set, and the table is emptied before packets without ports), so
// the verdict is the policy's alone.
//
// The kernel matrix (hack/kernels) runs it with -test.short: a quarter of
// the sets, which still reach every layer, where emulation makes each set
// several times slower; make test runs all 400 on the host.
func TestDifferential(t *testing.T) {
	h := newHarness(t)
	// Inside the space randomAddr draws from, so that rules cover them.
	nodes := []netip.Addr{netip.MustParseAddr("10.0.0.9"), netip.MustParseAddr("fd00::9")}
	if err := h.id.global.SetNodeAddrs(nodes); err != nil {
		t.Fatal(err)
	}
	seed := *diffSeed
	if seed == 0 {
		seed = uint64(time.Now().UnixNano())
	}
	t.Logf("seed %d (replay with -run TestDifferential -seed=%d)", seed, seed)
	rng := rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))

	cases, mismatches := 0, 0
	byLayer := map[string]int{} // what decided the cases: each must come up
	var prev *policy.Set
	midCases, midPort := 0, uint16(0)
	sets := *diffSets
	if testing.Short() && !flagSet("diff.sets") {
		sets = 100
	}
	for s := 0; s < sets && mismatches < 10; s++ {
		set := randomSet(rng)
		h.flushCT(t)
		if prev == nil {
			h.apply(t, set)
		} else {
			// Mid-change trials: new flows at each step of the change
			// from prev to set are judged by prev until the switch,
			// by set from it on, and never by a mix of the two.
			from := prev
			t.Cleanup(func() { testStop = nil })
			testStop = func(step string) error {
				judge := from
				if step == "switched" {
					judge = &set
				}
				for range 4 {
					d := policy.Direction(rng.IntN(2))
					pkt, remote, port := randomPacket(rng, 20000+midPort%40000, d)
					midPort++
					if pkt.Proto == 47 || pkt.FragOffset != 0 || len(pkt.ExtHeaders) != 0 {
						continue // flows without ports: see below
					}
					fromNode := d == policy.Ingress && slices.Contains(nodes, remote)
					want := fromNode || policy.Decide(judge, &judge.Cluster, d, remote, pkt.Proto, port).Allowed
					if got := h.run(t, d, pkt.Marshal()) == VerdictAllow; got != want {
						mismatches++
						t.Errorf("seed %d set %d, at %q of the change: %s %s->%s proto %d port %d: datapath allows=%v, reference allows=%v",
							seed, s, step, d, pkt.Src, pkt.Dst, pkt.Proto, port, got, want)
					}
					midCases++
				}
				return nil
			}
			h.apply(t, set)
			testStop = nil
		}
		prev = &set
		for p := 0; p < *diffPkts; p++ {
			d := policy.Direction(rng.IntN(2))
			pkt, remote, port := randomPacket(rng, uint16(p+1), d)
			if d == policy.Ingress && rng.IntN(16) == 0 {
				remote = nodes[0]
				if pkt.Src.Is6() {
					remote = nodes[1]
				}
				pkt.Src = remote
			}
			// One egress packet in eight is sent in another's name,
			// which no policy allows (the harness's pod owns pod4
			// and pod6).
			spoofed := false
			if d == policy.Egress && rng.IntN(8) == 0 {
				pkt.Src = randomAddr(rng, pkt.Src.Is6())
				spoofed = pkt.Src != ip(pod4) && pkt.Src != ip(pod6)
			}
			if pkt.Proto == 47 || pkt.FragOffset != 0 || len(pkt.ExtHeaders) != 0 {
				// Without ports, two such packets between the same
				// ends are one flow: start from an empty table so
				// that this one is new.
				h.flushCT(t)
			}
			fromNode := d == policy.Ingress && slices.Contains(nodes, remote)
			decision := policy.Decide(&set, &set.Cluster, d, remote, pkt.Proto, port)
			want := !spoofed && (fromNode || decision.Allowed)
			switch {
			case spoofed:
				byLayer["spoofed"]++
			case fromNode:
				byLayer["node"]++
			default:
				byLayer[fmt.Sprintf("%s %v", decision.Layer, decision.Allowed)]++
			}
			got := h.run(t, d, pkt.Marshal()) == VerdictAllow
			cases++
			if got != want {
				mismatches++
				t.Errorf("seed %d set %d packet %d: %s %s->%s proto %d port %d: datapath allows=%v, reference allows=%v\npolicy: %s",
					seed, s, p, d, pkt.Src, pkt.Dst, pkt.Proto, port, got, want, describe(set))
			}
		}
	}
	t.Logf("%d cases, %d of them mid-change, %d mismatches; decided by %v", cases+midCases, midCases, mismatches, byLayer)
	// 50 and 10 a set: what 60 packets a set give, less those a set's
	// rules make unusable.
	if (cases < 50*sets || midCases < 10*sets) && !t.Failed() && *diffPkts == 60 {
		t.Fatalf("only %d cases ran, %d mid-change", cases, midCases)
	}
}

func describe(set policy.Set) string {
	return fmt.Sprintf("mode %s selected %v ingress %+v egress %+v admin %+v baseline %+v",
		set.Mode, set.Selected, set.Ingress, set.Egress, set.Cluster.Admin, set.Cluster.Baseline)
}

// Addresses cluster in a small space so that rules, excepts and packets overlap.
func randomAddr(rng *rand.Rand, v6 bool) netip.Addr {
	if v6 {
		var b [16]byte
		b[0], b[1] = 0xfd, 0x00
		b[7] = byte(rng.IntN(4))
		b[13] = byte(rng.IntN(4))
		b[14] = byte(rng.IntN(4))
		b[15] = byte(rng.IntN(256))
		return netip.AddrFrom16(b)
	}
	return netip.AddrFrom4([4]byte{10, byte(rng.IntN(4)), byte(rng.IntN(4)), byte(rng.IntN(256))})
}

func randomPrefix(rng *rand.Rand, v6 bool, minBits int) netip.Prefix {
	bits4 := []int{0, 8, 14, 16, 22, 24, 28, 30, 31, 32}
	bits6 := []int{0, 48, 64, 100, 110, 120, 126, 128}
	var bits int
	for {
		if v6 {
			bits = bits6[rng.IntN(len(bits6))]
		} else {
			bits = bits4[rng.IntN(len(bits4))]
		}
		if bits >= minBits {
			break
		}
	}
	p, _ := randomAddr(rng, v6).Prefix(bits)
	return p
}

var interestingPorts = []uint16{0, 1, 53, 79, 80, 81, 443, 8000, 8080, 8100, 65535}

func randomPort(rng *rand.Rand) uint16 {
	if rng.IntN(2) == 0 {
		return interestingPorts[rng.IntN(len(interestingPorts))]
	}
	return uint16(rng.IntN(65536))
}

func randomPortRange(rng *rand.Rand) policy.PortRange {
	proto := []policy.Protocol{policy.ProtocolTCP, policy.ProtocolUDP, policy.ProtocolSCTP}[rng.IntN(3)]
	switch rng.IntN(4) {
	case 0: // protocol only
		return policy.PortRange{Protocol: proto, First: 0, Last: 65535}
	case 1: // single port
		p := max(randomPort(rng), 1)
		return policy.PortRange{Protocol: proto, First: p, Last: p}
	default: // range
		a, b := max(randomPort(rng), 1), max(randomPort(rng), 1)
		if a > b {
			a, b = b, a
		}
		return policy.PortRange{Protocol: proto, First: a, Last: b}
	}
}

func randomRules(rng *rand.Rand) []policy.Rule {
	rs := []policy.Rule{}
	for n := rng.IntN(7); n > 0; n-- {
		v6 := rng.IntN(3) == 0
		r := policy.Rule{CIDR: randomPrefix(rng, v6, 0)}
		if rng.IntN(3) == 0 {
			for e := rng.IntN(3) + 1; e > 0; e-- {
				ex := randomPrefix(rng, v6, r.CIDR.Bits())
				if r.CIDR.Contains(ex.Addr()) {
					r.Except = append(r.Except, ex)
				}
			}
		}
		r.Ports = randomPorts(rng, 4)
		rs = append(rs, r)
	}
	return rs
}

// randomPorts is every port in a quarter of the cases, else up to most
// random ranges.
func randomPorts(rng *rand.Rand, most int) []policy.PortRange {
	if rng.IntN(4) == 0 {
		return []policy.PortRange{{Protocol: policy.ProtocolAny, First: 0, Last: 65535}}
	}
	var ports []policy.PortRange
	for p := rng.IntN(most) + 1; p > 0; p-- {
		ports = append(ports, randomPortRange(rng))
	}
	return ports
}

// randomSet is what policy.ForIdentifier and ClusterForIdentifier could
// make of some documents: a pod selected by PolicyEndpoints or not (then
// isolated by strict mode alone, with no rules), and in half the sets
// cluster rules of either tier.
func randomSet(rng *rand.Rand) policy.Set {
	set := policy.Set{Mode: policy.ModeStandard, Selected: rng.IntN(5) != 0}
	if rng.IntN(2) == 0 {
		set.Mode = policy.ModeStrict
	}
	for _, d := range []*policy.DirectionPolicy{&set.Ingress, &set.Egress} {
		if set.Selected {
			d.Isolated = rng.IntN(5) != 0
			d.Rules = randomRules(rng)
		} else {
			d.Isolated = set.Mode == policy.ModeStrict
		}
	}
	if rng.IntN(2) == 0 {
		for d := range 2 {
			set.Cluster.Admin[d] = randomTierRules(rng)
			set.Cluster.Baseline[d] = randomTierRules(rng)
		}
	}
	return set
}

// randomTierRules are up to four cluster rules in evaluation order, with
// few priorities, so that ties between actions come up.
func randomTierRules(rng *rand.Rand) policy.TierRules {
	var rs policy.TierRules
	for i := range rng.IntN(5) {
		r := policy.ClusterRule{
			CIDR:     randomPrefix(rng, rng.IntN(3) == 0, 0),
			Action:   []policy.Action{policy.ActionDeny, policy.ActionAccept, policy.ActionPass}[rng.IntN(3)],
			Priority: uint16(rng.IntN(3) * 10),
			Index:    i,
		}
		r.Ports = randomPorts(rng, 3)
		rs = append(rs, r)
	}
	slices.SortStableFunc(rs, policy.Before)
	return rs
}

// randomPacket builds a new flow of direction d with a unique source port
// and returns it with the remote address and port the policy judges.
func randomPacket(rng *rand.Rand, sport uint16, d policy.Direction) (packet.Packet, netip.Addr, uint16) {
	v6 := rng.IntN(3) == 0
	pod, _ := netip.ParseAddr(pod4)
	if v6 {
		pod, _ = netip.ParseAddr(pod6)
	}
	remote := randomAddr(rng, v6)
	p := packet.Packet{Src: remote, Dst: pod, Proto: protocols[rng.IntN(len(protocols))], SrcPort: sport, DstPort: randomPort(rng)}
	if d == policy.Egress {
		p.Src, p.Dst = pod, remote
	}
	port := p.DstPort
	switch {
	case p.Proto == 1 || p.Proto == 47:
		if v6 && p.Proto == 1 {
			p.Proto = 58
		}
		// ICMP echo is tracked by its identifier, which is also the
		// port the policy sees; other protocols carry no ports.
		port = 0
		if p.Proto != 47 {
			port = sport
		}
		p.DstPort = 0
	case rng.IntN(10) == 0:
		// A later fragment: no L4 header, judged with port 0.
		port = 0
		if v6 {
			p.ExtHeaders = []packet.ExtHeader{{Type: 44, FragOffset: 100}}
		} else {
			p.FragOffset = 100
		}
	}
	return p, remote, port
}

// flagSet reports whether the test binary's command line set the flag, so
// that -test.short shortens only what was left at its default.
func flagSet(name string) bool {
	set := false
	flag.Visit(func(f *flag.Flag) { set = set || f.Name == name })
	return set
}
