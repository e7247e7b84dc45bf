package bpf

import (
	"errors"
	"fmt"
	"net/netip"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/podfence/podfence/pkg/pinfs"
)

// Frontend is an address, port and protocol that kube-proxy translates to
// a Service's backends on this node: a ClusterIP, an external or
// load-balancer IP, or one of the node's addresses with a NodePort. A new
// egress flow to one is judged on the backend it is translated to
// (service.h), where the kernel has the conntrack kfuncs.
type Frontend struct {
	Addr  netip.Addr
	Port  uint16
	Proto uint8 // IPPROTO_TCP or IPPROTO_UDP; others cannot be judged after the translation
}

func (f Frontend) String() string {
	return fmt.Sprintf("%s/%d", netip.AddrPortFrom(f.Addr, f.Port), f.Proto)
}

func (f Frontend) key() podfenceServiceKey {
	return podfenceServiceKey{Addr: f.Addr.As16(), Port: f.Port, Proto: f.Proto}
}

func frontendOf(k podfenceServiceKey) Frontend {
	return Frontend{Addr: netip.AddrFrom16(k.Addr).Unmap(), Port: k.Port, Proto: k.Proto}
}

// ErrFrontend is wrapped for a frontend the datapath cannot judge after
// its translation.
var ErrFrontend = errors.New("invalid frontend")

// checkFrontend refuses what the services map must not hold: the lookup
// takes TCP and UDP only, and a frontend without an address or port is
// no frontend.
func checkFrontend(f Frontend) error {
	switch {
	case !f.Addr.IsValid() || f.Addr.IsUnspecified():
		return fmt.Errorf("%w %s: no address", ErrFrontend, f)
	case f.Port == 0:
		return fmt.Errorf("%w %s: no port", ErrFrontend, f)
	case f.Proto != unix.IPPROTO_TCP && f.Proto != unix.IPPROTO_UDP:
		return fmt.Errorf("%w %s: protocol %d (only TCP and UDP are judged after the translation)", ErrFrontend, f, f.Proto)
	}
	return nil
}

// SetServices makes the node's services map hold exactly want, under the
// global directory's lock, writing only what changed: a frontend added is
// judged on its backends from its next new flow, one removed on its
// address again. Nothing is written when any frontend is invalid.
func (g *Global) SetServices(want []Frontend) (added, removed int, err error) {
	keys := make(map[podfenceServiceKey]bool, len(want))
	for _, f := range want {
		if err := checkFrontend(f); err != nil {
			return 0, 0, err
		}
		keys[f.key()] = true
	}
	if len(keys) > int(g.Services.MaxEntries()) {
		return 0, 0, fmt.Errorf("%d frontends: the services map holds %d", len(keys), g.Services.MaxEntries())
	}
	lock, err := pinfs.LockDir(g.dir, unix.LOCK_EX)
	if err != nil {
		return 0, 0, fmt.Errorf("lock global pins: %w", err)
	}
	defer lock.Close()
	have, err := readEntries[podfenceServiceKey, uint8](g.Services)
	if err != nil {
		return 0, 0, fmt.Errorf("list services: %w", err)
	}
	// Removals first, so that a full map has room for the additions.
	for k := range have {
		if keys[k] {
			continue
		}
		if err := g.Services.Delete(k); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			return added, removed, fmt.Errorf("remove frontend %s: %w", frontendOf(k), err)
		}
		removed++
	}
	for k := range keys {
		if _, ok := have[k]; ok {
			continue
		}
		if err := g.Services.Update(k, uint8(1), ebpf.UpdateAny); err != nil {
			return added, removed, fmt.Errorf("add frontend %s: %w", frontendOf(k), err)
		}
		added++
	}
	return added, removed, nil
}

// IsFrontend reports whether f is in the node's services map: a new
// egress flow to it is judged on its backend, where the identifier has a
// slot.
func (g *Global) IsFrontend(f Frontend) (bool, error) {
	var v uint8
	err := g.Services.Lookup(f.key(), &v)
	if errors.Is(err, ebpf.ErrKeyNotExist) {
		return false, nil
	}
	return err == nil, err
}
