// Package lifecycle adds and removes an identifier's members and pins in
// the order that keeps package membership's invariants: records before
// attachments, attachments gone before records, the pins removed only by a
// lock holder that sees no member. The CNI plugin (ADD, DEL, GC) and the
// sweeper (orphans of pods that vanished without a DEL) both go through
// it; a second copy of these rules is how the seed's scale-down bug came
// about.
//
// Errors wrap one of ErrState, ErrDatapath or ErrAttach, which say which
// part of the node failed: the plugin maps them to its CNI error codes.
package lifecycle

import (
	"errors"
	"fmt"
	"path/filepath"
	"slices"

	"github.com/cilium/ebpf"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/podfence/podfence/bpf"
	"github.com/podfence/podfence/pkg/attach"
	"github.com/podfence/podfence/pkg/membership"
	"github.com/podfence/podfence/pkg/objinfo"
	"github.com/podfence/podfence/pkg/pinpath"
	"github.com/podfence/podfence/pkg/podid"
)

var (
	// ErrState is wrapped when the membership store cannot be read or written.
	ErrState = errors.New("membership state")
	// ErrDatapath is wrapped when loading, pinning or removing eBPF objects fails.
	ErrDatapath = errors.New("datapath")
	// ErrAttach is wrapped when attaching to or detaching from a veth fails.
	ErrAttach = errors.New("attachment")
)

// wrap tags err with the part of the node it concerns; nil stays nil.
func wrap(kind, err error) error {
	if err == nil {
		return nil
	}
	return fmt.Errorf("%w: %w", kind, err)
}

// Hook is one of a member's two attachments.
type Hook struct {
	Hook    attach.Hook
	LinkPin string // where its TCX link is pinned (unused by tc attachments)
}

// Hooks are a member's attachments. TCX links are pinned in the member's
// directory, so removing the member removes them.
func Hooks(lock *membership.Lock, m membership.Member) []Hook {
	dir := lock.MemberDir(m.Key())
	return []Hook{
		{attach.HookIngress, filepath.Join(dir, pinpath.LinkIngress)},
		{attach.HookEgress, filepath.Join(dir, pinpath.LinkEgress)},
	}
}

// VethPresent reports whether the member's ifindex still names its veth in
// the calling thread's network namespace. Ifindexes are reused once a veth
// is gone, so the name must match too. An error other than "no such link"
// is returned: it says nothing about the veth.
func VethPresent(m membership.Member) (bool, error) {
	h, err := netlink.NewHandle(unix.NETLINK_ROUTE)
	if err != nil {
		return false, fmt.Errorf("netlink: %w", err)
	}
	defer h.Close()
	link, err := h.LinkByIndex(m.HostIfindex)
	var notFound netlink.LinkNotFoundError
	if errors.As(err, &notFound) || errors.Is(err, unix.ENODEV) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("veth %s (ifindex %d): %w", m.HostVeth, m.HostIfindex, err)
	}
	return link.Attrs().Name == m.HostVeth, nil
}

// RemoveMember detaches a member's programs and deletes its record and
// its sources entry. Gone already (veth, links, record) is fine.
func RemoveMember(lock *membership.Lock, m membership.Member) error {
	// The legacy filter is found by ifindex, which a new veth may have
	// taken since: detach it only from the veth the record names; without
	// it (ifindex 0) Detach removes only the link pins. A veth whose
	// presence cannot be read is treated as gone, for the same reason.
	ifindex := m.HostIfindex
	present, err := VethPresent(m)
	if err != nil || !present {
		ifindex = 0
	}
	var errs []error
	for _, h := range Hooks(lock, m) {
		o := attach.Options{Hook: h.Hook, LinkPin: h.LinkPin, Ifindex: ifindex}
		if err := attach.Detach(o); err != nil {
			errs = append(errs, err)
		}
	}
	if len(errs) > 0 {
		return fmt.Errorf("%w: veth %s: %w", ErrAttach, m.HostVeth, errors.Join(errs...))
	}
	if err := lock.Remove(m.Key()); err != nil {
		return wrap(ErrState, err)
	}
	return removeSources(lock, m, present)
}

