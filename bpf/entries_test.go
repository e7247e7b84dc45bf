package bpf

import (
	"maps"
	"testing"

	"github.com/cilium/ebpf"

	"github.com/podfence/podfence/test/kernel"
)

// TestReadEntries reads maps of more entries than one batch holds, a hash
// map and an LPM trie, and compares with reading them entry by entry (which
// is also what a kernel without batch lookups for the type gets).
func TestReadEntries(t *testing.T) {
	kernel.RequireRoot(t)
	const n = 2*batchSize + 7
	for _, spec := range []*ebpf.MapSpec{
		{Type: ebpf.Hash, KeySize: 8, ValueSize: 4, MaxEntries: n},
		{Type: ebpf.LPMTrie, KeySize: 8, ValueSize: 4, MaxEntries: n, Flags: 1 /* BPF_F_NO_PREALLOC */},
	} {
		t.Run(spec.Type.String(), func(t *testing.T) {
			m, err := ebpf.NewMap(spec)
			if err != nil {
				t.Fatal(err)
			}
			defer m.Close()
			for i := range n {
				k := [8]byte{32, 0, 0, 0, 10, byte(i >> 16), byte(i >> 8), byte(i)} // a /32 for a trie
				if err := m.Put(k, uint32(i)); err != nil {
					t.Fatal(err)
				}
			}
			got, err := readEntries[[8]byte, uint32](m)
			if err != nil {
				t.Fatal(err)
			}
			want, err := iterateEntries[[8]byte, uint32](m)
			if err != nil {
				t.Fatal(err)
			}
			if len(got) != n || !maps.Equal(got, want) {
				t.Fatalf("readEntries returned %d entries, iteration %d (want %d), or they differ", len(got), len(want), n)
			}
		})
	}
}
