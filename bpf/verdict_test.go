package bpf

import (
	"errors"
	"net/netip"
	"testing"

	"github.com/podfence/podfence/pkg/packet"
	"github.com/podfence/podfence/pkg/policy"
)

// The pod under test and the peers it talks to.
const (
	pod4  = "10.0.0.10"
	pod6  = "fd00::10"
	peer4 = "10.1.2.3"
	peer6 = "fd01::3"
	node4 = "192.168.0.1"
	node6 = "fd99::1"
	// routers on the path, which send ICMP errors
	router4 = "172.16.0.1"
	router6 = "fd77::1"
)

var (
	in  = policy.Ingress
	out = policy.Egress
)

// step runs one frame through the program of one direction and expects a
// reason (and so a verdict); a step with apply set reprograms the policy instead.
type step struct {
	dir   policy.Direction
	frame []byte
	want  Reason
	apply *policy.Set
}

func send(d policy.Direction, p packet.Packet, want Reason) step {
	return step{dir: d, frame: p.Marshal(), want: want}
}

func raw(d policy.Direction, frame []byte, want Reason) step {
	return step{dir: d, frame: frame, want: want}
}

func change(s policy.Set) step { return step{apply: &s} }

func withID(p packet.Packet, id uint16) packet.Packet {
	p.IPID = id
	return p
}

// nd is an ICMPv6 message of type typ with the given hop limit.
func nd(src, dst string, typ, hopLimit uint8) packet.Packet {
	return packet.Packet{Src: ip(src), Dst: ip(dst), Proto: 58, ICMPType: typ, TTL: hopLimit}
}

func withPayload(p packet.Packet, b []byte) packet.Packet {
	p.Payload = b
	return p
}

type verdictCase struct {
	name  string
	set   policy.Set
	steps []step
}

// patch returns a copy of frame with byte i set to v.
func patch(frame []byte, i int, v byte) []byte {
	out := append([]byte(nil), frame...)
	out[i] = v
	return out
}

func extHdrs(types ...uint8) []packet.ExtHeader {
	var hs []packet.ExtHeader
	for _, t := range types {
		h := packet.ExtHeader{Type: t}
		if t == 51 {
			h.Len = 16
		}
		hs = append(hs, h)
	}
	return hs
}

