package bpf

import (
	"encoding/binary"
	"fmt"
	"unsafe"

	"github.com/cilium/ebpf"

	"github.com/podfence/podfence/pkg/pinpath"
	"github.com/podfence/podfence/pkg/policy"
)

// mapLayout is what a pinned map must look like for this datapath to use
// it: the kernel map type, the sizes of its key and value, which the Go
// types bpf2go generated from types.h also have, and its capacity.
// TestLayoutMatchesObject keeps this table and podfence.c in agreement;
// the counters' capacity also ties NumReasons to REASON_MAX.
type mapLayout struct {
	typ              ebpf.MapType
	keySize, valSize uint32
	maxEntries       uint32
	// carry is what a build of another layout does with the map's
	// entries; since is the LayoutVersion in which their format or
	// meaning last changed.
	carry carry
	since uint32
	// rekey, when not nil, gives the key in this layout of an entry that
	// a pin of layout from holds under key (or false: the entry has no
	// place here), for a map whose entries moved but kept their meaning.
	rekey func(from uint32, key []byte) ([]byte, bool)
}

// carry says how a map of another layout (an earlier build's pin) becomes
// one of this layout while pods use it.
type carry uint8

const (
	// carryKeep: only a pin of exactly this layout is used; any other is
	// refused. The conntrack maps are kept: both ends of a flow look up
	// the same entry, and programs of the earlier build go on writing
	// into its map until every member has moved, so a copy would lose
	// the flows that start meanwhile.
	carryKeep carry = iota
	// carryCopy: a new map gets the pin's entries, which must have this
	// layout's key and value sizes and a format unchanged since the pin's
	// layout (since). Policy, state and counters: a member must enforce
	// from its first packet on the new programs what it enforced on the old.
	carryCopy
	// carryFresh: a new, empty map; what it held is rebuilt or expendable
	// (rate limiter, clock cache, unread events).
	carryFresh
)

var (
	ctV4Size     = uint32(unsafe.Sizeof(podfenceCtKeyV4{}))
	ctV6Size     = uint32(unsafe.Sizeof(podfenceCtKeyV6{}))
	ctValueSize  = uint32(unsafe.Sizeof(podfenceCtValue{}))
	lpmV4Size    = uint32(unsafe.Sizeof(podfenceLpmKeyV4{}))
	lpmV6Size    = uint32(unsafe.Sizeof(podfenceLpmKeyV6{}))
	policyVSize  = uint32(unsafe.Sizeof(podfencePolicyValue{}))
	portSetSize  = uint32(unsafe.Sizeof(podfencePortSet{}))
	sourcesSize  = uint32(unsafe.Sizeof(podfencePodSources{}))
	tierKeySize  = uint32(unsafe.Sizeof(podfenceTierKey{}))
	tierValSize  = uint32(unsafe.Sizeof(podfenceTierValue{}))
	tierCapacity = uint32(4096)
	trieCapacity = uint32(16384)
	// A policy's port sets and its successor's, while one replaces the other.
	portSetCapacity = uint32(2 * policy.MaxPortSets)
)

