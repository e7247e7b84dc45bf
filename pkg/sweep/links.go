package sweep

import (
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/podfence/podfence/pkg/membership"
	"github.com/podfence/podfence/pkg/pinroot"
	"github.com/podfence/podfence/pkg/podid"
)

// removalBatch gathers the link deletions of a burst (a Deployment scaled
// down) into one collection.
const removalBatch = 50 * time.Millisecond

// Removed are links the kernel deleted: ifindex to name.
type Removed map[uint32]string

// FollowLinkRemovals calls removed with the links the kernel deletes in the
// calling thread's network namespace, a burst at a time, until done is
// closed. Each time a subscription opens, at the start and after one failed
// (its socket overflowed, say, so deletions were lost), it calls removed
// with nil links first: every member must then be looked at, for what went
// while none was open. It returns when done is closed, or with the error
// of a first subscription it cannot open.
func FollowLinkRemovals(done <-chan struct{}, removed func(links Removed)) error {
	first := true
	for {
		updates := make(chan netlink.LinkUpdate, 256)
		failed := make(chan error, 1)
		stop := make(chan struct{})
		err := netlink.LinkSubscribeWithOptions(updates, stop, netlink.LinkSubscribeOptions{
			ErrorCallback: func(err error) {
				select {
				case failed <- err:
				default:
				}
			},
		})
		if err != nil {
			close(stop)
			if first {
				return fmt.Errorf("follow link removals: %w", err)
			}
			select {
			case <-done:
				return nil
			case <-time.After(time.Second):
				continue
			}
		}
		first = false
		removed(nil)
		ended := drainRemovals(done, updates, removed)
		close(stop)
		for range updates { // the reader closes it once its socket is closed
		}
		if ended {
			return nil
		}
	}
}

// drainRemovals passes on the deletions of one subscription until it ends
// (false) or done is closed (true).
func drainRemovals(done <-chan struct{}, updates <-chan netlink.LinkUpdate, removed func(Removed)) bool {
	batch := Removed{}
	var flush <-chan time.Time
	for {
		select {
		case <-done:
			return true
		case u, ok := <-updates:
			if !ok {
				if len(batch) > 0 {
					removed(batch)
				}
				return false
			}
			if u.Header.Type != unix.RTM_DELLINK {
				continue
			}
			batch[uint32(u.Index)] = u.Link.Attrs().Name
			if flush == nil {
				flush = time.After(removalBatch)
			}
		case <-flush:
			removed(batch)
			batch, flush = Removed{}, nil
		}
	}
}

// RemoveVethless removes at once, without the orphan grace, the members
// whose host veth is one of links and is gone (looked up again under the
// identifier's lock: an ifindex may have been given to a new veth since);
// with nil links, every member whose veth is gone. A veth's deletion is
// the kernel's word that the pod's hooks went with it, so nothing is gained
// by waiting: the pod's address may be given to the next pod at once.
func (s *Sweeper) RemoveVethless(links Removed) ([]Orphan, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	all := links == nil
	ids := s.identifiersWith(links)
	if all || ids == nil {
		var err error
		if ids, err = s.pins.Identifiers(); err != nil {
			return nil, fmt.Errorf("list identifiers: %w", err)
		}
	}
	var orphans []Orphan
	var errs []error
	for _, id := range ids {
		stale := func(_ string, m *membership.Member, _ bool) bool {
			if m == nil || (!all && links[uint32(m.HostIfindex)] != m.HostVeth) {
				return false
			}
			present, err := pinroot.VethPresent(*m)
			if err != nil {
				errs = append(errs, err)
				return false
			}
			return !present
		}
		c, err := s.pins.Collect(id, stale)
		orphans = append(orphans, s.logRemoved(id, c, "its veth was deleted")...)
		if err != nil {
			errs = append(errs, fmt.Errorf("identifier %q: %w", id, err))
		}
	}
	return orphans, errors.Join(errs...)
}

// identifiersWith are the identifiers whose members, as the last pass read
// them, have one of links as their veth; nil when a link is no member's
// veth the last pass saw (one added since, or not a pod's), so that
// every identifier is looked at.
func (s *Sweeper) identifiersWith(links Removed) []podid.ID {
	var ids []podid.ID
	for ifindex := range links {
		id, ok := s.vethOwners[ifindex]
		if !ok {
			return nil
		}
		if !slices.Contains(ids, id) {
			ids = append(ids, id)
		}
	}
	return ids
}

// logRemoved logs and returns the members a collection removed, and
// forgets when their veths went missing.
func (s *Sweeper) logRemoved(id podid.ID, c pinroot.Collected, why string) []Orphan {
	var orphans []Orphan
	for _, m := range c.Members {
		orphans = append(orphans, Orphan{ID: id, Member: m, Identifier: c.Identifier})
		delete(s.missingSince, string(id)+"/"+m.Key())
		s.opts.Log.Info("removed an orphaned member: "+why, "identifier", id,
			"container", m.ContainerID, "veth", m.HostVeth, "ifindex", m.HostIfindex, "identifier_removed", c.Identifier)
	}
	return orphans
}
