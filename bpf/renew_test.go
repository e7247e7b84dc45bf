package bpf

import (
	"embed"
	"errors"
	"flag"
	"fmt"
	"maps"
	"net/netip"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"

	"github.com/cilium/ebpf"

	"github.com/podfence/podfence/pkg/packet"
	"github.com/podfence/podfence/pkg/pinpath"
	"github.com/podfence/podfence/pkg/podid"
	"github.com/podfence/podfence/pkg/policy"
	"github.com/podfence/podfence/test/kernel"
)

// layoutRecords are embedded so that the test binary carries them into the
// kernel matrix's guests.
//
//go:embed testdata/layout-v*.txt
var layoutRecords embed.FS

var updateLayout = flag.Bool("update-layout", false, "rewrite testdata/layout-v<LayoutVersion>.txt from the layouts table")

// TestLayoutRecorded holds the layouts table to the record of its version:
// a change to a map's type, sizes, capacity or carry without a new
// LayoutVersion (and a record of it, with -update-layout) fails here, so
// that pins of two different layouts never carry the same version.
func TestLayoutRecorded(t *testing.T) {
	var b strings.Builder
	fmt.Fprintf(&b, "# podfence pin layout %d: map type key-size value-size max-entries carry since\n", LayoutVersion)
	for _, name := range slices.Sorted(maps.Keys(layouts)) {
		l := layouts[name]
		fmt.Fprintf(&b, "%s %s %d %d %d %s %d\n", name, l.typ, l.keySize, l.valSize, l.maxEntries, l.carry, l.since)
	}
	path := filepath.Join("testdata", fmt.Sprintf("layout-v%d.txt", LayoutVersion))
	if *updateLayout {
		if err := os.WriteFile(path, []byte(b.String()), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	want, err := layoutRecords.ReadFile(path)
	if *updateLayout {
		want, err = os.ReadFile(path)
	}
	if err != nil {
		t.Fatalf("%v: a new LayoutVersion needs its record (go test ./bpf -run TestLayoutRecorded -update-layout)", err)
	}
	if b.String() != string(want) {
		t.Errorf("the layouts table is not layout %d's as %s records it: bump LayoutVersion (and since, for maps whose entries changed), then record it with -update-layout\ngot:\n%s\nwant:\n%s",
			LayoutVersion, path, b.String(), want)
	}
}

func TestParseMarker(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want marker
		ok   bool
	}{
		{"v1", marker{version: 1}, true},
		{"v2 object=9f86d081884c7d65", marker{version: 2, object: "9f86d081884c7d65"}, true},
		{"v3 object=ab extra=1", marker{version: 3, object: "ab"}, true},
		{"v1 object=ab moving", marker{version: 1, object: "ab", moving: true}, true},
		{"", marker{}, false},
		{"v", marker{}, false},
		{"v0", marker{}, false},
		{"1", marker{}, false},
		{"vx object=ab", marker{}, false},
		{"v99999999999", marker{}, false},
	} {
		got, err := parseMarker(tc.in)
		if (err == nil) != tc.ok || got != tc.want {
			t.Errorf("parseMarker(%q) = %+v, %v; want %+v, ok %v", tc.in, got, err, tc.want, tc.ok)
		}
		if tc.ok && tc.in == tc.want.String() {
			if again, err := parseMarker(got.String()); err != nil || again != got {
				t.Errorf("%+v does not round-trip: %q", got, got.String())
			}
		}
	}
}

// mapLike creates an unpinned map of name's layout with some of it changed.
func mapLike(t *testing.T, name string, change func(*ebpf.MapSpec)) *ebpf.Map {
	t.Helper()
	cs, err := collectionSpec()
	if err != nil {
		t.Fatal(err)
	}
	ms := cs.Maps[name].Copy()
	ms.Pinning = ebpf.PinNone
	if change != nil {
		change(ms)
	}
	m, err := ebpf.NewMap(ms)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m.Close() })
	return m
}

