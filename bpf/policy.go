package bpf

import (
	"errors"
	"fmt"
	"net/netip"
	"time"
	"unsafe"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/podfence/podfence/pkg/policy"
)

// policyNode marks a trie entry of one of the node's addresses (POLICY_NODE).
const policyNode uint16 = 1

// Mode values stored in id_state.mode.
const (
	stateModeStandard uint8 = 0
	stateModeStrict   uint8 = 1
)

// ApplyPolicy programs the identifier's tries with set and then bumps the
// policy generation, so that tracked flows are re-checked against the new
// rules on their next packet. A direction that becomes isolated is closed
// only once its entries are written, and one that becomes open is opened
// before its entries are deleted, so no packet meets a half-written policy
// that denies what both the old and the new one allow; likewise a port set
// is written before the entries naming it, and deleted only after them.
// Callers serialise ApplyPolicy per identifier.
//
// The node's addresses (Global.SetNodeAddrs) become entries of the ingress
// tries that allow everything, so that kubelet probes pass whatever the
// policy says; after the node's addresses change, apply again.
func (i *Identifier) ApplyPolicy(set policy.Set) error {
	nodes, err := i.global.NodeAddresses()
	if err != nil {
		return fmt.Errorf("apply policy of %q: %w", i.ID, err)
	}
	sets, err := readPortSets(i.PortSets)
	if err != nil {
		return fmt.Errorf("apply policy of %q: %w", i.ID, err)
	}
	var desired [2][2]map[string]*podfencePolicyValue
	for _, d := range []policy.Direction{policy.Ingress, policy.Egress} {
		v4, v6, err := set.Direction(d).Compile()
		if err != nil {
			return fmt.Errorf("compile %s policy of %q: %w", d, i.ID, err)
		}
		for f, entries := range [][]policy.Entry{v4, v6} {
			if desired[d][f], err = sets.encode(entries); err != nil {
				return fmt.Errorf("encode %s policy of %q: %w", d, i.ID, err)
			}
		}
	}
	for _, a := range nodes {
		f := 0
		if a.Is6() {
			f = 1
		}
		// A host prefix is the longest there is, so the node's entry never
		// hides a rule from any other address.
		desired[policy.Ingress][f][string(lpmKey(netip.PrefixFrom(a, a.BitLen())))] = &podfencePolicyValue{Flags: policyNode}
	}
	// Port sets go in before the entries that name them.
	if err := sets.writeNew(i.PortSets); err != nil {
		return fmt.Errorf("write port sets of %q: %w", i.ID, err)
	}
	var st podfenceIdState
	if err := i.State.Lookup(uint32(0), &st); err != nil {
		return fmt.Errorf("read state of %q: %w", i.ID, err)
	}
	want := st
	want.Mode = stateModeStandard
	if set.Mode == policy.ModeStrict {
		want.Mode = stateModeStrict
	}
	want.Isolated = 0
	if set.Ingress.Isolated {
		want.Isolated |= 1 << policy.Ingress
	}
	if set.Egress.Isolated {
		want.Isolated |= 1 << policy.Egress
	}
	// A direction being opened is opened before its trie is emptied, and
	// (below) one being closed is closed after its trie is filled: at no
	// instant is a direction enforced against a trie that is neither the
	// old policy's nor the new one's.
	if opening := st; opening.Isolated&^want.Isolated != 0 {
		opening.Isolated &= want.Isolated
		if err := i.State.Update(uint32(0), &opening, ebpf.UpdateExist); err != nil {
			return fmt.Errorf("write state of %q: %w", i.ID, err)
		}
		// A packet that read the old isolation bit may still be on
		// its way to the trie; let it finish before entries go.
		if err := waitForPrograms(); err != nil {
			return fmt.Errorf("apply policy of %q: %w", i.ID, err)
		}
	}

	changed := false
	for d := range desired {
		for f := range desired[d] {
			c, err := syncTrie(i.Policy[d][f], desired[d][f])
			if err != nil {
				return fmt.Errorf("write %s policy of %q: %w", policy.Direction(d), i.ID, err)
			}
			changed = changed || c
		}
	}

	// Every replica's ADD applies the identifier's policy; only a change
	// makes the tracked flows of all replicas pay for a re-check.
	if changed || want != st {
		want.Generation++
		if err := i.State.Update(uint32(0), &want, ebpf.UpdateExist); err != nil {
			return fmt.Errorf("write state of %q: %w", i.ID, err)
		}
	}
	if err := sets.removeUnused(i.PortSets); err != nil {
		return fmt.Errorf("remove port sets of %q: %w", i.ID, err)
	}
	return nil
}

// Generation returns the identifier's current policy generation.
func (i *Identifier) Generation() (uint32, error) {
	var st podfenceIdState
	if err := i.State.Lookup(uint32(0), &st); err != nil {
		return 0, fmt.Errorf("read state of %q: %w", i.ID, err)
	}
	return st.Generation, nil
}

// portSets is an identifier's port_sets map as ApplyPolicy changes it:
// sets are found by their ranges, so that every entry allowing the same
// ports names one set, and a set keeps its key while any entry may name it.
type portSets struct {
	byKey   map[uint32]podfencePortSet
	byValue map[podfencePortSet]uint32
	added   []uint32        // keys encode gave to new sets
	used    map[uint32]bool // keys the desired entries name
	next    uint32          // where the search for a free key resumes
}

func readPortSets(m *ebpf.Map) (*portSets, error) {
	have, err := readEntries[uint32, podfencePortSet](m)
	if err != nil {
		return nil, fmt.Errorf("read port sets: %w", err)
	}
	s := &portSets{byKey: have, byValue: map[podfencePortSet]uint32{}, used: map[uint32]bool{}, next: 1}
	for k, v := range have {
		s.byValue[v] = k
	}
	return s, nil
}

