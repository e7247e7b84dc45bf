package bound

import (
	"fmt"
	"net/netip"

	"github.com/cilium/ebpf"
)

// Objects are the two programs and their maps, created unpinned.
type Objects struct {
	boundObjects
}

// Load creates the maps and loads the programs. Close releases them.
func Load() (*Objects, error) {
	var o Objects
	if err := loadBoundObjects(&o.boundObjects, nil); err != nil {
		return nil, fmt.Errorf("load lower-bound programs: %w", err)
	}
	return &o, nil
}

// Spec is the collection Load creates, for comparing its maps with the
// datapath's.
func Spec() (*ebpf.CollectionSpec, error) {
	return loadBound()
}

// CopyOptions say how one pod's copy is loaded for BenchmarkEgressAfterNAT.
type CopyOptions struct {
	// Slot is the copy's index in judges, which mark_then_judge stamps in
	// the mark.
	Slot uint32
	// Shared are the node-wide maps, by name (ct_v4, judges,
	// egress_by_pod_v4), that replace the copy's own; nil loads its own.
	Shared map[string]*ebpf.Map
	// CTFrom and CTTo, when set, are the tuple of the one kernel conntrack
	// entry that the kfunc designs look up for every packet (the
	// benchmark's); unset, they look up the packet's own.
	CTFrom, CTTo netip.AddrPort
}

// LoadCopy loads the programs and the maps not shared, as podfence loads
// one datapath per identifier.
func LoadCopy(opts CopyOptions) (*Objects, error) {
	spec, err := loadBound()
	if err != nil {
		return nil, err
	}
	vars := map[string]any{"slot": opts.Slot}
	if opts.CTFrom.IsValid() && opts.CTTo.IsValid() {
		be16 := func(v uint16) [2]byte { return [2]byte{byte(v >> 8), byte(v)} }
		vars["ct_saddr"], vars["ct_sport"] = opts.CTFrom.Addr().As4(), be16(opts.CTFrom.Port())
		vars["ct_daddr"], vars["ct_dport"] = opts.CTTo.Addr().As4(), be16(opts.CTTo.Port())
		vars["ct_fixed"] = uint8(1)
	}
	for name, v := range vars {
		if err := spec.Variables[name].Set(v); err != nil {
			return nil, fmt.Errorf("set %s: %w", name, err)
		}
	}
	var o Objects
	err = spec.LoadAndAssign(&o.boundObjects, &ebpf.CollectionOptions{MapReplacements: opts.Shared})
	if err != nil {
		return nil, fmt.Errorf("load copy %d: %w", opts.Slot, err)
	}
	return &o, nil
}
