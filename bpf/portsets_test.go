package bpf

import (
	"testing"

	"github.com/podfence/podfence/pkg/policy"
)

// TestPortSets checks how entries with more port ranges than they hold share
// port sets: one set per distinct list of ranges, whatever the number of
// prefixes naming it, and a set no entry names any more is deleted.
func TestPortSets(t *testing.T) {
	h := newHarness(t)
	three := []policy.PortRange{tcpPort(80), tcpPort(443), udpPort(53)}
	other := []policy.PortRange{tcpPort(22), tcpPort(80), tcpPort(8080)}
	steps := []struct {
		name string
		set  policy.Set
		want int // sets in port_sets afterwards
	}{
		{"two ranges stay in the entry", isolate(rules(rule("10.1.0.0/16", tcpPort(80), udpPort(53))), nil), 0},
		{"three prefixes, one list", isolate(rules(rule("10.1.0.0/16", three...), rule("10.2.0.0/16", three...), rule("fd01::/64", three...)), nil), 1},
		{"two lists", isolate(rules(rule("10.1.0.0/16", three...), rule("10.2.0.0/16", other...)), nil), 2},
		{"the first list goes", isolate(rules(rule("10.2.0.0/16", other...)), nil), 1},
		{"open again", policy.Set{Mode: policy.ModeStandard}, 0},
	}
	for _, s := range steps {
		h.apply(t, s.set)
		if n := len(setKeys(t, h)); n != s.want {
			t.Fatalf("%s: port_sets holds %d sets, want %d", s.name, n, s.want)
		}
	}

	// The shared set decides for every prefix naming it.
	h.apply(t, isolate(rules(rule("10.1.0.0/16", three...), rule("10.2.0.0/16", three...)), nil))
	for _, c := range []struct {
		peer string
		port uint16
		want uint32
	}{
		{"10.1.0.1", 443, VerdictAllow},
		{"10.2.0.1", 443, VerdictAllow},
		{"10.2.0.1", 22, VerdictDrop},
		{"10.3.0.1", 443, VerdictDrop},
	} {
		h.flushCT(t)
		if got := h.run(t, policy.Ingress, syn(tcp(c.peer, pod4, 40000, c.port)).Marshal()); got != c.want {
			t.Errorf("from %s to port %d: verdict %#x, want %#x", c.peer, c.port, got, c.want)
		}
	}
}

// TestPortSetKeyNamedByEntry: entries can outlive their set (a pin removal
// killed midway); a new set must not take such an entry's key, or the
// entry would allow the new set's ports until it is replaced.
func TestPortSetKeyNamedByEntry(t *testing.T) {
	h := newHarness(t)
	h.apply(t, isolate(rules(rule("10.1.0.0/16", tcpPort(80), tcpPort(443), udpPort(53))), nil))
	old := namedKeys(t, h)
	if len(old) != 1 {
		t.Fatalf("entries name port sets %v, want one", old)
	}
	for k := range old {
		if err := h.id.PortSets.Delete(k); err != nil {
			t.Fatal(err)
		}
	}
	h.apply(t, isolate(rules(rule("10.1.0.0/16", tcpPort(22), tcpPort(8080), udpPort(123))), nil))
	for k := range namedKeys(t, h) {
		if old[k] {
			t.Errorf("the new set took key %d, which the old entry named", k)
		}
	}
}

// namedKeys returns the port-set keys the entries of both sides name.
func namedKeys(t *testing.T, h *harness) map[uint32]bool {
	t.Helper()
	sets := &portSets{named: map[uint32]bool{}}
	for s := range h.id.Sides {
		e, err := h.id.Sides[s].entries()
		if err != nil {
			t.Fatal(err)
		}
		e.reserve(sets)
	}
	return sets.named
}

// setKeys returns the keys port_sets holds.
func setKeys(t *testing.T, h *harness) map[uint32]bool {
	t.Helper()
	sets, err := readEntries[uint32, podfencePortSet](h.id.PortSets)
	if err != nil {
		t.Fatal(err)
	}
	keys := map[uint32]bool{}
	for k := range sets {
		keys[k] = true
	}
	return keys
}