var layouts = map[string]mapLayout{
	mapCTv4:            {ebpf.LRUHash, ctV4Size, ctValueSize, 131072, carryKeep, 1, nil},
	mapCTv6:            {ebpf.LRUHash, ctV6Size, ctValueSize, 65536, carryKeep, 1, nil},
	mapNodeAddrs:       {ebpf.Hash, 16, 1, 256, carryCopy, 1, nil},
	mapDenyEvents:      {ebpf.RingBuf, 0, 0, 256 * 1024, carryFresh, 1, nil},
	mapEventBudget:     {ebpf.PerCPUArray, 4, uint32(unsafe.Sizeof(podfenceEventBudget{})), 1, carryFresh, 1, nil},
	mapFrags:           {ebpf.LRUHash, uint32(unsafe.Sizeof(podfenceFragKey{})), uint32(unsafe.Sizeof(podfenceFragPorts{})), 8192, carryCopy, 1, nil},
	mapTickClock:       {ebpf.PerCPUArray, 4, uint32(unsafe.Sizeof(podfenceCachedTime{})), 1, carryFresh, 1, nil},
	mapState:           {ebpf.Array, 4, uint32(unsafe.Sizeof(podfenceIdState{})), 1, carryCopy, 1, nil},
	mapCounters:        {ebpf.PerCPUArray, 4, 8, 2 * uint32(NumReasons), carryCopy, 1, rekeyCounters},
	pinpath.MapPolInV4: {ebpf.LPMTrie, lpmV4Size, policyVSize, trieCapacity, carryCopy, 1, nil},
	pinpath.MapPolInV6: {ebpf.LPMTrie, lpmV6Size, policyVSize, trieCapacity, carryCopy, 1, nil},
	pinpath.MapPolEgV4: {ebpf.LPMTrie, lpmV4Size, policyVSize, trieCapacity, carryCopy, 1, nil},
	pinpath.MapPolEgV6: {ebpf.LPMTrie, lpmV6Size, policyVSize, trieCapacity, carryCopy, 1, nil},
	mapPortSets:        {ebpf.Hash, 4, portSetSize, portSetCapacity, carryCopy, 1, nil},
	// New in layout 2, so no earlier pin holds entries of another
	// meaning; a take-over of layout 1 creates it empty and fills it from
	// the member records (package pinroot) before members move onto programs
	// that read it.
	mapSources: {ebpf.Hash, 4, sourcesSize, maxMembers, carryCopy, 1, nil},
	// New in layout 3, likewise: a take-over of an earlier layout creates
	// it empty, which is what that layout enforced (no cluster policy),
	// and the next ApplyPolicy fills it.
	mapTiers: {ebpf.LPMTrie, tierKeySize, tierValSize, tierCapacity, carryCopy, 1, nil},
	// Side 1 of the policy, new in layout 4: a take-over of an earlier
	// layout creates these empty and copies side 0 into them, with the
	// state's enforced bits (once padding), before any program of this
	// build reads them (syncSides).
	pinpath.MapPolInV4Side1: {ebpf.LPMTrie, lpmV4Size, policyVSize, trieCapacity, carryCopy, 1, nil},
	pinpath.MapPolInV6Side1: {ebpf.LPMTrie, lpmV6Size, policyVSize, trieCapacity, carryCopy, 1, nil},
	pinpath.MapPolEgV4Side1: {ebpf.LPMTrie, lpmV4Size, policyVSize, trieCapacity, carryCopy, 1, nil},
	pinpath.MapPolEgV6Side1: {ebpf.LPMTrie, lpmV6Size, policyVSize, trieCapacity, carryCopy, 1, nil},
	pinpath.MapTiersSide1:   {ebpf.LPMTrie, tierKeySize, tierValSize, tierCapacity, carryCopy, 1, nil},
	// New in layout 5 (service.h). The sweeper rewrites the frontends;
	// each identifier installs its programs at its slot when it opens.
	mapServices: {ebpf.Hash, uint32(unsafe.Sizeof(podfenceServiceKey{})), 1, 65536, carryCopy, 1, nil},
	mapJudges:   {ebpf.ProgramArray, 4, 4, 2 * (MaxSlots + 1), carryFresh, 1, nil},
	// New in layout 6: the same identifiers' judges of flows delivered to
	// the node's sockets (cgroup_skb programs, so a map of their own).
	mapLocalJudges: {ebpf.ProgramArray, 4, 4, MaxSlots + 1, carryFresh, 1, nil},
}

// maxMembers is MAX_MEMBERS in maps.h: the members of one identifier on
// one node, each with its sources entry.
const maxMembers = 1024

// reasonsIn is how many reasons (enum reason) the datapath of a layout
// counts: the counters of layout v are indexed direction*reasonsIn(v)+reason.
func reasonsIn(layout uint32) uint32 {
	switch layout {
	case 1:
		return 11 // before REASON_SPOOFED
	case 2:
		return 12 // before the tiers' reasons
	case 3, 4:
		return 16 // before REASON_UNTRANSLATED
	}
	// Layout 6 added no reason.
	return uint32(NumReasons)
}

