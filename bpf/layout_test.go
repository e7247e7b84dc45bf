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

// The policy compiler counts port sets by the ranges an entry holds itself,
// which types.h sets.
func TestInlineRangesMatchCompiler(t *testing.T) {
	if n := len(podfencePolicyValue{}.Ranges); n != policy.InlinePortRanges {
		t.Errorf("struct policy_value holds %d ranges, policy.InlinePortRanges is %d", n, policy.InlinePortRanges)
	}
}