// encode returns the trie contents for entries, keyed by the binary LPM key
// (4-byte prefix length, then the address bytes). An entry with more port
// ranges than its value holds names a port set; encode notes the sets named,
// new ones under free keys.
func (s *portSets) encode(entries []policy.Entry) (map[string]*podfencePolicyValue, error) {
	out := make(map[string]*podfencePolicyValue, len(entries))
	for _, e := range entries {
		if len(e.Ports) > policy.MaxPortRanges {
			return nil, fmt.Errorf("prefix %s: %d port ranges: %w", e.Prefix, len(e.Ports), policy.ErrTooManyPortRanges)
		}
		v := &podfencePolicyValue{Count: uint16(len(e.Ports))}
		out[string(lpmKey(e.Prefix))] = v
		if len(e.Ports) <= len(v.Ranges) {
			for j, r := range e.Ports {
				v.Ranges[j] = podfencePortRange{Proto: uint8(r.Protocol), First: r.First, Last: r.Last}
			}
			continue
		}
		set := podfencePortSet{Count: uint16(len(e.Ports))}
		for j, r := range e.Ports {
			set.Ranges[j] = podfencePortRange{Proto: uint8(r.Protocol), First: r.First, Last: r.Last}
		}
		key, ok := s.byValue[set]
		if !ok {
			var err error
			if key, err = s.freeKey(); err != nil {
				return nil, err
			}
			s.byKey[key], s.byValue[set] = set, key
			s.added = append(s.added, key)
		}
		s.used[key] = true
		v.Ports = key
	}
	return out, nil
}

// freeKey returns the lowest key no set holds, from 1 (0 names no set).
func (s *portSets) freeKey() (uint32, error) {
	for ; s.next <= trieCapacity; s.next++ {
		if _, taken := s.byKey[s.next]; !taken {
			return s.next, nil
		}
	}
	return 0, fmt.Errorf("more than %d distinct port sets", trieCapacity)
}

// writeNew writes the sets encode added. A key that was free holds no set
// an entry names, so no program can be reading it.
func (s *portSets) writeNew(m *ebpf.Map) error {
	for _, k := range s.added {
		set := s.byKey[k]
		if err := m.Update(k, &set, ebpf.UpdateNoExist); err != nil {
			return fmt.Errorf("add port set %d: %w", k, err)
		}
	}
	return nil
}

// removeUnused deletes the sets no desired entry names, once the programs
// that might have read an old entry naming one have finished. It runs after
// the tries hold the desired entries; sets a killed ApplyPolicy left behind
// go the same way.
func (s *portSets) removeUnused(m *ebpf.Map) error {
	var unused []uint32
	for k := range s.byKey {
		if !s.used[k] {
			unused = append(unused, k)
		}
	}
	if len(unused) == 0 {
		return nil
	}
	if err := waitForPrograms(); err != nil {
		return err
	}
	for _, k := range unused {
		if err := m.Delete(k); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			return fmt.Errorf("delete port set %d: %w", k, err)
		}
	}
	return nil
}

// lpmKey encodes a prefix as the kernel's struct bpf_lpm_trie_key: prefix
// length in host order (little-endian here), then the address in network order.
func lpmKey(p netip.Prefix) []byte {
	addr := p.Masked().Addr().AsSlice()
	key := make([]byte, 4+len(addr))
	key[0] = byte(p.Bits())
	copy(key[4:], addr)
	return key
}

// syncTrie makes m hold exactly want and reports whether anything changed.
// New and changed entries are written first, stale ones deleted after, so
// an address never loses an allowance it keeps under the new policy.
func syncTrie(m *ebpf.Map, want map[string]*podfencePolicyValue) (bool, error) {
	have, err := trieEntries(m)
	if err != nil {
		return false, err
	}
	changed := false
	for k, v := range want {
		if old, ok := have[k]; ok && old == *v {
			continue
		}
		if err := m.Update([]byte(k), v, ebpf.UpdateAny); err != nil {
			return changed, fmt.Errorf("update entry: %w", err)
		}
		changed = true
	}
	for k := range have {
		if _, ok := want[k]; ok {
			continue
		}
		if err := m.Delete([]byte(k)); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			return changed, fmt.Errorf("delete entry: %w", err)
		}
		changed = true
	}
	return changed, nil
}

// The policy tries' keys as raw bytes, which is how encode keys entries.
type (
	lpmBytesV4 = [unsafe.Sizeof(podfenceLpmKeyV4{})]byte
	lpmBytesV6 = [unsafe.Sizeof(podfenceLpmKeyV6{})]byte
)

// trieEntries reads a policy trie, keyed as encode keys its entries.
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

// waitForPrograms returns once every run of a BPF program that started
// before the call has ended. TC programs run inside RCU read-side critical
// sections, and membarrier's MEMBARRIER_CMD_GLOBAL is implemented with
// synchronize_rcu (Linux 4.3+; kernel/sched/membarrier.c), so it waits for
// exactly them. It costs one grace period (milliseconds), which ApplyPolicy
// pays only when it opens an isolated direction or drops a port set. The
// command is refused on nohz_full kernels; a sleep far longer than any
// program run stands in.
func waitForPrograms() error {
	const membarrierCmdGlobal = 1 // MEMBARRIER_CMD_GLOBAL, once MEMBARRIER_CMD_SHARED
	_, _, errno := unix.Syscall(unix.SYS_MEMBARRIER, membarrierCmdGlobal, 0, 0)
	switch errno {
	case 0:
		return nil
	case unix.EINVAL, unix.ENOSYS:
		time.Sleep(50 * time.Millisecond)
		return nil
	}
	return fmt.Errorf("wait for running programs: membarrier: %w", errno)
}
