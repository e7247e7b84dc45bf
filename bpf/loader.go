package bpf

import (
	"cmp"
	"errors"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/cilium/ebpf/features"
	"golang.org/x/sys/unix"

	"github.com/podfence/podfence/pkg/objinfo"
	"github.com/podfence/podfence/pkg/pinfs"
	"github.com/podfence/podfence/pkg/pinpath"
	"github.com/podfence/podfence/pkg/podid"
)

// ErrIncompatiblePin is wrapped when a pin exists but was made by a datapath
// whose layout differs from this one. podfence never replaces such a pin
// silently: replicas attached to it would stop sharing state.
var ErrIncompatiblePin = errors.New("incompatible pin")

// ErrTableSize is wrapped, with ErrIncompatiblePin, when a pinned conntrack
// map has another capacity than the node's setting asks for.
var ErrTableSize = errors.New("conntrack table size differs from the setting")

// Default capacities of the conntrack maps (GlobalOptions).
const (
	DefaultCTv4Entries = 131072
	DefaultCTv6Entries = 65536
	// MinCTEntries and MaxCTEntries bound the setting: below, a node of
	// busy pods evicts live flows; above, the map's memory (about 100
	// bytes an entry) is more than a node should spend on it.
	MinCTEntries = 1024
	MaxCTEntries = 1 << 24
)

// GlobalOptions are the node's settings of the global maps. The zero value
// is the defaults.
type GlobalOptions struct {
	// CTv4Entries and CTv6Entries are the conntrack maps' capacities. Every
	// process that opens the pins must agree: a pin of another size is
	// refused (ErrTableSize) rather than silently used.
	CTv4Entries, CTv6Entries uint32
	// KeepLayout opens the pins as they are: a map of an earlier layout is
	// refused rather than taken over, a missing one rather than created,
	// and nothing is written. Inspection commands set it, so that running
	// a newer tool does not change a node.
	KeepLayout bool
}

// CheckCTEntries validates one capacity of GlobalOptions (0 is the default).
func CheckCTEntries(n uint32) error {
	if n != 0 && (n < MinCTEntries || n > MaxCTEntries) {
		return fmt.Errorf("conntrack table size %d is outside [%d, %d]", n, MinCTEntries, MaxCTEntries)
	}
	return nil
}

func (o GlobalOptions) entries(name string) uint32 {
	switch name {
	case mapCTv4:
		if o.CTv4Entries != 0 {
			return o.CTv4Entries
		}
		return DefaultCTv4Entries
	case mapCTv6:
		if o.CTv6Entries != 0 {
			return o.CTv6Entries
		}
		return DefaultCTv6Entries
	}
	return 0
}

// Map and program names as they appear in the object file. The maps' names
// are also their pin names, which package pinpath owns.
const (
	mapCTv4        = pinpath.MapCTv4
	mapCTv6        = pinpath.MapCTv6
	mapNodeAddrs   = pinpath.MapNodeAddrs
	mapDenyEvents  = pinpath.MapDenyEvents
	mapEventBudget = pinpath.MapEventBudget
	mapFrags       = pinpath.MapFrags
	mapTickClock   = pinpath.MapTickClock
	mapServices    = pinpath.MapServices
	mapJudges      = pinpath.MapJudges
	mapLocalJudges = pinpath.MapLocalJudges
	mapState       = pinpath.MapState
	mapCounters    = pinpath.MapCounters
	mapPortSets    = pinpath.MapPortSets
	mapSources     = pinpath.MapSources
	mapTiers       = pinpath.MapTiers

	progIngress       = "pod_ingress"
	progEgress        = "pod_egress"
	progAfterNAT      = "pod_after_nat"
	progLocal         = "pod_local"
	progUplink        = "uplink_after_nat"
	progLocalDispatch = "local_after_nat"
)

var globalMaps = pinpath.GlobalMaps()

// sideMaps are the pin names of each side's maps (Side).
var sideMaps = [2]struct {
	policy [2][2]string // by [direction][family], family 0 for IPv4, 1 for IPv6
	tiers  string
}{
	{[2][2]string{{pinpath.MapPolInV4, pinpath.MapPolInV6}, {pinpath.MapPolEgV4, pinpath.MapPolEgV6}}, pinpath.MapTiers},
	{[2][2]string{{pinpath.MapPolInV4Side1, pinpath.MapPolInV6Side1}, {pinpath.MapPolEgV4Side1, pinpath.MapPolEgV6Side1}}, pinpath.MapTiersSide1},
}

// identifierMaps are the maps pinned per identifier.
var identifierMaps = pinpath.IdentifierMaps()

var (
	specOnce sync.Once
	specErr  error
	spec     *ebpf.CollectionSpec
)

var memlockOnce sync.Once

