package policy

import (
	"math/rand/v2"
	"net/netip"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"
)

func crule(cidr string, action Action, priority uint16, ports ...PortRange) ClusterRule {
	if len(ports) == 0 {
		ports = []PortRange{allPorts}
	}
	return ClusterRule{CIDR: netip.MustParsePrefix(cidr), Action: action, Priority: priority, Ports: ports}
}

// TestDecide is the tier semantics, case by case; the randomized tests
// below hold the compiled form to it.
func TestDecide(t *testing.T) {
	np := func(isolated bool, rules ...Rule) Set { // PolicyEndpoints isolating egress
		return Set{Mode: ModeStandard, Selected: true, Egress: DirectionPolicy{Isolated: isolated, Rules: rules}}
	}
	allowWeb := Rule{CIDR: netip.MustParsePrefix("10.0.1.0/24"), Ports: []PortRange{allPorts}}
	none := Set{Mode: ModeStandard}
	strict := Set{Mode: ModeStrict, Ingress: DirectionPolicy{Isolated: true}, Egress: DirectionPolicy{Isolated: true}}
	web := netip.MustParseAddr("10.0.1.5")
	for _, c := range []struct {
		name     string
		set      Set
		admin    TierRules
		baseline TierRules
		addr     netip.Addr
		port     uint16
		allowed  bool
		layer    Layer
	}{
		{"nothing: allowed", none, nil, nil, web, 80, true, LayerDefault},
		{"strict, nothing selects it: denied", strict, nil, nil, web, 80, false, LayerDefault},
		{"admin deny over a networkpolicy allow", np(true, allowWeb), TierRules{crule("10.0.0.0/8", ActionDeny, 10)}, nil, web, 80, false, LayerAdmin},
		{"admin accept over a networkpolicy deny", np(true), TierRules{crule("10.0.1.5/32", ActionAccept, 10)}, nil, web, 80, true, LayerAdmin},
		{"admin pass to the networkpolicy", np(true), TierRules{crule("10.0.0.0/8", ActionPass, 1), crule("10.0.0.0/8", ActionAccept, 2)}, nil, web, 80, false, LayerNetworkPolicy},
		{"admin pass ends the admin tier", none, TierRules{crule("10.0.0.0/8", ActionPass, 1), crule("10.0.0.0/8", ActionDeny, 2)}, nil, web, 80, true, LayerDefault},
		{"admin rule on other ports does not match", np(true, allowWeb), TierRules{crule("10.0.0.0/8", ActionDeny, 1, tcp(443, 443))}, nil, web, 80, true, LayerNetworkPolicy},
		{"priority, not prefix length: /8 deny at 10 over /24 accept at 20", none,
			TierRules{crule("10.0.1.0/24", ActionAccept, 20), crule("10.0.0.0/8", ActionDeny, 10)}, nil, web, 80, false, LayerAdmin},
		{"priority, not prefix length: /24 accept at 5 over /8 deny at 10", none,
			TierRules{crule("10.0.1.0/24", ActionAccept, 5), crule("10.0.0.0/8", ActionDeny, 10)}, nil, web, 80, true, LayerAdmin},
		{"equal priority: deny before accept", none, TierRules{crule("10.0.1.5/32", ActionAccept, 7), crule("10.0.0.0/8", ActionDeny, 7)}, nil, web, 80, false, LayerAdmin},
		{"equal priority: accept before pass", np(true), TierRules{crule("10.0.0.0/8", ActionPass, 7), crule("10.0.1.5/32", ActionAccept, 7)}, nil, web, 80, true, LayerAdmin},
		{"baseline deny without a networkpolicy", none, nil, TierRules{crule("10.0.0.0/8", ActionDeny, 1)}, web, 80, false, LayerBaseline},
		{"baseline deny under a networkpolicy allow: not consulted", np(true, allowWeb), nil, TierRules{crule("10.0.0.0/8", ActionDeny, 1)}, web, 80, true, LayerNetworkPolicy},
		{"baseline under a networkpolicy of the other direction only", np(false), nil, TierRules{crule("10.0.0.0/8", ActionDeny, 1)}, web, 80, false, LayerBaseline},
		{"baseline accept over strict's default", strict, nil, TierRules{crule("10.0.0.0/8", ActionAccept, 1)}, web, 80, true, LayerBaseline},
		{"baseline pass: the default", strict, nil, TierRules{crule("10.0.0.0/8", ActionPass, 1), crule("10.0.0.0/8", ActionAccept, 2)}, web, 80, false, LayerDefault},
		{"admin pass then baseline", none, TierRules{crule("10.0.0.0/8", ActionPass, 1)}, TierRules{crule("10.0.0.0/8", ActionDeny, 1)}, web, 80, false, LayerBaseline},
		{"strict: cluster documents do not make a pod selected", strict, TierRules{crule("192.0.2.0/24", ActionDeny, 1)}, nil, web, 80, false, LayerDefault},
	} {
		t.Run(c.name, func(t *testing.T) {
			var cl Cluster
			cl.Admin[Egress] = slices.SortedStableFunc(slices.Values(c.admin), Before)
			cl.Baseline[Egress] = slices.SortedStableFunc(slices.Values(c.baseline), Before)
			got := Decide(&c.set, &cl, Egress, c.addr, 6, c.port)
			if got.Allowed != c.allowed || got.Layer != c.layer {
				t.Errorf("allowed %v by %s, want %v by %s", got.Allowed, got.Layer, c.allowed, c.layer)
			}
			if want := compile(t, &c.set, &cl, Egress).decide(c.addr, 6, c.port); want != (verdict{got.Allowed, got.Layer}) {
				t.Errorf("compiled: %+v, reference: %v by %s", want, got.Allowed, got.Layer)
			}
		})
	}
}