func TestPlanRenewal(t *testing.T) {
	kernel.RequireRoot(t)
	capacity := func(n uint32) func(*ebpf.MapSpec) { return func(ms *ebpf.MapSpec) { ms.MaxEntries = n } }
	value := func(n uint32) func(*ebpf.MapSpec) { return func(ms *ebpf.MapSpec) { ms.ValueSize = n; ms.Value = nil } }
	for _, tc := range []struct {
		name    string
		pin     *ebpf.Map
		from    uint32
		want    renewal
		wantErr error
	}{
		{"nothing pinned", nil, 1, renewCreate, nil},
		{"this layout", mapLike(t, pinpath.MapPolInV4, nil), 1, renewReuse, nil},
		{"a trie of another capacity", mapLike(t, pinpath.MapPolInV4, capacity(trieCapacity/2)), 1, renewCopy, nil},
		{"a trie of another value", mapLike(t, pinpath.MapPolInV4, value(policyVSize+4)), 1, 0, ErrIncompatiblePin},
		{"entries changed meaning after the pin's layout", mapLike(t, pinpath.MapPolInV4, nil), 0, 0, ErrIncompatiblePin},
		{"an expendable map whose entries changed meaning", mapLike(t, pinpath.MapEventBudget, nil), 0, renewFresh, nil},
		{"conntrack of another capacity", mapLike(t, pinpath.MapCTv4, capacity(DefaultCTv4Entries/2)), 1, 0, ErrTableSize},
		{"an earlier event budget", mapLike(t, pinpath.MapEventBudget, value(16)), 1, renewFresh, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			name := pinpath.MapPolInV4
			if tc.pin != nil {
				info, err := tc.pin.Info()
				if err != nil {
					t.Fatal(err)
				}
				name = info.Name
			}
			got, err := planRenewal(name, tc.pin, tc.from, 0)
			if tc.wantErr != nil {
				if !errors.Is(err, tc.wantErr) {
					t.Fatalf("planRenewal: %v, want %v", err, tc.wantErr)
				}
				return
			}
			if err != nil || got != tc.want {
				t.Fatalf("planRenewal = %d, %v; want %d", got, err, tc.want)
			}
		})
	}
}

// TestUnconvertible: pins of a layout from which some map cannot be
// carried are refused as a whole, before anything changes.
func TestUnconvertible(t *testing.T) {
	if name, since, ok := unconvertible(LayoutVersion); ok {
		t.Errorf("this layout's own pins: %s (since %d) unconvertible", name, since)
	}
	name, since, ok := unconvertible(0)
	if !ok || layouts[name].carry == carryFresh || since != layouts[name].since {
		t.Errorf("unconvertible(0) = %s, %d, %v; want a map that cannot start empty", name, since, ok)
	}
	if _, err := pinnedVersion("dir", marker{}, true); err != nil {
		t.Errorf("pins without a marker (layout %d): %v", firstLayout, err)
	}
}

// pinEarlierBuild pins id's maps and programs as a build of the same layout
// version but half the trie capacity would, with set applied, and returns
// that identifier.
func pinEarlierBuild(t *testing.T, g *Global, root string, id podid.ID, set policy.Set) *Datapath {
	t.Helper()
	return pinBuild(t, g, root, id, set, marker{version: LayoutVersion, object: "an-earlier-build"},
		func(name string, ms *ebpf.MapSpec) bool {
			if ms.Type == ebpf.LPMTrie && ms.KeySize != tierKeySize {
				ms.MaxEntries = trieCapacity / 2
			}
			return true
		})
}

// pinLayout1 pins id as a build of layout 1 did: counters of 11 reasons per
// direction, and no sources map (its programs here get an unpinned one).
func pinLayout1(t *testing.T, g *Global, root string, id podid.ID, set policy.Set) *Datapath {
	t.Helper()
	return pinBuild(t, g, root, id, set, marker{version: 1, object: "a-layout-1-build"},
		func(name string, ms *ebpf.MapSpec) bool {
			switch name {
			case mapCounters:
				ms.MaxEntries = 2 * reasonsIn(1)
			case mapSources:
				return false
			}
			return true
		})
}