// liftMemlock removes RLIMIT_MEMLOCK for this process: before 5.11 the
// kernel charges BPF maps to it, and 5.10's default of 64 KiB does not hold
// a conntrack map. Later kernels account BPF memory to the cgroup and ignore
// it. (cilium/ebpf's rlimit package does the same after probing the kernel
// in its init, which every CNI call would pay for.)
func liftMemlock() {
	memlockOnce.Do(func() {
		_ = unix.Setrlimit(unix.RLIMIT_MEMLOCK, &unix.Rlimit{Cur: unix.RLIM_INFINITY, Max: unix.RLIM_INFINITY})
	})
}

// collectionSpec parses the embedded object once per process (a few
// milliseconds, so only paths that create something call it); callers get a
// copy.
func collectionSpec() (*ebpf.CollectionSpec, error) {
	specOnce.Do(func() {
		spec, specErr = loadPodfence()
	})
	if specErr != nil {
		return nil, fmt.Errorf("load embedded datapath object: %w", specErr)
	}
	return spec.Copy(), nil
}

// loadableSpec is the object's spec with its load-time constants set for
// this kernel, in a process allowed to create what it describes.
func loadableSpec() (*ebpf.CollectionSpec, error) {
	cs, err := collectionSpec()
	if err != nil {
		return nil, err
	}
	liftMemlock()
	// bpf_ktime_get_coarse_ns needs Linux >= 5.11; see podfence.c.
	if features.HaveProgramHelper(ebpf.SchedCLS, asm.FnKtimeGetCoarseNs) == nil {
		if err := cs.Variables["coarse_clock"].Set(uint32(1)); err != nil {
			return nil, fmt.Errorf("set coarse_clock: %w", err)
		}
	}
	return cs, nil
}

// Global holds the node-wide maps: conntrack (v4, v6), the node's own
// addresses, the deny-event ring buffer and its rate limiter, the ports of
// fragmented datagrams, and the per-CPU clock cache.
type Global struct {
	CTv4, CTv6  *ebpf.Map
	NodeAddrs   *ebpf.Map
	DenyEvents  *ebpf.Map
	EventBudget *ebpf.Map
	Frags       *ebpf.Map
	TickClock   *ebpf.Map
	// The Service frontends (services.go) and the identifiers' judges by
	// slot (slots.go), for judging Service flows after the translation.
	Services    *ebpf.Map
	Judges      *ebpf.Map
	LocalJudges *ebpf.Map

	// Renewal is what opening changed: the maps of an earlier layout it
	// replaced (Programs is always false here).
	Renewal Renewal

	dir string // where they are pinned; SyncNodeAddrs locks it
}

// OpenGlobal opens the node-wide maps pinned in dir (package pinroot says
// where), creating and pinning them on first use, with the node's settings.
// Pins of an earlier layout are taken over (see renew.go), unless
// opts.KeepLayout: maps this layout keeps are reused, others replaced by
// new ones, under the directory's lock held exclusively. Every opener holds
// it shared while it opens, so none sees a renewal half done; a process
// that opened the maps before a renewal keeps the replaced ones, which is
// why only a new build's plugin and sweeper renew. A pin that cannot be
// taken over, or another size than opts asks for, is an error wrapping
// ErrIncompatiblePin; pins of a later layout, ErrNewerLayout.
func OpenGlobal(dir string, opts GlobalOptions) (*Global, error) {
	for _, n := range []uint32{opts.CTv4Entries, opts.CTv6Entries} {
		if err := CheckCTEntries(n); err != nil {
			return nil, err
		}
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("create pin directory: %w", err)
	}
	g, err := openGlobalDir(dir, opts, unix.LOCK_SH)
	if errors.Is(err, errRenewalNeeded) {
		g, err = openGlobalDir(dir, opts, unix.LOCK_EX)
	}
	return g, err
}

// errKeptLayout is a global pin that needs renewing, opened with KeepLayout.
var errKeptLayout = fmt.Errorf("%w: the pin is an earlier layout's; `podfence-sweeper upgrade` (or run, or the plugin's next ADD) moves the node to this build", ErrIncompatiblePin)

