package localhook

import (
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"

	"github.com/podfence/podfence/pkg/objinfo"
	"github.com/podfence/podfence/test/kernel"
)

// passAll is a cgroup_skb program that lets every packet through.
func passAll(t *testing.T) *ebpf.Program {
	t.Helper()
	p, err := ebpf.NewProgram(&ebpf.ProgramSpec{
		Type:         ebpf.CGroupSKB,
		AttachType:   ebpf.AttachCGroupInetIngress,
		Instructions: asm.Instructions{asm.Mov.Imm(asm.R0, 1), asm.Return()},
		License:      "GPL",
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close() })
	return p
}

func programID(t *testing.T, p *ebpf.Program) ebpf.ProgramID {
	t.Helper()
	id, err := objinfo.ProgramID(p)
	if err != nil {
		t.Fatal(err)
	}
	return id
}

// TestHook: the hook attaches through a pinned link that outlives its
// maker; hooking again updates the program in place (never a moment with
// none), another cgroup moves it, Release detaches it, and both are
// idempotent.
func TestHook(t *testing.T) {
	kernel.RequireRoot(t)
	first, second := kernel.Cgroup(t), kernel.Cgroup(t)
	pin := filepath.Join(kernel.PinRoot(t), "link_local")
	a, b := passAll(t), passAll(t)

	// A link whose last pin goes is freed after an RCU grace period (bpffs
	// frees its inodes so), and detaches then: wait for it.
	attachedIs := func(cg string, want ...ebpf.ProgramID) {
		t.Helper()
		var got []ebpf.ProgramID
		for deadline := time.Now().Add(2 * time.Second); ; time.Sleep(10 * time.Millisecond) {
			var err error
			if got, err = Attached(cg); err != nil {
				t.Fatal(err)
			}
			if slices.Equal(got, want) || time.Now().After(deadline) {
				break
			}
		}
		if !slices.Equal(got, want) {
			t.Errorf("%s: attached %v, want %v", cg, got, want)
		}
	}
	if err := Hook(first, pin, a); err != nil {
		t.Fatal(err)
	}
	attachedIs(first, programID(t, a))
	if err := Hook(first, pin, b); err != nil {
		t.Fatal(err)
	}
	attachedIs(first, programID(t, b))
	if !Hooked(pin) {
		t.Error("no hook pinned")
	}

	if err := Hook(second, pin, a); err != nil {
		t.Fatal(err)
	}
	attachedIs(first)
	attachedIs(second, programID(t, a))

	for range 2 {
		if err := Release(pin); err != nil {
			t.Fatal(err)
		}
	}
	attachedIs(second)
	if Hooked(pin) {
		t.Error("a hook is still pinned after Release")
	}
}

// TestHookRefusesNonCgroup: a directory that is not a cgroup v2 one is
// refused with an error naming it, and nothing is pinned.
func TestHookRefusesNonCgroup(t *testing.T) {
	kernel.RequireRoot(t)
	pin := filepath.Join(kernel.PinRoot(t), "link_local")
	dir := t.TempDir()
	if err := Hook(dir, pin, passAll(t)); err == nil {
		t.Fatalf("Hook on %s: no error", dir)
	}
	if _, err := os.Stat(pin); !os.IsNotExist(err) {
		t.Errorf("pin %s after a refused hook: %v", pin, err)
	}
}
