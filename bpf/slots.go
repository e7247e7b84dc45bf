package bpf

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"sync"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/btf"
	"golang.org/x/sys/unix"

	"github.com/podfence/podfence/pkg/objinfo"
	"github.com/podfence/podfence/pkg/pinpath"
)

// MaxSlots is how many identifiers of one node can have their Service
// flows judged after the translation (MAX_SLOTS in service.h: the slot + 1
// fills 11 bits of the mark). An identifier past it is judged at its veths
// on the frontend, as on a kernel without the conntrack kfuncs.
const MaxSlots = 2047

// ErrNoSlot is wrapped when every slot of the node is taken.
var ErrNoSlot = errors.New("no free identifier slot")

// AfterNATSupported reports whether this kernel has what judging a Service
// flow after its translation needs: the conntrack kfuncs
// bpf_skb_ct_lookup and bpf_ct_release (Linux 5.18), in the kernel's BTF or
// nf_conntrack's. Where nf_conntrack is a module that is not loaded yet the
// answer is no until it is: kube-proxy loads it before a node runs pods.
// A yes is kept for the process; a no is asked again (a long-running
// sweeper sees nf_conntrack load), without reading BTF on kernels before
// 5.18.
func AfterNATSupported() bool { return afterNATSupported() }

var (
	afterNATMu  sync.Mutex
	afterNATYes bool
)

func afterNATSupported() bool {
	afterNATMu.Lock()
	defer afterNATMu.Unlock()
	if !afterNATYes {
		afterNATYes = probeAfterNAT()
	}
	return afterNATYes
}

func probeAfterNAT() bool {
	var u unix.Utsname
	if unix.Uname(&u) == nil {
		var major, minor int
		if _, err := fmt.Sscanf(unix.ByteSliceToString(u.Release[:]), "%d.%d", &major, &minor); err == nil &&
			(major < 5 || major == 5 && minor < 18) {
			return false
		}
	}
	has := func(s *btf.Spec) bool {
		var fn *btf.Func
		return s.TypeByName("bpf_skb_ct_lookup", &fn) == nil
	}
	if s, err := btf.LoadKernelModuleSpec("nf_conntrack"); err == nil && has(s) {
		return true
	}
	s, err := btf.LoadKernelSpec()
	return err == nil && has(s)
}

// ServiceJudgement says, for STATUS and the logs, how this kernel judges a
// pod's flows to Services.
func ServiceJudgement() string {
	if afterNATSupported() {
		return "Services judged on their backends, after the translation"
	}
	return "Services judged on their frontends: the kernel has no conntrack kfuncs (Linux 5.18, nf_conntrack loaded)"
}

// slotHeld reports whether the reservation of slot names the identifier
// directory dir.
func (g *Global) slotHeld(slot int, dir string) bool {
	owner, err := os.Readlink(filepath.Join(g.slotsDir(), strconv.Itoa(slot)))
	return err == nil && owner == dir
}

// slotsDir is where the global directory keeps the slot reservations.
func (g *Global) slotsDir() string { return filepath.Join(g.dir, pinpath.SlotsDir) }

// reserveSlot returns the slot the identifier directory dir holds (want,
// when its reservation names dir, or the first reservation naming dir,
// which a load killed before its marker left), or reserves the lowest free
// one: a reservation is a symlink to dir, and creating it is atomic, so
// two identifiers loading at once never share a slot.
func (g *Global) reserveSlot(dir string, want uint32, wanted bool) (uint32, error) {
	sd := g.slotsDir()
	if wanted {
		if owner, err := os.Readlink(filepath.Join(sd, strconv.Itoa(int(want)))); err == nil && owner == dir {
			return want, nil
		}
	}
	if err := os.MkdirAll(sd, 0o700); err != nil {
		return 0, fmt.Errorf("create slot directory: %w", err)
	}
	for n := range uint32(MaxSlots) {
		err := os.Symlink(dir, filepath.Join(sd, strconv.Itoa(int(n))))
		if err == nil {
			return n, nil
		}
		if !errors.Is(err, os.ErrExist) {
			return 0, fmt.Errorf("reserve slot %d: %w", n, err)
		}
		// Reserved for dir already, by a load killed before its marker.
		if owner, err := os.Readlink(filepath.Join(sd, strconv.Itoa(int(n)))); err == nil && owner == dir {
			return n, nil
		}
	}
	return 0, fmt.Errorf("%w: all %d are reserved (%s)", ErrNoSlot, MaxSlots, sd)
}

// installJudge puts the identifier's judge and ingress program at its
// slot in the judges map, and its local judge in local_judges, where tail
// calls find them. An entry that holds its program already is left alone:
// a reused open (every ADD) reads the entries instead of writing them,
// which would make the kernel patch every program's direct tail calls into
// the slot.
func (g *Global) installJudge(slot uint32, d *Datapath) error {
	for _, e := range []struct {
		m    *ebpf.Map
		key  uint32
		prog *ebpf.Program
		what string
	}{
		{g.Judges, 2 * slot, d.AfterNAT, "judge"},
		{g.Judges, 2*slot + 1, d.Ingress, "ingress program"},
		{g.LocalJudges, slot, d.Local, "local judge"},
	} {
		want, err := objinfo.ProgramID(e.prog)
		if err != nil {
			return fmt.Errorf("install %s of slot %d: %w", e.what, slot, err)
		}
		var have uint32
		if e.m.Lookup(e.key, &have) == nil && ebpf.ProgramID(have) == want {
			continue
		}
		if err := e.m.Put(e.key, e.prog); err != nil {
			return fmt.Errorf("install %s of slot %d: %w", e.what, slot, err)
		}
	}
	return nil
}