func openGlobalDir(dir string, opts GlobalOptions, how int) (*Global, error) {
	lock, err := pinfs.LockDir(dir, how)
	if err != nil {
		return nil, err
	}
	defer lock.Close()
	mode := openMode{renew: how == unix.LOCK_EX && !opts.KeepLayout, exclusive: how == unix.LOCK_EX, errRenew: errRenewalNeeded}
	if opts.KeepLayout {
		mode.errRenew, mode.existing = errKeptLayout, true
	}
	s, err := openMapSet(dir, globalMaps, opts.entries, mode)
	if err != nil {
		return nil, err
	}
	rn := Renewal{From: s.from, Maps: s.renewed}
	if err := s.commit(); err != nil {
		closeMaps(s.maps)
		return nil, err
	}
	// An earlier layout whose maps are all this one's: the marker says so
	// from now on (KeepLayout opens them as they are).
	if s.marker.version != LayoutVersion && !opts.KeepLayout {
		if how != unix.LOCK_EX {
			closeMaps(s.maps)
			return nil, errRenewalNeeded
		}
		if err := writeMarker(dir, marker{version: LayoutVersion}); err != nil {
			closeMaps(s.maps)
			return nil, err
		}
	}
	return &Global{
		CTv4:        s.maps[mapCTv4],
		CTv6:        s.maps[mapCTv6],
		NodeAddrs:   s.maps[mapNodeAddrs],
		DenyEvents:  s.maps[mapDenyEvents],
		EventBudget: s.maps[mapEventBudget],
		Frags:       s.maps[mapFrags],
		TickClock:   s.maps[mapTickClock],
		Services:    s.maps[mapServices],
		Judges:      s.maps[mapJudges],
		LocalJudges: s.maps[mapLocalJudges],
		Renewal:     rn,
		dir:         dir,
	}, nil
}

// createPinnedMap creates the map name of this layout and pins it in dir;
// maxEntries, when not 0, overrides the object's capacity. openMapSet found
// no pin there; two processes racing to create it both end up with the one
// that was pinned first (PinByName loads a pin that exists, and checks it).
func createPinnedMap(name, dir string, maxEntries uint32) (*ebpf.Map, error) {
	path := filepath.Join(dir, name)
	ms, err := layoutSpec(name, maxEntries)
	if err != nil {
		return nil, err
	}
	ms.Pinning = ebpf.PinByName
	for attempt := 0; ; attempt++ {
		m, err := ebpf.NewMapWithOptions(ms, ebpf.MapOptions{PinPath: dir})
		if err == nil {
			return m, nil
		}
		if errors.Is(err, ebpf.ErrMapIncompatible) {
			return nil, fmt.Errorf("pin %s: %w: %w", path, ErrIncompatiblePin, err)
		}
		// Lost a creation race: the winner's pin is there now.
		if errors.Is(err, os.ErrExist) && attempt < 3 {
			continue
		}
		return nil, fmt.Errorf("open map %s in %s: %w", name, dir, err)
	}
}

// Close releases the file descriptors; the pins stay.
func (g *Global) Close() error {
	var maps []*ebpf.Map
	for _, m := range g.replacements() {
		maps = append(maps, m)
	}
	return closeAll(maps...)
}

// replacements are the global maps by name, as the object file calls them.
func (g *Global) replacements() map[string]*ebpf.Map {
	return map[string]*ebpf.Map{
		mapCTv4:        g.CTv4,
		mapCTv6:        g.CTv6,
		mapNodeAddrs:   g.NodeAddrs,
		mapDenyEvents:  g.DenyEvents,
		mapEventBudget: g.EventBudget,
		mapFrags:       g.Frags,
		mapTickClock:   g.TickClock,
		mapServices:    g.Services,
		mapJudges:      g.Judges,
		mapLocalJudges: g.LocalJudges,
	}
}

// Datapath is what one pod identifier runs: its two programs and the
// maps they share with every replica.
type Datapath struct {
	ID  podid.ID
	Dir string // pin directory

	global *Global

	Ingress, Egress *ebpf.Program
	// AfterNAT judges the identifier's Service flows after the
	// translation, at Slot of the node's judges map; nil (and Slot -1)
	// where the kernel lacks the conntrack kfuncs (service.h).
	AfterNAT *ebpf.Program
	// Local is its judge of Service flows delivered to a socket of the
	// node (a cgroup_skb program), at the same slot of local_judges; it
	// goes with AfterNAT.
	Local           *ebpf.Program
	Slot            int
	State, Counters *ebpf.Map
	// The two sides of the policy; the generation's parity selects the
	// one in force (policy.go).
	Sides [2]Side
	// The port sets the entries of either side name.
	PortSets *ebpf.Map
	// Each member's source addresses, by host veth ifindex (sources.go).
	Sources *ebpf.Map

	// noDispatch: this kernel refused the programs that dispatch stamped
	// packets; they are loaded without.
	noDispatch bool

	// moving: members may still run an earlier build's programs
	// (Renewal.MovePending until MembersMoved), which, before layout 4,
	// read side 0 alone whatever the generation (policy.go).
	moving bool
}

// Side is one side of an identifier's policy: the maps that judge a new
// flow, pinned without a suffix for side 0 and with _1 for side 1.
type Side struct {
	// Policy tries by [policy.Direction][family], family 0 IPv4, 1 IPv6.
	Policy [2][2]*ebpf.Map
	// The cluster policy tiers of both directions and families (tiers.go).
	Tiers *ebpf.Map
}

