package bpf

import (
	"errors"
	"fmt"
	"net/netip"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/podfence/podfence/pkg/pinfs"
)

// NodeAddresses returns the node's own addresses as SetNodeAddrs recorded them.
func (g *Global) NodeAddresses() ([]netip.Addr, error) {
	have, err := readEntries[[16]byte, uint8](g.NodeAddrs)
	if err != nil {
		return nil, fmt.Errorf("list node addresses: %w", err)
	}
	addrs := make([]netip.Addr, 0, len(have))
	for k := range have {
		addrs = append(addrs, netip.AddrFrom16(k).Unmap())
	}
	return addrs, nil
}

// SyncNodeAddrs replaces the set of the node's own addresses with what
// current returns, under a lock on the global pins that every process
// syncing them takes: the addresses are read and written in one turn, so a
// process that read them earlier cannot overwrite a later reading with its
// own. Identifiers pick the change up at their next ApplyPolicy.
func (g *Global) SyncNodeAddrs(current func() ([]netip.Addr, error)) error {
	f, err := pinfs.LockDir(g.dir, unix.LOCK_EX)
	if err != nil {
		return fmt.Errorf("lock global pins: %w", err)
	}
	defer f.Close() // and with it the lock
	addrs, err := current()
	if err != nil {
		return err
	}
	return g.SetNodeAddrs(addrs)
}

// SetNodeAddrs replaces the set of the node's own addresses, from which
// traffic to pods is always allowed (kubelet probes). Identifiers pick the
// change up at their next ApplyPolicy. Processes that read the addresses
// themselves use SyncNodeAddrs.
func (g *Global) SetNodeAddrs(addrs []netip.Addr) error {
	want := make(map[[16]byte]bool, len(addrs))
	for _, a := range addrs {
		want[a.As16()] = true
	}
	// Only what changed is written: every ADD syncs, under a node-wide lock.
	have, err := readEntries[[16]byte, uint8](g.NodeAddrs)
	if err != nil {
		return fmt.Errorf("list node addresses: %w", err)
	}
	for k := range want {
		if _, ok := have[k]; ok {
			continue
		}
		if err := g.NodeAddrs.Update(k, uint8(1), ebpf.UpdateAny); err != nil {
			return fmt.Errorf("add node address %s: %w", netip.AddrFrom16(k).Unmap(), err)
		}
	}
	for k := range have {
		if want[k] {
			continue
		}
		if err := g.NodeAddrs.Delete(k); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			return fmt.Errorf("remove node address %s: %w", netip.AddrFrom16(k).Unmap(), err)
		}
	}
	return nil
}