// TestTierCompile shows the compiled form of overlapping rules: each
// prefix's entry holds every rule covering it, by priority.
func TestTierCompile(t *testing.T) {
	rules := TierRules{
		crule("10.0.0.0/8", ActionDeny, 10),
		crule("10.0.1.0/24", ActionAccept, 20, tcp(80, 80)),
		crule("10.0.1.0/24", ActionAccept, 20, tcp(81, 81)), // merges with the one above
		crule("10.0.1.0/24", ActionPass, 5, udp(53, 53)),
		crule("10.0.2.0/24", ActionAccept, 1),
		crule("10.0.2.0/24", ActionDeny, 30), // after an all-ports slot: dropped
	}
	v4, v6, err := rules.Compile()
	if err != nil || len(v6) != 0 {
		t.Fatal(err, v6)
	}
	want := []TierEntry{
		{netip.MustParsePrefix("10.0.0.0/8"), []TierSlot{{10, ActionDeny, []PortRange{allPorts}}}},
		{netip.MustParsePrefix("10.0.1.0/24"), []TierSlot{{5, ActionPass, []PortRange{udp(53, 53)}},
			{10, ActionDeny, []PortRange{allPorts}}}},
		{netip.MustParsePrefix("10.0.2.0/24"), []TierSlot{{1, ActionAccept, []PortRange{allPorts}}}},
	}
	if !reflect.DeepEqual(v4, want) {
		t.Errorf("got\n%+v\nwant\n%+v", v4, want)
	}
}

func TestTierCompileLimits(t *testing.T) {
	var rules TierRules
	for p := range MaxTierRules + 1 {
		rules = append(rules, crule("10.0.0.0/8", ActionDeny, uint16(p), tcp(uint16(p+1), uint16(p+1))))
	}
	if _, _, err := rules[:MaxTierRules].Compile(); err != nil {
		t.Fatalf("%d rules: %v", MaxTierRules, err)
	}
	if _, _, err := rules.Compile(); err == nil || !strings.Contains(err.Error(), "10.0.0.0/8") {
		t.Fatalf("%d rules: %v, want ErrTooManyTierRules naming the prefix", MaxTierRules+1, err)
	}
}

// tierLookup is what the datapath does with a compiled tier: the entry of
// the longest prefix holding addr, then its slots in order until one's
// ports hold the connection.
func tierLookup(v4, v6 []TierEntry, addr netip.Addr, proto uint8, port uint16) (TierSlot, bool) {
	e, ok := longestMatch(v4, v6, addr, func(e TierEntry) netip.Prefix { return e.Prefix })
	if !ok {
		return TierSlot{}, false
	}
	for _, s := range e.Slots {
		if slices.ContainsFunc(s.Ports, func(r PortRange) bool { return r.Contains(proto, port) }) {
			return s, true
		}
	}
	return TierSlot{}, false
}

type verdict struct {
	Allowed bool
	Layer   Layer
}

// compiled is one direction of an identifier as the datapath holds it.
type compiled struct {
	admin4, admin6, base4, base6 []TierEntry
	np4, np6                     []Entry
	npIsolated, selected, strict bool
}

func compile(t testing.TB, s *Set, c *Cluster, d Direction) compiled {
	t.Helper()
	var out compiled
	var err error
	if out.admin4, out.admin6, err = c.Admin[d].Compile(); err != nil {
		t.Fatal(err)
	}
	if out.base4, out.base6, err = c.Baseline[d].Compile(); err != nil {
		t.Fatal(err)
	}
	if out.np4, out.np6, err = s.Direction(d).Compile(); err != nil {
		t.Fatal(err)
	}
	out.npIsolated = s.Selected && s.Direction(d).Isolated
	out.selected, out.strict = s.Selected, s.Mode == ModeStrict
	return out
}

// decide is Decide as the datapath does it: a lookup per tier.
func (c compiled) decide(addr netip.Addr, proto uint8, port uint16) verdict {
	if slot, ok := tierLookup(c.admin4, c.admin6, addr, proto, port); ok && slot.Action != ActionPass {
		return verdict{slot.Action == ActionAccept, LayerAdmin}
	}
	if c.npIsolated {
		return verdict{lookup(c.np4, c.np6, addr, proto, port), LayerNetworkPolicy}
	}
	if slot, ok := tierLookup(c.base4, c.base6, addr, proto, port); ok && slot.Action != ActionPass {
		return verdict{slot.Action == ActionAccept, LayerBaseline}
	}
	return verdict{c.selected || !c.strict, LayerDefault}
}

