package bpf

import (
	"fmt"
	"path/filepath"

	"github.com/cilium/ebpf"

	"github.com/podfence/podfence/pkg/podid"
	"github.com/podfence/podfence/pkg/policy"
)

// IdentifierInfo is what an identifier's pins say about it.
type IdentifierInfo struct {
	ID         podid.ID
	Generation uint32
	Mode       policy.Mode
	// Isolated by policy.Direction: the PolicyEndpoints isolate that
	// direction, or strict mode's default denies it.
	Isolated [2]bool
	// Admin and Baseline by policy.Direction: cluster rules of that tier
	// judge the direction's new flows.
	Admin, Baseline [2]bool
	// Changing: a policy change is under way, or was stopped, and the
	// side it left behind is not level yet (policy.go).
	Changing        bool
	Counters        Counters
	Ingress, Egress ebpf.ProgramID
	// Layout is what the identifier's layout marker records ("v1
	// object=..."); empty for pins made before markers were written.
	Layout string
	// Slot is the identifier's slot (slots.go): its pods' Service flows
	// are judged on their backends. -1: on their frontends, at the veth
	// (a kernel without the conntrack kfuncs, no slot left, or programs
	// of an earlier build).
	Slot int
}

// Allowed and Denied are the packets the identifier's programs passed and
// dropped, both directions.
func (c Counters) Allowed() (n uint64) { return c.sum(VerdictAllow) }

// Denied: see Allowed.
func (c Counters) Denied() (n uint64) { return c.sum(VerdictDrop) }

func (c Counters) sum(verdict uint32) (n uint64) {
	for d := range c {
		for r := range c[d] {
			if Reason(r).Verdict() == verdict {
				n += c[d][r]
			}
		}
	}
	return n
}

// InspectIdentifier reads the state, counters and program IDs of
// identifier id from its pins in dir without loading, creating or changing anything (the
// sweeper's ls and metrics). Pins of another layout are refused
// (ErrIncompatiblePin).
func InspectIdentifier(dir string, id podid.ID) (IdentifierInfo, error) {
	info := IdentifierInfo{ID: id}
	open := func(name string) (*ebpf.Map, error) {
		m, err := ebpf.LoadPinnedMap(filepath.Join(dir, name), &ebpf.LoadPinOptions{ReadOnly: true})
		if err != nil {
			return nil, fmt.Errorf("inspect %q: %w", id, err)
		}
		if err := checkLayout(name, m, 0); err != nil {
			m.Close()
			return nil, fmt.Errorf("inspect %q: %s: %w: %w", id, name, ErrIncompatiblePin, err)
		}
		return m, nil
	}
	state, err := open(mapState)
	if err != nil {
		return info, err
	}
	defer state.Close()
	counters, err := open(mapCounters)
	if err != nil {
		return info, err
	}
	defer counters.Close()
	var st podfenceIdState
	if err := state.Lookup(uint32(0), &st); err != nil {
		return info, fmt.Errorf("read state of %q: %w", id, err)
	}
	info.Generation = st.Generation
	info.Mode = stateMode(st)
	info.Changing = st.Applying != 0
	// Pins of a layout before sides have padding where side 1's bits are
	// now, and one side, read whatever the generation.
	mk, hasMarker, err := readMarker(dir)
	if err != nil {
		return info, fmt.Errorf("inspect %q: %w", id, err)
	}
	bits := st.Enforced
	if hasMarker && mk.version >= sidesLayout {
		bits = enforcedOn(st, sideOf(st.Generation))
	}
	for d := range 2 {
		info.Isolated[d] = bits&((enforcePolicy|enforceDefaultDeny)<<d) != 0
		info.Admin[d] = bits&(enforceAdmin<<d) != 0
		info.Baseline[d] = bits&(enforceBaseline<<d) != 0
	}
	i := Datapath{ID: id, Counters: counters}
	if info.Counters, err = i.ReadCounters(); err != nil {
		return info, err
	}
	info.Slot = -1
	if hasMarker {
		info.Layout = mk.String()
		if mk.hasSlot {
			info.Slot = int(mk.slot)
		}
	}
	info.Ingress, info.Egress, err = PinnedProgramIDs(dir)
	return info, err
}
