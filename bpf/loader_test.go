package bpf

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/cilium/ebpf"

	"github.com/podfence/podfence/pkg/objinfo"
	"github.com/podfence/podfence/pkg/pinpath"
	"github.com/podfence/podfence/pkg/podid"
	"github.com/podfence/podfence/pkg/policy"
	"github.com/podfence/podfence/test/kernel"
)

func progID(t *testing.T, p *ebpf.Program) ebpf.ProgramID {
	t.Helper()
	id, err := objinfo.ProgramID(p)
	if err != nil {
		t.Fatal(err)
	}
	return id
}

func mapID(t *testing.T, m *ebpf.Map) ebpf.MapID {
	t.Helper()
	id, err := objinfo.MapID(m)
	if err != nil {
		t.Fatal(err)
	}
	return id
}

// openGlobal opens the global maps in a fresh pin root, closed at the end.
func openGlobal(t *testing.T) (string, *Global) {
	t.Helper()
	root := kernel.PinRoot(t)
	g, err := OpenGlobal(globalDir(root), GlobalOptions{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { g.Close() })
	return root, g
}

func TestOpenIdentifierReusesPins(t *testing.T) {
	root, g := openGlobal(t)

	first, err := OpenIdentifier(g, identDir(root, "web-7f65cc6544@default"), "web-7f65cc6544@default")
	if err != nil {
		t.Fatal(err)
	}
	defer first.Close()
	if err := first.ApplyPolicy(isolate(rules(rule("10.1.0.0/16", tcpPort(80))), nil)); err != nil {
		t.Fatal(err)
	}
	gen, _ := first.Generation()

	// A second replica (another process in production) gets the same
	// kernel objects, and the policy and generation the first one wrote.
	second, err := OpenIdentifier(g, identDir(root, "web-7f65cc6544@default"), "web-7f65cc6544@default")
	if err != nil {
		t.Fatal(err)
	}
	defer second.Close()
	if progID(t, first.Ingress) != progID(t, second.Ingress) || progID(t, first.Egress) != progID(t, second.Egress) {
		t.Error("second open loaded new programs instead of reusing the pinned ones")
	}
	if mapID(t, first.Sides[0].Policy[0][0]) != mapID(t, second.Sides[0].Policy[0][0]) || mapID(t, first.State) != mapID(t, second.State) {
		t.Error("second open created new maps instead of reusing the pinned ones")
	}
	if g2, _ := second.Generation(); g2 != gen {
		t.Errorf("generation %d after reopening, want %d", g2, gen)
	}

	// Global maps are shared by all identifiers.
	other, err := OpenIdentifier(g, identDir(root, "db-0@default"), "db-0@default")
	if err != nil {
		t.Fatal(err)
	}
	defer other.Close()
	if progID(t, other.Ingress) == progID(t, first.Ingress) {
		t.Error("two identifiers share a program")
	}
	g2, err := OpenGlobal(globalDir(root), GlobalOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer g2.Close()
	if mapID(t, g2.CTv4) != mapID(t, g.CTv4) {
		t.Error("reopening the global maps created a new conntrack map")
	}
}

func TestOpenIdentifierRepairsHalfPinned(t *testing.T) {
	root, g := openGlobal(t)
	id := podid.ID("web@default")
	first, err := OpenIdentifier(g, identDir(root, id), id)
	if err != nil {
		t.Fatal(err)
	}
	first.Close()
	// A plugin killed between pinning its two programs leaves one.
	if err := os.Remove(filepath.Join(pinpath.Root(root).Identifier(id), pinpath.ProgEgress)); err != nil {
		t.Fatal(err)
	}
	again, err := OpenIdentifier(g, identDir(root, id), id)
	if err != nil {
		t.Fatalf("open after a half-finished load: %v", err)
	}
	again.Close()
	for _, pin := range []string{pinpath.ProgIngress, pinpath.ProgEgress} {
		if _, err := os.Stat(filepath.Join(pinpath.Root(root).Identifier(id), pin)); err != nil {
			t.Errorf("pin %s missing after repair: %v", pin, err)
		}
	}

	// A RemoveIdentifier killed midway leaves some maps and no programs
	// (it removes the programs first).
	for _, pin := range []string{pinpath.ProgIngress, pinpath.ProgEgress, pinpath.MapPolInV4, pinpath.MapCounters} {
		if err := os.Remove(filepath.Join(pinpath.Root(root).Identifier(id), pin)); err != nil {
			t.Fatal(err)
		}
	}
	again, err = OpenIdentifier(g, identDir(root, id), id)
	if err != nil {
		t.Fatalf("open after a half-finished removal: %v", err)
	}
	defer again.Close()
	for _, pin := range []string{pinpath.ProgIngress, pinpath.ProgEgress, pinpath.MapPolInV4, pinpath.MapCounters} {
		if _, err := os.Stat(filepath.Join(pinpath.Root(root).Identifier(id), pin)); err != nil {
			t.Errorf("pin %s missing after repair: %v", pin, err)
		}
	}
}

func TestIncompatiblePinsAreRefused(t *testing.T) {
	root, g := openGlobal(t)
	id := podid.ID("web@default")
	dir := pinpath.Root(root).Identifier(id)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		t.Fatal(err)
	}

	// A map of another layout where the state map should be.
	wrong, err := ebpf.NewMap(&ebpf.MapSpec{Name: pinpath.MapState, Type: ebpf.Array, KeySize: 4, ValueSize: 16, MaxEntries: 1})
	if err != nil {
		t.Fatal(err)
	}
	defer wrong.Close()
	if err := wrong.Pin(filepath.Join(dir, pinpath.MapState)); err != nil {
		t.Fatal(err)
	}
	_, err = OpenIdentifier(g, identDir(root, id), id)
	if !errors.Is(err, ErrIncompatiblePin) {
		t.Fatalf("open with a foreign state map: got %v, want ErrIncompatiblePin", err)
	}
	if err := os.Remove(filepath.Join(dir, pinpath.MapState)); err != nil {
		t.Fatal(err)
	}

	// Programs of another identifier (other maps) pinned here.
	other, err := OpenIdentifier(g, identDir(root, "other@default"), "other@default")
	if err != nil {
		t.Fatal(err)
	}
	defer other.Close()
	if err := other.Ingress.Pin(filepath.Join(dir, pinpath.ProgIngress)); err != nil {
		t.Fatal(err)
	}
	if err := other.Egress.Pin(filepath.Join(dir, pinpath.ProgEgress)); err != nil {
		t.Fatal(err)
	}
	_, err = OpenIdentifier(g, identDir(root, id), id)
	if !errors.Is(err, ErrIncompatiblePin) {
		t.Fatalf("open with another identifier's programs: got %v, want ErrIncompatiblePin", err)
	}
	// Nothing was swapped: the foreign pins are still there as they were.
	p, err := ebpf.LoadPinnedProgram(filepath.Join(dir, pinpath.ProgIngress), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	if progID(t, p) != progID(t, other.Ingress) {
		t.Error("an incompatible program pin was replaced")
	}
}

func TestGlobalCreationRace(t *testing.T) {
	root := kernel.PinRoot(t)
	const n = 8
	ids := make([]ebpf.MapID, n)
	var wg sync.WaitGroup
	errs := make([]error, n)
	for i := 0; i < n; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			g, err := OpenGlobal(globalDir(root), GlobalOptions{})
			if err != nil {
				errs[i] = err
				return
			}
			defer g.Close()
			info, err := g.CTv4.Info()
			if err != nil {
				errs[i] = err
				return
			}
			ids[i], _ = info.ID()
		}()
	}
	wg.Wait()
	for i := range errs {
		if errs[i] != nil {
			t.Fatalf("opener %d: %v", i, errs[i])
		}
		if ids[i] != ids[0] {
			t.Fatalf("opener %d got conntrack map %d, opener 0 got %d", i, ids[i], ids[0])
		}
	}
}

