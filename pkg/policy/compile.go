package policy

import (
	"cmp"
	"fmt"
	"net/netip"
	"slices"
)

// Limits of the datapath's encoding. A trie holds twice MaxEntries plus
// 256 node addresses: each side of an identifier's policy holds one policy
// (since layout 4; before, a trie held a policy and its successor), and
// the room left lets a later build raise the limit without a layout
// change. The port sets, which both sides share, hold twice MaxPortSets:
// a policy's and those of the one replacing it.
const (
	// MaxEntries is how many entries Compile may return for one family:
	// the prefixes of one direction's trie.
	MaxEntries = 8064
	// MaxPortRanges is how many port ranges one entry may allow.
	MaxPortRanges = 64
	// InlinePortRanges is how many of them an entry holds itself; an entry
	// with more names a port set, which every entry with the same ranges
	// shares.
	InlinePortRanges = 2
	// MaxPortSets is how many distinct port sets one identifier's policy
	// may need, across directions and families.
	MaxPortSets = 512
)

// Entry is one LPM trie entry: the ports allowed for addresses whose longest
// matching prefix is Prefix. Empty Ports denies.
type Entry struct {
	Prefix netip.Prefix
	Ports  []PortRange
}

// Compile flattens the rules into LPM entries per family, such that for every
// address a: "the entry with the longest prefix containing a exists and one
// of its Ports contains (proto, port)" holds exactly when d.Allows(a, proto,
// port). A not-isolated direction compiles to no entries: the datapath allows
// it without a lookup. Entries are sorted by address, then prefix length.
//
// The prefixes inserted are every rule CIDR and every except, and for each
// such prefix P, Ports(P) is the union of the Ports of every rule R with
// R.CIDR ⊇ P and no except E of R with E ⊇ P. Why that is exact: let P be the
// longest inserted prefix containing a. Any inserted Q containing a is nested
// with P (both contain a) and not longer, so Q ⊇ P; conversely Q ⊇ P implies
// a ∈ Q. Hence for every rule, "a ∈ R.CIDR" ⇔ "R.CIDR ⊇ P" and "a ∈ E" ⇔
// "E ⊇ P", so Ports(P) is exactly the ports of the rules Allows would match.
// If no inserted prefix contains a, no rule CIDR does either: miss and
// Allows both deny.
//
// An error wrapping ErrTooManyPortRanges means a prefix needs more than
// MaxPortRanges ranges even after merging.
func (d DirectionPolicy) Compile() (v4, v6 []Entry, err error) {
	if !d.Isolated {
		return nil, nil, nil
	}
	var prefixes []netip.Prefix
	seen := make(map[netip.Prefix]bool)
	add := func(p netip.Prefix) {
		if p = p.Masked(); p.IsValid() && !seen[p] {
			seen[p] = true
			prefixes = append(prefixes, p)
		}
	}
	for _, r := range d.Rules {
		add(r.CIDR)
		for _, e := range r.Except {
			add(e)
		}
	}
	slices.SortFunc(prefixes, func(a, b netip.Prefix) int {
		return cmp.Or(a.Addr().Compare(b.Addr()), cmp.Compare(a.Bits(), b.Bits()))
	})
	// The rules whose CIDR covers a prefix P are those whose CIDR is P
	// masked to one of the rules' prefix lengths: found by lookups, not by
	// a scan of every rule for every prefix (a policy listing thousands of
	// hosts made that seconds).
	byCIDR := make(map[netip.Prefix][]*Rule)
	var lengths [2][]int // distinct rule prefix lengths, IPv4 then IPv6
	for i := range d.Rules {
		r := &d.Rules[i]
		c := r.CIDR.Masked()
		if !c.IsValid() {
			continue
		}
		f := family(c)
		if _, ok := byCIDR[c]; !ok && !slices.Contains(lengths[f], c.Bits()) {
			lengths[f] = append(lengths[f], c.Bits())
		}
		byCIDR[c] = append(byCIDR[c], r)
	}
	for _, p := range prefixes {
		var ports []PortRange
		for _, l := range lengths[family(p)] {
			if l > p.Bits() {
				continue
			}
			for _, r := range byCIDR[netip.PrefixFrom(p.Addr(), l).Masked()] {
				if !slices.ContainsFunc(r.Except, func(e netip.Prefix) bool { return covers(e, p) }) {
					ports = append(ports, r.Ports...)
				}
			}
		}
		ports = mergePorts(ports)
		if len(ports) > MaxPortRanges {
			return nil, nil, fmt.Errorf("prefix %s: %d port ranges after merging, at most %d: %w", p, len(ports), MaxPortRanges, ErrTooManyPortRanges)
		}
		if p.Addr().Is4() {
			v4 = append(v4, Entry{p, ports})
		} else {
			v6 = append(v6, Entry{p, ports})
		}
	}
	return v4, v6, nil
}

// family is 0 for an IPv4 prefix, 1 for IPv6.
func family(p netip.Prefix) int {
	if p.Addr().Is4() {
		return 0
	}
	return 1
}

// covers reports whether outer ⊇ inner; prefixes of different families never
// cover each other.
func covers(outer, inner netip.Prefix) bool {
	return outer.IsValid() && outer.Bits() <= inner.Bits() && outer.Contains(inner.Addr())
}

// mergePorts returns the same set of (protocol, port) pairs in the fewest
// ranges this representation allows, sorted by protocol then first port:
// overlapping or adjacent ranges of a protocol merge (so a protocol's full
// range absorbs its others), and a ProtocolAny full range absorbs everything.
func mergePorts(in []PortRange) []PortRange {
	if slices.Contains(in, allPorts) {
		return []PortRange{allPorts}
	}
	rs := slices.Clone(in)
	slices.SortFunc(rs, func(a, b PortRange) int {
		return cmp.Or(cmp.Compare(a.Protocol, b.Protocol), cmp.Compare(a.First, b.First), cmp.Compare(a.Last, b.Last))
	})
	out := rs[:0]
	for _, r := range rs {
		if r.First > r.Last {
			continue // empty; only hand-built rules have these
		}
		if n := len(out); n > 0 && out[n-1].Protocol == r.Protocol && int(r.First) <= int(out[n-1].Last)+1 {
			out[n-1].Last = max(out[n-1].Last, r.Last)
			continue
		}
		out = append(out, r)
	}
	if len(out) == 0 {
		return nil
	}
	return out
}