func verdictCases() []verdictCase {
	web80 := isolate(rules(rule("10.1.0.0/16", tcpPort(80))), nil)
	web80v6 := isolate(rules(rule("fd01::/64", tcpPort(80))), nil)
	denyAllIn := isolate(rules(), nil)
	denyAllOut := isolate(nil, rules())
	denyBoth := isolate(rules(), rules())
	allowAllIn := isolate(rules(rule("0.0.0.0/0"), rule("::/0")), rules())

	tcpIn := tcp(peer4, pod4, 40000, 80)
	tcpIn6 := tcp(peer6, pod6, 40000, 80)

	withOpts := func(p packet.Packet, n int) packet.Packet {
		p.IPOptions = make([]byte, n)
		for i := range p.IPOptions {
			p.IPOptions[i] = 1 // NOP
		}
		return p
	}
	frag4 := func(p packet.Packet, off uint16, more bool) packet.Packet {
		p.FragOffset, p.MoreFragments = off, more
		return p
	}
	ext := func(p packet.Packet, hs ...packet.ExtHeader) packet.Packet {
		p.ExtHeaders = hs
		return p
	}
	frag6 := packet.ExtHeader{Type: 44, FragOffset: 10}
	frag6first := packet.ExtHeader{Type: 44, MoreFragments: true}

	ranges64 := make([]policy.PortRange, 0, 64)
	for i := uint16(0); i < 64; i++ {
		ranges64 = append(ranges64, tcpPort(1000+2*i))
	}

	return []verdictCase{
		// Non-IP and malformed input. Frames cut inside the fixed IPv4 or
		// IPv6 header cannot be fed in: BPF_PROG_TEST_RUN refuses them
		// (EINVAL). The programs' bounds checks for them are what the
		// verifier proves at load time.
		{"arp passes both ways", denyBoth, []step{raw(in, packet.ARP(), ReasonNotIP), raw(out, packet.ARP(), ReasonNotIP)}},
		{"v4 ihl below 5", allowAllIn, []step{raw(in, patch(tcpIn.Marshal(), 14, 0x44), ReasonMalformed)}},
		{"v4 wrong version", allowAllIn, []step{raw(in, patch(tcpIn.Marshal(), 14, 0x65), ReasonMalformed)}},
		{"v4 options cut", allowAllIn, []step{raw(in, packet.Truncate(withOpts(tcpIn, 8).Marshal(), 14+24), ReasonMalformed)}},
		{"v4 ports cut", allowAllIn, []step{raw(in, packet.Truncate(tcpIn.Marshal(), tcpIn.L4Offset()+3), ReasonMalformed)}},
		{"v4 tcp header cut before its flags", allowAllIn, []step{raw(in, packet.Truncate(tcpIn.Marshal(), tcpIn.L4Offset()+13), ReasonMalformed)}},
		{"v4 udp needs only its ports", allowAllIn, []step{raw(in, packet.Truncate(udp(peer4, pod4, 1, 53).Marshal(), tcpIn.L4Offset()+4), ReasonPolicyAllow)}},
		{"v4 icmp header cut", allowAllIn, []step{raw(in, packet.Truncate(echo(peer4, pod4, 7).Marshal(), 14+20+7), ReasonMalformed)}},
		{"v4 ihl beyond frame", allowAllIn, []step{raw(in, packet.Truncate(withOpts(tcpIn, 40).Marshal(), 14+40), ReasonMalformed)}},
		{"v6 wrong version", allowAllIn, []step{raw(in, patch(tcpIn6.Marshal(), 14, 0x40), ReasonMalformed)}},
		{"v6 ports cut", allowAllIn, []step{raw(in, packet.Truncate(tcpIn6.Marshal(), tcpIn6.L4Offset()+2), ReasonMalformed)}},
		{"v6 ext header cut", allowAllIn, []step{raw(in, packet.Truncate(ext(tcpIn6, extHdrs(0)...).Marshal(), 14+40+1), ReasonMalformed)}},
		{"v6 ext header longer than frame", allowAllIn, []step{raw(in, packet.Truncate(ext(tcpIn6, packet.ExtHeader{Type: 60, Len: 64}).Marshal(), 14+40+32), ReasonMalformed)}},
		{"v6 nine ext headers", allowAllIn, []step{send(in, ext(tcpIn6, extHdrs(0, 60, 60, 60, 60, 60, 60, 60, 60)...), ReasonMalformed)}},
		{"v6 eight ext headers", allowAllIn, []step{send(in, ext(tcpIn6, extHdrs(0, 60, 43, 60, 51, 60, 60, 60)...), ReasonPolicyAllow)}},

		// Rule kinds, IPv4.
		{"cidr and port allow", web80, []step{send(in, tcpIn, ReasonPolicyAllow)}},
		{"other port denied", web80, []step{send(in, tcp(peer4, pod4, 40000, 81), ReasonPolicyDeny)}},
		{"other address denied", web80, []step{send(in, tcp("10.2.0.1", pod4, 40000, 80), ReasonPolicyDeny)}},
		{"prefix boundary", web80, []step{
			send(in, tcp("10.1.255.255", pod4, 1, 80), ReasonPolicyAllow),
			send(in, tcp("10.0.255.255", pod4, 1, 80), ReasonPolicyDeny),
			send(in, tcp("10.2.0.0", pod4, 1, 80), ReasonPolicyDeny)}},
		{"protocol must match", web80, []step{send(in, udp(peer4, pod4, 40000, 80), ReasonPolicyDeny)}},
		{"udp port", isolate(rules(rule("10.1.0.0/16", udpPort(53))), nil), []step{
			send(in, udp(peer4, pod4, 999, 53), ReasonPolicyAllow), send(in, tcp(peer4, pod4, 999, 53), ReasonPolicyDeny)}},
		{"sctp port", isolate(rules(rule("10.1.0.0/16", ports(policy.ProtocolSCTP, 3868, 3868))), nil), []step{
			send(in, withProto(tcp(peer4, pod4, 5, 3868), 132), ReasonPolicyAllow), send(in, tcp(peer4, pod4, 5, 3868), ReasonPolicyDeny)}},
		{"protocol-only rule", isolate(rules(rule("10.1.0.0/16", ports(policy.ProtocolUDP, 0, 65535))), nil), []step{
			send(in, udp(peer4, pod4, 1, 1), ReasonPolicyAllow), send(in, udp(peer4, pod4, 1, 65535), ReasonPolicyAllow),
			send(in, tcp(peer4, pod4, 1, 1), ReasonPolicyDeny)}},
		{"no ports allows every protocol", isolate(rules(rule("10.1.0.0/16")), nil), []step{
			send(in, tcp(peer4, pod4, 1, 9), ReasonPolicyAllow), send(in, echo(peer4, pod4, 3), ReasonPolicyAllow),
			send(in, withProto(udp(peer4, pod4, 0, 0), 47), ReasonPolicyAllow)}},
		{"other protocol needs a portless rule", web80, []step{send(in, withProto(tcp(peer4, pod4, 0, 0), 47), ReasonPolicyDeny)}},
		{"endPort range", isolate(rules(rule("10.1.0.0/16", ports(policy.ProtocolTCP, 8000, 8100))), nil), []step{
			send(in, tcp(peer4, pod4, 1, 8000), ReasonPolicyAllow), send(in, tcp(peer4, pod4, 2, 8050), ReasonPolicyAllow),
			send(in, tcp(peer4, pod4, 3, 8100), ReasonPolicyAllow), send(in, tcp(peer4, pod4, 4, 7999), ReasonPolicyDeny),
			send(in, tcp(peer4, pod4, 5, 8101), ReasonPolicyDeny)}},
		{"64 port ranges, last one matches", isolate(rules(rule("10.1.0.0/16", ranges64...)), nil), []step{
			send(in, tcp(peer4, pod4, 1, 1126), ReasonPolicyAllow), send(in, tcp(peer4, pod4, 1, 1000), ReasonPolicyAllow),
			send(in, tcp(peer4, pod4, 1, 1127), ReasonPolicyDeny)}},
		{"except removes its rule's allowance", isolate(rules(except(rule("10.1.0.0/16"), "10.1.2.0/24")), nil), []step{
			send(in, tcpIn, ReasonPolicyDeny), send(in, tcp("10.1.3.3", pod4, 40000, 80), ReasonPolicyAllow)}},
		{"except does not remove another rule's allowance", isolate(rules(except(rule("10.1.0.0/16"), "10.1.2.0/24"), rule("10.0.0.0/8", tcpPort(80))), nil), []step{
			send(in, tcpIn, ReasonPolicyAllow), send(in, tcp(peer4, pod4, 40000, 81), ReasonPolicyDeny)}},
		{"longer prefix does not hide shorter", isolate(rules(rule("10.0.0.0/8", tcpPort(80)), rule("10.1.2.0/24", tcpPort(443))), nil), []step{
			send(in, tcp(peer4, pod4, 1, 80), ReasonPolicyAllow), send(in, tcp(peer4, pod4, 1, 443), ReasonPolicyAllow),
			send(in, tcp("10.9.0.1", pod4, 1, 443), ReasonPolicyDeny)}},
		{"host /32 rule", isolate(rules(rule("10.1.2.3/32")), nil), []step{
			send(in, tcpIn, ReasonPolicyAllow), send(in, tcp("10.1.2.4", pod4, 40000, 80), ReasonPolicyDeny)}},
		{"v4 /0 does not allow v6", isolate(rules(rule("0.0.0.0/0")), nil), []step{
			send(in, tcpIn, ReasonPolicyAllow), send(in, tcpIn6, ReasonPolicyDeny)}},
		{"isolated without rules denies all", denyAllIn, []step{
			send(in, tcpIn, ReasonPolicyDeny), send(in, echo(peer4, pod4, 1), ReasonPolicyDeny), send(in, tcpIn6, ReasonPolicyDeny)}},
		{"egress rule", isolate(nil, rules(rule("10.96.0.10/32", udpPort(53)))), []step{
			send(out, udp(pod4, "10.96.0.10", 5000, 53), ReasonPolicyAllow), send(out, udp(pod4, "10.96.0.11", 5000, 53), ReasonPolicyDeny),
			send(in, tcpIn, ReasonNotIsolated)}},
		{"egress isolated without rules", denyAllOut, []step{send(out, tcp(pod4, peer4, 1, 80), ReasonPolicyDeny)}},

		// Modes and the node.
		{"standard mode, unselected, allows", policy.Set{Mode: policy.ModeStandard}, []step{
			send(in, tcpIn, ReasonNotIsolated), send(out, tcp(pod4, peer4, 1, 80), ReasonNotIsolated)}},
		{"strict mode, unselected, denies", policy.Set{Mode: policy.ModeStrict, Ingress: policy.DirectionPolicy{Isolated: true}, Egress: policy.DirectionPolicy{Isolated: true}}, []step{
			send(in, tcpIn, ReasonPolicyDeny), send(out, tcp(pod4, peer4, 1, 80), ReasonPolicyDeny)}},
		{"node address always allowed in", denyBoth, []step{
			send(in, tcp(node4, pod4, 5555, 8080), ReasonNode), send(out, tcp(pod4, node4, 8080, 5555), ReasonCTReply)}},
		{"node v6 address always allowed in", denyBoth, []step{send(in, tcp(node6, pod6, 5555, 8080), ReasonNode)}},
		{"node inside a rule's except is still allowed", isolate(rules(except(rule("192.168.0.0/16", tcpPort(80)), "192.168.0.0/24")), nil), []step{
			send(in, syn(tcp(node4, pod4, 5555, 8080)), ReasonNode), send(in, syn(tcp("192.168.0.2", pod4, 5555, 80)), ReasonPolicyDeny),
			send(in, syn(tcp("192.168.1.2", pod4, 5555, 80)), ReasonPolicyAllow)}},
		{"pod to node is policy", denyBoth, []step{send(out, tcp(pod4, node4, 1, 10250), ReasonPolicyDeny)}},

		// Conntrack.
		{"second packet hits conntrack", web80, []step{send(in, tcpIn, ReasonPolicyAllow), send(in, tcpIn, ReasonCTEstablished)}},
		{"syn opens, ack and syn-ack follow", isolate(rules(rule("10.1.0.0/16", tcpPort(80))), rules()), []step{
			send(in, syn(tcpIn), ReasonPolicyAllow), send(out, syn(tcpIn).Reply(), ReasonCTReply), send(in, tcpIn, ReasonCTEstablished)}},
		{"syn is judged by policy even when tracked", web80, []step{
			send(in, tcpIn, ReasonPolicyAllow), change(denyAllIn), send(in, syn(tcpIn), ReasonPolicyDeny)}},
		{"portless protocol is one flow both ways", isolate(rules(), rules(rule("10.1.0.0/16"))), []step{
			send(out, withProto(tcp(pod4, peer4, 0, 0), 47), ReasonPolicyAllow), send(in, withProto(tcp(peer4, pod4, 0, 0), 47), ReasonCTReply)}},
		{"reply passes isolated egress", isolate(rules(rule("10.1.0.0/16", tcpPort(80))), rules()), []step{
			send(in, tcpIn, ReasonPolicyAllow), send(out, tcpIn.Reply(), ReasonCTReply), send(out, tcp(pod4, peer4, 80, 40001), ReasonPolicyDeny)}},
		{"egress flow reply passes isolated ingress", isolate(rules(), rules(rule("10.1.0.0/16"))), []step{
			send(out, tcp(pod4, peer4, 40000, 443), ReasonPolicyAllow), send(in, tcp(peer4, pod4, 443, 40000), ReasonCTReply),
			send(in, tcp(peer4, pod4, 443, 40001), ReasonPolicyDeny)}},
		{"reply without a flow is denied", denyBoth, []step{send(out, tcpIn.Reply(), ReasonPolicyDeny)}},
		{"not isolated direction still tracks for replies", isolate(nil, rules()), []step{
			send(in, tcpIn, ReasonNotIsolated), send(out, tcpIn.Reply(), ReasonCTReply)}},
		{"flows are per owner", isolate(rules(rule("10.1.0.0/16", tcpPort(80))), nil), []step{
			send(in, tcpIn, ReasonPolicyAllow), send(in, tcp(peer4, "10.0.0.11", 40000, 80), ReasonPolicyAllow)}},
		{"icmp echo reply tracked", isolate(rules(), rules(rule("10.1.0.0/16"))), []step{
			send(out, echo(pod4, peer4, 77), ReasonPolicyAllow), send(in, echo(pod4, peer4, 77).Reply(), ReasonCTReply),
			send(in, echo(pod4, peer4, 78).Reply(), ReasonPolicyDeny)}},
		{"icmpv6 echo reply tracked", isolate(rules(), rules(rule("fd01::/64"))), []step{
			send(out, echo(pod6, peer6, 77), ReasonPolicyAllow), send(in, echo(pod6, peer6, 77).Reply(), ReasonCTReply)}},
		{"udp reply tracked v6", isolate(rules(), rules(rule("fd01::/64", udpPort(53)))), []step{
			send(out, udp(pod6, peer6, 3333, 53), ReasonPolicyAllow), send(in, udp(peer6, pod6, 53, 3333), ReasonCTReply),
			send(out, udp(pod6, peer6, 3333, 53), ReasonCTEstablished)}},

		// ICMP errors about tracked flows (RFC 792, RFC 4443): allowed as
		// related while the flow is, whoever sends them; judged as flows
		// of their own otherwise.
		{"frag needed for an egress flow passes isolated ingress", isolate(rules(), rules(rule("10.1.0.0/16"))), []step{
			send(out, syn(tcp(pod4, peer4, 40000, 443)), ReasonPolicyAllow),
			send(in, packet.ICMPError(ip(router4), tcp(pod4, peer4, 40000, 443), 3), ReasonCTRelated),
			send(in, packet.ICMPError(ip(router4), tcp(pod4, peer4, 40001, 443), 3), ReasonPolicyDeny),
			send(in, packet.ICMPError(ip(router4), tcp(pod4, peer4, 40000, 443).Reply(), 3), ReasonPolicyDeny)}},
		{"packet too big for an egress flow v6", isolate(rules(), rules(rule("fd01::/64"))), []step{
			send(out, syn(tcp(pod6, peer6, 40000, 443)), ReasonPolicyAllow),
			send(in, packet.ICMPError(ip(router6), tcp(pod6, peer6, 40000, 443), 2), ReasonCTRelated)}},
		{"packet too big quoting extension headers v6", isolate(rules(), rules(rule("fd01::/64"))), []step{
			send(out, ext(syn(tcp(pod6, peer6, 40000, 443)), extHdrs(0, 60)...), ReasonPolicyAllow),
			send(in, packet.ICMPError(ip(router6), ext(tcp(pod6, peer6, 40000, 443), extHdrs(0, 60)...), 2), ReasonCTRelated),
			send(in, packet.ICMPError(ip(router6), ext(tcp(pod6, peer6, 40000, 443), frag6first), 2), ReasonCTRelated),
			send(in, packet.ICMPError(ip(router6), ext(tcp(pod6, peer6, 40001, 443), extHdrs(0, 60)...), 2), ReasonPolicyDeny),
			// Past MAX_QUOTED_EXT_HDRS the quote is not read.
			send(out, ext(syn(tcp(pod6, peer6, 40002, 443)), extHdrs(0, 60, 43, 60, 60)...), ReasonPolicyAllow),
			send(in, packet.ICMPError(ip(router6), ext(tcp(pod6, peer6, 40002, 443), extHdrs(0, 60, 43, 60)...), 2), ReasonCTRelated),
			send(in, packet.ICMPError(ip(router6), ext(tcp(pod6, peer6, 40002, 443), extHdrs(0, 60, 43, 60, 60)...), 2), ReasonPolicyDeny)}},
		{"error about a later fragment is judged alone v6", isolate(rules(), rules(rule("fd01::/64"))), []step{
			send(out, ext(udp(pod6, peer6, 3333, 53), frag6first), ReasonPolicyAllow),
			send(in, packet.ICMPError(ip(router6), ext(udp(pod6, peer6, 3333, 53), frag6), 3), ReasonPolicyDeny)}},
		{"port unreachable from the peer v6", isolate(rules(), rules(rule("fd01::/64", udpPort(53)))), []step{
			send(out, udp(pod6, peer6, 3333, 53), ReasonPolicyAllow),
			send(in, packet.ICMPError(ip(peer6), udp(pod6, peer6, 3333, 53), 1), ReasonCTRelated)}},
		{"pod's error about an ingress flow passes isolated egress", isolate(rules(rule("10.1.0.0/16", tcpPort(80))), rules()), []step{
			send(in, tcpIn, ReasonPolicyAllow),
			send(out, packet.ICMPError(ip(pod4), tcpIn, 3), ReasonCTRelated)}},
		{"time exceeded for a ping", isolate(rules(), rules(rule("10.1.0.0/16"))), []step{
			send(out, echo(pod4, peer4, 9), ReasonPolicyAllow),
			send(in, packet.ICMPError(ip(router4), echo(pod4, peer4, 9), 11), ReasonCTRelated),
			send(in, packet.ICMPError(ip(router4), echo(pod4, peer4, 10), 11), ReasonPolicyDeny)}},
		{"error about a revoked flow is denied", isolate(rules(), rules(rule("10.1.0.0/16"))), []step{
			send(out, syn(tcp(pod4, peer4, 40000, 443)), ReasonPolicyAllow), change(denyBoth),
			send(in, packet.ICMPError(ip(router4), tcp(pod4, peer4, 40000, 443), 3), ReasonPolicyDeny)}},
		{"error quoting another pod's flow is denied", isolate(rules(), rules(rule("10.1.0.0/16"))), []step{
			send(out, syn(tcp(pod4, peer4, 40000, 443)), ReasonPolicyAllow),
			send(in, packet.ICMPError(ip(router4), tcp("10.0.0.11", peer4, 40000, 443), 3), ReasonPolicyDeny)}},
		{"error with its quote cut is judged alone", isolate(rules(), rules(rule("10.1.0.0/16"))), []step{
			send(out, syn(tcp(pod4, peer4, 40000, 443)), ReasonPolicyAllow),
			raw(in, packet.Truncate(packet.ICMPError(ip(router4), tcp(pod4, peer4, 40000, 443), 3).Marshal(), 14+20+8+20+3), ReasonPolicyDeny)}},
		{"error about a later fragment is judged alone", isolate(rules(), rules(rule("10.1.0.0/16"))), []step{
			send(out, frag4(udp(pod4, peer4, 0, 0), 100, false), ReasonPolicyAllow),
			send(in, packet.ICMPError(ip(router4), frag4(udp(pod4, peer4, 0, 0), 100, false), 11), ReasonPolicyDeny)}},
		{"echo request with a quote is not an error", isolate(rules(), rules(rule("10.1.0.0/16"))), []step{
			send(out, echo(pod4, peer4, 9), ReasonPolicyAllow),
			send(in, withPayload(echo(router4, pod4, 5), packet.ICMPError(ip(router4), echo(pod4, peer4, 9), 11).Payload), ReasonPolicyDeny)}},

		// IPv6 neighbour discovery passes like ARP, but only from the link.
		{"neighbour discovery passes closed directions", denyBoth, []step{
			send(out, nd("fe80::10", "ff02::1:ff00:1", 135, 255), ReasonND),
			send(in, nd("fe80::1", "fe80::10", 136, 255), ReasonND),
			send(out, nd("fe80::10", "ff02::2", 133, 255), ReasonND),
			send(in, nd("fe80::1", "ff02::1", 134, 255), ReasonND),
			send(in, nd("fe80::1", "fe80::10", 137, 255), ReasonND),
			send(in, nd("::", "ff02::1:ff00:10", 135, 255), ReasonND)}},
		{"neighbour discovery from beyond the link is a flow", denyBoth, []step{
			send(in, nd(peer6, pod6, 135, 64), ReasonPolicyDeny),
			send(in, nd(peer6, pod6, 136, 254), ReasonPolicyDeny)}},
		{"other icmpv6 with hop limit 255 is a flow", denyBoth, []step{
			send(in, nd(peer6, pod6, 130, 255), ReasonPolicyDeny),
			send(in, nd(peer6, pod6, 138, 255), ReasonPolicyDeny)}},
		{"icmpv6 types in ipv4 are not neighbour discovery", denyBoth, []step{
			send(in, nd(peer4, pod4, 135, 255), ReasonPolicyDeny)}},
		// Multicast listener messages stay on the link: from the
		// link-local or unspecified address, hop limit 1, to a
		// link-scope group (the pod's kernel sends reports with a
		// hop-by-hop router alert in front).
		{"multicast listener reports pass closed directions", denyBoth, []step{
			send(out, ext(nd("fe80::10", "ff02::16", 143, 1), packet.ExtHeader{Type: 0}), ReasonND),
			send(out, nd("::", "ff02::16", 143, 1), ReasonND),
			send(out, nd("fe80::10", "ff02::2", 132, 1), ReasonND),
			send(in, nd("fe80::1", "ff02::1", 130, 1), ReasonND)}},
		{"multicast listener messages off the link are flows", denyBoth, []step{
			send(in, nd(peer6, "ff02::16", 143, 1), ReasonPolicyDeny),
			send(in, nd("fe80::1", "ff05::16", 143, 1), ReasonPolicyDeny),
			send(in, nd("fe80::1", "ff02::16", 143, 2), ReasonPolicyDeny),
			send(out, nd(pod6, "ff02::16", 143, 1), ReasonPolicyDeny)}},

		// A pod speaks only for itself: a new flow from the pod with a
		// source not its own is dropped before anything is tracked, on
		// every path (policy, not isolated, node peers, ICMP errors).
		{"forged sources in egress", isolate(nil, rules(rule("0.0.0.0/0"), rule("::/0"))), []step{
			send(out, syn(tcp(peer4, "10.9.0.1", 40000, 80)), ReasonSpoofed),
			send(out, tcp(peer4, "10.9.0.1", 40000, 80), ReasonSpoofed),
			send(out, udp(peer4, "10.9.0.1", 40000, 53), ReasonSpoofed),
			send(out, syn(tcp("10.0.0.11", "10.9.0.1", 40000, 80)), ReasonSpoofed), // a neighbour in the pod's /24
			send(out, syn(tcp(node4, "10.9.0.1", 40000, 80)), ReasonSpoofed),
			send(out, syn(tcp(peer6, "fd09::1", 40000, 80)), ReasonSpoofed),
			send(out, withOpts(syn(tcp(peer4, "10.9.0.1", 40000, 80)), 12), ReasonSpoofed),
			send(out, ext(udp(peer6, "fd09::1", 40000, 53), packet.ExtHeader{Type: 0}, packet.ExtHeader{Type: 60}), ReasonSpoofed),
			send(out, frag4(udp(peer4, "10.9.0.1", 0, 0), 100, false), ReasonSpoofed),
			send(out, echo(peer4, "10.9.0.1", 3), ReasonSpoofed),
			send(out, syn(tcp(pod4, "10.9.0.1", 40000, 80)), ReasonPolicyAllow),
			send(out, withOpts(syn(tcp(pod4, "10.9.0.1", 40001, 80)), 12), ReasonPolicyAllow),
			send(out, ext(udp(pod6, "fd09::1", 40000, 53), packet.ExtHeader{Type: 0}, packet.ExtHeader{Type: 60}), ReasonPolicyAllow)}},
		{"forged sources where egress is not isolated", web80, []step{
			send(out, syn(tcp(peer4, "10.9.0.1", 40000, 80)), ReasonSpoofed),
			send(out, udp(peer6, "fd09::1", 40000, 53), ReasonSpoofed),
			send(out, syn(tcp(pod4, "10.9.0.1", 40000, 80)), ReasonNotIsolated)}},
		{"forged node address to the pod's own peer", isolate(rules(), nil), []step{
			// The node's address is allowed into every pod: a pod that
			// could send with it would pass every ingress policy.
			send(out, syn(tcp(node4, pod4, 40000, 80)), ReasonSpoofed),
			send(in, syn(tcp(node4, pod4, 40000, 80)), ReasonNode)}},
		{"a forged reply opens nothing", isolate(rules(), nil), []step{
			// The upstream agent's conntrack poisoning: a "reply" from
			// another pod's service port (10.0.0.20:8080) to a peer,
			// which, tracked, would let the peer's packets in as its
			// replies.
			send(out, tcp("10.0.0.20", peer4, 8080, 40000), ReasonSpoofed),
			send(in, tcp(peer4, "10.0.0.20", 40000, 8080), ReasonPolicyDeny)}},
		{"icmp errors from the pod carry its address", isolate(rules(rule("10.1.0.0/16")), rules()), []step{
			send(in, syn(tcp(peer4, pod4, 40000, 80)), ReasonPolicyAllow),
			send(out, packet.ICMPError(ip(router4), syn(tcp(peer4, pod4, 40000, 80)), 3), ReasonSpoofed),
			send(out, packet.ICMPError(ip(pod4), syn(tcp(peer4, pod4, 40000, 80)), 3), ReasonCTRelated)}},
		{"neighbour discovery in another's name", denyBoth, []step{
			send(out, nd("fd00::99", "ff02::1", 136, 255), ReasonSpoofed),
			send(out, nd(pod6, "ff02::1", 136, 255), ReasonND),
			send(out, nd("::", "ff02::1:ff00:10", 135, 255), ReasonND)}},

		// Policy changes and generations.
		{"revoked flow dropped on next packet", web80, []step{
			send(in, tcpIn, ReasonPolicyAllow), change(denyAllIn), send(in, tcpIn, ReasonRevoked), send(in, tcpIn, ReasonPolicyDeny)}},
		{"revoked flow's reply dropped", isolate(rules(rule("10.1.0.0/16", tcpPort(80))), rules()), []step{
			send(in, tcpIn, ReasonPolicyAllow), send(out, tcpIn.Reply(), ReasonCTReply), change(denyBoth),
			send(out, tcpIn.Reply(), ReasonRevoked)}},
		{"flow still allowed survives a change", web80, []step{
			send(in, tcpIn, ReasonPolicyAllow), change(isolate(rules(rule("10.0.0.0/8", tcpPort(80))), nil)),
			send(in, tcpIn, ReasonCTEstablished), send(in, tcpIn, ReasonCTEstablished)}},
		{"isolation lifted keeps flows", web80, []step{
			send(in, tcpIn, ReasonPolicyAllow), change(policy.Set{Mode: policy.ModeStandard}), send(in, tcpIn, ReasonCTEstablished)}},
		{"egress revoked", isolate(nil, rules(rule("10.1.0.0/16"))), []step{
			send(out, tcp(pod4, peer4, 1, 80), ReasonPolicyAllow), change(denyAllOut), send(out, tcp(pod4, peer4, 1, 80), ReasonRevoked)}},
		{"new policy allows what was denied", denyAllIn, []step{
			send(in, tcpIn, ReasonPolicyDeny), change(web80), send(in, tcpIn, ReasonPolicyAllow)}},
		{"node flow survives any change", denyAllIn, []step{
			send(in, tcp(node4, pod4, 1, 8080), ReasonNode), change(denyBoth), send(in, tcp(node4, pod4, 1, 8080), ReasonCTEstablished)}},

		// IPv4 options and fragments.
		{"v4 options 4 bytes", web80, []step{send(in, withOpts(tcpIn, 4), ReasonPolicyAllow), send(in, withOpts(tcp(peer4, pod4, 1, 81), 4), ReasonPolicyDeny)}},
		{"v4 options 40 bytes", web80, []step{send(in, withOpts(tcpIn, 40), ReasonPolicyAllow), send(in, withOpts(tcp(peer4, pod4, 1, 81), 40), ReasonPolicyDeny)}},
		{"v4 first fragment has ports", web80, []step{send(in, frag4(tcpIn, 0, true), ReasonPolicyAllow)}},
		{"v4 later fragment needs a portless rule", web80, []step{send(in, frag4(tcpIn, 100, false), ReasonPolicyDeny)}},
		{"v4 later fragment under portless rule", isolate(rules(rule("10.1.0.0/16")), nil), []step{send(in, frag4(tcpIn, 100, true), ReasonPolicyAllow)}},
		{"v4 later fragment under protocol-only rule", isolate(rules(rule("10.1.0.0/16", ports(policy.ProtocolUDP, 0, 65535))), nil), []step{
			send(in, frag4(udp(peer4, pod4, 1, 53), 100, false), ReasonPolicyAllow)}},

		// Later fragments take the ports their datagram's first fragment
		// carried; without a first fragment seen they have none.
		{"v4 later fragment follows its first", isolate(rules(rule("10.1.0.0/16", udpPort(53))), nil), []step{
			send(in, frag4(udp(peer4, pod4, 5353, 53), 0, true), ReasonPolicyAllow),
			send(in, frag4(udp(peer4, pod4, 5353, 53), 100, true), ReasonCTEstablished),
			send(in, frag4(udp(peer4, pod4, 5353, 53), 200, false), ReasonCTEstablished),
			send(in, withID(frag4(udp(peer4, pod4, 5353, 53), 100, false), 7), ReasonPolicyDeny)}},
		{"v4 later fragment of a denied first is denied", isolate(rules(rule("10.1.0.0/16", udpPort(53))), nil), []step{
			send(in, frag4(udp(peer4, pod4, 5353, 54), 0, true), ReasonPolicyDeny),
			send(in, frag4(udp(peer4, pod4, 5353, 54), 100, false), ReasonPolicyDeny)}},
		{"v4 fragmented reply passes isolated ingress", isolate(rules(), rules(rule("10.1.0.0/16", udpPort(53)))), []step{
			send(out, udp(pod4, peer4, 3333, 53), ReasonPolicyAllow),
			send(in, frag4(udp(peer4, pod4, 53, 3333), 0, true), ReasonCTReply),
			send(in, frag4(udp(peer4, pod4, 53, 3333), 185, false), ReasonCTReply)}},
		{"v6 later fragment follows its first", isolate(rules(rule("fd01::/64", udpPort(53))), nil), []step{
			send(in, ext(udp(peer6, pod6, 5353, 53), frag6first), ReasonPolicyAllow),
			send(in, ext(udp(peer6, pod6, 5353, 53), frag6), ReasonCTEstablished),
			send(in, ext(udp(peer6, pod6, 5353, 53), packet.ExtHeader{Type: 44, FragOffset: 10, FragID: 9}), ReasonPolicyDeny)}},
		{"v6 fragment after a hop-by-hop header follows its first", isolate(rules(rule("fd01::/64", udpPort(53))), nil), []step{
			send(in, ext(udp(peer6, pod6, 5353, 53), extHdrs(0)[0], frag6first), ReasonPolicyAllow),
			send(in, ext(udp(peer6, pod6, 5353, 53), extHdrs(0)[0], frag6), ReasonCTEstablished)}},
		{"whole datagrams record nothing", isolate(rules(rule("10.1.0.0/16", udpPort(53))), nil), []step{
			send(in, udp(peer4, pod4, 5353, 53), ReasonPolicyAllow),
			send(in, withID(frag4(udp(peer4, pod4, 5353, 53), 100, false), 0x4242), ReasonPolicyDeny)}},

		// IPv6 rules and extension headers.
		{"v6 allow and deny", web80v6, []step{send(in, tcpIn6, ReasonPolicyAllow), send(in, tcp(peer6, pod6, 1, 81), ReasonPolicyDeny),
			send(in, tcp("fd02::3", pod6, 1, 80), ReasonPolicyDeny)}},
		{"v6 except", isolate(rules(except(rule("fd01::/32"), "fd01::/64")), nil), []step{
			send(in, tcpIn6, ReasonPolicyDeny), send(in, tcp("fd01:0:0:1::3", pod6, 1, 80), ReasonPolicyAllow)}},
		{"v6 /0", isolate(rules(rule("::/0", udpPort(53))), nil), []step{send(in, udp("2001:db8::1", pod6, 1, 53), ReasonPolicyAllow)}},
		{"v6 hop-by-hop", web80v6, []step{send(in, ext(tcpIn6, extHdrs(0)...), ReasonPolicyAllow), send(in, ext(tcp(peer6, pod6, 1, 81), extHdrs(0)...), ReasonPolicyDeny)}},
		{"v6 routing and destination options", web80v6, []step{
			send(in, ext(tcpIn6, packet.ExtHeader{Type: 43, Len: 24}, packet.ExtHeader{Type: 60, Len: 16}), ReasonPolicyAllow)}},
		{"v6 authentication header", web80v6, []step{send(in, ext(tcp(peer6, pod6, 1, 81), extHdrs(51)...), ReasonPolicyDeny),
			send(in, ext(tcpIn6, extHdrs(51)...), ReasonPolicyAllow)}},
		{"v6 first fragment has ports", web80v6, []step{send(in, ext(tcpIn6, frag6first), ReasonPolicyAllow)}},
		{"v6 later fragment needs a portless rule", web80v6, []step{send(in, ext(tcpIn6, frag6), ReasonPolicyDeny)}},
		{"v6 later fragment under portless rule", isolate(rules(rule("fd01::/64")), nil), []step{send(in, ext(tcpIn6, extHdrs(0)[0], frag6), ReasonPolicyAllow)}},
		{"v6 conntrack after ext headers", web80v6, []step{send(in, ext(tcpIn6, extHdrs(0)...), ReasonPolicyAllow), send(in, tcpIn6, ReasonCTEstablished)}},
	}
}