// judgeMaps are the program arrays a slot has entries in.
func (g *Global) judgeMaps() slotMaps { return slotMaps{g.Judges, g.LocalJudges} }

// slotMaps are the judges and local_judges maps (either nil: no such map).
type slotMaps struct{ judges, local *ebpf.Map }

// keys are slot's entries in each.
func (m slotMaps) entries(slot uint32) []struct {
	m   *ebpf.Map
	key uint32
} {
	return []struct {
		m   *ebpf.Map
		key uint32
	}{{m.judges, 2 * slot}, {m.judges, 2*slot + 1}, {m.local, slot}}
}

// ReleaseSlot frees the slot of the identifier directory dir, whose node
// directory is globalDir: its programs leave the node's judges map and its
// reservation goes. A caller about to remove the identifier's objects
// (RemoveObjects, RemoveIdentifier) calls it first, under the identifier's
// lock. It opens only the judges pin, so that a DEL, which opens no other
// global map, can call it. Idempotent; a reservation naming another
// directory is left to it.
func ReleaseSlot(globalDir, dir string) error {
	slotsDir := filepath.Join(globalDir, pinpath.SlotsDir)
	var slots []uint32
	mk, ok, err := readMarker(dir)
	switch {
	case err == nil && ok && mk.hasSlot:
		slots = append(slots, mk.slot)
	default:
		// No slot recorded: a load killed between reserving one and
		// writing the marker may have left a reservation naming dir.
		entries, err := os.ReadDir(slotsDir)
		if err != nil && !errors.Is(err, os.ErrNotExist) {
			return fmt.Errorf("release slots: %w", err)
		}
		for _, e := range entries {
			n, err := strconv.ParseUint(e.Name(), 10, 32)
			if err != nil || n >= MaxSlots {
				continue
			}
			if owner, err := os.Readlink(filepath.Join(slotsDir, e.Name())); err == nil && owner == dir {
				slots = append(slots, uint32(n))
			}
		}
	}
	if len(slots) == 0 {
		return nil
	}
	var maps slotMaps
	for _, p := range []struct {
		m    **ebpf.Map
		name string
	}{{&maps.judges, mapJudges}, {&maps.local, mapLocalJudges}} {
		m, err := ebpf.LoadPinnedMap(filepath.Join(globalDir, p.name), nil)
		if err != nil && !errors.Is(err, os.ErrNotExist) {
			return fmt.Errorf("release slots: %w", err)
		}
		if m != nil {
			defer m.Close()
			*p.m = m
		}
	}
	for _, n := range slots {
		if err := freeSlot(maps, slotsDir, n, dir); err != nil {
			return err
		}
	}
	return nil
}

// freeSlot empties slot's entries of the judges maps and removes its
// reservation in slotsDir, if it names dir.
func freeSlot(maps slotMaps, slotsDir string, slot uint32, dir string) error {
	path := filepath.Join(slotsDir, strconv.Itoa(int(slot)))
	owner, err := os.Readlink(path)
	if errors.Is(err, os.ErrNotExist) || (err == nil && owner != dir) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("read slot %d: %w", slot, err)
	}
	for _, e := range maps.entries(slot) {
		if e.m == nil {
			continue
		}
		if err := e.m.Delete(e.key); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			return fmt.Errorf("release slot %d: %w", slot, err)
		}
	}
	if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("release slot %d: %w", slot, err)
	}
	return nil
}

// SweepSlots frees the slots whose identifier directory is gone (removed
// by a build before slots, or by a removal killed halfway) and returns how
// many it freed. A reservation a load made but did not record (killed
// before its marker) stays until its identifier is removed: freeing it
// while the identifier lives could race a load that is about to record it.
func (g *Global) SweepSlots() (int, error) {
	entries, err := os.ReadDir(g.slotsDir())
	if errors.Is(err, os.ErrNotExist) {
		return 0, nil
	}
	if err != nil {
		return 0, fmt.Errorf("sweep slots: %w", err)
	}
	freed := 0
	var errs []error
	for _, e := range entries {
		n, err := strconv.ParseUint(e.Name(), 10, 32)
		if err != nil || n >= MaxSlots {
			continue
		}
		owner, err := os.Readlink(filepath.Join(g.slotsDir(), e.Name()))
		if err != nil {
			continue
		}
		if _, err := os.Stat(owner); !errors.Is(err, os.ErrNotExist) {
			continue
		}
		if err := freeSlot(g.judgeMaps(), g.slotsDir(), uint32(n), owner); err != nil {
			errs = append(errs, err)
			continue
		}
		freed++
	}
	return freed, errors.Join(errs...)
}

// LoadUplink loads the program that judges, at an uplink's TC egress, the
// Service flows translated to backends off the node (uplink_after_nat),
// using the node's judges map. The caller attaches and owns it.
func LoadUplink(g *Global) (*ebpf.Program, error) {
	cs, err := loadableSpec()
	if err != nil {
		return nil, err
	}
	return loadProgram(cs, progUplink, g.replacements())
}

// LoadLocal loads the program that judges, at the ingress of a cgroup of
// the node's sockets, the Service flows delivered to them
// (local_after_nat), using the node's local_judges map. The caller
// attaches and owns it.
func LoadLocal(g *Global) (*ebpf.Program, error) {
	cs, err := loadableSpec()
	if err != nil {
		return nil, err
	}
	return loadProgram(cs, progLocalDispatch, g.replacements())
}
