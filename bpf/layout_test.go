package bpf

import (
	"testing"

	"github.com/podfence/podfence/pkg/policy"
)

// The layout table used to check pins without parsing the object file must
// describe exactly the maps of the object file.
func TestLayoutMatchesObject(t *testing.T) {
	cs, err := collectionSpec()
	if err != nil {
		t.Fatal(err)
	}
	for name, ms := range cs.Maps {
		if ms.Name == ".rodata" || ms.Name == "" || name == ".rodata" {
			continue
		}
		want, ok := layouts[name]
		if !ok {
			t.Errorf("map %s of the object has no layout entry", name)
			continue
		}
		if ms.Type != want.typ || ms.KeySize != want.keySize || ms.ValueSize != want.valSize || ms.MaxEntries != want.maxEntries {
			t.Errorf("map %s: object says %s %d/%d/%d, layout table %s %d/%d/%d", name,
				ms.Type, ms.KeySize, ms.ValueSize, ms.MaxEntries, want.typ, want.keySize, want.valSize, want.maxEntries)
		}
	}
	for name := range layouts {
		if _, ok := cs.Maps[name]; !ok {
			t.Errorf("layout entry %s names no map of the object", name)
		}
	}
}

// The policy compiler refuses what the maps cannot hold, by limits that
// must agree with types.h and podfence.c: the ranges an entry holds itself,
// and room in every trie and in port_sets for a policy and the one it
// replaces (and the node's addresses, in the ingress tries).
func TestLimitsMatchCompiler(t *testing.T) {
	if n := len(podfencePolicyValue{}.Ranges); n != policy.InlinePortRanges {
		t.Errorf("struct policy_value holds %d ranges, policy.InlinePortRanges is %d", n, policy.InlinePortRanges)
	}
	if n := layouts[mapNodeAddrs].maxEntries + 2*policy.MaxEntries; n != trieCapacity {
		t.Errorf("node addresses and two policies of policy.MaxEntries make %d entries, a trie holds %d", n, trieCapacity)
	}
	cs, err := collectionSpec()
	if err != nil {
		t.Fatal(err)
	}
	if n := 2 * policy.MaxPortSets; n != int(cs.Maps[mapPortSets].MaxEntries) {
		t.Errorf("two policies of policy.MaxPortSets make %d sets, port_sets in podfence.c holds %d", n, cs.Maps[mapPortSets].MaxEntries)
	}
}
