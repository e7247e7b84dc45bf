package bpf

import (
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"github.com/cilium/ebpf"
)

// A build of podfence takes over the pins of an earlier one while pods
// use them (an upgrade), one directory of maps at a time:
//
//   - every map is planned first (planRenewal): kept, or replaced by a new
//     map of this layout that gets the pin's entries or starts empty. A map
//     that cannot be taken over refuses the whole directory before anything
//     changes;
//   - the new maps are created and filled unpinned, and an identifier's
//     programs are loaded against them;
//   - then the new maps replace the pins through renames, the programs
//     follow, and the directory's marker records this build.
//
// Programs of the earlier build stay attached, and keep the maps they were
// loaded with alive, until their members are moved onto the new programs
// (package pinroot), which is an atomic swap on each hook. An upgrade
// killed midway leaves pins that the next one finishes: new pins are
// reused, old ones renewed again.

// errRenewalNeeded says that the global pins need an exclusive turn.
var errRenewalNeeded = errors.New("global pins need renewal")

// loadPins loads the maps of names pinned in dir; a missing pin is nil.
func loadPins(dir string, names []string) (map[string]*ebpf.Map, error) {
	pinned := make(map[string]*ebpf.Map, len(names))
	for _, name := range names {
		m, err := ebpf.LoadPinnedMap(filepath.Join(dir, name), nil)
		if errors.Is(err, os.ErrNotExist) {
			continue
		}
		if err != nil {
			closeMaps(pinned)
			return nil, fmt.Errorf("open map pin %s: %w", filepath.Join(dir, name), err)
		}
		pinned[name] = m
	}
	return pinned, nil
}

// mapSet is one directory's maps as this build opens them.
type mapSet struct {
	dir     string
	maps    map[string]*ebpf.Map
	renewed []string // names whose new map is not pinned yet
	from    uint32   // the layout of the pins found
	marker  marker   // the directory's; version 0 when it had none
	fresh   map[string]bool
}

// openMode is how openMapSet may treat a directory.
type openMode struct {
	renew     bool  // replace pins of an earlier layout
	exclusive bool  // the caller holds the directory's lock exclusively
	errRenew  error // what a pin that needs replacing is without renew
	existing  bool  // open only what is pinned: create nothing, write nothing
}

// errNotPinned is a map that an open of existing pins found missing.
var errNotPinned = errors.New("not pinned (no pod has been added on this node yet, or its first ADD failed)")

// openMapSet opens the maps of names in dir, planning each against this
// layout; entries gives a map's capacity setting (0: the layout's). A pin
// that needs replacing without m.renew is an error wrapping m.errRenew. A
// directory that holds nothing yet gets its marker before its first map,
// so that pins are never without one: that needs m.exclusive, and is
// errRenewalNeeded otherwise.
func openMapSet(dir string, names []string, entries func(string) uint32, m openMode) (*mapSet, error) {
	mk, _, err := readMarker(dir)
	if err != nil {
		return nil, err
	}
	pinned, err := loadPins(dir, names)
	if err != nil {
		return nil, err
	}
	if mk.version == 0 && len(pinned) == 0 && !m.existing {
		if !m.exclusive {
			return nil, errRenewalNeeded
		}
		mk = marker{version: LayoutVersion}
		if err := writeMarker(dir, mk); err != nil {
			return nil, err
		}
	}
	from, err := pinnedVersion(dir, mk, len(pinned) > 0)
	if err != nil {
		closeMaps(pinned)
		return nil, err
	}
	plans := make(map[string]renewal, len(names))
	for _, name := range names {
		p, err := planRenewal(name, pinned[name], from, entries(name))
		if err != nil {
			closeMaps(pinned)
			return nil, fmt.Errorf("pin %s: %w", filepath.Join(dir, name), err)
		}
		if p == renewCreate && from < LayoutVersion && len(pinned) > 0 && !m.renew {
			// A map that the pins' earlier layout did not have: making
			// it is part of a take-over.
			closeMaps(pinned)
			return nil, fmt.Errorf("map %s: %w", filepath.Join(dir, name), m.errRenew)
		}
		if p == renewCreate && m.existing {
			closeMaps(pinned)
			return nil, fmt.Errorf("map %s: %w", filepath.Join(dir, name), errNotPinned)
		}
		if (p == renewCopy || p == renewFresh) && !m.renew {
			closeMaps(pinned)
			return nil, fmt.Errorf("pin %s: %w", filepath.Join(dir, name), m.errRenew)
		}
		plans[name] = p
	}
	s := &mapSet{dir: dir, maps: map[string]*ebpf.Map{}, from: from, marker: mk, fresh: map[string]bool{}}
	for _, name := range names {
		old := pinned[name]
		delete(pinned, name)
		m, err := s.open(name, plans[name], old, entries(name))
		if err != nil {
			closeMaps(pinned)
			closeMaps(s.maps)
			return nil, err
		}
		s.maps[name] = m
	}
	return s, nil
}

