package bpf

import (
	"fmt"

	"github.com/cilium/ebpf"

	"github.com/podfence/podfence/pkg/policy"
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
	ReasonCTEstablished  Reason = iota // conntrack hit in the flow's own direction
	ReasonCTReply                      // conntrack hit of the reversed tuple
	ReasonPolicyAllow                  // new flow allowed by a rule
	ReasonNotIsolated                  // new flow in a direction no policy isolates
	ReasonNode                         // new flow from one of the node's addresses
	ReasonNotIP                        // not IPv4/IPv6: passed
	ReasonPolicyDeny                   // new flow no rule allows: dropped
	ReasonRevoked                      // tracked flow the current policy no longer allows: dropped
	ReasonMalformed                    // truncated or malformed IP packet: dropped
	ReasonCTRelated                    // ICMP error about a tracked flow ("packet too big")
	ReasonND                           // IPv6 link control (neighbour discovery, MLD): passed like ARP
	ReasonSpoofed                      // from the pod with a source that is not its own: dropped
	ReasonAdminAccept                  // new flow an Admin tier rule accepts
	ReasonAdminDeny                    // new flow an Admin tier rule denies: dropped
	ReasonBaselineAccept               // new flow a Baseline tier rule accepts
	ReasonBaselineDeny                 // new flow a Baseline tier rule denies: dropped
	ReasonUntranslated                 // flow to a Service whose translation could not be read: dropped
	NumReasons
)

var reasonNames = [NumReasons]string{
	"ct-established", "ct-reply", "policy-allow", "not-isolated", "node",
	"not-ip", "policy-deny", "revoked", "malformed", "ct-related",
	"neighbor-discovery", "spoofed", "admin-accept", "admin-deny",
	"baseline-accept", "baseline-deny", "untranslated",
}

func (r Reason) String() string {
	if r < NumReasons {
		return reasonNames[r]
	}
	return fmt.Sprintf("reason(%d)", uint8(r))
}

// Tier names the cluster policy tier that gives r ("Admin", "Baseline"),
// or is empty for a reason of another layer.
func (r Reason) Tier() string {
	switch r {
	case ReasonAdminAccept, ReasonAdminDeny:
		return policy.TierAdmin.String()
	case ReasonBaselineAccept, ReasonBaselineDeny:
		return policy.TierBaseline.String()
	}
	return ""
}

// Verdict is the verdict the programs give for r.
func (r Reason) Verdict() uint32 {
	switch r {
	case ReasonPolicyDeny, ReasonRevoked, ReasonMalformed, ReasonSpoofed, ReasonAdminDeny, ReasonBaselineDeny, ReasonUntranslated:
		return VerdictDrop
	}
	return VerdictAllow
}

// Counters are an identifier's packet counts summed over CPUs, by
// [direction][reason] (direction 0 ingress, 1 egress).
type Counters [2][NumReasons]uint64

// ReadCounters sums the identifier's per-CPU counters.
func (i *Datapath) ReadCounters() (Counters, error) {
	c, err := readCounters(i.Counters)
	if err != nil {
		return c, fmt.Errorf("read counters of %q: %w", i.ID, err)
	}
	return c, nil
}

func readCounters(m *ebpf.Map) (Counters, error) {
	var c Counters
	for d := range c {
		for r := range c[d] {
			var perCPU []uint64
			idx := uint32(d*int(NumReasons) + r)
			if err := m.Lookup(idx, &perCPU); err != nil {
				return c, err
			}
			for _, n := range perCPU {
				c[d][r] += n
			}
		}
	}
	return c, nil
}
