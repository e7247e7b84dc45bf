// Package sweep reconciles the node's eBPF conntrack maps with the kernel's
// conntrack table, and removes the members of pods that vanished without a
// DEL. It is the sweeper's work, behind its run loop and its commands.
//
// A pass, in this order:
//
//  1. notes the time (CLOCK_MONOTONIC, the clock of the entries' last_seen);
//  2. reads the members of every identifier, collecting those whose veth has
//     been gone for longer than the orphan grace (package pinroot), and
//     notes the host veths of the live ones;
//  3. streams the kernel table into a set of the tuples its flows hold in
//     either direction (two keys a flow: no copy of the flows themselves);
//  4. scans the eBPF maps a batch at a time, decides each entry with package
//     liveness, and deletes a batch's dead entries before reading the next.
//
// Reading the kernel before the maps closes the window a new connection
// would otherwise fall into: a flow the dump missed was created after the
// pass began, so its entry is recent and kept. What remains is the few
// microseconds between reading a batch and deleting from it.
package sweep

import (
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/podfence/podfence/bpf"
	"github.com/podfence/podfence/pkg/ctnetlink"
	"github.com/podfence/podfence/pkg/liveness"
	"github.com/podfence/podfence/pkg/membership"
	"github.com/podfence/podfence/pkg/pinroot"
	"github.com/podfence/podfence/pkg/podid"
)

// Defaults of the sweeper's flags for Options (a zero Options field means
// zero: New never puts a default in place of what its caller set).
const (
	DefaultGrace       = 10 * time.Second
	DefaultOrphanGrace = 60 * time.Second
)

// clockSlack covers the datapath's clock lagging CLOCK_MONOTONIC: it reads
// the coarse clock once per jiffy (bpf/clock.h), at most two ticks behind.
const clockSlack = 50 * time.Millisecond

// Options configure a Sweeper.
type Options struct {
	// Grace keeps an entry seen this recently whatever the kernel says: a
	// new flow's entry is written at the veth before netfilter creates the
	// kernel flow (DefaultGrace is the sweeper's). 0 keeps none that way,
	// and can delete a new flow's entry before its kernel flow exists.
	Grace time.Duration
	// OrphanGrace is how long a member's veth must be gone before the
	// member is removed (DefaultOrphanGrace is the sweeper's); 0 removes
	// it on the first pass that sees it gone.
	OrphanGrace time.Duration
	// Record makes a pass return every entry's decision (sweep's output);
	// without it only counts, so that memory does not grow with the maps.
	Record bool
	// Log receives what a pass removed; default slog.Default.
	Log *slog.Logger

	// afterKernelRead runs between reading the kernel and the maps (tests).
	afterKernelRead func()
}

// Sweeper reconciles one node. Its methods run one at a time.
type Sweeper struct {
	opts Options
	g    *bpf.Global
	pins *pinroot.Root
	dump *ctnetlink.Dumper

	mu        sync.Mutex
	lastFlows int // kernel flows the last pass read
	// missingSince is when a member's veth was first seen gone.
	missingSince map[string]time.Time
	// vethOwners is, as the last pass read the members, the identifier of
	// each live member's host veth (RemoveVethless starts there).
	vethOwners map[uint32]podid.ID
	// owners maps a pod address to the host veths of the members that
	// have it (the event path finds an entry's ifindex through it).
	ownersMu   sync.Mutex
	owners     map[netip.Addr][]uint32
	ownersRead time.Time
}

// New returns a sweeper of the pin root's members and node-wide maps,
// reading the kernel table of the calling thread's network namespace.
func New(root *pinroot.Root, opts Options) (*Sweeper, error) {
	if opts.Grace < 0 || opts.OrphanGrace < 0 {
		return nil, fmt.Errorf("sweeper: grace %v and orphan grace %v: need 0 or more", opts.Grace, opts.OrphanGrace)
	}
	g, err := root.Global()
	if err != nil {
		return nil, fmt.Errorf("sweeper: %w", err)
	}
	if opts.Log == nil {
		opts.Log = slog.Default()
	}
	d, err := ctnetlink.NewDumper()
	if err != nil {
		return nil, fmt.Errorf("sweeper: %w", err)
	}
	return &Sweeper{
		opts:         opts,
		g:            g,
		pins:         root,
		dump:         d,
		missingSince: map[string]time.Time{},
		owners:       map[netip.Addr][]uint32{},
	}, nil
}