// removeSources deletes the sources entry of a removed member's veth. A
// veth that is gone may have passed its ifindex on to another member of
// the identifier, whose entry it is now: it stays then. (Another
// identifier's member keeps its entry in its own identifier's map.)
func removeSources(lock *membership.Lock, m membership.Member, present bool) error {
	if !present {
		sc, err := lock.Scan()
		if err != nil {
			return wrap(ErrState, err)
		}
		for _, o := range sc.Members {
			if o.HostIfindex == m.HostIfindex {
				return nil
			}
		}
	}
	return wrap(ErrDatapath, bpf.DeleteSources(lock.Dir(), uint32(m.HostIfindex)))
}

// setSources writes what m may send from into ident's sources map, before
// ident's programs run on m's veth.
func setSources(m membership.Member, ident *bpf.Identifier) error {
	return ident.SetSources(uint32(m.HostIfindex), bpf.Sources{Addrs: m.Sources(), Any: m.AnySource})
}

// RemoveIfUnused removes the identifier's pins when it has no member left,
// and says whether it did. A member whose record cannot be read keeps them:
// it may be a live pod whose record another version of podfence wrote.
func RemoveIfUnused(lock *membership.Lock) (bool, error) {
	sc, err := lock.Scan()
	if err != nil {
		return false, wrap(ErrState, err)
	}
	if sc.InUse() {
		return false, nil
	}
	if err := bpf.RemoveIdentifier(lock.Dir()); err != nil {
		return false, wrap(ErrDatapath, err)
	}
	return true, nil
}

// ReplaceUnusedObjects handles pins of the identifier that this build
// cannot use (another build's, say): when no member uses them, nothing
// attached does either (see package membership), so they are replaced and
// replaced is true. With members they stay, and the error wraps
// incompatible's: a live datapath is never swapped silently.
func ReplaceUnusedObjects(g *bpf.Global, lock *membership.Lock, incompatible error) (ident *bpf.Identifier, replaced bool, err error) {
	sc, err := lock.Scan()
	if err != nil {
		return nil, false, wrap(ErrState, errors.Join(incompatible, err))
	}
	if sc.InUse() {
		return nil, false, fmt.Errorf("%w: %w (in use by %d members; it is replaced once they are gone)",
			ErrDatapath, incompatible, len(sc.Members)+len(sc.Unreadable))
	}
	if err := bpf.RemoveObjects(lock.Dir()); err != nil {
		return nil, false, wrap(ErrDatapath, errors.Join(incompatible, err))
	}
	ident, err = bpf.OpenIdentifier(g, lock.Dir(), lock.ID)
	if err != nil {
		return nil, false, wrap(ErrDatapath, err)
	}
	return ident, true, nil
}

// Stale decides which of an identifier's member directories a collection
// removes. m is the member's record, or nil for a directory whose record is
// missing (an ADD killed before writing it) or unreadable; corrupt says
// which.
type Stale func(key string, m *membership.Member, corrupt bool) bool

// Collected is what one Collect removed.
type Collected struct {
	Members    []membership.Member // removed members with a readable record
	Keys       []string            // removed directories without one (missing or corrupt)
	Identifier bool                // the identifier's pins went with its last member
}

// Collect removes the members of id that stale selects, under id's lock,
// and the identifier's pins when no member is left. A missing identifier
// is nothing to collect.
//
// Without a record nothing can be detached, but the member's link pins go
// with its directory (invariant 1: nothing else was attached for it).
func Collect(store *membership.Store, id podid.ID, stale Stale) (Collected, error) {
	var out Collected
	lock, err := store.Lock(id)
	if errors.Is(err, membership.ErrNoIdentifier) {
		return out, nil
	}
	if err != nil {
		return out, wrap(ErrState, err)
	}
	defer lock.Unlock()
	sc, err := lock.Scan()
	if err != nil {
		return out, wrap(ErrState, err)
	}
	for i := range sc.Members {
		m := sc.Members[i]
		if !stale(m.Key(), &m, false) {
			continue
		}
		if err := RemoveMember(lock, m); err != nil {
			return out, err
		}
		out.Members = append(out.Members, m)
	}
	for _, group := range []struct {
		keys    []string
		corrupt bool
	}{{sc.Incomplete, false}, {sc.Unreadable, true}} {
		for _, key := range group.keys {
			if !stale(key, nil, group.corrupt) {
				continue
			}
			if err := lock.Remove(key); err != nil {
				return out, wrap(ErrState, err)
			}
			out.Keys = append(out.Keys, key)
		}
	}
	out.Identifier, err = RemoveIfUnused(lock)
	return out, err
}

