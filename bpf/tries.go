package bpf

import (
	"cmp"
	"encoding/binary"
	"errors"
	"fmt"
	"maps"
	"net/netip"
	"slices"
	"unsafe"

	"github.com/cilium/ebpf"
)

// lpmKey encodes a prefix as the kernel's struct bpf_lpm_trie_key: prefix
// length in host order (little-endian here), then the address in network order.
func lpmKey(p netip.Prefix) []byte {
	addr := p.Masked().Addr().AsSlice()
	key := make([]byte, 4+len(addr))
	key[0] = byte(p.Bits())
	copy(key[4:], addr)
	return key
}

// The policy tries' keys as raw bytes, which is how lpmKey encodes them.
type (
	lpmBytesV4 = [unsafe.Sizeof(podfenceLpmKeyV4{})]byte
	lpmBytesV6 = [unsafe.Sizeof(podfenceLpmKeyV6{})]byte
)

// trieEntries reads a policy trie, keyed as lpmKey encodes prefixes.
func trieEntries(m *ebpf.Map) (map[string]podfencePolicyValue, error) {
	switch m.KeySize() {
	case lpmV4Size:
		entries, err := readEntries[lpmBytesV4, podfencePolicyValue](m)
		return stringKeys(entries, err, func(k lpmBytesV4) string { return string(k[:]) })
	case lpmV6Size:
		entries, err := readEntries[lpmBytesV6, podfencePolicyValue](m)
		return stringKeys(entries, err, func(k lpmBytesV6) string { return string(k[:]) })
	}
	return nil, fmt.Errorf("a trie with %d-byte keys", m.KeySize())
}

func stringKeys[K comparable, V any](entries map[K]V, err error, str func(K) string) (map[string]V, error) {
	if err != nil {
		return nil, err
	}
	out := make(map[string]V, len(entries))
	for k, v := range entries {
		out[str(k)] = v
	}
	return out, nil
}

// trieChange is a change to one trie that ApplyPolicy makes.
type trieChange interface {
	apply() error
	empty() bool
}

// trieDiff is what turns a trie's entries, of value type V (a policy trie's
// or the tiers trie's), into the desired ones.
type trieDiff[V comparable] struct {
	m      *ebpf.Map
	update map[string]*V // new and changed entries
	remove []string
}

func diffTrie[V comparable](m *ebpf.Map, have map[string]V, want map[string]*V) trieDiff[V] {
	d := trieDiff[V]{m: m, update: map[string]*V{}}
	for k, v := range want {
		if old, ok := have[k]; !ok || old != *v {
			d.update[k] = v
		}
	}
	for k := range have {
		if _, ok := want[k]; !ok {
			d.remove = append(d.remove, k)
		}
	}
	return d
}

func (d trieDiff[V]) empty() bool { return len(d.update) == 0 && len(d.remove) == 0 }

// apply changes the trie so that every address is judged by its old entry
// or its new one at each instant, never by an entry of neither policy:
// new and changed entries are written longest prefix first, then stale ones
// deleted shortest prefix first. (An address's new entry, the longest of the
// new policy that contains it, goes in before any shorter one that would
// otherwise take over from its old entry; its old entry, when no longer
// wanted, goes only after the stale entries between it and the new one.)
// This build's programs never read a side while it is written; an earlier
// build's, which read side 0 alone (members a take-over could not move),
// may, and for them the order is what it was before sides.
func (d trieDiff[V]) apply() error {
	updates := slices.Collect(maps.Keys(d.update))
	slices.SortFunc(updates, func(a, b string) int { return cmp.Compare(prefixLen(b), prefixLen(a)) })
	for _, k := range updates {
		if err := d.m.Update([]byte(k), d.update[k], ebpf.UpdateAny); err != nil {
			return fmt.Errorf("update policy entry: %w", err)
		}
	}
	slices.SortFunc(d.remove, func(a, b string) int { return cmp.Compare(prefixLen(a), prefixLen(b)) })
	for _, k := range d.remove {
		if err := d.m.Delete([]byte(k)); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			return fmt.Errorf("delete policy entry: %w", err)
		}
	}
	return nil
}

// prefixLen is the prefix length of a key as lpmKey and tierKey encode
// it. Within one selector byte of the tiers trie, longer is longer, which
// is all apply needs: an address is judged only by entries of its selector.
func prefixLen(key string) uint32 {
	return binary.LittleEndian.Uint32([]byte(key[:4]))
}
