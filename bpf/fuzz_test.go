package bpf

import (
	"encoding/binary"
	"errors"
	"net/netip"
	"testing"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/podfence/podfence/pkg/packet"
	"github.com/podfence/podfence/pkg/policy"
	"github.com/podfence/podfence/test/kernel"
)

// The policy FuzzDatapath enforces: ingress from 10.1.0.0/16 on TCP 80 and
// from fd00:1::/32 on UDP 53 only, egress isolated with no rule.
var (
	fuzzRule   = netip.MustParsePrefix("10.1.0.0/16")
	fuzzRuleV6 = netip.MustParsePrefix("fd00:1::/32")
)

// FuzzDatapath feeds arbitrary frames to the real programs with
// BPF_PROG_TEST_RUN, from an empty conntrack table each time. Every frame
// must get the verdict of the one reason counter it moved, and no reason
// that needs a tracked flow. Where the frame is plain IPv4 TCP or UDP that
// is not a fragment, the verdict must be the reference's: a source that is
// not the pod's own is spoofed in egress, else the rule, or nothing,
// decides, as policy.DirectionPolicy.Allows says. Other frames
// (IPv6, extension headers, ICMP, fragments) are checked by the invariants
// only; TestDifferential holds them against the reference with
// well-formed packets. The verifier has already proved the bounds: what
// this finds is a parser that reads the right bytes wrongly.
func FuzzDatapath(f *testing.F) {
	kernel.RequireRoot(f)
	h := newHarness(f)
	set := isolate(rules(policy.Rule{CIDR: fuzzRule, Ports: []policy.PortRange{tcpPort(80)}},
		policy.Rule{CIDR: fuzzRuleV6, Ports: []policy.PortRange{udpPort(53)}}), rules())
	h.apply(f, set)
	for _, p := range []packet.Packet{
		tcp(peer4, pod4, 40000, 80), syn(tcp(peer4, pod4, 40000, 80)), tcp("10.2.0.1", pod4, 40000, 80),
		udp(peer4, pod4, 5353, 80), tcp(peer6, pod6, 40000, 80), tcp(pod4, peer4, 40000, 443),
		udp("fd00:1::7", pod6, 5353, 53), udp("fd00:2::7", pod6, 5353, 53),
	} {
		frame := p.Marshal()
		f.Add(frame, false)
		f.Add(frame, true)
		f.Add(packet.Truncate(frame, 30), false)
	}
	f.Add(packet.ARP(), false)

	f.Fuzz(func(t *testing.T, frame []byte, egress bool) {
		d := policyDir(egress)
		// BPF_PROG_TEST_RUN refuses frames it cannot make an skb of
		// (EINVAL), which no interface would deliver either.
		if _, err := h.prog(d).Run(&ebpf.RunOptions{Data: frame}); errors.Is(err, unix.EINVAL) {
			t.Skip("the kernel makes no skb of this frame")
		}
		h.flushCT(t)
		ret, reason := h.runReason(t, d, frame)
		if ret != reason.Verdict() {
			t.Fatalf("verdict %#x with reason %s, whose verdict is %#x", ret, reason, reason.Verdict())
		}
		switch reason {
		case ReasonCTEstablished, ReasonCTReply, ReasonCTRelated, ReasonRevoked, ReasonNotIsolated:
			t.Fatalf("reason %s with an empty conntrack table and both directions isolated", reason)
		}
		ref, ok := plainIPv4(frame)
		if !ok {
			ref, ok = plainIPv6(frame)
		}
		if !ok {
			return
		}
		remote := ref.src
		if egress {
			remote = ref.dst
		}
		want := ReasonPolicyDeny
		switch {
		case egress && ref.src != ip(pod4) && ref.src != ip(pod6):
			want = ReasonSpoofed // the harness's pod owns pod4 and pod6
		case set.Direction(d).Allows(remote, ref.proto, ref.dport):
			want = ReasonPolicyAllow
		}
		if reason != want {
			t.Fatalf("%s %s -> %s proto %d dport %d: reason %s, reference %s", d, ref.src, ref.dst, ref.proto, ref.dport, reason, want)
		}
	})
}

type plainFlow struct {
	src, dst netip.Addr
	proto    uint8
	dport    uint16
}

// plainIPv4 decodes the frames whose verdict FuzzDatapath knows: Ethernet,
// IPv4 with any header length, not a fragment, TCP with its whole fixed
// header or UDP with its whole header.
func plainIPv4(frame []byte) (plainFlow, bool) {
	const eth = 14
	if len(frame) < eth+20 || binary.BigEndian.Uint16(frame[12:]) != 0x0800 {
		return plainFlow{}, false
	}
	ip := frame[eth:]
	ihl := int(ip[0]&0xf) * 4
	if ip[0]>>4 != 4 || ihl < 20 || len(ip) < ihl || binary.BigEndian.Uint16(ip[6:])&0x3fff != 0 {
		return plainFlow{}, false
	}
	f := plainFlow{src: netip.AddrFrom4([4]byte(ip[12:16])), dst: netip.AddrFrom4([4]byte(ip[16:20])), proto: ip[9]}
	l4 := ip[ihl:]
	switch {
	case f.proto == 6 && len(l4) >= 20, f.proto == 17 && len(l4) >= 8:
		f.dport = binary.BigEndian.Uint16(l4[2:])
		return f, true
	}
	return plainFlow{}, false
}

// plainIPv6 decodes Ethernet, IPv6 whose next header is TCP with its whole
// fixed header or UDP with its whole header. IPv4-mapped addresses are left
// out: the reference unmaps them (a rule of either family is one rule), the
// datapath looks an IPv6 packet up in the IPv6 trie, and no route delivers
// such a packet to a pod.
func plainIPv6(frame []byte) (plainFlow, bool) {
	const eth = 14
	if len(frame) < eth+40 || binary.BigEndian.Uint16(frame[12:]) != 0x86dd || frame[eth]>>4 != 6 {
		return plainFlow{}, false
	}
	ip := frame[eth:]
	f := plainFlow{src: netip.AddrFrom16([16]byte(ip[8:24])), dst: netip.AddrFrom16([16]byte(ip[24:40])), proto: ip[6]}
	if f.src.Is4In6() || f.dst.Is4In6() {
		return plainFlow{}, false
	}
	l4 := ip[40:]
	switch {
	case f.proto == 6 && len(l4) >= 20, f.proto == 17 && len(l4) >= 8:
		f.dport = binary.BigEndian.Uint16(l4[2:])
		return f, true
	}
	return plainFlow{}, false
}
