package bpf

import (
	"fmt"
	"net/netip"

	"github.com/podfence/podfence/pkg/policy"
)

// sideEntries is what one side's maps hold, keyed as the tries encode
// prefixes (lpmKey, tierKey).
type sideEntries struct {
	policy [2][2]map[string]podfencePolicyValue // by [direction][family]
	tiers  map[string]podfenceTierValue
}

// sideWant is what a side is to hold for a policy, with the enforced bits
// that go with it.
type sideWant struct {
	policy   [2][2]map[string]*podfencePolicyValue
	tiers    map[string]*podfenceTierValue
	enforced uint8
}

// entries reads the side's maps.
func (s *Side) entries() (sideEntries, error) {
	var e sideEntries
	var err error
	for d := range s.Policy {
		for f := range s.Policy[d] {
			if e.policy[d][f], err = trieEntries(s.Policy[d][f]); err != nil {
				return e, fmt.Errorf("read %s policy: %w", policy.Direction(d), err)
			}
		}
	}
	if e.tiers, err = tierEntries(s.Tiers); err != nil {
		return e, fmt.Errorf("read cluster tiers: %w", err)
	}
	return e, nil
}

// reserve notes the port sets the entries name.
func (e sideEntries) reserve(sets *portSets) {
	for d := range e.policy {
		for f := range e.policy[d] {
			sets.reserve(e.policy[d][f])
		}
	}
	sets.reserveTiers(e.tiers)
}

// want is e as what another side is to hold.
func (e sideEntries) want(enforced uint8) sideWant {
	w := sideWant{tiers: pointers(e.tiers), enforced: enforced}
	for d := range e.policy {
		for f := range e.policy[d] {
			w.policy[d][f] = pointers(e.policy[d][f])
		}
	}
	return w
}

func pointers[V any](m map[string]V) map[string]*V {
	out := make(map[string]*V, len(m))
	for k, v := range m {
		out[k] = &v
	}
	return out
}

// desiredEntries compiles set into what a side holds: its NetworkPolicy
// tries, with the node's addresses allowed on ingress, its cluster tiers,
// and the enforced bits. New port sets get keys in sets.
func desiredEntries(set *policy.Set, nodes []netip.Addr, sets *portSets) (sideWant, error) {
	var w sideWant
	for _, d := range []policy.Direction{policy.Ingress, policy.Egress} {
		v4, v6, err := set.Direction(d).Compile()
		if err != nil {
			return w, fmt.Errorf("compile %s policy: %w", d, err)
		}
		for f, entries := range [][]policy.Entry{v4, v6} {
			if w.policy[d][f], err = sets.encode(entries); err != nil {
				return w, fmt.Errorf("encode %s policy: %w", d, err)
			}
		}
	}
	for _, a := range nodes {
		f := 0
		if a.Is6() {
			f = 1
		}
		// A host prefix is the longest there is, so the node's entry never
		// hides a rule from any other address.
		w.policy[policy.Ingress][f][string(lpmKey(netip.PrefixFrom(a, a.BitLen())))] = &podfencePolicyValue{Flags: policyNode}
	}
	w.enforced = enforced(set)
	var err error
	if w.tiers, err = sets.encodeTiers(set, w.enforced, nodes); err != nil {
		return w, fmt.Errorf("encode cluster tiers: %w", err)
	}
	return w, nil
}

// use notes the port sets w's entries name.
func (w sideWant) use(sets *portSets) {
	for d := range w.policy {
		for f := range w.policy[d] {
			sets.use(w.policy[d][f])
		}
	}
	sets.useTiers(w.tiers)
}

// fits checks, before anything changes, that each side's maps can hold w
// next to what they hold, as they must while apply writes them, and that
// port_sets, which both sides share, can hold w's sets next to those of
// the policy it replaces. Set.Check refuses a policy too large on its own;
// this also covers one read again after the check.
func (w sideWant) fits(have [2]sideEntries, sets *portSets) error {
	for _, h := range have {
		for d := range w.policy {
			for f := range w.policy[d] {
				if n := len(h.policy[d][f]) + newKeys(h.policy[d][f], w.policy[d][f]); n > int(trieCapacity) {
					return fmt.Errorf("%s policy of IPv%d: %d entries with those of the policy it replaces, a trie holds %d: %w",
						policy.Direction(d), 4+2*f, n, trieCapacity, policy.ErrTooManyEntries)
				}
			}
		}
		if n := len(h.tiers) + newKeys(h.tiers, w.tiers); n > int(tierCapacity) {
			return fmt.Errorf("cluster tiers: %d entries with those of the rules they replace, the trie holds %d: %w",
				n, tierCapacity, policy.ErrTooManyEntries)
		}
	}
	if n := len(sets.used); n > policy.MaxPortSets {
		return fmt.Errorf("%d distinct port sets, at most %d: %w", n, policy.MaxPortSets, policy.ErrTooManyPortSets)
	}
	return nil
}

// sideChange is what turns a side's maps from what they hold into what a
// policy wants, one trie at a time.
type sideChange []trieChange

// diff is the change of the side's maps from have to want.
func (s *Side) diff(have sideEntries, want sideWant) sideChange {
	var c sideChange
	for d := range s.Policy {
		for f := range s.Policy[d] {
			if df := diffTrie(s.Policy[d][f], have.policy[d][f], want.policy[d][f]); !df.empty() {
				c = append(c, df)
			}
		}
	}
	if df := diffTrie(s.Tiers, have.tiers, want.tiers); !df.empty() {
		c = append(c, df)
	}
	return c
}

func (c sideChange) empty() bool { return len(c) == 0 }

func (c sideChange) apply() error {
	for _, df := range c {
		if err := df.apply(); err != nil {
			return err
		}
	}
	return nil
}

// newKeys counts the keys of want that have does not hold.
func newKeys[V any](have map[string]V, want map[string]*V) int {
	n := 0
	for k := range want {
		if _, ok := have[k]; !ok {
			n++
		}
	}
	return n
}
