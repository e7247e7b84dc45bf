package bpf

import (
	"bufio"
	"os"
	"strconv"
	"strings"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
)

// TestMapCallsAreDirect keeps bpf/calls.h's promise: every map call in the
// verified programs goes to the map's own function, none to the generic
// helper that clang's sharing of a call between maps would leave (an
// indirect call through the map's ops, and no inlining). A program that
// regresses costs a deny about 10 ns more.
func TestMapCallsAreDirect(t *testing.T) {
	h := newHarness(t)
	sym := kernelSymbols(t, "__bpf_call_base", "bpf_map_lookup_elem", "bpf_map_update_elem",
		"bpf_map_delete_elem", "trie_lookup_elem")
	generic := map[uint64]string{
		sym["bpf_map_lookup_elem"]: "bpf_map_lookup_elem",
		sym["bpf_map_update_elem"]: "bpf_map_update_elem",
		sym["bpf_map_delete_elem"]: "bpf_map_delete_elem",
	}
	for name, p := range map[string]*ebpf.Program{"ingress": h.id.Ingress, "egress": h.id.Egress} {
		insns := translated(t, p)
		tries := 0
		for i, ins := range insns {
			if !ins.IsBuiltinCall() {
				continue
			}
			target := sym["__bpf_call_base"] + uint64(int64(int32(ins.Constant)))
			if helper, ok := generic[target]; ok {
				t.Errorf("%s: instruction %d calls the generic %s: a call shared between maps", name, i, helper)
			}
			if target == sym["trie_lookup_elem"] {
				tries++
			}
		}
		// Each of the four policy tries, and the tiers trie, of both
		// sides has a call of its own; without them the test would
		// check nothing.
		if tries != 10 {
			t.Errorf("%s: %d direct calls of trie_lookup_elem, want 10 (one per policy trie and one for the tiers, on each side)", name, tries)
		}
	}
}

// translated returns the program as the verifier left it.
func translated(t *testing.T, p *ebpf.Program) asm.Instructions {
	t.Helper()
	info, err := p.Info()
	if err != nil {
		t.Fatal(err)
	}
	insns, err := info.Instructions()
	if err != nil {
		t.Fatal(err)
	}
	return insns
}

// kernelSymbols reads the addresses of names from /proc/kallsyms; it skips
// the test where they are hidden (kptr_restrict) or missing.
func kernelSymbols(t *testing.T, names ...string) map[string]uint64 {
	t.Helper()
	f, err := os.Open("/proc/kallsyms")
	if err != nil {
		t.Skipf("kernel symbols: %v", err)
	}
	defer f.Close()
	want := make(map[string]bool, len(names))
	for _, n := range names {
		want[n] = true
	}
	out := make(map[string]uint64, len(names))
	s := bufio.NewScanner(f)
	for s.Scan() {
		fields := strings.Fields(s.Text())
		if len(fields) < 3 || !want[fields[2]] {
			continue
		}
		if _, seen := out[fields[2]]; seen {
			continue
		}
		addr, err := strconv.ParseUint(fields[0], 16, 64)
		if err == nil && addr != 0 {
			out[fields[2]] = addr
		}
	}
	if err := s.Err(); err != nil {
		t.Fatal(err)
	}
	for _, n := range names {
		if out[n] == 0 {
			t.Skipf("kernel symbol %s not readable in /proc/kallsyms", n)
		}
	}
	return out
}
