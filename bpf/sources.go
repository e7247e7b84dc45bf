package bpf

import (
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"slices"

	"github.com/cilium/ebpf"

	"github.com/podfence/podfence/pkg/pinpath"
)

// MaxSourceAddrs is how many addresses one member may send from
// (MAX_POD_ADDRS in types.h): a pod has one per family, and a primary
// plugin that reports more than this many is refused at ADD.
const MaxSourceAddrs = len(podfencePodSources{}.Addrs)

// ErrTooManySources is wrapped when a member has more addresses than the
// datapath holds.
var ErrTooManySources = errors.New("too many source addresses")

// Sources is what the pod behind one host veth may send from. The egress
// program drops a packet of a new flow from any other source (reason
// spoofed): no pod opens a flow, or a conntrack entry, in another's name.
type Sources struct {
	// Addrs are the pod's own addresses, each one exact: the /32 or /128
	// of what the primary plugin reported, never its prefix, which would
	// let a pod speak for its neighbours.
	Addrs []netip.Addr
	// Any turns the check off for this member (the plugin's sourceCheck
	// false): for pods that send from addresses not their own, such as
	// VPN or egress-gateway pods.
	Any bool
}

func (s Sources) encode() (podfencePodSources, error) {
	var v podfencePodSources
	if len(s.Addrs) > MaxSourceAddrs {
		return v, fmt.Errorf("%w: %d addresses, the datapath holds %d per pod", ErrTooManySources, len(s.Addrs), MaxSourceAddrs)
	}
	for i, a := range s.Addrs {
		if !a.IsValid() {
			return v, fmt.Errorf("source address %d is not valid", i)
		}
		v.Addrs[i] = a.As16()
	}
	v.Count = uint8(len(s.Addrs))
	if s.Any {
		v.Flags = 1 // SOURCES_ANY
	}
	return v, nil
}

func decodeSources(v podfencePodSources) Sources {
	s := Sources{Any: v.Flags&1 != 0}
	for i := range min(int(v.Count), MaxSourceAddrs) {
		s.Addrs = append(s.Addrs, netip.AddrFrom16(v.Addrs[i]).Unmap())
	}
	return s
}

// SetSources records what the member on host veth ifindex may send from.
// The caller holds the identifier's lock and writes the entry before it
// attaches the programs, so the pod's first packet finds it.
func (i *Datapath) SetSources(ifindex uint32, s Sources) error {
	v, err := s.encode()
	if err != nil {
		return fmt.Errorf("identifier %q, veth ifindex %d: %w", i.ID, ifindex, err)
	}
	if err := i.Sources.Update(ifindex, &v, ebpf.UpdateAny); err != nil {
		return fmt.Errorf("identifier %q: write the sources of veth ifindex %d: %w", i.ID, ifindex, err)
	}
	return nil
}

// ReadSources returns every member's sources by host veth ifindex.
func (i *Datapath) ReadSources() (map[uint32]Sources, error) {
	return readSources(i.Sources)
}

func readSources(m *ebpf.Map) (map[uint32]Sources, error) {
	raw, err := readEntries[uint32, podfencePodSources](m)
	if err != nil {
		return nil, fmt.Errorf("read sources: %w", err)
	}
	out := make(map[uint32]Sources, len(raw))
	for k, v := range raw {
		out[k] = decodeSources(v)
	}
	return out, nil
}

// LookupSources reads the sources entry of host veth ifindex in the
// identifier whose pins are in dir; ok is false when there is none.
func LookupSources(dir string, ifindex uint32) (s Sources, ok bool, err error) {
	m, err := ebpf.LoadPinnedMap(filepath.Join(dir, pinpath.MapSources), &ebpf.LoadPinOptions{ReadOnly: true})
	if errors.Is(err, os.ErrNotExist) {
		return Sources{}, false, nil
	}
	if err != nil {
		return Sources{}, false, fmt.Errorf("open the sources of %s: %w", dir, err)
	}
	defer m.Close()
	var v podfencePodSources
	err = m.Lookup(ifindex, &v)
	if errors.Is(err, ebpf.ErrKeyNotExist) {
		return Sources{}, false, nil
	}
	if err != nil {
		return Sources{}, false, fmt.Errorf("read the sources of veth ifindex %d in %s: %w", ifindex, dir, err)
	}
	return decodeSources(v), true, nil
}

// Equal reports whether s and o allow the same sources.
func (s Sources) Equal(o Sources) bool {
	return s.Any == o.Any && slices.Equal(s.Addrs, o.Addrs)
}

// DeleteSources removes the sources entry of host veth ifindex from the
// identifier whose pins are in dir, for callers that work from a member's
// record without opening the identifier (DEL). An entry or a map that is
// not there (pins of an earlier layout) is nothing to remove. The caller
// holds the identifier's lock.
func DeleteSources(dir string, ifindex uint32) error {
	m, err := ebpf.LoadPinnedMap(filepath.Join(dir, pinpath.MapSources), nil)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("open the sources of %s: %w", dir, err)
	}
	defer m.Close()
	if err := m.Delete(ifindex); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
		return fmt.Errorf("remove the sources of veth ifindex %d in %s: %w", ifindex, dir, err)
	}
	return nil
}
