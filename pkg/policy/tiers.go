package policy

import (
	"cmp"
	"fmt"
	"net/netip"
	"slices"

	"github.com/podfence/podfence/pkg/podid"
)

// MaxTierRules is how many rules one prefix of a tier may need after
// merging: the slots of one datapath entry. Past it Compile fails with
// ErrTooManyTierRules; the upstream agent drops what does not fit.
const MaxTierRules = 24

// MaxTierEntries is how many prefixes the cluster rules of one identifier
// may compile to, both tiers, directions and families together: each
// side's tiers trie holds twice as many (room that lets a later build
// raise the limit without a layout change) and 256 node addresses per
// ingress tier.
const MaxTierEntries = 1792

// TierRules are the rules of one tier in one direction of one identifier:
// those of every cluster document of the tier that selects it, in
// evaluation order (see Before).
type TierRules []ClusterRule

// Before orders rules as they are evaluated: lower priority first, then by
// action (Deny, Accept, Pass); what is left (policy, file, index) only
// makes the order, and so what why names, stable.
func Before(a, b ClusterRule) int {
	return cmp.Or(cmp.Compare(a.Priority, b.Priority), cmp.Compare(a.Action, b.Action),
		cmp.Compare(a.Policy, b.Policy), cmp.Compare(a.Source, b.Source), cmp.Compare(a.Index, b.Index))
}

// Cluster is what cluster documents say about one identifier.
type Cluster struct {
	// Admin and Baseline are indexed by Direction.
	Admin, Baseline [2]TierRules
	Sources         []string // the selecting documents, for messages
	Problems        []string // what they say that is not enforced as written
}

// ClusterForIdentifier collects the rules of the cluster documents that
// select id, and of every other chunk of their policies, by tier and
// direction, each list in evaluation order.
func ClusterForIdentifier(docs []ClusterDocument, id podid.ID) Cluster {
	policies := map[string]bool{}
	for _, d := range docs {
		if selectsAny(d.Selects, id) {
			policies[d.Policy] = true
		}
	}
	var c Cluster
	for _, d := range docs {
		if !policies[d.Policy] {
			continue
		}
		c.Sources = append(c.Sources, d.Source)
		for _, n := range d.Notes {
			c.Problems = append(c.Problems, fmt.Sprintf("%s %s: %s", d.Source, n.Field, n.What))
		}
		tier := &c.Admin
		if d.Tier == TierBaseline {
			tier = &c.Baseline
		}
		tier[Ingress] = append(tier[Ingress], d.Ingress...)
		tier[Egress] = append(tier[Egress], d.Egress...)
	}
	for _, tier := range []*[2]TierRules{&c.Admin, &c.Baseline} {
		for d := range tier {
			slices.SortStableFunc(tier[d], Before)
		}
	}
	return c
}

// First is the rule of t that decides a connection to or from addr on
// (proto, port): the first in evaluation order whose CIDR holds the address
// and whose ports the connection's. ok is false when none does. t must be
// in evaluation order (ClusterForIdentifier sorts it).
func (t TierRules) First(addr netip.Addr, proto uint8, port uint16) (r ClusterRule, ok bool) {
	addr = addr.Unmap().WithZone("")
	for _, r := range t {
		if r.CIDR.Contains(addr) && slices.ContainsFunc(r.Ports, func(p PortRange) bool { return p.Contains(proto, port) }) {
			return r, true
		}
	}
	return r, false
}

// Layer names what decided a connection.
type Layer uint8

const (
	LayerAdmin         Layer = iota // an Admin rule's Accept or Deny
	LayerNetworkPolicy              // the PolicyEndpoints that isolate the direction
	LayerBaseline                   // a Baseline rule's Accept or Deny
	LayerDefault                    // nothing did: the mode's default
)

func (l Layer) String() string {
	switch l {
	case LayerAdmin:
		return "admin"
	case LayerNetworkPolicy:
		return "networkpolicy"
	case LayerBaseline:
		return "baseline"
	case LayerDefault:
		return "default"
	}
	return fmt.Sprintf("layer(%d)", uint8(l))
}

// Decision is the verdict on a connection and what gave it.
type Decision struct {
	Allowed bool
	Layer   Layer
	// Rule is the deciding cluster rule (layers admin and baseline).
	Rule *ClusterRule
	// Passed is the Admin rule whose Pass sent the connection on, if any.
	Passed *ClusterRule
}

