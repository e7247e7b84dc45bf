package main

import (
	"errors"
	"slices"
	"strings"

	"github.com/cilium/ebpf"

	"github.com/podfence/podfence/bpf"
	"github.com/podfence/podfence/pkg/attach"
	"github.com/podfence/podfence/pkg/membership"
	"github.com/podfence/podfence/pkg/pinroot"
	"github.com/podfence/podfence/pkg/podid"
)

// identState is one identifier as the node has it, read in one hold of its
// lock: what ls, why, trace, dump and sweep show, typed. Only ls turns it
// into text (view).
type identState struct {
	ID podid.ID
	// Info is its state, counters and programs; InfoErr says why they
	// could not be read (pins of another layout, being removed).
	Info       bpf.IdentifierInfo
	InfoErr    error
	Members    []memberState
	Unreadable []string // keys of member records that do not decode
}

// memberState is a member with what the kernel says of its host veth.
type memberState struct {
	membership.Member
	VethPresent bool
	// Attached: both of the identifier's programs are on the veth.
	Attached bool
}

// readIdentifiers reads every identifier of the pin root, each under its lock, so
// that a member half-added is never shown. An identifier whose last
// member left meanwhile is left out.
func readIdentifiers(pins *pinroot.Root) ([]identState, error) {
	ids, err := pins.Identifiers()
	if err != nil {
		return nil, err
	}
	var out []identState
	for _, id := range ids {
		s, ok, err := readIdentifier(pins, id)
		if err != nil {
			return nil, err
		}
		if ok {
			out = append(out, s)
		}
	}
	return out, nil
}

// readIdentifier reads one identifier in one hold of its lock; ok is false
// when it is gone.
func readIdentifier(pins *pinroot.Root, id podid.ID) (s identState, ok bool, err error) {
	lock, err := pins.Lock(id)
	if errors.Is(err, membership.ErrNoIdentifier) {
		return s, false, nil
	}
	if err != nil {
		return s, false, err
	}
	defer lock.Unlock()
	s, err = readHeld(lock)
	return s, err == nil, err
}

// readHeld reads an identifier whose lock the caller holds.
func readHeld(lock *pinroot.Hold) (s identState, err error) {
	s.ID = lock.ID
	s.Info, s.InfoErr = lock.Inspect()
	sc, err := lock.Scan()
	if err != nil {
		return s, err
	}
	s.Unreadable = sc.Unreadable
	for _, m := range sc.Members {
		ms := memberState{Member: m}
		ms.VethPresent, _ = pinroot.VethPresent(m)
		if ms.VethPresent && s.InfoErr == nil && s.Info.Ingress != 0 {
			ms.Attached = attached(m.HostIfindex, attach.HookEgress, s.Info.Ingress) &&
				attached(m.HostIfindex, attach.HookIngress, s.Info.Egress)
		}
		s.Members = append(s.Members, ms)
	}
	return s, nil
}

func attached(ifindex int, h attach.Hook, want ebpf.ProgramID) bool {
	ids, err := attach.Attached(ifindex, h)
	return err == nil && slices.Contains(ids, want)
}

// view is s as ls shows it.
func (s identState) view() identifierView {
	v := identifierView{ID: s.ID, Members: []memberView{}, Isolated: []string{}, Tiers: []string{}, Unreadable: s.Unreadable}
	if s.InfoErr != nil {
		v.Error = s.InfoErr.Error()
	} else {
		v.Generation, v.Mode, v.Layout = s.Info.Generation, string(s.Info.Mode), s.Info.Layout
		for d, name := range []string{"ingress", "egress"} {
			if s.Info.Isolated[d] {
				v.Isolated = append(v.Isolated, name)
			}
			if s.Info.Admin[d] {
				v.Tiers = append(v.Tiers, "admin/"+name)
			}
			if s.Info.Baseline[d] {
				v.Tiers = append(v.Tiers, "baseline/"+name)
			}
		}
		v.Allowed, v.Denied = s.Info.Counters.Allowed(), s.Info.Counters.Denied()
		v.ServicesJudged = "frontend"
		if s.Info.Slot >= 0 {
			v.ServicesJudged = "backend"
		}
	}
	for _, m := range s.Members {
		mv := memberView{ContainerID: m.ContainerID, IfName: m.IfName, HostVeth: m.HostVeth,
			HostIfindex: m.HostIfindex, AttachMode: m.AttachMode, IPs: prefixStrings(m.IPs),
			VethPresent: m.VethPresent, Attached: m.Attached}
		v.Members = append(v.Members, mv)
	}
	return v
}

// owner is the member a conntrack entry's host veth belongs to.
type owner struct {
	ID        podid.ID
	Container string
}

// String is how dump and sweep print it: identifier/short container ID.
func (o owner) String() string {
	if o.ID == "" {
		return ""
	}
	return string(o.ID) + "/" + shortID(o.Container)
}

// matches says whether prefix starts the identifier or the container ID.
func (o owner) matches(prefix string) bool {
	return o.ID != "" && (strings.HasPrefix(string(o.ID), prefix) || strings.HasPrefix(o.Container, prefix))
}

// owners maps the host veths' ifindexes to their members.
func owners(pins *pinroot.Root) map[uint32]owner {
	out := map[uint32]owner{}
	idents, err := readIdentifiers(pins)
	if err != nil {
		return out
	}
	for _, s := range idents {
		for _, m := range s.Members {
			out[uint32(m.HostIfindex)] = owner{ID: s.ID, Container: m.ContainerID}
		}
	}
	return out
}
