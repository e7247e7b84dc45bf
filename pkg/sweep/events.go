package sweep

import (
	"errors"
	"fmt"
	"time"

	"net/netip"

	"github.com/vishvananda/netlink"

	"github.com/podfence/podfence/bpf"
	"github.com/podfence/podfence/pkg/ctnetlink"
	"github.com/podfence/podfence/pkg/liveness"
)

// EventReport is what following destroy events did, since the last report.
type EventReport struct {
	Events  int // destroy events read
	Deleted int // entries they deleted
	Lost    bool
}

// Follow reads the kernel's conntrack destroy events until ev is closed,
// deleting the entries of each destroyed flow at once, and calls report
// after each read. A lost or unreadable event is reported as lost, and the
// caller runs a full pass: the flow it hid is found there.
//
// An entry is deleted only if no packet touched it since the event came:
// a packet after the destroy belongs to a new connection on the same tuple.
// Its owner is found by its address (the members' pod IPs as the last pass
// read them): an address no member has is not this node's pod.
func (s *Sweeper) Follow(ev *ctnetlink.Events, report func(EventReport)) error {
	for {
		var r EventReport
		err := ev.Read(func(f *ctnetlink.Flow) {
			r.Events++
			// The datapath's clock lags: a packet just after the event
			// may record a time just before it.
			received := Monotonic() - clockSlack
			for _, k := range liveness.FlowKeys(liveness.Key(f.Orig), liveness.Key(f.Reply)) {
				r.Deleted += s.deleteIfIdle(k, received)
			}
		})
		if errors.Is(err, ctnetlink.ErrLost) || errors.Is(err, ctnetlink.ErrMalformed) {
			r.Lost = true
			err = nil
		}
		report(r)
		if err != nil {
			return err
		}
	}
}

// deleteIfIdle deletes k's entries on the veths of the members that own
// its source address, unless touched at or after received.
func (s *Sweeper) deleteIfIdle(k liveness.Key, received time.Duration) int {
	ifindexes := s.ownersOf(k.SrcAddrPort().Addr())
	deleted := 0
	for _, ifindex := range ifindexes {
		e := bpf.CTEntry{Key: k, Ifindex: ifindex}
		ok, err := s.g.LookupConntrack(&e)
		if err != nil || !ok || e.LastSeen() >= received {
			continue
		}
		if n, err := s.g.DeleteConntrack([]bpf.CTEntry{e}); err == nil {
			deleted += n
		}
	}
	return deleted
}

// ownersOf returns the host veths of the members that have addr. A pod
// added since the last reading is found by reading the members again, at
// most once a second (most destroyed flows are not of this node's pods).
func (s *Sweeper) ownersOf(addr netip.Addr) []uint32 {
	s.ownersMu.Lock()
	defer s.ownersMu.Unlock()
	if v, ok := s.owners[addr]; ok || time.Since(s.ownersRead) < time.Second {
		return v
	}
	if owners, err := s.readOwners(); err == nil {
		s.owners, s.ownersRead = owners, time.Now()
	}
	return s.owners[addr]
}

// nodeLinks are the names of the calling thread's namespace's interfaces,
// by ifindex.
func nodeLinks() (map[uint32]string, error) {
	links, err := netlink.LinkList()
	if err != nil {
		return nil, fmt.Errorf("list interfaces: %w", err)
	}
	out := make(map[uint32]string, len(links))
	for _, l := range links {
		out[uint32(l.Attrs().Index)] = l.Attrs().Name
	}
	return out, nil
}