// OpenIdentifier returns the programs and maps of id pinned in dir, its
// directory (the one its membership lock holds: package bpf never works out
// where an identifier lives), reusing its pins when they exist and are
// compatible, loading and pinning them otherwise. The
// caller must serialise calls for the same identifier (the CNI plugin holds
// the identifier's lock); a fresh identifier allows everything until
// ApplyPolicy programs it. Pins that an earlier layout made, or programs
// that do not use the node's maps, are refused (ErrIncompatiblePin):
// RenewIdentifier takes them over.
func OpenIdentifier(g *Global, dir string, id podid.ID) (*Datapath, error) {
	ident, _, err := openIdentifier(g, dir, id, false)
	return ident, err
}

// OpenExistingIdentifier opens the pinned maps and programs of id without
// creating, loading or writing anything: for a caller that runs or reads
// what the node has (why, adoption's seeding of a pod the plugin just
// added). Missing pins, and pins this build would have to take over, are
// errors. The caller holds the identifier's lock; dir is its directory.
func OpenExistingIdentifier(g *Global, dir string, id podid.ID) (*Datapath, error) {
	s, err := openMapSet(dir, identifierMaps, func(string) uint32 { return 0 }, openMode{existing: true, errRenew: errIdentifierRenewal})
	if err != nil {
		return nil, fmt.Errorf("identifier %q: %w", id, err)
	}
	ident := &Datapath{ID: id, Dir: dir, global: g, Slot: -1}
	fields := ident.mapFields()
	for name, m := range s.maps {
		*fields[name] = m
	}
	if s.marker.hasSlot {
		ident.Slot = int(s.marker.slot)
	}
	reused, err := ident.openPinnedPrograms(g)
	if err == nil && !reused {
		err = fmt.Errorf("programs: %w", errNotPinned)
	}
	if err != nil {
		ident.Close()
		return nil, fmt.Errorf("identifier %q: %w", id, err)
	}
	return ident, nil
}

// Renewal is what RenewIdentifier changed.
type Renewal struct {
	// From is the layout of the pins found (this build's for a new identifier).
	From uint32
	// Maps are the maps replaced by new ones of this layout.
	Maps []string
	// Programs says that pinned programs of another build, or of the
	// replaced maps, were replaced by this build's.
	Programs bool
	// MovePending says that members may still run other programs than the
	// pinned ones: programs were replaced now, or by a renewal whose
	// members were not all moved. The caller moves them
	// (pinroot.Hold.MoveMembers), then calls MembersMoved.
	MovePending bool
}

// MembersMoved records that every member runs the pinned programs, which
// ends a renewal's MovePending. The caller holds the identifier's lock.
func (i *Datapath) MembersMoved() error {
	mk, ok, err := readMarker(i.Dir)
	if err != nil {
		return err
	}
	if ok && mk.moving {
		mk.moving = false
		if err := writeMarker(i.Dir, mk); err != nil {
			return err
		}
	}
	i.moving = false
	return nil
}

// RenewIdentifier is OpenIdentifier for a caller that moves the members
// too: pins of an earlier layout are taken over (maps copied into new ones
// of this layout, see renew.go), and programs of another build, or that use
// other maps than the node's and the identifier's, are replaced by this
// build's. Only pins this build cannot take over are refused
// (ErrIncompatiblePin; a later layout's, ErrNewerLayout).
func RenewIdentifier(g *Global, dir string, id podid.ID) (*Datapath, Renewal, error) {
	return openIdentifier(g, dir, id, true)
}

var errIdentifierRenewal = fmt.Errorf("%w: the pin is another layout's (podfence-sweeper upgrade moves the identifier to this build)", ErrIncompatiblePin)

