package bpf

import (
	"encoding/binary"
	"fmt"
	"net/netip"
	"unsafe"

	"github.com/cilium/ebpf"

	"github.com/podfence/podfence/pkg/policy"
)

// The tiers trie (struct tier_key, struct tier_value in types.h): every
// cluster rule of an identifier, both tiers, directions and families, in
// one LPM trie whose keys start with a selector byte.
const (
	tierSelBaseline = 1 // TIER_SEL_BASELINE; else Admin
	tierSelEgress   = 2 // TIER_SEL_EGRESS; else ingress
	tierSelIPv6     = 4 // TIER_SEL_IPV6

	tierEntryNode = 1 // TIER_ENTRY_NODE: one of the node's addresses
)

// Bits of id_state.enforced (enum enforced_bits), shifted left by the
// direction.
const (
	enforcePolicy      uint8 = 1 << 0
	enforceAdmin       uint8 = 1 << 2
	enforceBaseline    uint8 = 1 << 4
	enforceDefaultDeny uint8 = 1 << 6
)

// tierActions are the datapath's enum tier_action values of the actions.
var tierActions = [...]uint8{policy.ActionDeny: 1, policy.ActionAccept: 2, policy.ActionPass: 3}

// The tiers trie's keys as raw bytes, which is how tierKey encodes them.
type tierKeyBytes = [unsafe.Sizeof(podfenceTierKey{})]byte

// tierKey encodes prefix p of tier t and direction d as struct tier_key.
func tierKey(t policy.Tier, d policy.Direction, p netip.Prefix) string {
	p = p.Masked()
	var k tierKeyBytes
	binary.NativeEndian.PutUint32(k[:4], uint32(8+p.Bits()))
	if t == policy.TierBaseline {
		k[4] |= tierSelBaseline
	}
	if d == policy.Egress {
		k[4] |= tierSelEgress
	}
	if p.Addr().Is6() {
		k[4] |= tierSelIPv6
	}
	copy(k[5:], p.Addr().AsSlice())
	return string(k[:])
}

// enforced is the id_state.enforced of set: which layers judge a new flow
// in each direction (see judge in podfence.c). Isolation by the
// PolicyEndpoints is what it was before tiers; so is strict mode's default
// for a pod no PolicyEndpoint selects, unless Baseline rules come before
// that default.
func enforced(set *policy.Set) uint8 {
	var bits uint8
	for _, d := range []policy.Direction{policy.Ingress, policy.Egress} {
		var b uint8
		if len(set.Cluster.Admin[d]) > 0 {
			b |= enforceAdmin
		}
		isolated := set.Direction(d).Isolated
		baseline := len(set.Cluster.Baseline[d]) > 0
		switch {
		case isolated && set.Selected:
			b |= enforcePolicy // NetworkPolicy decides; Baseline is never reached
		case isolated && baseline:
			b |= enforceBaseline | enforceDefaultDeny // strict, no PolicyEndpoint selects it
		case isolated:
			b |= enforcePolicy
		case baseline:
			b |= enforceBaseline
		}
		bits |= b << d
	}
	return bits
}

// encodeTiers returns the tiers trie's contents for set: the compiled
// rules of every tier and direction that enforced (the state it goes with)
// consults, and in each consulted ingress tier the node's addresses, which
// pass before any rule. A slot with more than one port range names a port
// set in s.
func (s *portSets) encodeTiers(set *policy.Set, enforced uint8, nodes []netip.Addr) (map[string]*podfenceTierValue, error) {
	out := map[string]*podfenceTierValue{}
	for _, t := range []struct {
		tier  policy.Tier
		bit   uint8
		rules *[2]policy.TierRules
	}{{policy.TierAdmin, enforceAdmin, &set.Cluster.Admin}, {policy.TierBaseline, enforceBaseline, &set.Cluster.Baseline}} {
		for _, d := range []policy.Direction{policy.Ingress, policy.Egress} {
			if enforced&(t.bit<<d) == 0 {
				continue
			}
			v4, v6, err := t.rules[d].Compile()
			if err != nil {
				return nil, fmt.Errorf("%s %s rules: %w", t.tier, d, err)
			}
			for _, e := range append(v4, v6...) {
				v := &podfenceTierValue{Count: uint8(len(e.Slots))}
				for j, slot := range e.Slots {
					v.Slots[j] = podfenceTierSlot{Action: tierActions[slot.Action], Count: uint8(len(slot.Ports)), Priority: slot.Priority}
					if len(slot.Ports) == 1 {
						v.Slots[j].Range = podfencePortRange{Proto: uint8(slot.Ports[0].Protocol), First: slot.Ports[0].First, Last: slot.Ports[0].Last}
						continue
					}
					if v.Slots[j].Ports, err = s.key(slot.Ports); err != nil {
						return nil, err
					}
				}
				out[tierKey(t.tier, d, e.Prefix)] = v
			}
			if d != policy.Ingress {
				continue
			}
			// A host prefix is the longest there is: the node's entry
			// hides no rule from any other address.
			for _, a := range nodes {
				out[tierKey(t.tier, d, netip.PrefixFrom(a, a.BitLen()))] = &podfenceTierValue{Flags: tierEntryNode}
			}
		}
	}
	return out, nil
}

// tierSets are the port set keys a tiers entry names.
func tierSets(v *podfenceTierValue) []uint32 {
	var keys []uint32
	for _, slot := range v.Slots[:min(int(v.Count), len(v.Slots))] {
		if slot.Count > 1 {
			keys = append(keys, slot.Ports)
		}
	}
	return keys
}

// tierEntries reads a tiers trie, keyed as tierKey encodes prefixes.
func tierEntries(m *ebpf.Map) (map[string]podfenceTierValue, error) {
	entries, err := readEntries[tierKeyBytes, podfenceTierValue](m)
	return stringKeys(entries, err, func(k tierKeyBytes) string { return string(k[:]) })
}
