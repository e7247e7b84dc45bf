package bpf

import (
	"errors"
	"os"
	"path/filepath"
	"testing"

	"github.com/cilium/ebpf"

	"github.com/podfence/podfence/pkg/objinfo"
	"github.com/podfence/podfence/pkg/podid"
	"github.com/podfence/podfence/test/kernel"
)

// TestSlots: each identifier gets a slot of its own, recorded in its
// marker and kept across opens; its judge and ingress program sit at the
// slot in the judges map; releasing it empties them and frees the slot for
// the next identifier; a slot whose identifier directory is gone is freed
// by SweepSlots.
func TestSlots(t *testing.T) {
	requireAfterNAT(t)
	root, g := openGlobal(t)
	open := func(id podid.ID) *Datapath {
		t.Helper()
		d, err := OpenIdentifier(g, identDir(root, id), id)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { d.Close() })
		return d
	}
	installed := func(slot int) (judge, ingress bool) {
		t.Helper()
		var id uint32
		judge = g.Judges.Lookup(uint32(2*slot), &id) == nil
		ingress = g.Judges.Lookup(uint32(2*slot+1), &id) == nil
		return
	}
	a, b := open("a@default"), open("b@default")
	if a.Slot != 0 || b.Slot != 1 {
		t.Fatalf("slots %d and %d, want 0 and 1", a.Slot, b.Slot)
	}
	for _, d := range []*Datapath{a, b} {
		if j, i := installed(d.Slot); !j || !i {
			t.Errorf("%s: judge %v, ingress %v installed at slot %d", d.ID, j, i, d.Slot)
		}
		if mk, ok, err := readMarker(d.Dir); err != nil || !ok || !mk.hasSlot || mk.slot != uint32(d.Slot) {
			t.Errorf("%s: marker %+v, %v, %v", d.ID, mk, ok, err)
		}
	}
	if again := open("a@default"); again.Slot != a.Slot {
		t.Errorf("reopened a has slot %d, want %d", again.Slot, a.Slot)
	}

	if err := ReleaseSlot(globalDir(root), a.Dir); err != nil {
		t.Fatal(err)
	}
	if err := ReleaseSlot(globalDir(root), a.Dir); err != nil {
		t.Fatalf("second release: %v", err)
	}
	if j, i := installed(0); j || i {
		t.Errorf("released slot 0 still holds judge %v, ingress %v", j, i)
	}
	if err := RemoveIdentifier(a.Dir); err != nil {
		t.Fatal(err)
	}
	if c := open("c@default"); c.Slot != 0 {
		t.Errorf("c has slot %d, want the freed 0", c.Slot)
	}

	// b's directory goes without a release (a build before slots, a
	// removal killed midway): the sweep frees it.
	if err := os.RemoveAll(b.Dir); err != nil {
		t.Fatal(err)
	}
	n, err := g.SweepSlots()
	if err != nil || n != 1 {
		t.Fatalf("SweepSlots freed %d (%v), want 1", n, err)
	}
	if j, i := installed(1); j || i {
		t.Errorf("swept slot 1 still holds judge %v, ingress %v", j, i)
	}
	if _, err := os.Lstat(filepath.Join(g.slotsDir(), "1")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("slot 1's reservation: %v", err)
	}
	if n, err := g.SweepSlots(); err != nil || n != 0 {
		t.Errorf("a second sweep freed %d (%v)", n, err)
	}
}

// TestJudgeLoads: where the kernel has the conntrack kfuncs, an
// identifier's programs load with its judge and a slot, and a second open
// reuses them (no nftables needed: the kernel guests run it).
func TestJudgeLoads(t *testing.T) {
	kernel.RequireRoot(t)
	if !AfterNATSupported() {
		t.Skip("no conntrack kfuncs here")
	}
	root, g := openGlobal(t)
	d, err := OpenIdentifier(g, identDir(root, "a@default"), "a@default")
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	if d.AfterNAT == nil || d.Local == nil || d.Slot < 0 {
		t.Fatalf("no judge (slot %d, local judge %v): %v", d.Slot, d.Local != nil, JudgeRefused())
	}
	// Both installed at the slot.
	var id uint32
	if err := g.LocalJudges.Lookup(uint32(d.Slot), &id); err != nil {
		t.Fatalf("local_judges[%d]: %v", d.Slot, err)
	}
	// The node's programs that hand stamped packets to the judges.
	for name, load := range map[string]func(*Global) (*ebpf.Program, error){"uplink_after_nat": LoadUplink, "local_after_nat": LoadLocal} {
		p, err := load(g)
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		p.Close()
	}
	// A second open reuses the pinned programs, the local judge with them.
	again, err := OpenIdentifier(g, identDir(root, "a@default"), "a@default")
	if err != nil {
		t.Fatal(err)
	}
	defer again.Close()
	for _, p := range []struct {
		what      string
		first, re *ebpf.Program
	}{{"judge", d.AfterNAT, again.AfterNAT}, {"local judge", d.Local, again.Local}} {
		if p.re == nil {
			t.Fatalf("the second open has no %s", p.what)
		}
		a, _ := objinfo.ProgramID(p.first)
		b, _ := objinfo.ProgramID(p.re)
		if a != b {
			t.Errorf("the second open loaded the %s again (%d, then %d)", p.what, a, b)
		}
	}
}