// Close releases the kernel socket; the maps are the caller's.
func (s *Sweeper) Close() error { return s.dump.Close() }

// Monotonic is CLOCK_MONOTONIC, the clock of the entries' last_seen.
func Monotonic() time.Duration {
	var ts unix.Timespec
	_ = unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts) // cannot fail for this clock
	return time.Duration(ts.Nano())
}

// Decision is one entry's fate in a pass (Options.Record).
type Decision struct {
	Entry  bpf.CTEntry
	Reason liveness.Reason
}

// Report is what one pass did.
type Report struct {
	Started     time.Time
	Duration    time.Duration
	KernelFlows int
	Scanned     int
	// By liveness.Reason: kept ones under Kept*, deleted ones under Deleted*.
	Count [5]int
	// Deleted is how many entries the maps no longer hold (some may have
	// been evicted meanwhile).
	Deleted int
	// Fill is the conntrack maps' occupancy before the pass, v4 and v6.
	Fill      [2]float64
	Orphans   []Orphan
	Decisions []Decision // with Options.Record
}

// Orphan is a member the pass removed because its veth was gone.
type Orphan struct {
	ID         podid.ID
	Member     membership.Member
	Identifier bool // its identifier's pins went with it
}

// Pass runs one reconciliation pass.
func (s *Sweeper) Pass() (Report, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	rep := Report{Started: time.Now()}
	pass := liveness.Pass{Start: Monotonic() - clockSlack, Grace: s.opts.Grace}
	defer func() { rep.Duration = time.Since(rep.Started) }()

	owners, orphans, err := s.members()
	rep.Orphans = orphans
	if err != nil {
		return rep, err
	}

	// Sized after the last pass: growing a map of 2 keys per flow, on a
	// node of 100,000 flows, costs a tenth of a pass.
	kernel := make(map[liveness.Key]struct{}, 2*s.lastFlows)
	err = s.dump.Dump(func(f *ctnetlink.Flow) error {
		rep.KernelFlows++
		kernel[liveness.Key(f.Orig)] = struct{}{}
		kernel[liveness.Key(f.Reply)] = struct{}{}
		return nil
	})
	if err != nil {
		return rep, fmt.Errorf("read the kernel conntrack table: %w", err)
	}
	s.lastFlows = rep.KernelFlows
	if s.opts.afterKernelRead != nil {
		s.opts.afterKernelRead()
	}

	var n4, n6 int
	del := newDeleter(s.g)
	err = s.g.ScanConntrack(func(batch []bpf.CTEntry) error {
		dead := del.batch()
		for i := range batch {
			e := &batch[i]
			if e.Key.Family == 4 {
				n4++
			} else {
				n6++
			}
			_, inKernel := kernel[e.Key]
			r := pass.Decide(liveness.Entry{
				Key:       e.Key,
				LastSeen:  e.LastSeen(),
				OwnerLive: owners.live(e.Ifindex),
				InKernel:  inKernel,
			})
			rep.Count[r]++
			if r.Delete() {
				dead = append(dead, *e)
			}
			if s.opts.Record {
				rep.Decisions = append(rep.Decisions, Decision{*e, r})
			}
		}
		rep.Scanned += len(batch)
		del.delete(dead)
		return del.failed()
	})
	var derr error
	rep.Deleted, derr = del.wait()
	err = errors.Join(err, derr)
	rep.Fill = [2]float64{
		float64(n4) / float64(s.g.CTv4.MaxEntries()),
		float64(n6) / float64(s.g.CTv6.MaxEntries()),
	}
	if err != nil {
		return rep, err
	}
	return rep, nil
}

