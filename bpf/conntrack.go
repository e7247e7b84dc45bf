package bpf

import (
	"errors"
	"fmt"
	"time"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/podfence/podfence/pkg/liveness"
)

// The conntrack maps' key and value types (types.h, through bpf2go).
type (
	CTKeyV4 = podfenceCtKeyV4
	CTKeyV6 = podfenceCtKeyV6
	CTValue = podfenceCtValue
)

// CTValue flags (enum ct_flags).
const (
	CTEgress uint8 = 1 // the pod opened the flow
	CTNode   uint8 = 2 // allowed because the peer is the node itself
)

// Liveness is the key as the liveness rule compares it (without ifindex).
func (k *CTKeyV4) Liveness() liveness.Key {
	lk := liveness.Key{Family: 4, Proto: k.Proto, SrcPort: k.Sport, DstPort: k.Dport}
	copy(lk.Src[:], k.Src[:])
	copy(lk.Dst[:], k.Dst[:])
	return lk
}

// Liveness is the key as the liveness rule compares it (without ifindex).
func (k *CTKeyV6) Liveness() liveness.Key {
	return liveness.Key{Family: 6, Proto: k.Proto, SrcPort: k.Sport, DstPort: k.Dport, Src: k.Src, Dst: k.Dst}
}

// CTEntry is one entry of either conntrack map.
type CTEntry struct {
	Key     liveness.Key
	Ifindex uint32 // the owner pod's host veth
	Value   CTValue
}

// LastSeen is the CLOCK_MONOTONIC time of the entry's last packet.
func (e *CTEntry) LastSeen() time.Duration { return time.Duration(e.Value.LastSeenNs) }

func (e *CTEntry) keyV4() CTKeyV4 {
	return CTKeyV4{Src: [4]uint8(e.Key.Src[:4]), Dst: [4]uint8(e.Key.Dst[:4]), Ifindex: e.Ifindex,
		Sport: e.Key.SrcPort, Dport: e.Key.DstPort, Proto: e.Key.Proto}
}

func (e *CTEntry) keyV6() CTKeyV6 {
	return CTKeyV6{Src: e.Key.Src, Dst: e.Key.Dst, Ifindex: e.Ifindex,
		Sport: e.Key.SrcPort, Dport: e.Key.DstPort, Proto: e.Key.Proto}
}

// CTBatch is how many entries a conntrack scan reads, and a delete
// removes, per system call: large enough that the calls' cost vanishes
// beside the copying, small enough that a batch's Go memory is noise.
const CTBatch = 4096

// ScanConntrack calls fn with every entry of both conntrack maps, IPv4 then
// IPv6, a batch at a time; batch is reused after fn returns. The maps are
// LRU hashes that the datapath changes meanwhile, so an entry may be seen
// twice or not at all when it is written during the scan; the caller's
// rule must not depend on seeing all of them (the sweeper's does not: an
// entry written during a pass is recent, and never deleted).
//
// Batched lookups need Linux 5.6; earlier kernels fall back to iteration.
func (g *Global) ScanConntrack(fn func(batch []CTEntry) error) error {
	out := make([]CTEntry, 0, CTBatch)
	if err := scanMap(g.CTv4, out, fn, func(k *CTKeyV4, v *CTValue) CTEntry {
		return CTEntry{Key: k.Liveness(), Ifindex: k.Ifindex, Value: *v}
	}); err != nil {
		return fmt.Errorf("scan %s: %w", mapCTv4, err)
	}
	if err := scanMap(g.CTv6, out, fn, func(k *CTKeyV6, v *CTValue) CTEntry {
		return CTEntry{Key: k.Liveness(), Ifindex: k.Ifindex, Value: *v}
	}); err != nil {
		return fmt.Errorf("scan %s: %w", mapCTv6, err)
	}
	return nil
}

