package objinfo

import (
	"fmt"
	"slices"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"

	"github.com/podfence/podfence/test/kernel"
)

// newMaps creates n small arrays named m0, m1, ...
func newMaps(t *testing.T, n int) []*ebpf.Map {
	t.Helper()
	var maps []*ebpf.Map
	for i := range n {
		m, err := ebpf.NewMap(&ebpf.MapSpec{Name: fmt.Sprintf("m%d", i), Type: ebpf.Array, KeySize: 4, ValueSize: 4, MaxEntries: 1})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { m.Close() })
		maps = append(maps, m)
	}
	return maps
}

// usingMaps loads a program that references every map in maps.
func usingMaps(t *testing.T, name string, maps []*ebpf.Map) *ebpf.Program {
	t.Helper()
	var insns asm.Instructions
	for _, m := range maps {
		insns = append(insns, asm.LoadMapPtr(asm.R1, m.FD()))
	}
	insns = append(insns, asm.Mov.Imm(asm.R0, 0), asm.Return())
	p, err := ebpf.NewProgram(&ebpf.ProgramSpec{Name: name, Type: ebpf.SchedCLS, License: "GPL", Instructions: insns})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close() })
	return p
}

// TestAgreesWithLibrary checks every fact against cilium/ebpf's full Info,
// for programs using no maps, a few, and more than the first read has room
// for.
func TestAgreesWithLibrary(t *testing.T) {
	kernel.RequireRoot(t)
	for _, n := range []int{0, 3, 40} {
		t.Run(fmt.Sprintf("%d-maps", n), func(t *testing.T) {
			maps := newMaps(t, n)
			p := usingMaps(t, "pf_objinfo_test", maps)

			got, err := ProgramOf(p)
			if err != nil {
				t.Fatal(err)
			}
			want, err := p.Info()
			if err != nil {
				t.Fatal(err)
			}
			wantID, _ := want.ID()
			wantMaps, _ := want.MapIDs()
			if got.ID != wantID || got.Type != want.Type || got.Name != want.Name {
				t.Errorf("ProgramOf = id %d, type %s, name %q; Info says %d, %s, %q", got.ID, got.Type, got.Name, wantID, want.Type, want.Name)
			}
			if !slices.Equal(got.MapIDs, wantMaps) || len(got.MapIDs) != n {
				t.Errorf("map IDs %v, Info says %v (%d maps)", got.MapIDs, wantMaps, n)
			}
			if id, err := ProgramID(p); err != nil || id != wantID {
				t.Errorf("ProgramID = %d, %v; want %d", id, err, wantID)
			}

			for i, m := range maps {
				info, err := m.Info()
				if err != nil {
					t.Fatal(err)
				}
				wantID, _ := info.ID()
				if id, err := MapID(m); err != nil || id != wantID {
					t.Errorf("MapID = %d, %v; want %d", id, err, wantID)
				}
				if name, err := MapName(wantID); err != nil || name != fmt.Sprintf("m%d", i) {
					t.Errorf("MapName(%d) = %q, %v; want m%d", wantID, name, err, i)
				}
			}
		})
	}
}

func TestClosedObjects(t *testing.T) {
	kernel.RequireRoot(t)
	m := newMaps(t, 1)[0]
	id, err := MapID(m)
	if err != nil {
		t.Fatal(err)
	}
	m.Close()
	if _, err := MapID(m); err == nil {
		t.Error("MapID of a closed map: no error")
	}
	if _, err := MapName(id); err == nil {
		t.Errorf("MapName of freed map %d: no error", id)
	}
}
