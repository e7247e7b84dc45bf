package adopt

import (
	"fmt"
	"net/netip"

	"github.com/podfence/podfence/bpf"
	"github.com/podfence/podfence/pkg/ctnetlink"
	"github.com/podfence/podfence/pkg/liveness"
	"github.com/podfence/podfence/pkg/membership"
	"github.com/podfence/podfence/pkg/packet"
	"github.com/podfence/podfence/pkg/pinroot"
	"github.com/podfence/podfence/pkg/policy"
)

// tcActShot is the datapath's verdict for a dropped packet (TC_ACT_SHOT).
const tcActShot = 2

// Seeded counts an adopted pod's live flows by what the policy said of
// the direction that opened them.
type Seeded struct{ Allowed, Denied int }

// kernelFlows reads the node's conntrack table once per pass: the flows
// that pods opened, or that were opened to them, before they were adopted.
func kernelFlows() ([]ctnetlink.Flow, error) {
	d, err := ctnetlink.NewDumper()
	if err != nil {
		return nil, err
	}
	defer d.Close()
	var flows []ctnetlink.Flow
	err = d.Dump(func(f *ctnetlink.Flow) error {
		switch policy.Protocol(f.Orig.Proto) {
		case policy.ProtocolTCP, policy.ProtocolUDP, policy.ProtocolSCTP:
			flows = append(flows, *f)
		}
		return nil
	})
	return flows, err
}

// seed judges an adopted member's live flows as they were opened: each
// flow's opening packet is run through the member's program for the
// direction that opened it (Identifier.Seed), so that an allowed flow has
// the entry the datapath would have written at its first packet. A flow
// the pod opened has the pod as the original source (before any DNAT of
// the destination); one opened to it has the pod as the reply's source
// (after the DNAT of a Service), and its packets reach the pod from the
// reply's destination (after any SNAT).
func seed(pins *pinroot.Root, sb Sandbox, flows []ctnetlink.Flow) (Seeded, error) {
	var s Seeded
	g, err := pins.Global()
	if err != nil {
		return s, err
	}
	id, err := pins.FindContainer(sb.ID, IfName)
	if err != nil {
		return s, err
	}
	lock, err := pins.Lock(id)
	if err != nil {
		return s, err
	}
	defer lock.Unlock()
	m, err := lock.Member(membership.Key(sb.ID, IfName))
	if err != nil {
		return s, err
	}
	ident, err := lock.OpenExisting()
	if err != nil {
		return s, err
	}
	defer ident.Close()
	own := map[netip.Addr]bool{}
	for _, a := range m.Sources() {
		own[a] = true
	}
	for _, f := range flows {
		dir, pkt, ok := opening(f, own)
		if !ok {
			continue
		}
		ret, err := ident.Seed(dir, pkt.Marshal(), uint32(m.HostIfindex))
		if err != nil {
			return s, fmt.Errorf("%s %s: %w", id, dir, err)
		}
		if ret == tcActShot {
			// A packet between the attach and this seed may have written
			// an entry as if it opened the flow: the policy refuses the
			// flow as it was opened, so it goes.
			if _, err := g.DeleteConntrack([]bpf.CTEntry{ctEntry(dir, pkt, uint32(m.HostIfindex))}); err != nil {
				return s, err
			}
			s.Denied++
		} else {
			s.Allowed++
		}
	}
	return s, nil
}

// ctEntry is the conntrack entry the datapath keys pkt's flow by: from
// the pod's side (the pod as source), on its host veth.
func ctEntry(dir policy.Direction, pkt packet.Packet, ifindex uint32) bpf.CTEntry {
	pod, peer, podPort, peerPort := pkt.Src, pkt.Dst, pkt.SrcPort, pkt.DstPort
	if dir == policy.Ingress {
		pod, peer, podPort, peerPort = pkt.Dst, pkt.Src, pkt.DstPort, pkt.SrcPort
	}
	k := liveness.Key{Family: 6, Proto: pkt.Proto, SrcPort: podPort, DstPort: peerPort}
	if pod.Is4() {
		k.Family = 4
		a, b := pod.As4(), peer.As4()
		copy(k.Src[:], a[:])
		copy(k.Dst[:], b[:])
	} else {
		k.Src, k.Dst = pod.As16(), peer.As16()
	}
	return bpf.CTEntry{Key: k, Ifindex: ifindex}
}

// opening is the first packet of f as the pod's veth saw it, and the
// direction it went, when one end of f is the pod (own).
func opening(f ctnetlink.Flow, own map[netip.Addr]bool) (policy.Direction, packet.Packet, bool) {
	addr := func(t ctnetlink.Tuple, b [16]byte) netip.Addr {
		if t.Family == 4 {
			return netip.AddrFrom4([4]byte(b[:4]))
		}
		return netip.AddrFrom16(b)
	}
	o, r := f.Orig, f.Reply
	// The packets are SYNs for TCP (Packet's zero TCPFlags).
	switch {
	case own[addr(o, o.Src)]:
		return policy.Egress, packet.Packet{Src: addr(o, o.Src), Dst: addr(o, o.Dst), Proto: o.Proto,
			SrcPort: o.SrcPort, DstPort: o.DstPort}, true
	case own[addr(r, r.Src)]:
		return policy.Ingress, packet.Packet{Src: addr(r, r.Dst), Dst: addr(r, r.Src), Proto: o.Proto,
			SrcPort: r.DstPort, DstPort: r.SrcPort}, true
	}
	return 0, packet.Packet{}, false
}
