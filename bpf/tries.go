package bpf

import (
	"errors"
	"fmt"
	"net/netip"
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

// apply changes the trie, which no program reads (a side not in force):
// stale entries are deleted first, so that the trie needs room only for
// the larger of the old and the new policy.
func (d trieDiff[V]) apply() error {
	for _, k := range d.remove {
		if err := d.m.Delete([]byte(k)); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			return fmt.Errorf("delete policy entry: %w", err)
		}
	}
	for k, v := range d.update {
		if err := d.m.Update([]byte(k), v, ebpf.UpdateAny); err != nil {
			return fmt.Errorf("update policy entry: %w", err)
		}
	}
	return nil
}