func scanMap[K any](m *ebpf.Map, out []CTEntry, fn func([]CTEntry) error, conv func(*K, *CTValue) CTEntry) error {
	keys, values := make([]K, CTBatch), make([]CTValue, CTBatch)
	var cursor ebpf.MapBatchCursor
	for first := true; ; first = false {
		n, err := m.BatchLookup(&cursor, keys, values, nil)
		if first && (errors.Is(err, ebpf.ErrNotSupported) || errors.Is(err, unix.EINVAL)) {
			return iterateMap(m, out, fn, conv)
		}
		if err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			return err
		}
		out = out[:0]
		for i := range n {
			out = append(out, conv(&keys[i], &values[i]))
		}
		if len(out) > 0 {
			if ferr := fn(out); ferr != nil {
				return ferr
			}
		}
		if err != nil { // ErrKeyNotExist: the end of the map
			return nil
		}
	}
}

func iterateMap[K any](m *ebpf.Map, out []CTEntry, fn func([]CTEntry) error, conv func(*K, *CTValue) CTEntry) error {
	var (
		k K
		v CTValue
	)
	out = out[:0]
	it := m.Iterate()
	for it.Next(&k, &v) {
		out = append(out, conv(&k, &v))
		if len(out) == cap(out) {
			if err := fn(out); err != nil {
				return err
			}
			out = out[:0]
		}
	}
	if err := it.Err(); err != nil {
		return err
	}
	if len(out) > 0 {
		return fn(out)
	}
	return nil
}

// LookupConntrack fills e.Value from the map of e's family, and says
// whether the entry exists.
func (g *Global) LookupConntrack(e *CTEntry) (bool, error) {
	var err error
	if e.Key.Family == 4 {
		k := e.keyV4()
		err = g.CTv4.Lookup(&k, &e.Value)
	} else {
		k := e.keyV6()
		err = g.CTv6.Lookup(&k, &e.Value)
	}
	if errors.Is(err, ebpf.ErrKeyNotExist) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("look up conntrack entry %s: %w", e.Key, err)
	}
	return true, nil
}

// DeleteConntrack deletes entries from the maps of their families, in
// batches, and returns how many it deleted. An entry already gone (the LRU
// evicted it meanwhile) is not an error.
func (g *Global) DeleteConntrack(entries []CTEntry) (int, error) {
	var v4 []CTKeyV4
	var v6 []CTKeyV6
	for i := range entries {
		if entries[i].Key.Family == 4 {
			v4 = append(v4, entries[i].keyV4())
		} else {
			v6 = append(v6, entries[i].keyV6())
		}
	}
	n4, err := deleteKeys(g.CTv4, v4)
	if err != nil {
		return n4, fmt.Errorf("delete from %s: %w", mapCTv4, err)
	}
	n6, err := deleteKeys(g.CTv6, v6)
	if err != nil {
		return n4 + n6, fmt.Errorf("delete from %s: %w", mapCTv6, err)
	}
	return n4 + n6, nil
}

// deleteKeys deletes keys in batches. A batch stops at the first key that
// is missing (ENOENT), having deleted those before it: the rest is retried
// past it, one missing key at a time.
func deleteKeys[K any](m *ebpf.Map, keys []K) (int, error) {
	deleted := 0
	for len(keys) > 0 {
		chunk := keys[:min(len(keys), CTBatch)]
		n, err := m.BatchDelete(chunk, nil)
		deleted += n
		switch {
		case err == nil:
			keys = keys[len(chunk):]
		case errors.Is(err, ebpf.ErrKeyNotExist):
			keys = keys[n+1:] // skip the missing key
		case errors.Is(err, ebpf.ErrNotSupported):
			for i := range keys {
				if err := m.Delete(&keys[i]); err == nil {
					deleted++
				} else if !errors.Is(err, ebpf.ErrKeyNotExist) {
					return deleted, err
				}
			}
			return deleted, nil
		default:
			return deleted, err
		}
	}
	return deleted, nil
}