// OpenIdentifier opens the identifier of lock for a caller that changes it
// (ADD, a policy push), taking over pins of an earlier layout or build
// (bpf.RenewIdentifier). When members may run other programs than the
// pinned ones (programs replaced now, or by a renewal whose move did not
// finish), every member is moved onto them before it returns, so that the
// identifier's pins and what its members run agree again. A member that
// cannot be moved is not the caller's failure: it is reported in
// Upgraded.Unmoved, and the next OpenIdentifier tries again.
func OpenIdentifier(g *bpf.Global, lock *membership.Lock) (*bpf.Identifier, Upgraded, error) {
	up := Upgraded{ID: lock.ID}
	ident, rn, err := bpf.RenewIdentifier(g, lock.Dir(), lock.ID)
	up.Renewal = rn
	if err != nil {
		return nil, up, wrap(ErrDatapath, err)
	}
	if rn.MovePending {
		up.Moved, up.Unmoved = moveAll(lock, ident)
	}
	return ident, up, nil
}

// moveAll is MoveMembers that, once every member has moved, ends the
// identifier's pending move.
func moveAll(lock *membership.Lock, ident *bpf.Identifier) (int, error) {
	moved, err := MoveMembers(lock, ident)
	if err != nil {
		return moved, err
	}
	return moved, wrap(ErrDatapath, ident.MembersMoved())
}

// MoveMembers points both hooks of every member whose veth is present at
// ident's programs, and returns how many members it moved. Each hook is
// swapped atomically (a TCX link update, a cls_bpf filter replace), so a
// member's packets meet either program, never none. A member whose veth is
// gone is left to the collection of orphans.
func MoveMembers(lock *membership.Lock, ident *bpf.Identifier) (int, error) {
	sc, err := lock.Scan()
	if err != nil {
		return 0, wrap(ErrState, err)
	}
	moved := 0
	var errs []error
	for _, m := range sc.Members {
		present, err := VethPresent(m)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		if !present {
			continue
		}
		n, err := moveMember(lock, m, ident)
		if err != nil {
			errs = append(errs, fmt.Errorf("%w: veth %s: %w", ErrAttach, m.HostVeth, err))
		}
		if n > 0 {
			moved++
		}
	}
	if len(sc.Unreadable) > 0 {
		// Possibly live pods whose veths cannot be named: they stay on
		// the earlier programs, so the move is not done.
		errs = append(errs, fmt.Errorf("%w: members %v have unreadable records and could not be moved", ErrState, sc.Unreadable))
	}
	return moved, errors.Join(errs...)
}

// moveMember attaches ident's programs to the hooks of m that run another,
// and returns how many it changed.
func moveMember(lock *membership.Lock, m membership.Member, ident *bpf.Identifier) (int, error) {
	// Programs of a build before the source check run without entries:
	// the move writes them first.
	if err := setSources(m, ident); err != nil {
		return 0, err
	}
	changed := 0
	for _, h := range Hooks(lock, m) {
		id, err := objinfo.ProgramID(ProgramFor(ident, h.Hook))
		if err != nil {
			return changed, err
		}
		if ids, err := attach.Attached(m.HostIfindex, h.Hook); err == nil && slices.Contains(ids, id) {
			continue
		}
		if err := attachHook(m, h, ident); err != nil {
			return changed, err
		}
		changed++
	}
	return changed, nil
}

// AttachMember writes what m may send from, then attaches ident's
// programs to both hooks of m's veth, in the mode its record names.
// Attaching is idempotent, and replaces another program atomically.
func AttachMember(lock *membership.Lock, m membership.Member, ident *bpf.Identifier) error {
	if err := setSources(m, ident); err != nil {
		return err
	}
	for _, h := range Hooks(lock, m) {
		if err := attachHook(m, h, ident); err != nil {
			return fmt.Errorf("veth %s: %w", m.HostVeth, err)
		}
	}
	return nil
}

func attachHook(m membership.Member, h Hook, ident *bpf.Identifier) error {
	_, err := attach.Attach(attach.Options{
		Ifindex: m.HostIfindex,
		Hook:    h.Hook,
		Program: ProgramFor(ident, h.Hook),
		Mode:    attach.Mode(m.AttachMode),
		LinkPin: h.LinkPin,
	})
	return err
}