func openIdentifier(g *Global, dir string, id podid.ID, renew bool) (*Datapath, Renewal, error) {
	if dir == "" {
		return nil, Renewal{}, fmt.Errorf("open identifier %q: no directory", id)
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, Renewal{}, fmt.Errorf("create pin directory: %w", err)
	}
	// The caller holds the identifier's lock.
	s, err := openMapSet(dir, identifierMaps, func(string) uint32 { return 0 }, openMode{renew: renew, exclusive: true, errRenew: errIdentifierRenewal})
	if err != nil {
		return nil, Renewal{}, fmt.Errorf("identifier %q: %w", id, err)
	}
	ident := &Datapath{ID: id, Dir: dir, global: g, Slot: -1}
	fields := ident.mapFields()
	for name, m := range s.maps {
		*fields[name] = m
	}
	if s.marker.hasSlot {
		ident.Slot = int(s.marker.slot)
	}
	rn := Renewal{From: s.from, Maps: s.renewed}
	fail := func(err error) (*Datapath, Renewal, error) {
		ident.Close()
		return nil, Renewal{}, fmt.Errorf("identifier %q: %w", id, err)
	}
	if s.fresh[mapState] {
		st := podfenceIdState{Generation: randomGeneration()}
		if err := ident.State.Update(uint32(0), &st, ebpf.UpdateAny); err != nil {
			return fail(fmt.Errorf("initialise state: %w", err))
		}
	} else if s.from < sidesLayout {
		// Before this layout the policy had one side; its programs
		// never read side 1, this build's will.
		if err := ident.syncSides(); err != nil {
			return fail(err)
		}
	}

	// Pinned programs are this build's to reuse when the maps stay and
	// the marker names this object; a caller that does not renew takes
	// whatever uses exactly these maps.
	sameBuild := s.marker.object == objectID()
	if len(s.renewed) == 0 && (!renew || sameBuild) {
		reused, err := ident.openPinnedPrograms(g)
		if err == nil && reused && ident.judgeMatches(g) {
			// Installed again on every open: the judges map may be a
			// new one (its layout's take-over creates it empty).
			if ident.AfterNAT != nil {
				if err := g.installJudge(uint32(ident.Slot), ident); err != nil {
					return fail(err)
				}
			}
			rn.MovePending = sameBuild && s.marker.moving
			ident.moving = rn.MovePending
			return ident, rn, nil
		}
		if err == nil && reused { // programs of a kernel with(out) the kfuncs
			closeAll(ident.Ingress, ident.Egress, ident.AfterNAT, ident.Local)
			ident.Ingress, ident.Egress, ident.AfterNAT, ident.Local = nil, nil, nil, nil
		}
		if err != nil && !renew {
			return fail(err)
		}
	}
	_, errIn := os.Stat(filepath.Join(dir, pinpath.ProgIngress))
	_, errEg := os.Stat(filepath.Join(dir, pinpath.ProgEgress))
	rn.Programs = errIn == nil || errEg == nil
	rn.MovePending = rn.Programs
	ident.Slot = -1
	if afterNATSupported() {
		slot, err := g.reserveSlot(dir, s.marker.slot, s.marker.hasSlot)
		switch {
		case err == nil:
			ident.Slot = int(slot)
		case !errors.Is(err, ErrNoSlot):
			return fail(err)
		}
		// No slot left: this identifier's Service flows are judged on
		// the frontend, at the veth (service.h); ls reports it.
	}
	err = ident.loadPrograms(g)
	if err != nil && ident.Slot >= 0 {
		// A kernel whose verifier refuses what the judge needs (tail
		// calls beside bpf-to-bpf calls: arm64 before 6.0, no JIT) still
		// gets the datapath, judging Services on their frontends.
		refused := err
		judgeRefused.Store(&refused)
		_ = freeSlot(g.judgeMaps(), g.slotsDir(), uint32(ident.Slot), dir)
		ident.Slot = -1
		ident.noDispatch = true
		err = ident.loadPrograms(g)
	}
	if err != nil {
		return fail(err)
	}
	// The maps go before the programs: a kill in between leaves pinned
	// programs that do not use the pinned maps, and a kill before the
	// marker programs of another build than the marker's; the next renewal
	// replaces them either way.
	if err := s.commit(); err != nil {
		return fail(err)
	}
	if err := ident.pinPrograms(); err != nil {
		return fail(err)
	}
	mk := marker{version: LayoutVersion, object: objectID(), moving: rn.MovePending}
	if ident.AfterNAT != nil {
		// Installed before any member runs programs that stamp the slot.
		if err := g.installJudge(uint32(ident.Slot), ident); err != nil {
			return fail(err)
		}
		mk.slot, mk.hasSlot = uint32(ident.Slot), true
	}
	if err := writeMarker(dir, mk); err != nil {
		return fail(err)
	}
	ident.moving = rn.MovePending
	return ident, rn, nil
}

// mapFields are the identifier's map fields by pin name (identifierMaps).
func (i *Datapath) mapFields() map[string]**ebpf.Map {
	fields := map[string]**ebpf.Map{
		mapState:    &i.State,
		mapCounters: &i.Counters,
		mapPortSets: &i.PortSets,
		mapSources:  &i.Sources,
	}
	for s, names := range sideMaps {
		side := &i.Sides[s]
		fields[names.tiers] = &side.Tiers
		for d := range names.policy {
			for f, name := range names.policy[d] {
				fields[name] = &side.Policy[d][f]
			}
		}
	}
	return fields
}