// open carries out one map's plan; old is its pin, which it closes unless
// it is reused (attached programs hold it while they need it).
func (s *mapSet) open(name string, p renewal, old *ebpf.Map, maxEntries uint32) (*ebpf.Map, error) {
	switch p {
	case renewReuse:
		return old, nil
	case renewCreate:
		s.fresh[name] = true
		return createPinnedMap(name, s.dir, maxEntries)
	}
	defer old.Close()
	m, err := newMap(name, maxEntries)
	if err != nil {
		return nil, err
	}
	if p == renewCopy {
		var rekey func([]byte) ([]byte, bool)
		if f := layouts[name].rekey; f != nil {
			rekey = func(k []byte) ([]byte, bool) { return f(s.from, k) }
		}
		if err := copyEntries(m, old, rekey); err != nil {
			m.Close()
			return nil, fmt.Errorf("copy the entries of pin %s: %w", filepath.Join(s.dir, name), err)
		}
	}
	s.renewed = append(s.renewed, name)
	return m, nil
}

// commit pins the renewed maps in place of the old pins.
func (s *mapSet) commit() error {
	for _, name := range s.renewed {
		if err := pinReplacing(s.maps[name], filepath.Join(s.dir, name)); err != nil {
			return err
		}
	}
	s.renewed = nil
	return nil
}

// layoutSpec is the object's spec of map name, unpinned, with maxEntries
// (when not 0) as its capacity: a copy, since concurrent loads share the
// object's spec.
func layoutSpec(name string, maxEntries uint32) (*ebpf.MapSpec, error) {
	cs, err := collectionSpec()
	if err != nil {
		return nil, err
	}
	liftMemlock()
	ms := cs.Maps[name].Copy()
	ms.Pinning = ebpf.PinNone
	if maxEntries != 0 {
		ms.MaxEntries = maxEntries
	}
	return ms, nil
}

// newMap creates an unpinned map of this layout named name.
func newMap(name string, maxEntries uint32) (*ebpf.Map, error) {
	ms, err := layoutSpec(name, maxEntries)
	if err != nil {
		return nil, err
	}
	m, err := ebpf.NewMap(ms)
	if err != nil {
		return nil, fmt.Errorf("create map %s: %w", name, err)
	}
	return m, nil
}

// copyEntries writes every entry of src into dst, whose key and value
// sizes are src's, under the key rekey gives (nil: the same key; false:
// the entry is dropped). A dst too small for them is an error (an LRU map
// evicts instead, which only its own datapath would do too).
func copyEntries(dst, src *ebpf.Map, rekey func([]byte) ([]byte, bool)) error {
	key := make([]byte, src.KeySize())
	to := func() ([]byte, bool) {
		if rekey == nil {
			return key, true
		}
		return rekey(key)
	}
	it := src.Iterate()
	n := 0
	if src.Type() == ebpf.PerCPUArray || src.Type() == ebpf.PerCPUHash || src.Type() == ebpf.LRUCPUHash {
		if src.ValueSize() != 8 {
			return fmt.Errorf("per-CPU values of %d bytes: only 8-byte counters are copied", src.ValueSize())
		}
		var vals []uint64
		for it.Next(key, &vals) {
			k, ok := to()
			if !ok {
				continue
			}
			if err := dst.Update(k, vals, ebpf.UpdateAny); err != nil {
				return fmt.Errorf("entry %d: %w", n, err)
			}
			n++
		}
		return it.Err()
	}
	val := make([]byte, src.ValueSize())
	for it.Next(key, val) {
		k, ok := to()
		if !ok {
			continue
		}
		if err := dst.Update(k, val, ebpf.UpdateAny); err != nil {
			return fmt.Errorf("entry %d: %w", n, err)
		}
		n++
	}
	return it.Err()
}

// randomGeneration starts a fresh identifier, so that conntrack entries
// left by an earlier identifier of the same name are re-checked rather
// than trusted.
func randomGeneration() uint32 {
	var b [4]byte
	_, _ = rand.Read(b[:])
	return binary.LittleEndian.Uint32(b[:])
}