// ProgramFor is the program of ident that runs on the host veth's hook:
// the pod's egress program on the veth's ingress, and the other way round.
func ProgramFor(ident *bpf.Identifier, h attach.Hook) *ebpf.Program {
	if h == attach.HookIngress {
		return ident.Egress
	}
	return ident.Ingress
}

// Upgraded is what an upgrade did to one identifier.
type Upgraded struct {
	ID      podid.ID
	Renewal bpf.Renewal
	Moved   int   // members moved onto the identifier's programs
	Unmoved error // why members that should have moved did not
}

// Changed says whether anything of the identifier changed.
func (u Upgraded) Changed() bool {
	return len(u.Renewal.Maps) > 0 || u.Renewal.Programs || u.Moved > 0
}

// Upgrade brings every identifier with members onto this build's pins and
// programs: RenewIdentifier under each identifier's lock, then MoveMembers,
// which also moves members that a killed upgrade left on older programs.
// Identifiers without members are left to the collection of orphans. It
// goes on past an identifier it cannot upgrade and returns every failure.
func Upgrade(g *bpf.Global, store *membership.Store) ([]Upgraded, error) {
	ids, err := store.Identifiers()
	if err != nil {
		return nil, wrap(ErrState, err)
	}
	var out []Upgraded
	var errs []error
	for _, id := range ids {
		u, err := upgradeOne(g, store, id)
		if err != nil {
			errs = append(errs, fmt.Errorf("identifier %q: %w", id, err))
			continue
		}
		if u == nil {
			continue
		}
		out = append(out, *u)
		if u.Unmoved != nil {
			errs = append(errs, fmt.Errorf("identifier %q: %w", id, u.Unmoved))
		}
	}
	return out, errors.Join(errs...)
}

func upgradeOne(g *bpf.Global, store *membership.Store, id podid.ID) (*Upgraded, error) {
	lock, err := store.Lock(id)
	if errors.Is(err, membership.ErrNoIdentifier) {
		return nil, nil
	}
	if err != nil {
		return nil, wrap(ErrState, err)
	}
	defer lock.Unlock()
	sc, err := lock.Scan()
	if err != nil {
		return nil, wrap(ErrState, err)
	}
	if !sc.InUse() {
		return nil, nil
	}
	ident, up, err := OpenIdentifier(g, lock)
	if err != nil {
		return nil, err
	}
	defer ident.Close()
	if !up.Renewal.MovePending {
		// Members that something else left on other programs move too.
		up.Moved, up.Unmoved = moveAll(lock, ident)
	}
	return &up, nil
}

// Removed is what RemoveAll took off a node.
type Removed struct {
	Identifiers int // whose pins were removed
	Members     int // taken off their veths
	// Kept are identifiers left in place because a member record could
	// not be read: the hooks it stands for are unknown, so its pins stay
	// (see RemoveIfUnused).
	Kept []podid.ID
}

// RemoveAll takes every member of every identifier off its veth and
// removes the identifiers' pins, each under its lock: podfence leaves the
// node, and its pods keep running, no longer fenced. A runtime's ADD or
// DEL that waits for a lock meanwhile finds the identifier gone and does
// what it does for a new or an absent one.
func RemoveAll(store *membership.Store) (Removed, error) {
	var r Removed
	ids, err := store.Identifiers()
	if err != nil {
		return r, wrap(ErrState, err)
	}
	var errs []error
	for _, id := range ids {
		lock, err := store.Lock(id)
		if errors.Is(err, membership.ErrNoIdentifier) {
			continue // removed by its last DEL meanwhile
		}
		if err != nil {
			errs = append(errs, wrap(ErrState, err))
			continue
		}
		n, removed, err := removeIdentifier(lock)
		lock.Unlock()
		r.Members += n
		switch {
		case err != nil:
			errs = append(errs, fmt.Errorf("identifier %s: %w", id, err))
		case removed:
			r.Identifiers++
		default:
			r.Kept = append(r.Kept, id)
		}
	}
	return r, errors.Join(errs...)
}

// removeIdentifier removes the locked identifier's members, then its pins
// when no unreadable record is left.
func removeIdentifier(lock *membership.Lock) (members int, removed bool, err error) {
	sc, err := lock.Scan()
	if err != nil {
		return 0, false, wrap(ErrState, err)
	}
	for _, m := range sc.Members {
		if err := RemoveMember(lock, m); err != nil {
			return members, false, err
		}
		members++
	}
	removed, err = RemoveIfUnused(lock)
	return members, removed, err
}
