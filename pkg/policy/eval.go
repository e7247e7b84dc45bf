package policy

import (
	"net/netip"
	"slices"
)

// Allows is the direct, unoptimised NetworkPolicy evaluation of a connection
// with the remote address addr, IP protocol proto and destination port port
// (the pod's port for ingress, the remote's for egress). It is the reference
// the datapath and Compile are tested against.
//
// addr is unmapped first, so an IPv4-mapped IPv6 address is treated as IPv4;
// an IPv4 address never matches an IPv6 CIDR or the reverse.
func (d DirectionPolicy) Allows(addr netip.Addr, proto uint8, port uint16) bool {
	if !d.Isolated {
		return true
	}
	addr = addr.Unmap().WithZone("")
	for _, r := range d.Rules {
		if !r.CIDR.Contains(addr) || slices.ContainsFunc(r.Except, func(e netip.Prefix) bool { return e.Contains(addr) }) {
			continue
		}
		for _, pr := range r.Ports {
			if pr.Contains(proto, port) {
				return true
			}
		}
	}
	return false
}
