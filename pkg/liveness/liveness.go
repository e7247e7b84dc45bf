// Package liveness is the rule that decides whether an eBPF conntrack entry
// still belongs to a live connection. It is pure (no kernel, no root) so
// that every NAT shape it must cover is a table test.
//
// The datapath keys an entry from the pod's side: src is the pod (the
// owner), dst the peer. The kernel keeps one flow per connection, with an
// original tuple (as the first packet left its sender) and a reply tuple (as
// the answers leave theirs). The pod that opened a connection sees it as the
// original tuple; the pod that accepted it, through any DNAT and SNAT in
// between, sees it as the reply tuple. So an entry is live exactly when its
// {src, sport, dst, dport, proto} equals one of its kernel flow's two
// tuples, which covers same-node ClusterIP (the client's entry is the
// original tuple, the backend's the reply), NodePort with SNAT (the backend
// sees the node's address, as the reply tuple says), a pod's SNAT to the
// outside (the original tuple), hairpin (both), and plain pod-to-pod.
package liveness

import (
	"fmt"
	"net/netip"
	"time"

	"github.com/podfence/podfence/pkg/ipproto"
)

// Key is what the rule compares: one direction of a connection. Addresses
// hold IPv4 in their first 4 bytes. Ports are in host order; ICMP echo
// carries its identifier in both, as the datapath does. Its fields are
// those of ctnetlink.Tuple, in the same order, so a kernel tuple converts
// to a Key directly.
type Key struct {
	Family   uint8 // 4 or 6
	Proto    uint8
	SrcPort  uint16
	DstPort  uint16
	Src, Dst [16]byte
}

// String is the key as "proto src:port -> dst:port".
func (k Key) String() string {
	return fmt.Sprintf("%s %s -> %s", ipproto.Name(k.Proto), k.SrcAddrPort(), k.DstAddrPort())
}

func (k Key) addr(b [16]byte) netip.Addr {
	if k.Family == 4 {
		return netip.AddrFrom4([4]byte(b[:4]))
	}
	return netip.AddrFrom16(b)
}

// SrcAddrPort is the owner's side.
func (k Key) SrcAddrPort() netip.AddrPort { return netip.AddrPortFrom(k.addr(k.Src), k.SrcPort) }

// DstAddrPort is the peer's side.
func (k Key) DstAddrPort() netip.AddrPort { return netip.AddrPortFrom(k.addr(k.Dst), k.DstPort) }

// Reason says why an entry is kept or deleted.
type Reason uint8

const (
	KeptRecent  Reason = iota // a packet since the pass started: a flow the kernel may not show yet
	KeptGrace                 // seen within the grace period (a new flow's entry precedes its kernel flow)
	KeptLive                  // equals the original or reply tuple of a kernel flow
	DeletedGone               // its ifindex is no live member's host veth: the pod is gone
	DeletedDead               // no kernel flow has it as either tuple
)

var reasonNames = [...]string{"recent", "grace", "live", "owner-gone", "no-flow"}

func (r Reason) String() string {
	if int(r) < len(reasonNames) {
		return reasonNames[r]
	}
	return fmt.Sprintf("reason-%d", r)
}

// Delete reports whether the reason is a deletion.
func (r Reason) Delete() bool { return r >= DeletedGone }

// Entry is what the rule knows of one eBPF entry.
type Entry struct {
	Key      Key
	LastSeen time.Duration // CLOCK_MONOTONIC of its last packet
	// OwnerLive: the entry's ifindex is the host veth of a live member.
	OwnerLive bool
	// InKernel: some kernel flow has Key as its original or reply tuple.
	InKernel bool
}

// Pass is the time frame of one reconciliation pass.
type Pass struct {
	Start time.Duration // CLOCK_MONOTONIC when the pass began, before it read the kernel
	Grace time.Duration
}

// Decide applies the rule. Recency comes first: an entry touched since the
// pass began, or within the grace period, is never deleted, whatever else
// is true, because the kernel's view and the members' were read before it.
func (p Pass) Decide(e Entry) Reason {
	switch {
	case e.LastSeen >= p.Start:
		return KeptRecent
	case e.LastSeen+p.Grace >= p.Start:
		return KeptGrace
	case !e.OwnerLive:
		return DeletedGone
	case e.InKernel:
		return KeptLive
	default:
		return DeletedDead
	}
}

// FlowKeys are the two keys a kernel flow keeps alive: its original and
// its reply tuple, each as the pod on that side keys it.
func FlowKeys(orig, reply Key) [2]Key { return [2]Key{orig, reply} }
