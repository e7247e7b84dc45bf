// Package pinroot owns the pin root: the node-wide maps, the identifiers
// pinned below it with their member records and locks, and the node's
// records (STATUS's verified builds, the TCX probe's answer, the policy
// status, the DELs' tombstones). A caller opens the root once (Open, with
// one bpffs check; the node-wide maps are opened by the first method that
// needs them and closed with the root), and reaches an identifier through
// a Hold, a handle that holds its lock; package bpf is handed the
// directories and package membership the records, and neither works out
// where they live.
//
// It adds and removes members and pins in the order that keeps package
// membership's invariants: records before attachments, attachments gone
// before records, the pins removed only by a lock holder that sees no
// member. An ADD is one method (Hold.Add). The CNI plugin (ADD, DEL, GC)
// and the sweeper (orphans of pods that vanished without a DEL, upgrades,
// policy pushes) both go through it; a second copy of these rules is how
// the seed's scale-down bug came about.
//
// Errors wrap one of ErrState, ErrDatapath or ErrAttach, which say which
// part of the node failed: the plugin maps them to its CNI error codes.
package pinroot

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/podfence/podfence/bpf"
	"github.com/podfence/podfence/pkg/membership"
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

// ErrNoPinRoot and ErrNotBPFFS are wrapped by Open when the pin root is
// missing (and Options.Create not set) or not a directory on bpffs;
// ErrNoGlobal by Global when the node-wide maps are missing and may not be
// made.
// Their text completes "pin root <path> ...".
var (
	ErrNoPinRoot = errors.New("does not exist")
	ErrNotBPFFS  = errors.New("is not on bpffs")
	ErrNoGlobal  = errors.New("has no node-wide maps: no pod has been added on this node yet")
)

// Options say how Open treats a pin root.
type Options struct {
	// Create makes a missing pin root, and the node-wide maps when a
	// method needs them and they are missing: an ADD's, the sweeper's run.
	// Without it, missing ones are an error (ErrNoPinRoot, ErrNoGlobal).
	Create bool
	// Global sizes the node-wide maps, and KeepLayout opens them as they
	// are instead of taking over an earlier layout's (bpf.GlobalOptions):
	// a newer tool run on a node does not upgrade it.
	Global bpf.GlobalOptions
}

// Root is the pin root of one node, and the one owner of everything below
// it: the node-wide maps, the identifiers, the records of the node
// (STATUS's verified builds, the TCX probe's answer, the policy status, the
// DELs' tombstones) and their removal. Its methods may run concurrently;
// Close releases the node-wide maps once no method runs.
type Root struct {
	path  string
	store *membership.Store
	opts  Options

	noMaps bool // At's: Global fails

	mu     sync.Mutex
	global *bpf.Global // opened by the first method that needs it
}

// Open checks once that path is a directory on bpffs, making it with
// o.Create, and returns its owner. The node-wide maps are opened by the
// first method that needs them, and closed by Close.
func Open(path string, o Options) (*Root, error) {
	if o.Create {
		if err := os.MkdirAll(path, 0o700); err != nil {
			return nil, fmt.Errorf("pin root %s: %w", path, err)
		}
	}
	var st unix.Statfs_t
	if err := unix.Statfs(path, &st); errors.Is(err, unix.ENOENT) {
		return nil, fmt.Errorf("pin root %s %w", path, ErrNoPinRoot)
	} else if err != nil {
		return nil, fmt.Errorf("pin root %s: %w", path, err)
	}
	if st.Type != unix.BPF_FS_MAGIC {
		return nil, fmt.Errorf("pin root %s %w (mount -t bpf bpf /sys/fs/bpf)", path, ErrNotBPFFS)
	}
	return &Root{path: path, store: membership.New(path), opts: o}, nil
}

// At is the pin root at path, unchecked and without the node-wide maps,
// for a caller that only reads and removes members (DEL, CHECK, GC): a DEL
// must succeed on a node where no ADD could, and finds nothing there.
// Methods that need the maps fail with ErrNoGlobal.
func At(path string) *Root {
	return &Root{path: path, store: membership.New(path), noMaps: true}
}

// Close releases the node-wide maps, if a method opened them; the pins stay.
func (n *Root) Close() error {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.global == nil {
		return nil
	}
	err := n.global.Close()
	n.global = nil
	return err
}

// Global is the node-wide maps, opened (and with Options.Create made) the
// first time, and renewed then when they are an earlier layout's and
// Options.Global does not keep layouts (bpf.OpenGlobal).
func (n *Root) Global() (*bpf.Global, error) {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.global != nil {
		return n.global, nil
	}
	dir := pinpath.Root(n.path).Global()
	if n.noMaps {
		return nil, fmt.Errorf("pin root %s (opened for members only) %w", n.path, ErrNoGlobal)
	}
	if !n.opts.Create {
		if _, err := os.Stat(dir); errors.Is(err, fs.ErrNotExist) {
			return nil, fmt.Errorf("pin root %s %w", n.path, ErrNoGlobal)
		}
	}
	g, err := bpf.OpenGlobal(dir, n.opts.Global)
	if err != nil {
		return nil, fmt.Errorf("open the node's maps: %w", err)
	}
	n.global = g
	return g, nil
}