// openPinnedPrograms reuses pinned programs when both exist and use exactly
// this identifier's maps and the node's global maps.
func (i *Datapath) openPinnedPrograms(g *Global) (bool, error) {
	ingress, errIn := ebpf.LoadPinnedProgram(filepath.Join(i.Dir, pinpath.ProgIngress), nil)
	egress, errEg := ebpf.LoadPinnedProgram(filepath.Join(i.Dir, pinpath.ProgEgress), nil)
	if errIn != nil || errEg != nil {
		closeAll(ingress, egress)
		for _, err := range []error{errIn, errEg} {
			if err != nil && !errors.Is(err, os.ErrNotExist) {
				return false, fmt.Errorf("load pinned program: %w", err)
			}
		}
		// One or both missing: a first ADD, or one killed midway. Loading
		// afresh repairs it; replacing a lone pin is safe because attached
		// hooks hold their own reference.
		return false, nil
	}
	want := map[ebpf.MapID]bool{}
	maps := i.maps()
	for _, m := range g.replacements() {
		maps = append(maps, m)
	}
	for _, m := range maps {
		id, err := objinfo.MapID(m)
		if err != nil {
			closeAll(ingress, egress)
			return false, err
		}
		want[id] = true
	}
	for _, p := range []struct {
		prog *ebpf.Program
		name string
		pin  string
	}{{ingress, progIngress, pinpath.ProgIngress}, {egress, progEgress, pinpath.ProgEgress}} {
		if err := checkProgram(p.prog, ebpf.SchedCLS, p.name, want); err != nil {
			closeAll(ingress, egress)
			return false, fmt.Errorf("pin %s: %w: %w", filepath.Join(i.Dir, p.pin), ErrIncompatiblePin, err)
		}
	}
	i.Ingress, i.Egress = ingress, egress
	judge, err := loadPinnedProgram(i.Dir, pinpath.ProgAfterNAT, ebpf.SchedCLS, progAfterNAT, want)
	if judge == nil && err == nil {
		return true, nil
	}
	// The local judge goes with it; an earlier build's judge came alone,
	// and the programs are loaded again to add it.
	var local *ebpf.Program
	if err == nil {
		local, err = loadPinnedProgram(i.Dir, pinpath.ProgLocal, ebpf.CGroupSKB, progLocal, want)
	}
	if err != nil || local == nil {
		closeAll(ingress, egress, judge)
		i.Ingress, i.Egress = nil, nil
		return false, err
	}
	i.AfterNAT, i.Local = judge, local
	return true, nil
}

// loadPinnedProgram loads the program pinned at dir/pin and checks that it
// is the object's name, of typ, using only maps of want; nil and no error
// when nothing is pinned there.
func loadPinnedProgram(dir, pin string, typ ebpf.ProgramType, name string, want map[ebpf.MapID]bool) (*ebpf.Program, error) {
	path := filepath.Join(dir, pin)
	p, err := ebpf.LoadPinnedProgram(path, nil)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("load pinned program: %w", err)
	}
	if err := checkProgram(p, typ, name, want); err != nil {
		p.Close()
		return nil, fmt.Errorf("pin %s: %w: %w", path, ErrIncompatiblePin, err)
	}
	return p, nil
}

// judgeRefused is the last error of a load with the judge that this
// kernel refused (the datapath was loaded without it), for the logs and
// the tests.
var judgeRefused atomic.Pointer[error]

// JudgeRefused is the error of the last load of the judge this kernel
// refused in this process, nil if none.
func JudgeRefused() error {
	if e := judgeRefused.Load(); e != nil {
		return *e
	}
	return nil
}

// judgeMatches reports whether the pinned programs are what this kernel
// and node want of the identifier's judge: one pinned where the marker
// records a slot, at a slot still reserved for it; none only where the
// kernel has no conntrack kfuncs (programs loaded before nf_conntrack
// was, say, are loaded again, with a slot).
func (i *Datapath) judgeMatches(g *Global) bool {
	if i.AfterNAT == nil {
		return i.Slot < 0 && !afterNATSupported()
	}
	return i.Slot >= 0 && g.slotHeld(i.Slot, i.Dir)
}

func checkProgram(p *ebpf.Program, typ ebpf.ProgramType, name string, want map[ebpf.MapID]bool) error {
	info, err := objinfo.ProgramOf(p)
	if err != nil {
		return err
	}
	if info.Type != typ || info.Name != name {
		return fmt.Errorf("program is %s %q, want %s %q", info.Type, info.Name, typ, name)
	}
	unnamed := 0
	for _, id := range info.MapIDs {
		if want[id] {
			continue
		}
		constants, err := isConstants(id)
		if errors.Is(err, unix.EPERM) {
			// Opening a map by ID needs CAP_SYS_ADMIN, which the
			// sweeper's DaemonSet does not grant (CAP_BPF is not
			// enough). Its name cannot be read then: allow as many
			// such maps as the program has constant sections.
			unnamed++
			constants = unnamed <= constantSections()
		}
		if !constants {
			return fmt.Errorf("program uses map id %d, which is not one of this identifier's or the node's maps", id)
		}
	}
	return nil
}