// pinLayout3 pins id as a build of layout 3 did, with set applied: one
// side of the policy (no _1 maps; its programs here get unpinned ones),
// the state's side-1 bits padding, and a generation of either parity.
func pinLayout3(t *testing.T, g *Global, root string, id podid.ID, set policy.Set, odd, stopped bool) *Datapath {
	t.Helper()
	side1 := map[string]bool{}
	for d := range sideMaps[1].policy {
		for _, name := range sideMaps[1].policy[d] {
			side1[name] = true
		}
	}
	side1[sideMaps[1].tiers] = true
	old := pinBuild(t, g, root, id, set, marker{version: 3, object: "a-layout-3-build"},
		func(name string, _ *ebpf.MapSpec) bool { return !side1[name] })
	var st podfenceIdState
	if err := old.State.Lookup(uint32(0), &st); err != nil {
		t.Fatal(err)
	}
	st.Enforced1, st.Applying = 0, 0
	if stopped {
		st.Applying = 1
	}
	st.Generation &^= 1
	if odd {
		st.Generation |= 1
	}
	if err := old.State.Update(uint32(0), &st, ebpf.UpdateExist); err != nil {
		t.Fatal(err)
	}
	return old
}

// pinBuild pins id's maps, shaped by shape (which says whether a map is
// pinned), and programs loaded against them, with set applied and mk as
// the directory's marker.
func pinBuild(t *testing.T, g *Global, root string, id podid.ID, set policy.Set, mk marker, shape func(string, *ebpf.MapSpec) bool) *Datapath {
	t.Helper()
	cs, err := loadableSpec()
	if err != nil {
		t.Fatal(err)
	}
	dir := pinpath.Root(root).Identifier(id)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	old := &Datapath{ID: id, Dir: dir, global: g}
	t.Cleanup(func() { old.Close() })
	fields := old.mapFields()
	repl := g.replacements()
	for _, name := range identifierMaps {
		ms := cs.Maps[name].Copy()
		ms.Pinning = ebpf.PinNone
		pin := shape(name, ms)
		cs.Maps[name] = ms
		m, err := ebpf.NewMap(ms)
		if err != nil {
			t.Fatal(err)
		}
		if pin {
			if err := m.Pin(filepath.Join(dir, name)); err != nil {
				t.Fatal(err)
			}
		}
		*fields[name] = m
		repl[name] = m
	}
	if err := old.State.Update(uint32(0), &podfenceIdState{Generation: randomGeneration()}, ebpf.UpdateAny); err != nil {
		t.Fatal(err)
	}
	for _, p := range []struct {
		out  **ebpf.Program
		name string
	}{{&old.Ingress, progIngress}, {&old.Egress, progEgress}} {
		if *p.out, err = loadProgram(cs, p.name, repl); err != nil {
			t.Fatal(err)
		}
	}
	if err := old.pinPrograms(); err != nil {
		t.Fatal(err)
	}
	if err := writeMarker(dir, mk); err != nil {
		t.Fatal(err)
	}
	if err := old.ApplyPolicy(set); err != nil {
		t.Fatal(err)
	}
	return old
}