// Path is the pin root's directory.
func (n *Root) Path() string { return n.path }

// Identifiers lists the identifiers that have a directory (pins, members
// or both).
func (n *Root) Identifiers() ([]podid.ID, error) { return n.store.Identifiers() }

// Lock takes the lock of an identifier that exists, waiting for another
// holder; a missing identifier is membership.ErrNoIdentifier. Everything
// but an ADD locks this way: it must not bring back an identifier that was
// removed.
func (n *Root) Lock(id podid.ID) (*Hold, error) {
	l, err := n.store.Lock(id)
	if err != nil {
		return nil, err
	}
	return &Hold{l, n}, nil
}

// LockOrCreate takes the identifier's lock, making its directory when it
// is missing: an ADD's.
func (n *Root) LockOrCreate(id podid.ID) (*Hold, error) {
	l, err := n.store.LockOrCreate(id)
	if err != nil {
		return nil, err
	}
	return &Hold{l, n}, nil
}

// FindContainer is the identifier that has a record of the container's
// interface, or membership.ErrNotMember.
func (n *Root) FindContainer(containerID, ifname string) (podid.ID, error) {
	return n.store.FindContainer(containerID, ifname)
}

// PutTombstone records that the DEL of a member key ran, before the DEL
// takes its identifier's lock (see package membership).
func (n *Root) PutTombstone(key string, now time.Time) error {
	return wrap(ErrState, n.store.PutTombstone(key, now))
}

// ExpireTombstones removes the tombstones older than
// membership.TombstoneTTL, and returns how many it removed.
func (n *Root) ExpireTombstones(now time.Time) (int, error) {
	k, err := n.store.ExpireTombstones(now.Add(-membership.TombstoneTTL))
	return k, wrap(ErrState, err)
}

// Peek reads id's state, counters and programs without its lock, for
// readers that must not wait behind an ADD and need nothing consistent
// with the members (a metrics scrape). An identifier being created or
// removed is an error.
func (n *Root) Peek(id podid.ID) (bpf.IdentifierInfo, error) {
	return bpf.InspectIdentifier(pinpath.Root(n.Path()).Identifier(id), id)
}

// ScanIdentifier is Identifier.Scan in a hold of id's lock of its own.
func (n *Root) ScanIdentifier(id podid.ID) (membership.Scan, error) {
	return n.store.ScanIdentifier(id)
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
func (n *Root) Collect(id podid.ID, stale Stale) (Collected, error) {
	var out Collected
	h, err := n.Lock(id)
	if errors.Is(err, membership.ErrNoIdentifier) {
		return out, nil
	}
	if err != nil {
		return out, wrap(ErrState, err)
	}
	defer h.Unlock()
	sc, err := h.Scan()
	if err != nil {
		return out, wrap(ErrState, err)
	}
	for i := range sc.Members {
		m := sc.Members[i]
		if !stale(m.Key(), &m, false) {
			continue
		}
		if err := h.RemoveMember(m); err != nil {
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
			if err := h.Remove(key); err != nil {
				return out, wrap(ErrState, err)
			}
			out.Keys = append(out.Keys, key)
		}
	}
	out.Identifier, err = h.RemoveIfUnused()
	return out, err
}

// inUse locks id and returns its handle when it has members; nil (and no
// error) when it is gone or has none, which is left to the collection of
// orphans.
func (n *Root) inUse(id podid.ID) (*Hold, error) {
	h, err := n.Lock(id)
	if errors.Is(err, membership.ErrNoIdentifier) {
		return nil, nil
	}
	if err != nil {
		return nil, wrap(ErrState, err)
	}
	sc, err := h.Scan()
	if err != nil || !sc.InUse() {
		h.Unlock()
		return nil, wrap(ErrState, err)
	}
	return h, nil
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
func (n *Root) Upgrade() ([]Upgraded, error) {
	ids, err := n.Identifiers()
	if err != nil {
		return nil, wrap(ErrState, err)
	}
	var out []Upgraded
	var errs []error
	for _, id := range ids {
		u, err := n.upgradeOne(id)
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

func (n *Root) upgradeOne(id podid.ID) (*Upgraded, error) {
	h, err := n.inUse(id)
	if h == nil {
		return nil, err
	}
	defer h.Unlock()
	ident, up, err := h.Open()
	if err != nil {
		return nil, err
	}
	defer ident.Close()
	if !up.Renewal.MovePending {
		// Members that something else left on other programs move too.
		up.Moved, up.Unmoved = h.moveAll(ident)
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
func (n *Root) RemoveAll() (Removed, error) {
	var r Removed
	ids, err := n.Identifiers()
	if err != nil {
		return r, wrap(ErrState, err)
	}
	var errs []error
	for _, id := range ids {
		h, err := n.Lock(id)
		if errors.Is(err, membership.ErrNoIdentifier) {
			continue // removed by its last DEL meanwhile
		}
		if err != nil {
			errs = append(errs, wrap(ErrState, err))
			continue
		}
		members, removed, err := h.RemoveAll()
		h.Unlock()
		r.Members += members
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
