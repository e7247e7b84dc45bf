package bpf

import (
	"fmt"
	"unsafe"

	"github.com/cilium/ebpf"
)

// mapLayout is what a pinned map must look like for this datapath to use
// it: the kernel map type and the sizes of its key and value, which the Go
// types bpf2go generated from types.h also have. TestLayoutMatchesObject
// keeps this table and podfence.c in agreement.
type mapLayout struct {
	typ              ebpf.MapType
	keySize, valSize uint32
}

var layouts = map[string]mapLayout{
	mapCTv4:        {ebpf.LRUHash, uint32(unsafe.Sizeof(podfenceCtKeyV4{})), uint32(unsafe.Sizeof(podfenceCtValue{}))},
	mapCTv6:        {ebpf.LRUHash, uint32(unsafe.Sizeof(podfenceCtKeyV6{})), uint32(unsafe.Sizeof(podfenceCtValue{}))},
	mapNodeAddrs:   {ebpf.Hash, 16, 1},
	mapDenyEvents:  {ebpf.RingBuf, 0, 0},
	mapEventBudget: {ebpf.PerCPUArray, 4, uint32(unsafe.Sizeof(podfenceEventBudget{}))},
	mapState:       {ebpf.Array, 4, uint32(unsafe.Sizeof(podfenceIdState{}))},
	mapCounters:    {ebpf.PerCPUArray, 4, 8},
	"pol_in_v4":    {ebpf.LPMTrie, uint32(unsafe.Sizeof(podfenceLpmKeyV4{})), uint32(unsafe.Sizeof(podfencePolicyValue{}))},
	"pol_in_v6":    {ebpf.LPMTrie, uint32(unsafe.Sizeof(podfenceLpmKeyV6{})), uint32(unsafe.Sizeof(podfencePolicyValue{}))},
	"pol_eg_v4":    {ebpf.LPMTrie, uint32(unsafe.Sizeof(podfenceLpmKeyV4{})), uint32(unsafe.Sizeof(podfencePolicyValue{}))},
	"pol_eg_v6":    {ebpf.LPMTrie, uint32(unsafe.Sizeof(podfenceLpmKeyV6{})), uint32(unsafe.Sizeof(podfencePolicyValue{}))},
}

// checkLayout compares a pinned map with the layout its name should have.
func checkLayout(name string, m *ebpf.Map) error {
	want, ok := layouts[name]
	if !ok {
		return fmt.Errorf("no layout for map %s", name)
	}
	if m.Type() != want.typ || m.KeySize() != want.keySize || m.ValueSize() != want.valSize {
		return fmt.Errorf("map is %s with %d-byte keys and %d-byte values, want %s with %d and %d",
			m.Type(), m.KeySize(), m.ValueSize(), want.typ, want.keySize, want.valSize)
	}
	return nil
}
