package bpf

import (
	"fmt"
	"net/netip"

	"github.com/cilium/ebpf"
)

// Verdicts the programs return (TC_ACT_UNSPEC, which TCX reads as
// TCX_NEXT, and TC_ACT_SHOT, which TCX reads as TCX_DROP).
const (
	VerdictAllow uint32 = 0xffffffff
	VerdictDrop  uint32 = 2
)

// Reason says why a packet got its verdict; it mirrors enum reason in types.h.
type Reason uint8

const (
	ReasonCTEstablished Reason = iota // conntrack hit in the flow's own direction
	ReasonCTReply                     // conntrack hit of the reversed tuple
	ReasonPolicyAllow                 // new flow allowed by a rule
	ReasonNotIsolated                 // new flow in a direction no policy isolates
	ReasonNode                        // new flow from one of the node's addresses
	ReasonNotIP                       // not IPv4/IPv6: passed
	ReasonPolicyDeny                  // new flow no rule allows: dropped
	ReasonRevoked                     // tracked flow the current policy no longer allows: dropped
	ReasonMalformed                   // truncated or malformed IP packet: dropped
	NumReasons
)

var reasonNames = [NumReasons]string{
	"ct-established", "ct-reply", "policy-allow", "not-isolated", "node",
	"not-ip", "policy-deny", "revoked", "malformed",
}

func (r Reason) String() string {
	if r < NumReasons {
		return reasonNames[r]
	}
	return fmt.Sprintf("reason(%d)", uint8(r))
}

// Verdict is the verdict the programs give for r.
func (r Reason) Verdict() uint32 {
	switch r {
	case ReasonPolicyDeny, ReasonRevoked, ReasonMalformed:
		return VerdictDrop
	}
	return VerdictAllow
}

// Counters are an identifier's packet counts summed over CPUs, by
// [direction][reason] (direction 0 ingress, 1 egress).
type Counters [2][NumReasons]uint64

// ReadCounters sums the identifier's per-CPU counters.
func (i *Identifier) ReadCounters() (Counters, error) {
	var c Counters
	for d := range c {
		for r := range c[d] {
			var perCPU []uint64
			idx := uint32(d*int(NumReasons) + r)
			if err := i.Counters.Lookup(idx, &perCPU); err != nil {
				return c, fmt.Errorf("read counters of %q: %w", i.ID, err)
			}
			for _, n := range perCPU {
				c[d][r] += n
			}
		}
	}
	return c, nil
}

// NodeAddresses returns the node's own addresses as SetNodeAddrs recorded them.
func (g *Global) NodeAddresses() ([]netip.Addr, error) {
	var addrs []netip.Addr
	var k [16]byte
	var v uint8
	it := g.NodeAddrs.Iterate()
	for it.Next(&k, &v) {
		addrs = append(addrs, netip.AddrFrom16(k).Unmap())
	}
	if err := it.Err(); err != nil {
		return nil, fmt.Errorf("list node addresses: %w", err)
	}
	return addrs, nil
}

// SetNodeAddrs replaces the set of the node's own addresses, from which
// traffic to pods is always allowed (kubelet probes). Identifiers pick the
// change up at their next ApplyPolicy.
func (g *Global) SetNodeAddrs(addrs []netip.Addr) error {
	want := make(map[[16]byte]bool, len(addrs))
	for _, a := range addrs {
		want[a.As16()] = true
	}
	for k := range want {
		if err := g.NodeAddrs.Update(k, uint8(1), ebpf.UpdateAny); err != nil {
			return fmt.Errorf("add node address %s: %w", netip.AddrFrom16(k).Unmap(), err)
		}
	}
	var k [16]byte
	var v uint8
	var stale [][16]byte
	it := g.NodeAddrs.Iterate()
	for it.Next(&k, &v) {
		if !want[k] {
			stale = append(stale, k)
		}
	}
	if err := it.Err(); err != nil {
		return fmt.Errorf("list node addresses: %w", err)
	}
	for _, k := range stale {
		if err := g.NodeAddrs.Delete(k); err != nil {
			return fmt.Errorf("remove node address %s: %w", netip.AddrFrom16(k).Unmap(), err)
		}
	}
	return nil
}
