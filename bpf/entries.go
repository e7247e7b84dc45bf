package bpf

import (
	"errors"
	"fmt"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"
)

// batchSize is how many entries one batch lookup asks for. A hash map
// refuses a batch smaller than one of its buckets; none of podfence's comes
// near this.
const batchSize = 256

// firstTrieBatch is the first batch lookup's size for an LPM trie.
const firstTrieBatch = 16

// readEntries returns every entry of m. Where the kernel has batch lookups
// for the map's type (hash maps from Linux 5.6; LPM tries later), a system
// call returns up to batchSize of them; otherwise they come one at a time,
// two system calls each. Every ADD reads the node's addresses and the
// identifier's tries, which hold one entry per node address: on a node that
// gives each pod's veth an address, hundreds of calls.
func readEntries[K comparable, V any](m *ebpf.Map) (map[K]V, error) {
	out := map[K]V{}
	// A trie has no buckets, and most hold a few entries: its first
	// batch is small, as a policy change reads ten of them (a tiers
	// value is 388 bytes, and allocating batchSize of them for each read
	// was most of what a change cost).
	size := batchSize
	if m.Type() == ebpf.LPMTrie {
		size = firstTrieBatch
	}
	keys, values := make([]K, size), make([]V, size)
	var cursor ebpf.MapBatchCursor
	for first := true; ; first = false {
		n, err := m.BatchLookup(&cursor, keys, values, nil)
		for i := range n {
			out[keys[i]] = values[i]
		}
		if n == len(keys) && len(keys) < batchSize {
			keys, values = make([]K, batchSize), make([]V, batchSize)
		}
		switch {
		case errors.Is(err, ebpf.ErrKeyNotExist):
			return out, nil // the end of the map
		case first && (errors.Is(err, ebpf.ErrNotSupported) || errors.Is(err, unix.EINVAL)):
			// No batch lookups for this map type on this kernel.
			return iterateEntries[K, V](m)
		case err != nil:
			return nil, fmt.Errorf("read entries: %w", err)
		}
	}
}

func iterateEntries[K comparable, V any](m *ebpf.Map) (map[K]V, error) {
	out := map[K]V{}
	var (
		k K
		v V
	)
	it := m.Iterate()
	for it.Next(&k, &v) {
		out[k] = v
	}
	if err := it.Err(); err != nil {
		return nil, fmt.Errorf("read entries: %w", err)
	}
	return out, nil
}
