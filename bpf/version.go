package bpf

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"

	"github.com/podfence/podfence/pkg/pinfs"
	"github.com/podfence/podfence/pkg/pinpath"
)

// LayoutVersion is the version of the pins' layout: which maps there are,
// their types, capacities, and the format and meaning of their entries.
// Each directory of maps (global, and each identifier's) records the
// version that made it (pinpath.Layout), so that a later build knows what
// it finds there. Bump it with any change to the layouts table, and record
// the new table: TestLayoutRecorded compares it with
// testdata/layout-v<N>.txt. A map whose entries change format or meaning
// also gets the new version as its since, which tells a later build that
// its entries cannot be copied from pins of an earlier layout; unless the
// take-over converts it in place, as layout 4 does with the state's
// padding byte (syncSides), which keeps since 1 so that the pin is reused.
const LayoutVersion = 6

// sidesLayout is the layout that gave the policy two sides (struct id_state).
const sidesLayout = 4

// ErrNewerLayout is wrapped when the pins were made by a build of a later
// layout than this one. podfence never downgrades pins: this build cannot
// know what the later layout's entries mean.
var ErrNewerLayout = errors.New("pins of a newer layout")

// firstLayout is what pins made before the layout was recorded are.
const firstLayout = 1

// marker is what a directory of maps records about the build that made
// its pins: the layout version and, for an identifier, the object whose
// programs are pinned there.
type marker struct {
	version uint32
	object  string // empty in the global directory
	// moving: the programs were replaced, and members may still run the
	// ones before (until pinroot.Hold.MoveMembers and MembersMoved).
	moving bool
	// slot, when hasSlot, is the identifier's slot (slots.go), which its
	// pinned programs were loaded with.
	slot    uint32
	hasSlot bool
}

// String is the marker's symlink target: "v1", "v1 object=9f86d081884c7d65",
// "v5 object=9f86d081884c7d65 slot=3 moving".
func (m marker) String() string {
	s := "v" + strconv.FormatUint(uint64(m.version), 10)
	if m.object != "" {
		s += " object=" + m.object
	}
	if m.hasSlot {
		s += " slot=" + strconv.FormatUint(uint64(m.slot), 10)
	}
	if m.moving {
		s += " moving"
	}
	return s
}

func parseMarker(s string) (marker, error) {
	fields := strings.Fields(s)
	if len(fields) == 0 || !strings.HasPrefix(fields[0], "v") {
		return marker{}, fmt.Errorf("layout marker %q: no version", s)
	}
	v, err := strconv.ParseUint(fields[0][1:], 10, 32)
	if err != nil || v == 0 {
		return marker{}, fmt.Errorf("layout marker %q: bad version", s)
	}
	m := marker{version: uint32(v)}
	for _, f := range fields[1:] {
		if obj, ok := strings.CutPrefix(f, "object="); ok {
			m.object = obj
		}
		if f == "moving" {
			m.moving = true
		}
		if v, ok := strings.CutPrefix(f, "slot="); ok {
			n, err := strconv.ParseUint(v, 10, 32)
			if err != nil || n >= MaxSlots {
				return marker{}, fmt.Errorf("layout marker %q: bad slot", s)
			}
			m.slot, m.hasSlot = uint32(n), true
		}
	}
	return m, nil
}

// readMarker reads dir's marker. A directory without one has none (ok
// false): new, or made before markers were written.
func readMarker(dir string) (m marker, ok bool, err error) {
	target, err := os.Readlink(filepath.Join(dir, pinpath.Layout))
	if errors.Is(err, os.ErrNotExist) {
		return marker{}, false, nil
	}
	if err != nil {
		return marker{}, false, fmt.Errorf("read layout marker in %s: %w", dir, err)
	}
	m, err = parseMarker(target)
	if err != nil {
		return marker{}, false, fmt.Errorf("%s: %w", dir, err)
	}
	return m, true, nil
}

// writeMarker replaces dir's marker through a rename, so that readers see
// the old one or the new one. Writers hold dir's lock exclusively (the
// identifier's, or the global directory's), so one temporary name does, and
// one left by a killed writer is replaced.
func writeMarker(dir string, m marker) error {
	if err := pinfs.WriteRecord(filepath.Join(dir, pinpath.Layout), m.String()); err != nil {
		return fmt.Errorf("write layout marker in %s: %w", dir, err)
	}
	return nil
}

// pinnedVersion is the layout of what dir holds: its marker's (m, version
// 0 when there is none), or for pins without one firstLayout, or this
// build's when it holds nothing yet.
// A later layout than this build's is refused (ErrNewerLayout), and so is
// an earlier one that this build cannot take over (ErrIncompatiblePin):
// both before anything changes.
func pinnedVersion(dir string, m marker, anyPinned bool) (uint32, error) {
	v := uint32(LayoutVersion)
	switch {
	case m.version != 0:
		v = m.version
	case anyPinned:
		v = firstLayout
	}
	if v > LayoutVersion {
		return 0, fmt.Errorf("%s: %w: they are layout %d and this build knows layouts up to %d; run a build of layout %d or later, or remove the pins once no pod uses them",
			dir, ErrNewerLayout, v, LayoutVersion, v)
	}
	if name, since, ok := unconvertible(v); ok {
		return 0, fmt.Errorf("%s: %w: they are layout %d, and the entries of %s changed meaning in layout %d, which this build (layout %d) cannot convert while pods use them; drain the node's pods (their pins go with the last one), or upgrade through a build that converts them",
			dir, ErrIncompatiblePin, v, name, since, LayoutVersion)
	}
	return v, nil
}

// unconvertible names a map whose entries changed meaning after layout
// from and that cannot start empty. Every directory of the node is at
// least that old, so this build cannot take any of the node's pins over:
// it refuses before the first change, not halfway.
func unconvertible(from uint32) (name string, since uint32, ok bool) {
	for _, n := range slices.Sorted(maps.Keys(layouts)) {
		if l := layouts[n]; l.since > from && l.carry != carryFresh {
			return n, l.since, true
		}
	}
	return "", 0, false
}

// ObjectID names this build's datapath object: the pinned programs of an
// identifier whose marker names another object are another build's.
func ObjectID() string { return objectID() }

var objectID = sync.OnceValue(func() string {
	sum := sha256.Sum256(_PodfenceBytes)
	return hex.EncodeToString(sum[:8])
})
