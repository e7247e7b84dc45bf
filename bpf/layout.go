package bpf

import (
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
}

var (
	ctV4Size     = uint32(unsafe.Sizeof(podfenceCtKeyV4{}))
	ctV6Size     = uint32(unsafe.Sizeof(podfenceCtKeyV6{}))
	ctValueSize  = uint32(unsafe.Sizeof(podfenceCtValue{}))
	lpmV4Size    = uint32(unsafe.Sizeof(podfenceLpmKeyV4{}))
	lpmV6Size    = uint32(unsafe.Sizeof(podfenceLpmKeyV6{}))
	policyVSize  = uint32(unsafe.Sizeof(podfencePolicyValue{}))
	portSetSize  = uint32(unsafe.Sizeof(podfencePortSet{}))
	trieCapacity = uint32(16384)
	// A policy's port sets and its successor's, while one replaces the other.
	portSetCapacity = uint32(2 * policy.MaxPortSets)
)

var layouts = map[string]mapLayout{
	mapCTv4:            {ebpf.LRUHash, ctV4Size, ctValueSize, 131072},
	mapCTv6:            {ebpf.LRUHash, ctV6Size, ctValueSize, 65536},
	mapNodeAddrs:       {ebpf.Hash, 16, 1, 256},
	mapDenyEvents:      {ebpf.RingBuf, 0, 0, 256 * 1024},
	mapEventBudget:     {ebpf.PerCPUArray, 4, uint32(unsafe.Sizeof(podfenceEventBudget{})), 1},
	mapFrags:           {ebpf.LRUHash, uint32(unsafe.Sizeof(podfenceFragKey{})), uint32(unsafe.Sizeof(podfenceFragPorts{})), 8192},
	mapTickClock:       {ebpf.PerCPUArray, 4, uint32(unsafe.Sizeof(podfenceCachedTime{})), 1},
	mapState:           {ebpf.Array, 4, uint32(unsafe.Sizeof(podfenceIdState{})), 1},
	mapCounters:        {ebpf.PerCPUArray, 4, 8, 2 * uint32(NumReasons)},
	pinpath.MapPolInV4: {ebpf.LPMTrie, lpmV4Size, policyVSize, trieCapacity},
	pinpath.MapPolInV6: {ebpf.LPMTrie, lpmV6Size, policyVSize, trieCapacity},
	pinpath.MapPolEgV4: {ebpf.LPMTrie, lpmV4Size, policyVSize, trieCapacity},
	pinpath.MapPolEgV6: {ebpf.LPMTrie, lpmV6Size, policyVSize, trieCapacity},
	mapPortSets:        {ebpf.Hash, 4, portSetSize, portSetCapacity},
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