// isConstants tells the program's own read-only constants (.rodata), which
// every load creates afresh, from maps it should share.
func isConstants(id ebpf.MapID) (bool, error) {
	name, err := objinfo.MapName(id)
	return err == nil && strings.HasSuffix(name, ".rodata"), err
}

// constantSections is how many .rodata maps a load of the programs creates,
// counted once per process from the embedded object.
var constantSections = sync.OnceValue(func() int {
	cs, err := collectionSpec()
	if err != nil {
		return 0
	}
	n := 0
	for name := range cs.Maps {
		if strings.HasPrefix(name, ".rodata") {
			n++
		}
	}
	return n
})

// loadPrograms loads the programs at once, unpinned, each in a goroutine
// of its own: the kernel verifies privileged loads concurrently, and
// verification is most of what a first replica's ADD waits for. With a
// slot, the judge too, and all three know the slot.
func (i *Datapath) loadPrograms(g *Global) error {
	cs, err := loadableSpec()
	if err != nil {
		return err
	}
	names := []string{progIngress, progEgress}
	if afterNATSupported() && !i.noDispatch {
		if err := cs.Variables["dispatch"].Set(uint8(1)); err != nil {
			return fmt.Errorf("set dispatch: %w", err)
		}
	}
	if i.Slot >= 0 {
		if err := cs.Variables["slot"].Set(uint32(i.Slot)); err != nil {
			return fmt.Errorf("set slot: %w", err)
		}
		if err := cs.Variables["after_nat"].Set(uint8(1)); err != nil {
			return fmt.Errorf("set after_nat: %w", err)
		}
		names = append(names, progAfterNAT, progLocal)
	}
	repl := g.replacements()
	for name, m := range i.mapFields() {
		repl[name] = *m
	}
	progs := make([]*ebpf.Program, len(names))
	errs := make([]error, len(names))
	var wg sync.WaitGroup
	for k, name := range names {
		wg.Add(1)
		go func() {
			defer wg.Done()
			progs[k], errs[k] = loadProgram(cs, name, repl)
		}()
	}
	wg.Wait()
	// The first error only: both programs share their code, and a verifier
	// log in full is long enough once.
	if err := cmp.Or(errs[:]...); err != nil {
		for _, p := range progs {
			if p != nil {
				p.Close()
			}
		}
		return err
	}
	i.Ingress, i.Egress = progs[0], progs[1]
	if len(progs) > 2 {
		i.AfterNAT, i.Local = progs[2], progs[3]
	}
	return nil
}

// pinPrograms pins the programs loadPrograms loaded, in place of any pins.
func (i *Datapath) pinPrograms() error {
	for _, p := range []struct {
		prog *ebpf.Program
		pin  string
	}{{i.Ingress, pinpath.ProgIngress}, {i.Egress, pinpath.ProgEgress}} {
		if err := pinReplacing(p.prog, filepath.Join(i.Dir, p.pin)); err != nil {
			return err
		}
	}
	for _, p := range []struct {
		prog *ebpf.Program
		pin  string
	}{{i.AfterNAT, pinpath.ProgAfterNAT}, {i.Local, pinpath.ProgLocal}} {
		path := filepath.Join(i.Dir, p.pin)
		if p.prog == nil {
			if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
				return fmt.Errorf("remove %s: %w", path, err)
			}
			continue
		}
		if err := pinReplacing(p.prog, path); err != nil {
			return err
		}
	}
	return nil
}

// loadProgram loads the program name of cs alone, with the maps of repl.
// Loads run concurrently on the same cs: cilium/ebpf only reads a spec
// (it copies each map and program spec it loads), so each load needs no
// more than its own view naming its one program. Each creates its own copy
// of the read-only constants.
func loadProgram(cs *ebpf.CollectionSpec, name string, repl map[string]*ebpf.Map) (*ebpf.Program, error) {
	one := *cs
	one.Programs = map[string]*ebpf.ProgramSpec{name: cs.Programs[name]}
	// The conntrack maps' capacity is a node setting: the programs take
	// the pinned maps as they are (a replacement must match its spec).
	one.Maps = maps.Clone(cs.Maps)
	for _, ct := range []string{mapCTv4, mapCTv6} {
		if m, ms := repl[ct], one.Maps[ct]; m != nil && ms != nil && m.MaxEntries() != ms.MaxEntries {
			ms = ms.Copy()
			ms.MaxEntries = m.MaxEntries()
			one.Maps[ct] = ms
		}
	}
	coll, err := ebpf.NewCollectionWithOptions(&one, ebpf.CollectionOptions{MapReplacements: repl})
	if err != nil {
		var ve *ebpf.VerifierError
		if errors.As(err, &ve) {
			return nil, fmt.Errorf("load program %s: %+v", name, ve)
		}
		return nil, fmt.Errorf("load program %s: %w", name, err)
	}
	p := coll.Programs[name]
	delete(coll.Programs, name)
	coll.Close()
	return p, nil
}