// TestRenewIdentifier: an identifier whose tries have an earlier capacity
// and whose programs are another build's is refused by OpenIdentifier,
// untouched, and taken over by RenewIdentifier: new tries with the old
// entries, the state (and its generation) kept, this build's programs,
// which enforce the policy the old ones did.
func TestRenewIdentifier(t *testing.T) {
	root, g := openGlobal(t)
	id := podid.ID("web-7f65cc6544@default")
	set := isolate(rules(rule("10.1.0.0/16", tcpPort(80)), except(rule("10.2.0.0/16", tcpPort(443)), "10.2.3.0/24")), nil)
	old := pinEarlierBuild(t, g, root, id, set)
	oldGen, err := old.Generation()
	if err != nil {
		t.Fatal(err)
	}
	oldTrie, err := trieEntries(old.Sides[0].Policy[policy.Ingress][0])
	if err != nil {
		t.Fatal(err)
	}

	if _, err := OpenIdentifier(g, identDir(root, id), id); !errors.Is(err, ErrIncompatiblePin) {
		t.Fatalf("OpenIdentifier of an earlier build's pins: %v, want ErrIncompatiblePin", err)
	}
	if in, _, err := PinnedProgramIDs(identDir(root, id)); err != nil || in != progID(t, old.Ingress) {
		t.Fatalf("the refusal changed the program pins: %d, %v", in, err)
	}

	ident, rn, err := RenewIdentifier(g, identDir(root, id), id)
	if err != nil {
		t.Fatal(err)
	}
	defer ident.Close()
	wantMaps := []string{pinpath.MapPolInV4, pinpath.MapPolInV6, pinpath.MapPolEgV4, pinpath.MapPolEgV6,
		pinpath.MapPolInV4Side1, pinpath.MapPolInV6Side1, pinpath.MapPolEgV4Side1, pinpath.MapPolEgV6Side1}
	if rn.From != LayoutVersion || !rn.Programs || !slices.Equal(rn.Maps, wantMaps) {
		t.Errorf("renewal %+v, want from %d, programs, maps %v", rn, LayoutVersion, wantMaps)
	}
	if ident.Sides[0].Policy[policy.Ingress][0].MaxEntries() != trieCapacity {
		t.Errorf("renewed trie holds %d entries, want %d", ident.Sides[0].Policy[policy.Ingress][0].MaxEntries(), trieCapacity)
	}
	if got, err := trieEntries(ident.Sides[0].Policy[policy.Ingress][0]); err != nil || !maps.Equal(got, oldTrie) {
		t.Errorf("renewed trie has %v (%v), want the old entries %v", got, err, oldTrie)
	}
	if mapID(t, ident.State) != mapID(t, old.State) {
		t.Error("the state map, of this layout already, was replaced")
	}
	if gen, _ := ident.Generation(); gen != oldGen {
		t.Errorf("generation %d after the renewal, want %d: tracked flows would be re-checked", gen, oldGen)
	}
	if progID(t, ident.Ingress) == progID(t, old.Ingress) {
		t.Error("the earlier build's programs were kept")
	}
	want := marker{version: LayoutVersion, object: objectID(), moving: true}
	if ident.Slot >= 0 {
		want.slot, want.hasSlot = uint32(ident.Slot), true
	}
	if mk, ok, err := readMarker(ident.Dir); err != nil || !ok || mk != want {
		t.Errorf("marker %+v, %v, %v; want this build's, moving", mk, ok, err)
	}
	if !rn.MovePending {
		t.Error("programs replaced, but no move pending")
	}

	// The new programs enforce what the old ones did.
	h := &harness{root: root, g: g, id: ident}
	for _, tc := range []struct {
		src  string
		port uint16
		want uint32
	}{
		{"10.1.2.3", 80, VerdictAllow}, {"10.1.2.3", 81, VerdictDrop},
		{"10.2.9.9", 443, VerdictAllow}, {"10.2.3.4", 443, VerdictDrop}, {"10.9.0.1", 80, VerdictDrop},
	} {
		frame := syn(tcp(tc.src, "10.0.0.5", 40000, tc.port)).Marshal()
		if ret, reason := h.runReason(t, policy.Ingress, frame); ret != tc.want {
			t.Errorf("%s -> :%d: %#x (%s), want %#x", tc.src, tc.port, ret, reason, tc.want)
		}
	}

	// Until the members are said to be moved, a renewal keeps the
	// programs and says the move is pending; after, nothing is.
	for _, moved := range []bool{false, true} {
		if moved {
			if err := ident.MembersMoved(); err != nil {
				t.Fatal(err)
			}
		}
		again, rn, err := RenewIdentifier(g, identDir(root, id), id)
		if err != nil {
			t.Fatal(err)
		}
		if rn.Programs || len(rn.Maps) != 0 || progID(t, again.Ingress) != progID(t, ident.Ingress) || rn.MovePending == moved {
			t.Errorf("renewal again (members moved: %v): %+v, want nothing changed and a move pending %v", moved, rn, !moved)
		}
		again.Close()
	}
}