// liveVeths are the host veths of live members. With a member whose record
// cannot be read, every interface of the node counts: its veth is unknown,
// and deleting a live pod's entries is worse than keeping a dead one's.
type liveVeths struct {
	ifindex map[uint32]bool
	any     map[uint32]bool // the node's interfaces, when a record is unreadable
}

func (l liveVeths) live(ifindex uint32) bool {
	return l.ifindex[ifindex] || l.any[ifindex]
}

// members reads every identifier's members, removes orphans whose grace
// has passed, and returns the veths of the rest.
func (s *Sweeper) members() (liveVeths, []Orphan, error) {
	live := liveVeths{ifindex: map[uint32]bool{}}
	ids, err := s.pins.Identifiers()
	if err != nil {
		return live, nil, fmt.Errorf("list identifiers: %w", err)
	}
	// One link list for the pass rather than a netlink socket per member.
	// It may predate a member added meanwhile, so a veth it lacks is
	// looked up again, under the member's lock, before it counts as gone.
	links, linksErr := nodeLinks()
	now := time.Now()
	seen := map[string]bool{}
	owners := map[netip.Addr][]uint32{}
	vethOwners := map[uint32]podid.ID{}
	unreadable := false
	var orphans []Orphan
	var errs []error
	for _, id := range ids {
		stale := func(key string, m *membership.Member, corrupt bool) bool {
			if m == nil {
				if corrupt {
					unreadable = true
					s.opts.Log.Warn("member record unreadable: kept, with every interface's entries", "identifier", id, "member", key)
				}
				// Without a record nothing is attached (an ADD died
				// before writing it), but its DEL or GC removes it.
				return false
			}
			present := linksErr == nil && links[uint32(m.HostIfindex)] == m.HostVeth
			if !present {
				var err error
				if present, err = pinroot.VethPresent(*m); err != nil {
					errs = append(errs, err)
					present = true
				}
			}
			mk := string(id) + "/" + key
			seen[mk] = true
			if present {
				delete(s.missingSince, mk)
				live.ifindex[uint32(m.HostIfindex)] = true
				vethOwners[uint32(m.HostIfindex)] = id
				for _, p := range m.IPs {
					owners[p.Addr()] = append(owners[p.Addr()], uint32(m.HostIfindex))
				}
				return false
			}
			since, ok := s.missingSince[mk]
			if !ok {
				since = now
				s.missingSince[mk] = now
			}
			return now.Sub(since) >= s.opts.OrphanGrace
		}
		c, err := s.pins.Collect(id, stale)
		orphans = append(orphans, s.logRemoved(id, c, "its veth is gone")...)
		if err != nil {
			errs = append(errs, fmt.Errorf("identifier %q: %w", id, err))
		}
	}
	for mk := range s.missingSince {
		if !seen[mk] {
			delete(s.missingSince, mk) // removed by its DEL meanwhile
		}
	}
	s.vethOwners = vethOwners
	if n, err := s.pins.ExpireTombstones(now); err != nil {
		errs = append(errs, err)
	} else if n > 0 {
		s.opts.Log.Debug("removed DELs' tombstones past their time", "count", n)
	}
	s.ownersMu.Lock()
	s.owners, s.ownersRead = owners, now
	s.ownersMu.Unlock()
	if unreadable {
		if linksErr != nil {
			errs = append(errs, linksErr)
		}
		live.any = make(map[uint32]bool, len(links))
		for ifindex := range links {
			live.any[ifindex] = true
		}
	}
	return live, orphans, errors.Join(errs...)
}

// readOwners reads the pod addresses of every member, changing nothing.
func (s *Sweeper) readOwners() (map[netip.Addr][]uint32, error) {
	owners := map[netip.Addr][]uint32{}
	ids, err := s.pins.Identifiers()
	if err != nil {
		return nil, err
	}
	for _, id := range ids {
		sc, err := s.pins.ScanIdentifier(id)
		if errors.Is(err, membership.ErrNoIdentifier) {
			continue
		}
		if err != nil {
			return nil, err
		}
		for _, m := range sc.Members {
			for _, p := range m.IPs {
				owners[p.Addr()] = append(owners[p.Addr()], uint32(m.HostIfindex))
			}
		}
	}
	return owners, nil
}
