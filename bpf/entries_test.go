package bpf

import (
	"errors"
	"fmt"
	"maps"
	"testing"

	"github.com/cilium/ebpf"

	"github.com/podfence/podfence/test/kernel"
)

// TestReadEntries reads maps of more entries than one batch holds, a hash
// map and an LPM trie (also of exactly one first batch, and one more), and
// compares with reading them entry by entry (which is also what a kernel
// without batch lookups for the type gets: LPM tries on 5.10).
func TestReadEntries(t *testing.T) {
	kernel.RequireRoot(t)
	const most = 2*batchSize + 7
	for _, c := range []struct {
		spec *ebpf.MapSpec
		n    int
	}{
		{&ebpf.MapSpec{Type: ebpf.Hash, KeySize: 8, ValueSize: 4, MaxEntries: most}, most},
		{&ebpf.MapSpec{Type: ebpf.LPMTrie, KeySize: 8, ValueSize: 4, MaxEntries: most, Flags: 1 /* BPF_F_NO_PREALLOC */}, most},
		{&ebpf.MapSpec{Type: ebpf.LPMTrie, KeySize: 8, ValueSize: 4, MaxEntries: most, Flags: 1}, firstTrieBatch},
		{&ebpf.MapSpec{Type: ebpf.LPMTrie, KeySize: 8, ValueSize: 4, MaxEntries: most, Flags: 1}, firstTrieBatch + 1},
	} {
		spec, n := c.spec, c.n
		t.Run(fmt.Sprintf("%s/%d", spec.Type, n), func(t *testing.T) {
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
			if spec.Type == ebpf.Hash {
				// Every supported kernel has batch lookups for hash
				// maps (5.6): check that path is the one taken.
				var c ebpf.MapBatchCursor
				keys, values := make([][8]byte, n+1), make([]uint32, n+1)
				if k, err := m.BatchLookup(&c, keys, values, nil); k != n || !errors.Is(err, ebpf.ErrKeyNotExist) {
					t.Fatalf("batch lookup of %d entries: %d, %v", n, k, err)
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