func TestRemoveIdentifier(t *testing.T) {
	root, g := openGlobal(t)
	id, err := OpenIdentifier(g, identDir(root, "web@default"), "web@default")
	if err != nil {
		t.Fatal(err)
	}
	id.Close()
	if err := RemoveIdentifier(identDir(root, "web@default")); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(pinpath.Root(root).Identifier("web@default")); !os.IsNotExist(err) {
		t.Errorf("identifier directory still there: %v", err)
	}
	if err := RemoveIdentifier(identDir(root, "web@default")); err != nil {
		t.Errorf("second remove: %v", err)
	}
	if _, err := os.Stat(filepath.Join(pinpath.Root(root).Global(), pinpath.MapCTv4)); err != nil {
		t.Errorf("global maps must stay: %v", err)
	}
	// Identifiers are validated where their directory is made (the
	// membership lock's); no directory at all is refused here.
	if err := RemoveIdentifier(""); err == nil {
		t.Error("remove with no directory: no error")
	}
}

func TestApplyPolicyErrors(t *testing.T) {
	h := newHarness(t)
	r := rule("10.1.0.0/16")
	r.Ports = nil
	for i := uint16(0); i < 65; i++ {
		r.Ports = append(r.Ports, tcpPort(1000+2*i))
	}
	before, _ := h.id.Generation()
	err := h.id.ApplyPolicy(isolate(rules(r), nil))
	if !errors.Is(err, policy.ErrTooManyPortRanges) {
		t.Fatalf("65 port ranges on one prefix: got %v, want ErrTooManyPortRanges", err)
	}
	if after, _ := h.id.Generation(); after != before {
		t.Error("a refused policy bumped the generation")
	}
}