// TestOpenGlobalRenewsExpendableMaps: the deny-event budget of the build
// before the dropped-event count (16-byte values) is replaced by an empty
// one of this layout; the conntrack maps, which live flows need, stay.
func TestOpenGlobalRenewsExpendableMaps(t *testing.T) {
	kernel.RequireRoot(t)
	root := kernel.PinRoot(t)
	first, err := OpenGlobal(globalDir(root), GlobalOptions{})
	if err != nil {
		t.Fatal(err)
	}
	ct := mapID(t, first.CTv4)
	first.Close()
	dir := pinpath.Root(root).Global()
	if err := os.Remove(filepath.Join(dir, pinpath.MapEventBudget)); err != nil {
		t.Fatal(err)
	}
	if err := os.Remove(filepath.Join(dir, pinpath.Layout)); err != nil {
		t.Fatal(err)
	}
	earlier := mapLike(t, pinpath.MapEventBudget, func(ms *ebpf.MapSpec) { ms.ValueSize = 16; ms.Value = nil })
	if err := earlier.Pin(filepath.Join(dir, pinpath.MapEventBudget)); err != nil {
		t.Fatal(err)
	}

	// An inspection open takes nothing over and writes nothing.
	if _, err := OpenGlobal(globalDir(root), GlobalOptions{KeepLayout: true}); !errors.Is(err, ErrIncompatiblePin) {
		t.Errorf("KeepLayout open of an earlier event budget: %v, want ErrIncompatiblePin", err)
	}
	if _, ok, _ := readMarker(dir); ok {
		t.Error("the KeepLayout open wrote a marker")
	}
	if m, err := ebpf.LoadPinnedMap(filepath.Join(dir, pinpath.MapEventBudget), nil); err != nil || m.ValueSize() != 16 {
		t.Errorf("the KeepLayout open changed the event budget pin: %v", err)
	} else {
		m.Close()
	}

	g, err := OpenGlobal(globalDir(root), GlobalOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer g.Close()
	if g.EventBudget.ValueSize() != layouts[pinpath.MapEventBudget].valSize || !slices.Equal(g.Renewal.Maps, []string{pinpath.MapEventBudget}) {
		t.Errorf("event budget of %d-byte values, renewal %+v; want this layout's, renewed", g.EventBudget.ValueSize(), g.Renewal)
	}
	if mapID(t, g.CTv4) != ct {
		t.Error("the conntrack map was replaced")
	}
	if mk, ok, err := readMarker(dir); err != nil || !ok || mk.version != LayoutVersion {
		t.Errorf("global marker %+v, %v, %v; want layout %d", mk, ok, err, LayoutVersion)
	}
}

// TestKeepLayoutCreatesNothing: an inspection open of a node without maps
// is an error, and leaves it without.
func TestKeepLayoutCreatesNothing(t *testing.T) {
	kernel.RequireRoot(t)
	root := kernel.PinRoot(t)
	if _, err := OpenGlobal(globalDir(root), GlobalOptions{KeepLayout: true}); !errors.Is(err, errNotPinned) {
		t.Fatalf("KeepLayout open of an empty pin root: %v, want errNotPinned", err)
	}
	if entries, _ := os.ReadDir(pinpath.Root(root).Global()); len(entries) != 0 {
		t.Errorf("the KeepLayout open left %d entries in the global directory", len(entries))
	}
}

// TestNewerLayoutRefused: pins that a later layout marked are refused,
// globally and per identifier, and nothing is created beside them.
func TestNewerLayoutRefused(t *testing.T) {
	root, g := openGlobal(t)
	newer := marker{version: LayoutVersion + 1, object: "a-later-build"}
	id := podid.ID("db-0@default")
	dir := pinpath.Root(root).Identifier(id)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := writeMarker(dir, newer); err != nil {
		t.Fatal(err)
	}
	if _, _, err := RenewIdentifier(g, identDir(root, id), id); !errors.Is(err, ErrNewerLayout) {
		t.Errorf("renew an identifier of layout %d: %v, want ErrNewerLayout", newer.version, err)
	}
	if entries, _ := os.ReadDir(dir); len(entries) != 1 {
		t.Errorf("the refused identifier's directory holds %d entries, want only its marker", len(entries))
	}

	if err := writeMarker(pinpath.Root(root).Global(), newer); err != nil {
		t.Fatal(err)
	}
	_, err := OpenGlobal(globalDir(root), GlobalOptions{})
	if !errors.Is(err, ErrNewerLayout) || !strings.Contains(err.Error(), fmt.Sprintf("layout %d", newer.version)) {
		t.Errorf("open global pins of layout %d: %v, want ErrNewerLayout naming it", newer.version, err)
	}
}

// TestRenewLayout1: an identifier of layout 1 gets a sources map, empty
// until its members' entries are written, and its counters keep their
// direction and reason though the directions' blocks grew by one reason.
func TestRenewLayout1(t *testing.T) {
	root, g := openGlobal(t)
	id := podid.ID("web-7f65cc6544@default")
	old := pinLayout1(t, g, root, id, isolate(rules(rule("10.1.0.0/16")), nil))
	// Counter i of layout 1 holds i+1 on the first CPU.
	ncpu, err := ebpf.PossibleCPU()
	if err != nil {
		t.Fatal(err)
	}
	for i := range 2 * reasonsIn(1) {
		vals := make([]uint64, ncpu)
		vals[0] = uint64(i + 1)
		if err := old.Counters.Update(i, vals, ebpf.UpdateAny); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := os.Stat(filepath.Join(old.Dir, pinpath.MapSources)); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("layout 1 pins hold a sources map: %v", err)
	}

	ident, rn, err := RenewIdentifier(g, identDir(root, id), id)
	if err != nil {
		t.Fatal(err)
	}
	defer ident.Close()
	if rn.From != 1 || !rn.Programs || !slices.Contains(rn.Maps, mapCounters) || !rn.MovePending {
		t.Errorf("renewal %+v, want from 1, programs and counters replaced, a move pending", rn)
	}
	c, err := ident.ReadCounters()
	if err != nil {
		t.Fatal(err)
	}
	for d := range 2 {
		for r := range NumReasons {
			want := uint64(0) // spoofed and the tiers' reasons are new
			if r < Reason(reasonsIn(1)) {
				want = uint64(d)*uint64(reasonsIn(1)) + uint64(r) + 1
			}
			if c[d][r] != want {
				t.Errorf("counter %s of direction %d: %d, want %d", r, d, c[d][r], want)
			}
		}
	}
	if src, err := ident.ReadSources(); err != nil || len(src) != 0 {
		t.Errorf("sources after the take-over: %v, %v; want an empty map", src, err)
	}
	if _, err := os.Stat(filepath.Join(ident.Dir, pinpath.MapSources)); err != nil {
		t.Errorf("sources map not pinned: %v", err)
	}
}

// TestRenewLayout3: a take-over of layout 3, which had one side of the
// policy, copies it with its enforced bits into side 1 before this build's
// programs run, so that they enforce it whatever the generation's parity,
// and keeps the generation, so that tracked flows are not re-checked;
// unless layout 3 had a change stopped, which owed a bump.
func TestRenewLayout3(t *testing.T) {
	for _, c := range []struct{ odd, stopped bool }{{false, false}, {true, false}, {true, true}} {
		odd := c.odd
		t.Run(fmt.Sprintf("odd generation %v, change stopped %v", odd, c.stopped), func(t *testing.T) {
			root, g := openGlobal(t)
			id := podid.ID("web-7f65cc6544@default")
			set := isolate(rules(rule("10.1.0.0/16", tcpPort(80))), nil)
			set.Cluster.Admin[policy.Ingress] = policy.TierRules{{CIDR: netip.MustParsePrefix("10.1.9.0/24"), Action: policy.ActionDeny,
				Ports: []policy.PortRange{tcpPort(80)}}}
			old := pinLayout3(t, g, root, id, set, odd, c.stopped)
			oldGen, err := old.Generation()
			if err != nil {
				t.Fatal(err)
			}
			side0, err := old.Sides[0].entries()
			if err != nil {
				t.Fatal(err)
			}
			// An inspection says to upgrade, not that nothing is pinned,
			// and an open that does not renew refuses rather than making
			// side 1 beside the earlier build's programs.
			if _, err := OpenExistingIdentifier(g, identDir(root, id), id); !errors.Is(err, ErrIncompatiblePin) {
				t.Errorf("inspecting layout 3 pins: %v, want ErrIncompatiblePin", err)
			}
			if _, err := OpenIdentifier(g, identDir(root, id), id); !errors.Is(err, ErrIncompatiblePin) {
				t.Errorf("OpenIdentifier of layout 3 pins: %v, want ErrIncompatiblePin", err)
			}
			if _, err := os.Stat(filepath.Join(identDir(root, id), pinpath.MapTiersSide1)); !errors.Is(err, os.ErrNotExist) {
				t.Errorf("a refused open made side 1 (%v)", err)
			}
			// ls reads the layout's one side whatever the generation.
			if info, err := InspectIdentifier(identDir(root, id), id); err != nil || !info.Isolated[policy.Ingress] || !info.Admin[policy.Ingress] {
				t.Errorf("inspecting layout 3 pins: isolated %v, admin %v (%v); want ingress both", info.Isolated, info.Admin, err)
			}

			ident, rn, err := RenewIdentifier(g, identDir(root, id), id)
			if err != nil {
				t.Fatal(err)
			}
			defer ident.Close()
			if rn.From != 3 || !rn.Programs {
				t.Errorf("renewal %+v, want from 3, programs replaced", rn)
			}
			h := &harness{root: root, g: g, id: ident}
			st := h.state(t)
			wantGen := oldGen
			if c.stopped {
				wantGen++
			}
			// Flagged: the first change waits for the earlier build's
			// programs before it writes a side.
			if st.Generation != wantGen || st.Enforced1 != st.Enforced || st.Enforced == 0 || st.Applying == 0 {
				t.Errorf("state after the take-over %+v, want generation %d, the flag, and side 1's bits those of side 0", st, wantGen)
			}
			side1, err := ident.Sides[1].entries()
			if err != nil {
				t.Fatal(err)
			}
			if !reflect.DeepEqual(side1, side0) {
				t.Error("side 1 after the take-over differs from side 0")
			}
			for _, tc := range []struct {
				src  string
				want uint32
			}{{"10.1.2.3", VerdictAllow}, {"10.1.9.9", VerdictDrop}, {"10.9.0.1", VerdictDrop}} {
				frame := syn(tcp(tc.src, "10.0.0.5", 40000, 80)).Marshal()
				if ret, reason := h.runReason(t, policy.Ingress, frame); ret != tc.want {
					t.Errorf("%s -> :80: %#x (%s), want %#x", tc.src, ret, reason, tc.want)
				}
			}
		})
	}
}

// TestUnmovedMemberKeepsRevocations: a member that a take-over of layout
// 3 could not move runs that build's programs, which read side 0 alone
// whatever the generation. A change made meanwhile must still cut, on that
// member, the flows it revokes: a flow judged by side 0's old entries after
// the switch (the generation even before it, so side 0 is levelled last)
// is checked again once side 0 holds the new policy.
func TestUnmovedMemberKeepsRevocations(t *testing.T) {
	root, g := openGlobal(t)
	id := podid.ID("web-7f65cc6544@default")
	both := isolate(rules(rule("10.1.0.0/16", tcpPort(80)), rule("10.3.0.0/16", tcpPort(80))), nil)
	pinLayout3(t, g, root, id, both, false, false)
	ident, rn, err := RenewIdentifier(g, identDir(root, id), id)
	if err != nil {
		t.Fatal(err)
	}
	defer ident.Close()
	if !rn.MovePending {
		t.Fatalf("renewal %+v: no move pending", rn)
	}
	// The member's programs: the last layout-3 build's, on the maps the
	// take-over kept.
	cs := earlierSpec(t, beforeSides)
	repl := map[string]*ebpf.Map{}
	for name, m := range g.replacements() {
		if _, ok := cs.Maps[name]; ok {
			repl[name] = m
		}
	}
	for name, m := range ident.mapFields() {
		// Counters it keeps its own: the take-over copied them into a
		// map of this layout's size.
		if ms, ok := cs.Maps[name]; ok && ms.MaxEntries == (*m).MaxEntries() {
			repl[name] = *m
		}
	}
	coll, err := ebpf.NewCollectionWithOptions(cs, ebpf.CollectionOptions{MapReplacements: repl})
	if err != nil {
		t.Fatal(err)
	}
	defer coll.Close()
	unmoved := coll.Programs[progIngress]
	run := func(p packet.Packet) uint32 {
		t.Helper()
		ret, err := unmoved.Run(&ebpf.RunOptions{Data: p.Marshal()})
		if err != nil {
			t.Fatal(err)
		}
		return ret
	}
	revoked, kept := tcp("10.1.2.3", pod4, 40000, 80), tcp("10.3.2.3", pod4, 40001, 80)
	for _, p := range []packet.Packet{revoked, kept} {
		if ret := run(syn(p)); ret != VerdictAllow {
			t.Fatalf("opening %s on the unmoved member: %#x", p.Src, ret)
		}
	}

	judgedAtSwitch := uint32(0)
	t.Cleanup(func() { testStop = nil })
	testStop = func(step string) error {
		if step == "switched" {
			judgedAtSwitch = run(revoked)
		}
		return nil
	}
	if err := ident.ApplyPolicy(isolate(rules(rule("10.3.0.0/16", tcpPort(80))), nil)); err != nil {
		t.Fatal(err)
	}
	testStop = nil
	if judgedAtSwitch != VerdictAllow {
		t.Fatalf("at the switch the unmoved member judged by side 0's new entries already (%#x): the case tests nothing", judgedAtSwitch)
	}
	if ret := run(revoked); ret != VerdictDrop {
		t.Errorf("the revoked flow on the unmoved member after the change: %#x, want it dropped", ret)
	}
	if ret := run(kept); ret != VerdictAllow {
		t.Errorf("the flow still allowed on the unmoved member after the change: %#x", ret)
	}
}

// TestOpenExistingIdentifier: the inspect-only open creates nothing where
// nothing is pinned, nor loads programs where only the maps are (a first
// ADD killed before its programs were pinned), and opens what an ADD left
// as it is.
func TestOpenExistingIdentifier(t *testing.T) {
	root, g := openGlobal(t)
	id := podid.ID("web-7f65cc6544@default")
	dir := pinpath.Root(root).Identifier(id)
	if _, err := OpenExistingIdentifier(g, identDir(root, id), id); !errors.Is(err, errNotPinned) {
		t.Fatalf("open an identifier nothing pinned: %v, want errNotPinned", err)
	}
	if _, err := os.Stat(dir); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("the open made %s (%v)", dir, err)
	}

	added, err := OpenIdentifier(g, identDir(root, id), id)
	if err != nil {
		t.Fatal(err)
	}
	defer added.Close()
	progID := func(p *ebpf.Program) ebpf.ProgramID {
		t.Helper()
		info, err := p.Info()
		if err != nil {
			t.Fatal(err)
		}
		id, _ := info.ID()
		return id
	}
	names := func() []string {
		t.Helper()
		entries, err := os.ReadDir(dir)
		if err != nil {
			t.Fatal(err)
		}
		var out []string
		for _, e := range entries {
			out = append(out, e.Name())
		}
		return out
	}
	pins := names()
	got, err := OpenExistingIdentifier(g, identDir(root, id), id)
	if err != nil {
		t.Fatal(err)
	}
	if progID(got.Ingress) != progID(added.Ingress) || progID(got.Egress) != progID(added.Egress) {
		t.Error("the open did not return the pinned programs")
	}
	got.Close()

	if err := os.Remove(filepath.Join(dir, pinpath.ProgEgress)); err != nil {
		t.Fatal(err)
	}
	if _, err := OpenExistingIdentifier(g, identDir(root, id), id); !errors.Is(err, errNotPinned) {
		t.Errorf("open with a program pin missing: %v, want errNotPinned", err)
	}
	if after := names(); len(after) != len(pins)-1 {
		t.Errorf("pins %v after the open, want %v without %s", after, pins, pinpath.ProgEgress)
	}
}