// Decide is the reference evaluation of a connection of an identifier
// with set s (its PolicyEndpoints) and c (its cluster documents), in
// direction d, with remote address addr, protocol proto and destination
// port port. Per direction:
//
//  1. Admin rules in evaluation order: the first that matches decides;
//     Accept allows and Deny drops, without consulting NetworkPolicy; Pass
//     skips the rest of the tier.
//  2. NetworkPolicy, if a PolicyEndpoint isolates the pod in direction d:
//     its rules allow, or nothing does and the connection is dropped.
//  3. Baseline rules, the same way as Admin's (a Pass ends the tier).
//  4. The default: allowed, except in strict mode for a pod no
//     PolicyEndpoint selects (cluster documents do not count: they say
//     nothing of the namespace's own policies, which strict mode waits for).
//
// The node's own addresses are allowed before all of this by the
// datapath, and are not Decide's concern.
func Decide(s *Set, c *Cluster, d Direction, addr netip.Addr, proto uint8, port uint16) Decision {
	var passed *ClusterRule
	if r, ok := c.Admin[d].First(addr, proto, port); ok {
		if r.Action != ActionPass {
			return Decision{Allowed: r.Action == ActionAccept, Layer: LayerAdmin, Rule: &r}
		}
		passed = &r
	}
	if s.Selected && s.Direction(d).Isolated {
		return Decision{Allowed: s.Direction(d).Allows(addr, proto, port), Layer: LayerNetworkPolicy, Passed: passed}
	}
	if r, ok := c.Baseline[d].First(addr, proto, port); ok && r.Action != ActionPass {
		return Decision{Allowed: r.Action == ActionAccept, Layer: LayerBaseline, Rule: &r, Passed: passed}
	}
	return Decision{Allowed: s.Selected || s.Mode != ModeStrict, Layer: LayerDefault, Passed: passed}
}

// TierSlot is one step of a compiled tier entry: a connection whose
// protocol and port one of Ports holds gets Action, and the scan stops.
type TierSlot struct {
	Priority uint16
	Action   Action
	Ports    []PortRange
}

// TierEntry is one LPM trie entry of a tier: the slots, in evaluation
// order, for addresses whose longest matching prefix is Prefix.
type TierEntry struct {
	Prefix netip.Prefix
	Slots  []TierSlot
}

// Compile flattens t into LPM entries per family such that, for every
// address a, a scan of the slots of the entry with the longest prefix
// holding a stops at a slot with the Action and Priority of
// t.First(a, ...), and finds none exactly when First does not. Priority
// decides, not prefix length: a /8 Deny at priority 10 wins over a /16
// Accept at 20 inside the /16.
//
// The prefixes inserted are the rules' CIDRs; the entry of P holds every
// rule whose CIDR covers P, in evaluation order (why that is exact: see
// DirectionPolicy.Compile; with no excepts, "a ∈ R.CIDR" ⇔ "R.CIDR ⊇ P").
// Neighbouring slots of equal priority and action merge their ports, and a
// slot holding every port ends the entry: nothing after it can match.
//
// An error wrapping ErrTooManyTierRules means a prefix needs more than
// MaxTierRules slots; ErrTooManyPortRanges, a slot more than MaxPortRanges.
func (t TierRules) Compile() (v4, v6 []TierEntry, err error) {
	// As in DirectionPolicy.Compile, the rules covering a prefix are found
	// by lookups per rule prefix length, not a scan of every rule.
	var prefixes []netip.Prefix
	byCIDR := map[netip.Prefix][]ClusterRule{}
	var lengths [2][]int
	for _, r := range t {
		p := r.CIDR.Masked()
		if !p.IsValid() {
			continue
		}
		if _, ok := byCIDR[p]; !ok {
			prefixes = append(prefixes, p)
			if f := family(p); !slices.Contains(lengths[f], p.Bits()) {
				lengths[f] = append(lengths[f], p.Bits())
			}
		}
		byCIDR[p] = append(byCIDR[p], r)
	}
	slices.SortFunc(prefixes, func(a, b netip.Prefix) int {
		return cmp.Or(a.Addr().Compare(b.Addr()), cmp.Compare(a.Bits(), b.Bits()))
	})
	for _, p := range prefixes {
		var covering []ClusterRule
		for _, l := range lengths[family(p)] {
			if l <= p.Bits() {
				covering = append(covering, byCIDR[netip.PrefixFrom(p.Addr(), l).Masked()]...)
			}
		}
		slices.SortStableFunc(covering, Before)
		var slots []TierSlot
		for _, r := range covering {
			if n := len(slots); n > 0 && slots[n-1].Priority == r.Priority && slots[n-1].Action == r.Action {
				slots[n-1].Ports = mergePorts(append(slots[n-1].Ports, r.Ports...))
			} else {
				slots = append(slots, TierSlot{Priority: r.Priority, Action: r.Action, Ports: mergePorts(r.Ports)})
			}
		}
		// Slots after one that holds every port are never reached.
		if i := slices.IndexFunc(slots, func(s TierSlot) bool { return slices.Equal(s.Ports, []PortRange{allPorts}) }); i >= 0 {
			slots = slots[:i+1]
		}
		if len(slots) > MaxTierRules {
			return nil, nil, fmt.Errorf("prefix %s: %d rules of different priority or action, at most %d: %w", p, len(slots), MaxTierRules, ErrTooManyTierRules)
		}
		for _, s := range slots {
			if len(s.Ports) > MaxPortRanges {
				return nil, nil, fmt.Errorf("prefix %s: %d port ranges for priority %d %s, at most %d: %w", p, len(s.Ports), s.Priority, s.Action, MaxPortRanges, ErrTooManyPortRanges)
			}
		}
		if p.Addr().Is4() {
			v4 = append(v4, TierEntry{p, slots})
		} else {
			v6 = append(v6, TierEntry{p, slots})
		}
	}
	return v4, v6, nil
}