func TestApplyPolicyBumpsGenerationOnlyOnChange(t *testing.T) {
	h := newHarness(t)
	web80 := isolate(rules(rule("10.1.0.0/16", tcpPort(80))), nil)
	steps := []struct {
		set  policy.Set
		bump bool
	}{
		{web80, true},
		{web80, false}, // another replica's ADD: same policy
		{isolate(rules(rule("10.1.0.0/16", tcpPort(81))), nil), true},
		{isolate(rules(rule("10.1.0.0/16", tcpPort(81))), rules()), true}, // isolation only
		{isolate(rules(rule("10.1.0.0/16", tcpPort(81))), rules()), false},
	}
	for i, s := range steps {
		before, _ := h.id.Generation()
		h.apply(t, s.set)
		after, _ := h.id.Generation()
		if (after != before) != s.bump {
			t.Errorf("step %d: generation %d -> %d, want a bump: %v", i, before, after, s.bump)
		}
	}
}

// TestModeRecorded: the mode a policy was applied in is what Mode and
// InspectIdentifier read back, for a reapply that must keep it.
func TestModeRecorded(t *testing.T) {
	h := newHarness(t)
	for _, mode := range []policy.Mode{policy.ModeStrict, policy.ModeStandard, policy.ModeStrict} {
		set := isolate(rules(rule("10.1.0.0/16", tcpPort(80))), nil)
		set.Mode = mode
		h.apply(t, set)
		got, err := h.id.Mode()
		if err != nil || got != mode {
			t.Errorf("applied in %s: Mode %q, %v", mode, got, err)
		}
	}
}

// TestConntrackTableSize: the conntrack maps' capacity is a node setting;
// the programs use maps of that size, and pins of another size are refused
// with an error that names both sizes.
func TestConntrackTableSize(t *testing.T) {
	root := kernel.PinRoot(t)
	g, err := OpenGlobal(globalDir(root), GlobalOptions{CTv4Entries: 4096, CTv6Entries: 2048})
	if err != nil {
		t.Fatal(err)
	}
	defer g.Close()
	if g.CTv4.MaxEntries() != 4096 || g.CTv6.MaxEntries() != 2048 {
		t.Fatalf("maps of %d and %d entries, want 4096 and 2048", g.CTv4.MaxEntries(), g.CTv6.MaxEntries())
	}
	ident, err := OpenIdentifier(g, identDir(root, "web@default"), "web@default")
	if err != nil {
		t.Fatalf("programs with a resized conntrack map: %v", err)
	}
	ident.Close()

	_, err = OpenGlobal(globalDir(root), GlobalOptions{})
	if !errors.Is(err, ErrTableSize) || !errors.Is(err, ErrIncompatiblePin) {
		t.Fatalf("default size over pins of 4096: got %v, want ErrTableSize", err)
	}
	for _, want := range []string{"4096", "131072", "--ct-v4-entries"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not mention %s", err, want)
		}
	}
	if _, err := OpenGlobal(globalDir(root), GlobalOptions{CTv4Entries: 100}); err == nil {
		t.Error("a table of 100 entries was accepted")
	}
}
