package bpf

import (
	"net/netip"
	"runtime"
	"testing"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/podfence/podfence/pkg/packet"
	"github.com/podfence/podfence/pkg/pinpath"
	"github.com/podfence/podfence/pkg/podid"
	"github.com/podfence/podfence/pkg/policy"
	"github.com/podfence/podfence/test/kernel"
)

// harness is one pin root with the global maps and one identifier, for
// tests that run the real programs with BPF_PROG_TEST_RUN.
type harness struct {
	root string
	g    *Global
	id   *Datapath
}

func newHarness(tb testing.TB) *harness {
	tb.Helper()
	root := kernel.PinRoot(tb)
	g, err := OpenGlobal(globalDir(root), GlobalOptions{})
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { g.Close() })
	id, err := OpenIdentifier(g, identDir(root, "web-7f65cc6544@default"), "web-7f65cc6544@default")
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { id.Close() })
	// BPF_PROG_TEST_RUN runs a frame without a context as if it came on
	// the loopback device: that is the pod's veth here.
	if err := id.SetSources(testIfindex, Sources{Addrs: []netip.Addr{ip(pod4), ip(pod6)}}); err != nil {
		tb.Fatal(err)
	}
	return &harness{root: root, g: g, id: id}
}

// testIfindex is the ifindex BPF_PROG_TEST_RUN gives a frame run without a
// context: the loopback device's.
const testIfindex = 1

func (h *harness) apply(tb testing.TB, set policy.Set) {
	tb.Helper()
	if err := h.id.ApplyPolicy(set); err != nil {
		tb.Fatalf("apply policy: %v", err)
	}
}

// flushCT empties both conntrack maps and the fragment map, so that cases
// do not see each other's flows.
func (h *harness) flushCT(tb testing.TB) {
	tb.Helper()
	for _, m := range []*ebpf.Map{h.g.CTv4, h.g.CTv6, h.g.Frags} {
		var keys [][]byte
		k := make([]byte, m.KeySize())
		v := make([]byte, m.ValueSize())
		it := m.Iterate()
		for it.Next(&k, &v) {
			keys = append(keys, append([]byte(nil), k...))
		}
		if err := it.Err(); err != nil {
			tb.Fatal(err)
		}
		for _, k := range keys {
			_ = m.Delete(k)
		}
	}
}

func policyDir(egress bool) policy.Direction {
	if egress {
		return policy.Egress
	}
	return policy.Ingress
}

func (h *harness) prog(d policy.Direction) *ebpf.Program {
	if d == policy.Egress {
		return h.id.Egress
	}
	return h.id.Ingress
}

// run feeds one frame to the program of direction d and returns its verdict.
func (h *harness) run(tb testing.TB, d policy.Direction, frame []byte) uint32 {
	tb.Helper()
	ret, err := h.prog(d).Run(&ebpf.RunOptions{Data: frame})
	if err != nil {
		tb.Fatalf("run %s program: %v", d, err)
	}
	return ret
}

// runReason runs a frame and tells, from the counters, why it got its verdict.
func (h *harness) runReason(tb testing.TB, d policy.Direction, frame []byte) (uint32, Reason) {
	tb.Helper()
	before, err := h.id.ReadCounters()
	if err != nil {
		tb.Fatal(err)
	}
	ret := h.run(tb, d, frame)
	after, err := h.id.ReadCounters()
	if err != nil {
		tb.Fatal(err)
	}
	reason := NumReasons
	for r := Reason(0); r < NumReasons; r++ {
		if n := after[d][r] - before[d][r]; n != 0 {
			if reason != NumReasons || n != 1 {
				tb.Fatalf("one packet moved several counters: before %v after %v", before[d], after[d])
			}
			reason = r
		}
	}
	if reason == NumReasons {
		tb.Fatalf("no %s counter moved (verdict %#x)", d, ret)
	}
	return ret, reason
}

// Shorthands for building policies and packets in tables.

func rule(cidr string, ports ...policy.PortRange) policy.Rule {
	if len(ports) == 0 {
		ports = []policy.PortRange{{Protocol: policy.ProtocolAny, First: 0, Last: 65535}}
	}
	return policy.Rule{CIDR: netip.MustParsePrefix(cidr), Ports: ports}
}

func except(r policy.Rule, cidrs ...string) policy.Rule {
	for _, c := range cidrs {
		r.Except = append(r.Except, netip.MustParsePrefix(c))
	}
	return r
}

func ports(p policy.Protocol, first, last uint16) policy.PortRange {
	return policy.PortRange{Protocol: p, First: first, Last: last}
}

func tcpPort(p uint16) policy.PortRange { return ports(policy.ProtocolTCP, p, p) }
func udpPort(p uint16) policy.PortRange { return ports(policy.ProtocolUDP, p, p) }

// isolate builds a selected policy set; a nil slice leaves that direction
// not isolated, an empty non-nil one isolates it with no rules.
func isolate(ingress, egress []policy.Rule) policy.Set {
	return policy.Set{
		Mode:     policy.ModeStandard,
		Selected: true,
		Ingress:  policy.DirectionPolicy{Isolated: ingress != nil, Rules: ingress},
		Egress:   policy.DirectionPolicy{Isolated: egress != nil, Rules: egress},
	}
}

func rules(r ...policy.Rule) []policy.Rule { return append([]policy.Rule{}, r...) }

func ip(s string) netip.Addr { return netip.MustParseAddr(s) }

// tcp is a TCP segment of an established connection (ACK): the programs
// look it up in conntrack. syn makes it the opening segment, which they judge
// by policy without a lookup.
func tcp(src, dst string, sport, dport uint16) packet.Packet {
	return packet.Packet{Src: ip(src), Dst: ip(dst), Proto: 6, SrcPort: sport, DstPort: dport, TCPFlags: 0x10}
}

func syn(p packet.Packet) packet.Packet {
	p.TCPFlags = 0x02
	return p
}

func udp(src, dst string, sport, dport uint16) packet.Packet {
	p := tcp(src, dst, sport, dport)
	p.Proto, p.TCPFlags = 17, 0
	return p
}

func withProto(p packet.Packet, proto uint8) packet.Packet {
	p.Proto = proto
	return p
}

func echo(src, dst string, id uint16) packet.Packet {
	proto := uint8(1)
	if ip(src).Is6() {
		proto = 58
	}
	return packet.Packet{Src: ip(src), Dst: ip(dst), Proto: proto, SrcPort: id}
}

// onOneCPU keeps the calling goroutine on one thread and that thread on one
// CPU, until the returned function runs: the per-CPU maps (the event
// budget, the clock cache) then see one CPU throughout.
func onOneCPU(tb testing.TB) (restore func()) {
	tb.Helper()
	runtime.LockOSThread()
	var one unix.CPUSet
	if err := unix.SchedGetaffinity(0, &one); err != nil {
		tb.Fatal(err)
	}
	all := one
	for cpu := 0; cpu < 1024; cpu++ {
		if one.IsSet(cpu) {
			one.Zero()
			one.Set(cpu)
			break
		}
	}
	if err := unix.SchedSetaffinity(0, &one); err != nil {
		tb.Fatal(err)
	}
	return func() {
		unix.SchedSetaffinity(0, &all)
		runtime.UnlockOSThread()
	}
}

// identDir is id's directory below root, as the pin root's owner gives it.
func identDir(root string, id podid.ID) string { return pinpath.Root(root).Identifier(id) }

// globalDir is where a pin root keeps the node-wide maps.
func globalDir(root string) string { return pinpath.Root(root).Global() }