// rekeyCounters moves a counter of an earlier layout to its index here:
// reasons are only ever added at the end, so a counter keeps its direction
// and reason while the directions' blocks grow.
func rekeyCounters(from uint32, key []byte) ([]byte, bool) {
	idx := binary.NativeEndian.Uint32(key)
	n := reasonsIn(from)
	dir, r := idx/n, idx%n
	if dir > 1 {
		return nil, false
	}
	return binary.NativeEndian.AppendUint32(nil, dir*uint32(NumReasons)+r), true
}

// checkLayout compares a pinned map with the layout its name should have;
// maxEntries, when not 0, is the capacity a node setting asks for instead.
func checkLayout(name string, m *ebpf.Map, maxEntries uint32) error {
	want, ok := layouts[name]
	if !ok {
		return fmt.Errorf("no layout for map %s", name)
	}
	if maxEntries != 0 {
		want.maxEntries = maxEntries
	}
	if m.Type() == want.typ && m.KeySize() == want.keySize && m.ValueSize() == want.valSize && m.MaxEntries() != want.maxEntries {
		return fmt.Errorf("%w: the map has %d entries, the node's setting is %d (the plugin's ctV4Entries/ctV6Entries and the sweeper's --ct-v4-entries/--ct-v6-entries must agree; a new size takes effect once no pod uses the maps and they are removed)",
			ErrTableSize, m.MaxEntries(), want.maxEntries)
	}
	if m.Type() != want.typ || m.KeySize() != want.keySize || m.ValueSize() != want.valSize || m.MaxEntries() != want.maxEntries {
		return fmt.Errorf("map is %s with %d-byte keys, %d-byte values and %d entries, want %s with %d, %d and %d",
			m.Type(), m.KeySize(), m.ValueSize(), m.MaxEntries(), want.typ, want.keySize, want.valSize, want.maxEntries)
	}
	return nil
}

// renewal is what becomes of one pinned map when this build opens it.
type renewal uint8

const (
	renewReuse  renewal = iota // the pin has this layout: use it
	renewCreate                // nothing is pinned: create it
	renewCopy                  // a new map, with the pin's entries
	renewFresh                 // a new, empty map
)

// planRenewal decides what becomes of the map pinned as name (m, nil when
// nothing is), made by a build of layout from. An error wraps
// ErrIncompatiblePin: this build cannot take the pin over.
func planRenewal(name string, m *ebpf.Map, from uint32, maxEntries uint32) (renewal, error) {
	if m == nil {
		return renewCreate, nil
	}
	want := layouts[name]
	// A pin of the same shape whose entries mean something else since is
	// not this layout's either.
	if want.since > from {
		if want.carry == carryFresh {
			return renewFresh, nil
		}
		return 0, fmt.Errorf("%w: its entries changed meaning in layout %d and the pin is layout %d, from which this build has no conversion",
			ErrIncompatiblePin, want.since, from)
	}
	err := checkLayout(name, m, maxEntries)
	if err == nil {
		return renewReuse, nil
	}
	switch want.carry {
	case carryFresh:
		return renewFresh, nil
	case carryCopy:
		if m.Type() != want.typ || m.KeySize() != want.keySize || m.ValueSize() != want.valSize {
			return 0, fmt.Errorf("%w: %w (its entries cannot be copied: the layout does not say how they convert)", ErrIncompatiblePin, err)
		}
		return renewCopy, nil
	}
	return 0, fmt.Errorf("%w: %w", ErrIncompatiblePin, err)
}

func (c carry) String() string {
	switch c {
	case carryKeep:
		return "keep"
	case carryCopy:
		return "copy"
	case carryFresh:
		return "fresh"
	}
	return fmt.Sprintf("carry(%d)", uint8(c))
}