func TestNodeAddressesFollowTheNode(t *testing.T) {
	h := newHarness(t)
	probe := syn(tcp(node4, pod4, 5555, 8080)).Marshal()
	for _, c := range []struct {
		nodes []netip.Addr
		want  Reason
	}{
		{[]netip.Addr{ip(node4)}, ReasonNode},
		{nil, ReasonPolicyDeny},
		{[]netip.Addr{ip(node6), ip(node4)}, ReasonNode},
	} {
		if err := h.g.SetNodeAddrs(c.nodes); err != nil {
			t.Fatal(err)
		}
		h.apply(t, isolate(rules(), nil))
		if _, reason := h.runReason(t, in, probe); reason != c.want {
			t.Errorf("node addresses %v: got %s, want %s", c.nodes, reason, c.want)
		}
		got, err := h.g.NodeAddresses()
		if err != nil || len(got) != len(c.nodes) {
			t.Errorf("NodeAddresses() = %v, %v; want %v", got, err, c.nodes)
		}
	}
}

func TestVerdicts(t *testing.T) {
	h := newHarness(t)
	if err := h.g.SetNodeAddrs([]netip.Addr{ip(node4), ip(node6)}); err != nil {
		t.Fatal(err)
	}
	cases := verdictCases()
	steps := 0
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			h.flushCT(t)
			h.apply(t, tc.set)
			for i, s := range tc.steps {
				if s.apply != nil {
					h.apply(t, *s.apply)
					continue
				}
				steps++
				verdict, reason := h.runReason(t, s.dir, s.frame)
				if reason != s.want || verdict != s.want.Verdict() {
					t.Errorf("step %d (%s): got %s (verdict %#x), want %s (verdict %#x)",
						i, s.dir, reason, verdict, s.want, s.want.Verdict())
				}
			}
		})
	}
	t.Logf("%d cases, %d packets", len(cases), steps)
}

