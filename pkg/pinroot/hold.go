package pinroot

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
	"github.com/podfence/podfence/pkg/nodeaddr"
	"github.com/podfence/podfence/pkg/objinfo"
	"github.com/podfence/podfence/pkg/pinpath"
	"github.com/podfence/podfence/pkg/policy"
)

// Hold is one identifier of the node, held under its lock: its
// member records (the embedded membership.Lock) and its pins are read and
// changed through it alone, and Unlock ends the hold. The pins' directory
// is the lock's: nothing outside this package works out where it is.
type Hold struct {
	*membership.Lock
	root *Root
}

// Hook is one of a member's two attachments.
type Hook struct {
	Hook    attach.Hook
	LinkPin string // where its TCX link is pinned (unused by tc attachments)
}

// Hooks are a member's attachments. TCX links are pinned in the member's
// directory, so removing the member removes them.
func (h *Hold) Hooks(m membership.Member) []Hook {
	dir := h.MemberDir(m.Key())
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

// Open opens the identifier's pins for a caller that changes them (ADD, a
// policy push), taking over pins of an earlier layout or build
// (bpf.RenewIdentifier). When members may run other programs than the
// pinned ones (programs replaced now, or by a renewal whose move did not
// finish), every member is moved onto them before it returns, so that the
// identifier's pins and what its members run agree again. A member that
// cannot be moved is not the caller's failure: it is reported in
// Upgraded.Unmoved, and the next Open tries again.
func (h *Hold) Open() (*bpf.Datapath, Upgraded, error) {
	up := Upgraded{ID: h.ID}
	g, err := h.root.Global()
	if err != nil {
		return nil, up, wrap(ErrDatapath, err)
	}
	ident, rn, err := bpf.RenewIdentifier(g, h.Dir(), h.ID)
	up.Renewal = rn
	if err != nil {
		return nil, up, wrap(ErrDatapath, err)
	}
	if rn.MovePending {
		up.Moved, up.Unmoved = h.moveAll(ident)
	}
	return ident, up, nil
}

// OpenExisting opens the identifier's pins as they are, changing nothing:
// for why, and for judging an adopted pod's flows.
func (h *Hold) OpenExisting() (*bpf.Datapath, error) {
	g, err := h.root.Global()
	if err != nil {
		return nil, err
	}
	return bpf.OpenExistingIdentifier(g, h.Dir(), h.ID)
}

// Inspect reads the identifier's state, counters and pinned programs,
// changing nothing.
func (h *Hold) Inspect() (bpf.IdentifierInfo, error) {
	return bpf.InspectIdentifier(h.Dir(), h.ID)
}

// ProgramIDs are the IDs of the identifier's pinned programs.
func (h *Hold) ProgramIDs() (ingress, egress ebpf.ProgramID, err error) {
	return bpf.PinnedProgramIDs(h.Dir())
}

// Sources is what the pinned sources map lets the veth of ifindex send
// from; false when it has no entry.
func (h *Hold) Sources(ifindex int) (bpf.Sources, bool, error) {
	return bpf.LookupSources(h.Dir(), uint32(ifindex))
}

// ReplaceUnused handles pins of the identifier that this build cannot use
// (another build's, say): when no member uses them, nothing attached does
// either (see package membership), so they are replaced and replaced is
// true. With members they stay, and the error wraps incompatible's: a live
// datapath is never swapped silently.
func (h *Hold) ReplaceUnused(incompatible error) (ident *bpf.Datapath, replaced bool, err error) {
	sc, err := h.Scan()
	if err != nil {
		return nil, false, wrap(ErrState, errors.Join(incompatible, err))
	}
	if sc.InUse() {
		return nil, false, fmt.Errorf("%w: %w (in use by %d members; it is replaced once they are gone)",
			ErrDatapath, incompatible, len(sc.Members)+len(sc.Unreadable))
	}
	g, err := h.root.Global()
	if err != nil {
		return nil, false, wrap(ErrDatapath, errors.Join(incompatible, err))
	}
	if err := bpf.ReleaseSlot(pinpath.Root(h.root.path).Global(), h.Dir()); err != nil {
		return nil, false, wrap(ErrDatapath, errors.Join(incompatible, err))
	}
	if err := bpf.RemoveObjects(h.Dir()); err != nil {
		return nil, false, wrap(ErrDatapath, errors.Join(incompatible, err))
	}
	ident, err = bpf.OpenIdentifier(g, h.Dir(), h.ID)
	if err != nil {
		return nil, false, wrap(ErrDatapath, err)
	}
	return ident, true, nil
}

// Attach writes what m may send from, then attaches ident's programs to
// both hooks of m's veth, in the mode its record names. Attaching is
// idempotent, and replaces another program atomically.
func (h *Hold) Attach(m membership.Member, ident *bpf.Datapath) error {
	if err := setSources(m, ident); err != nil {
		return err
	}
	for _, hk := range h.Hooks(m) {
		if err := attachHook(m, hk, ident); err != nil {
			return fmt.Errorf("veth %s: %w", m.HostVeth, err)
		}
	}
	return nil
}

// RemoveMember detaches a member's programs and deletes its record and
// its sources entry. Gone already (veth, links, record) is fine.
func (h *Hold) RemoveMember(m membership.Member) error {
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
	for _, hk := range h.Hooks(m) {
		o := attach.Options{Hook: hk.Hook, LinkPin: hk.LinkPin, Ifindex: ifindex}
		if err := attach.Detach(o); err != nil {
			errs = append(errs, err)
		}
	}
	if len(errs) > 0 {
		return fmt.Errorf("%w: veth %s: %w", ErrAttach, m.HostVeth, errors.Join(errs...))
	}
	if err := h.Remove(m.Key()); err != nil {
		return wrap(ErrState, err)
	}
	return h.removeSources(m, present)
}

// removeSources deletes the sources entry of a removed member's veth. A
// veth that is gone may have passed its ifindex on to another member of
// the identifier, whose entry it is now: it stays then. (Another
// identifier's member keeps its entry in its own identifier's map.)
func (h *Hold) removeSources(m membership.Member, present bool) error {
	if !present {
		sc, err := h.Scan()
		if err != nil {
			return wrap(ErrState, err)
		}
		for _, o := range sc.Members {
			if o.HostIfindex == m.HostIfindex {
				return nil
			}
		}
	}
	return wrap(ErrDatapath, bpf.DeleteSources(h.Dir(), uint32(m.HostIfindex)))
}

// RemoveIfUnused removes the identifier's pins when it has no member left,
// and says whether it did. A member whose record cannot be read keeps them:
// it may be a live pod whose record another version of podfence wrote.
func (h *Hold) RemoveIfUnused() (bool, error) {
	sc, err := h.Scan()
	if err != nil {
		return false, wrap(ErrState, err)
	}
	if sc.InUse() {
		return false, nil
	}
	if err := bpf.ReleaseSlot(pinpath.Root(h.root.path).Global(), h.Dir()); err != nil {
		return false, wrap(ErrDatapath, err)
	}
	if err := bpf.RemoveIdentifier(h.Dir()); err != nil {
		return false, wrap(ErrDatapath, err)
	}
	return true, nil
}

// RemoveAll removes the identifier's members, then its pins when no
// unreadable record is left.
func (h *Hold) RemoveAll() (members int, removed bool, err error) {
	sc, err := h.Scan()
	if err != nil {
		return 0, false, wrap(ErrState, err)
	}
	for _, m := range sc.Members {
		if err := h.RemoveMember(m); err != nil {
			return members, false, err
		}
		members++
	}
	removed, err = h.RemoveIfUnused()
	return members, removed, err
}

// moveAll is MoveMembers that, once every member has moved, ends the
// identifier's pending move.
func (h *Hold) moveAll(ident *bpf.Datapath) (int, error) {
	moved, err := h.MoveMembers(ident)
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
func (h *Hold) MoveMembers(ident *bpf.Datapath) (int, error) {
	sc, err := h.Scan()
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
		n, err := h.moveMember(m, ident)
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
func (h *Hold) moveMember(m membership.Member, ident *bpf.Datapath) (int, error) {
	// Programs of a build before the source check run without entries:
	// the move writes them first.
	if err := setSources(m, ident); err != nil {
		return 0, err
	}
	changed := 0
	for _, hk := range h.Hooks(m) {
		id, err := objinfo.ProgramID(ProgramFor(ident, hk.Hook))
		if err != nil {
			return changed, err
		}
		if ids, err := attach.Attached(m.HostIfindex, hk.Hook); err == nil && slices.Contains(ids, id) {
			continue
		}
		if err := attachHook(m, hk, ident); err != nil {
			return changed, err
		}
		changed++
	}
	return changed, nil
}

// setSources writes what m may send from into ident's sources map, before
// ident's programs run on m's veth.
func setSources(m membership.Member, ident *bpf.Datapath) error {
	return ident.SetSources(uint32(m.HostIfindex), bpf.Sources{Addrs: m.Sources(), Any: m.AnySource})
}

func attachHook(m membership.Member, h Hook, ident *bpf.Datapath) error {
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
func ProgramFor(ident *bpf.Datapath, h attach.Hook) *ebpf.Program {
	if h == attach.HookIngress {
		return ident.Egress
	}
	return ident.Ingress
}

// AddOptions are what an ADD gives Add beside its member.
type AddOptions struct {
	// Policy is what the identifier enforces: in its maps before the
	// programs are attached, so that enforcement starts with the pod's
	// first packet.
	Policy policy.Set
	// Mark, when set, is called as each step ends (open-global,
	// open-identifier, apply-policy, attach), for the call's log.
	Mark func(step string)
}

// Added is what Add did to the identifier beside adding the member.
type Added struct {
	// Upgraded says what of an earlier build's pins was taken over, and
	// which members were moved onto this build's programs with them.
	Upgraded Upgraded
	// Replaced is why pins this build cannot use were replaced (no member
	// used them); nil when none were.
	Replaced error
}

// Add adds m to the identifier, in the order that makes a kill at any
// instant repairable (see package membership): the node's addresses into
// the node-wide maps; the identifier's pins, taken over from an earlier
// build, or replaced when they are another build's that no member uses;
// the policy; m's record; then its attachments. A new pod therefore never
// runs an older datapath than the plugin that added it. On failure nothing
// of m is left, nor the identifier's pins when no other member uses them.
// A policy the maps cannot hold is an error wrapping its policy sentinel
// (policy.ErrTooManyEntries, ...).
func (h *Hold) Add(m membership.Member, o AddOptions) (Added, error) {
	mark := o.Mark
	if mark == nil {
		mark = func(string) {}
	}
	a, err := h.add(m, o.Policy, mark)
	if err == nil {
		return a, nil
	}
	if cerr := h.RemoveMember(m); cerr != nil {
		err = errors.Join(err, cerr)
	}
	if _, cerr := h.RemoveIfUnused(); cerr != nil {
		err = errors.Join(err, cerr)
	}
	return a, err
}

func (h *Hold) add(m membership.Member, set policy.Set, mark func(string)) (Added, error) {
	var a Added
	g, err := h.root.Global()
	if err != nil {
		return a, wrap(ErrDatapath, err)
	}
	if err := g.SyncNodeAddrs(nodeaddr.List); err != nil {
		return a, wrap(ErrDatapath, err)
	}
	mark("open-global")
	ident, up, err := h.Open()
	a.Upgraded = up
	if errors.Is(err, bpf.ErrIncompatiblePin) {
		incompatible := err
		var replaced bool
		if ident, replaced, err = h.ReplaceUnused(incompatible); replaced {
			a.Replaced = incompatible
		}
	}
	if err != nil {
		return a, err
	}
	defer ident.Close()
	mark("open-identifier")
	if err := ident.ApplyPolicy(set); err != nil {
		return a, wrap(ErrDatapath, err)
	}
	mark("apply-policy")
	if err := h.Put(m); err != nil {
		return a, wrap(ErrState, err)
	}
	if err := h.Attach(m, ident); err != nil {
		return a, wrap(ErrAttach, err)
	}
	mark("attach")
	return a, nil
}