func randClusterRule(rng *rand.Rand) ClusterRule {
	r := randRule(rng) // its excepts are dropped: cluster rules have none
	return ClusterRule{CIDR: r.CIDR, Ports: r.Ports, Action: Action(rng.IntN(3)), Priority: uint16(rng.IntN(6))}
}

// TestTiersMatchDecide holds the compiled tiers, with the compiled
// NetworkPolicy between them, to Decide on random policies whose prefixes
// and priorities collide often: at least 20,000 connections a run. Replay a
// failure with go test ./pkg/policy -run TestTiersMatchDecide -seed=N.
func TestTiersMatchDecide(t *testing.T) {
	seed := *seedFlag
	if seed == 0 {
		seed = uint64(time.Now().UnixNano())
	}
	t.Logf("seed %d", seed)
	rng := rand.New(rand.NewPCG(seed, seed))
	checked := 0
	byLayer := map[Layer]int{}
	for round := range 300 {
		var c Cluster
		for range rng.IntN(8) {
			c.Admin[Egress] = append(c.Admin[Egress], randClusterRule(rng))
		}
		for range rng.IntN(8) {
			c.Baseline[Egress] = append(c.Baseline[Egress], randClusterRule(rng))
		}
		slices.SortStableFunc(c.Admin[Egress], Before)
		slices.SortStableFunc(c.Baseline[Egress], Before)
		s := Set{Mode: []Mode{ModeStandard, ModeStrict}[rng.IntN(2)], Selected: rng.IntN(2) > 0}
		s.Egress.Isolated = s.Selected && rng.IntN(3) > 0 || !s.Selected && s.Mode == ModeStrict
		for range rng.IntN(4) {
			s.Egress.Rules = append(s.Egress.Rules, randRule(rng))
		}
		comp := compile(t, &s, &c, Egress)
		checkTierEntries(t, comp.admin4, true)
		checkTierEntries(t, comp.admin6, false)
		checkTierEntries(t, comp.base4, true)
		checkTierEntries(t, comp.base6, false)
		var addrs []netip.Addr
		for _, r := range slices.Concat(c.Admin[Egress], c.Baseline[Egress]) {
			first, last := r.CIDR.Masked().Addr(), lastAddr(r.CIDR)
			addrs = append(addrs, first, last, first.Prev(), last.Next())
		}
		for range 40 {
			addrs = append(addrs, clusterAddr(rng, false), clusterAddr(rng, true))
		}
		for _, addr := range addrs {
			if !addr.IsValid() {
				continue
			}
			for range 2 {
				proto := []uint8{1, 6, 17, 132}[rng.IntN(4)]
				port := uint16(rng.IntN(26))
				want := Decide(&s, &c, Egress, addr, proto, port)
				if got := comp.decide(addr, proto, port); got != (verdict{want.Allowed, want.Layer}) {
					t.Fatalf("seed %d round %d: %s proto %d port %d: compiled %+v, Decide %v by %s\nadmin %+v\nbaseline %+v\nset %+v",
						seed, round, addr, proto, port, got, want.Allowed, want.Layer, c.Admin[Egress], c.Baseline[Egress], s)
				}
				checked++
				byLayer[want.Layer]++
			}
		}
	}
	if checked < 20000 {
		t.Errorf("only %d connections checked, want at least 20,000", checked)
	}
	for l := LayerAdmin; l <= LayerDefault; l++ {
		if byLayer[l] < checked/50 {
			t.Errorf("only %d of %d connections decided by %s: the generator does not exercise it", byLayer[l], checked, l)
		}
	}
	t.Logf("%d connections agree with Decide (by layer: %v)", checked, byLayer)
}

// checkTierEntries checks the shape the datapath relies on: right family,
// masked, unique sorted prefixes, slots in evaluation order within limits.
func checkTierEntries(t *testing.T, entries []TierEntry, is4 bool) {
	t.Helper()
	var prefixes []netip.Prefix
	for _, e := range entries {
		prefixes = append(prefixes, e.Prefix)
		if len(e.Slots) == 0 || len(e.Slots) > MaxTierRules {
			t.Fatalf("entry %v: %d slots", e.Prefix, len(e.Slots))
		}
		for j, s := range e.Slots {
			if j > 0 {
				p := e.Slots[j-1]
				if p.Priority > s.Priority || p.Priority == s.Priority && p.Action >= s.Action {
					t.Fatalf("entry %v: slots %+v out of order", e.Prefix, e.Slots)
				}
			}
			if !reflect.DeepEqual(mergePorts(s.Ports), s.Ports) {
				t.Fatalf("entry %v: ports not merged: %v", e.Prefix, s.Ports)
			}
		}
	}
	checkPrefixes(t, prefixes, is4)
}