// TestSourceCheckSettings: a veth without an entry opens nothing, and one
// whose entry says any source (sourceCheck false) is judged by policy alone.
func TestSourceCheckSettings(t *testing.T) {
	h := newHarness(t)
	h.apply(t, isolate(nil, rules(rule("10.9.0.0/16"))))
	forged := syn(tcp(peer4, "10.9.0.1", 40000, 80)).Marshal()
	own := syn(tcp(pod4, "10.9.0.1", 40001, 80)).Marshal()
	for _, c := range []struct {
		name         string
		set          func() error
		forged, mine Reason
	}{
		{"exact", func() error { return h.id.SetSources(testIfindex, Sources{Addrs: []netip.Addr{ip(pod4)}}) }, ReasonSpoofed, ReasonPolicyAllow},
		{"no entry", func() error { return h.id.Sources.Delete(uint32(testIfindex)) }, ReasonSpoofed, ReasonSpoofed},
		{"any source", func() error { return h.id.SetSources(testIfindex, Sources{Any: true}) }, ReasonPolicyAllow, ReasonPolicyAllow},
	} {
		t.Run(c.name, func(t *testing.T) {
			h.flushCT(t)
			if err := c.set(); err != nil {
				t.Fatal(err)
			}
			if _, r := h.runReason(t, out, forged); r != c.forged {
				t.Errorf("forged source: %s, want %s", r, c.forged)
			}
			if _, r := h.runReason(t, out, own); r != c.mine {
				t.Errorf("own source: %s, want %s", r, c.mine)
			}
		})
	}
	got, err := h.id.ReadSources()
	if err != nil || len(got) != 1 || !got[testIfindex].Any {
		t.Errorf("ReadSources() = %v, %v; want ifindex %d with any source", got, err, testIfindex)
	}
	addrs := make([]netip.Addr, MaxSourceAddrs+1)
	for i := range addrs {
		addrs[i] = netip.AddrFrom4([4]byte{10, 0, 0, byte(i)})
	}
	if err := h.id.SetSources(testIfindex, Sources{Addrs: addrs}); !errors.Is(err, ErrTooManySources) {
		t.Errorf("SetSources with %d addresses: %v, want ErrTooManySources", len(addrs), err)
	}
}