// pinReplacing pins p (a program or a map) at path. A pin already there (a
// stale one left by a killed plugin, an earlier build's) is replaced
// through a rename, so that the path never goes missing.
func pinReplacing(p interface{ Pin(string) error }, path string) error {
	if err := pinfs.ReplacePin(path, p); err != nil {
		return fmt.Errorf("pin %s: %w", path, err)
	}
	return nil
}

func (i *Datapath) maps() []*ebpf.Map {
	fields := i.mapFields()
	maps := make([]*ebpf.Map, 0, len(identifierMaps))
	for _, name := range identifierMaps {
		maps = append(maps, *fields[name])
	}
	return maps
}

// Close releases the file descriptors; the pins stay.
func (i *Datapath) Close() error {
	err := closeAll(i.maps()...)
	return errors.Join(err, closeAll(i.Ingress, i.Egress, i.AfterNAT, i.Local))
}

// RemoveObjects removes the pinned programs and maps of an identifier's
// directory dir but leaves dir (the membership lock's) and what else it holds, so that the
// next OpenIdentifier loads them afresh. Only a caller that knows no member
// uses them may call it: attached hooks keep the old objects alive, but
// they would no longer be the identifier's.
func RemoveObjects(dir string) error {
	if dir == "" {
		return errors.New("remove objects: no directory")
	}
	pins := append([]string{pinpath.ProgIngress, pinpath.ProgEgress, pinpath.ProgAfterNAT, pinpath.ProgLocal}, identifierMaps...) // programs first, as in RemoveIdentifier
	pins = append(pins, pinpath.Layout)
	for _, pin := range pins {
		// A kill between pinning and renaming (pinReplacing, writeMarker)
		// leaves the temporary, which holds its object alive too.
		for _, name := range []string{pin, pinfs.TempName(pin)} {
			if err := os.Remove(filepath.Join(dir, name)); err != nil && !errors.Is(err, os.ErrNotExist) {
				return fmt.Errorf("remove objects: %w", err)
			}
		}
	}
	return nil
}

// RemoveIdentifier removes an identifier's directory dir and every pin in
// it. Attached hooks keep their
// programs alive until they are detached; call it only once no member is left.
func RemoveIdentifier(dir string) error {
	// The programs go first (RemoveObjects). A removal killed midway then
	// leaves maps without programs, which the next OpenIdentifier
	// completes; programs whose maps are no longer pinned it would refuse
	// (ErrIncompatiblePin).
	if err := RemoveObjects(dir); err != nil {
		return err
	}
	if err := os.RemoveAll(dir); err != nil {
		return fmt.Errorf("remove identifier: %w", err)
	}
	return nil
}

func closeMaps(maps map[string]*ebpf.Map) {
	for _, m := range maps {
		m.Close()
	}
}

// closeAll closes every object (Close is nil-safe on maps and programs) and
// returns the first error.
func closeAll[T interface{ Close() error }](objs ...T) error {
	var first error
	for _, o := range objs {
		if err := o.Close(); err != nil && first == nil {
			first = err
		}
	}
	return first
}

// PinnedProgramIDs returns the IDs of the programs pinned in an
// identifier's directory dir without loading
// or creating anything (CNI CHECK, the sweeper's ls).
func PinnedProgramIDs(dir string) (ingress, egress ebpf.ProgramID, err error) {
	for _, p := range []struct {
		pin string
		out *ebpf.ProgramID
	}{{pinpath.ProgIngress, &ingress}, {pinpath.ProgEgress, &egress}} {
		prog, err := ebpf.LoadPinnedProgram(filepath.Join(dir, p.pin), &ebpf.LoadPinOptions{ReadOnly: true})
		if err != nil {
			return 0, 0, fmt.Errorf("program pin: %w", err)
		}
		*p.out, err = objinfo.ProgramID(prog)
		prog.Close()
		if err != nil {
			return 0, 0, fmt.Errorf("program pin: %w", err)
		}
	}
	return ingress, egress, nil
}

// CheckLoad loads both programs, with throwaway single-entry maps, and
// unloads them: the kernel accepts this datapath.
func CheckLoad() error {
	cs, err := loadableSpec()
	if err != nil {
		return err
	}
	for _, ms := range cs.Maps {
		if ms.Type != ebpf.RingBuf && ms.MaxEntries > 1 {
			ms.MaxEntries = 1
		}
	}
	coll, err := ebpf.NewCollection(cs)
	if err != nil {
		return fmt.Errorf("load datapath: %w", err)
	}
	coll.Close()
	return nil
}
