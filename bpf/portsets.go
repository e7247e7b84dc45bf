package bpf

import (
	"errors"
	"fmt"

	"github.com/cilium/ebpf"

	"github.com/podfence/podfence/pkg/policy"
)

// portSets is an identifier's port_sets map as ApplyPolicy changes it. A set
// is found by its ranges, so that every entry allowing the same ones names
// one set; a set never changes under its key, and a key is not given to a
// new set while any entry may name it.
type portSets struct {
	byKey   map[uint32]podfencePortSet // in the map, and added by encode
	byValue map[podfencePortSet]uint32
	inMap   map[uint32]bool // keys the map holds
	named   map[uint32]bool // keys the tries' entries name now, whether or not the map holds them
	used    map[uint32]bool // keys the desired entries name
	added   []uint32        // keys encode gave to new sets
	next    uint32          // where the search for a free key resumes
}

func readPortSets(m *ebpf.Map) (*portSets, error) {
	have, err := readEntries[uint32, podfencePortSet](m)
	if err != nil {
		return nil, fmt.Errorf("read port sets: %w", err)
	}
	s := &portSets{
		byKey:   have,
		byValue: make(map[podfencePortSet]uint32, len(have)),
		inMap:   make(map[uint32]bool, len(have)),
		named:   map[uint32]bool{},
		used:    map[uint32]bool{},
		next:    1,
	}
	for k, v := range have {
		s.byValue[v] = k
		s.inMap[k] = true
	}
	return s, nil
}

// namesSet tells whether a trie entry's ranges are in a port set.
func namesSet(v podfencePolicyValue) bool {
	return v.Flags&policyNode == 0 && int(v.Count) > len(v.Ranges)
}

// reserve notes the keys that entries of a trie name now. A removal killed
// midway can leave entries whose set is gone; their keys stay taken until
// the entries are replaced.
func (s *portSets) reserve(entries map[string]podfencePolicyValue) {
	for _, v := range entries {
		if namesSet(v) {
			s.named[v.Ports] = true
		}
	}
}

// reserveTiers is reserve for the tiers trie's entries.
func (s *portSets) reserveTiers(entries map[string]podfenceTierValue) {
	for _, v := range entries {
		for _, k := range tierSets(&v) {
			s.named[k] = true
		}
	}
}

// removeUnnamed deletes the sets that no entry of either side names now,
// left by an ApplyPolicy that stopped after writing them or before
// deleting them. They would otherwise hold keys the new policy may need.
func (s *portSets) removeUnnamed(m *ebpf.Map) error {
	return s.removeHeldExcept(m, s.named, true)
}

// encode returns the trie contents for entries, keyed by the binary LPM key
// (4-byte prefix length, then the address bytes). An entry with more port
// ranges than its value holds names a port set, a new one under a free key
// when no set has its ranges.
func (s *portSets) encode(entries []policy.Entry) (map[string]*podfencePolicyValue, error) {
	out := make(map[string]*podfencePolicyValue, len(entries))
	for _, e := range entries {
		if len(e.Ports) > policy.MaxPortRanges {
			return nil, fmt.Errorf("prefix %s: %d port ranges: %w", e.Prefix, len(e.Ports), policy.ErrTooManyPortRanges)
		}
		v := &podfencePolicyValue{Count: uint16(len(e.Ports))}
		out[string(lpmKey(e.Prefix))] = v
		if len(e.Ports) <= len(v.Ranges) {
			fillRanges(v.Ranges[:], e.Ports)
			continue
		}
		key, err := s.key(e.Ports)
		if err != nil {
			return nil, err
		}
		v.Ports = key
	}
	return out, nil
}

// key is the key of the set of ports, a new one under a free key when no
// set has these ranges. ports holds at most MaxPortRanges ranges.
func (s *portSets) key(ports []policy.PortRange) (uint32, error) {
	set := podfencePortSet{Count: uint16(len(ports))}
	fillRanges(set.Ranges[:], ports)
	if key, ok := s.byValue[set]; ok {
		return key, nil
	}
	key, err := s.freeKey()
	if err != nil {
		return 0, err
	}
	s.byKey[key], s.byValue[set] = set, key
	s.added = append(s.added, key)
	return key, nil
}

// fillRanges writes ports to dst, which has room for them.
func fillRanges(dst []podfencePortRange, ports []policy.PortRange) {
	for j, r := range ports {
		dst[j] = podfencePortRange{Proto: uint8(r.Protocol), First: r.First, Last: r.Last}
	}
}

// freeKey returns the lowest key that neither holds a set nor is named by
// an entry, from 1 (0 names no set).
func (s *portSets) freeKey() (uint32, error) {
	for ; s.next <= portSetCapacity; s.next++ {
		_, holds := s.byKey[s.next]
		if !holds && !s.named[s.next] {
			return s.next, nil
		}
	}
	return 0, fmt.Errorf("port sets: the policy and the one it replaces need more than the %d an identifier holds: %w",
		portSetCapacity, policy.ErrTooManyPortSets)
}

// use notes the keys that desired entries name, once the node's entries
// have replaced any they take the place of.
func (s *portSets) use(desired map[string]*podfencePolicyValue) {
	for _, v := range desired {
		if namesSet(*v) {
			s.used[v.Ports] = true
		}
	}
}

// useTiers is use for the tiers trie's desired entries.
func (s *portSets) useTiers(desired map[string]*podfenceTierValue) {
	for _, v := range desired {
		for _, k := range tierSets(v) {
			s.used[k] = true
		}
	}
}

// writeNew writes the new sets that desired entries name. A key that was
// free is named by no entry, so no program can be reading it.
func (s *portSets) writeNew(m *ebpf.Map) error {
	for _, k := range s.added {
		if !s.used[k] {
			continue
		}
		set := s.byKey[k]
		if err := m.Update(k, &set, ebpf.UpdateNoExist); err != nil {
			return fmt.Errorf("add port set %d: %w", k, err)
		}
		s.inMap[k] = true
	}
	return nil
}

// removeUnused deletes the sets that no desired entry names. It runs after
// both sides hold the desired entries; wait says that programs may still
// hold an entry naming such a set (no grace period has passed since one
// was in force).
func (s *portSets) removeUnused(m *ebpf.Map, wait bool) error {
	return s.removeHeldExcept(m, s.used, wait)
}

// removeHeldExcept deletes the sets the map holds whose keys are not in
// keep, once (wait) the programs that might have read an old entry naming
// one have finished.
func (s *portSets) removeHeldExcept(m *ebpf.Map, keep map[uint32]bool, wait bool) error {
	var gone []uint32
	for k := range s.inMap {
		if !keep[k] {
			gone = append(gone, k)
		}
	}
	if len(gone) == 0 {
		return nil
	}
	if wait {
		if err := WaitForPrograms(); err != nil {
			return err
		}
	}
	for _, k := range gone {
		if err := m.Delete(k); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			return fmt.Errorf("delete port set %d: %w", k, err)
		}
		if set := s.byKey[k]; s.byValue[set] == k {
			delete(s.byValue, set)
		}
		delete(s.byKey, k)
		delete(s.inMap, k)
	}
	return nil
}
