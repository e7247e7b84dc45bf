package bpf

import (
	"fmt"
	"net/netip"
	"runtime"
	"testing"
	"unsafe"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/podfence/podfence/pkg/packet"
	"github.com/podfence/podfence/test/kernel"
	"github.com/podfence/podfence/test/netnsutil"
)

// layout4Build is the last commit whose datapath judged every flow at the
// veth, before Services were judged on their backends (layout 5).
const layout4Build = "cf649bb"

// BenchmarkServiceFlow puts this build's cost of a pod's flows beside the
// layout-4 build's (its object from this clone's history, layout4Build),
// in one run, on the same policy (an egress trie of 1,000 prefixes and the
// backend's and the ClusterIP's rules) and, for this build, a services map
// of 1,000 frontends:
//
//   - other-new: a new flow to an address no Service translates, at the
//     veth (this build adds the services lookup);
//   - service-new: a new flow to a ClusterIP, both hooks: today the veth's
//     judgement of the ClusterIP and the backend's ingress judgement; now
//     the veth's stamp, then at the backend's veth the dispatch, the
//     sender's judge (the conntrack kfunc, the judgement of the backend,
//     the entry) and the backend's own ingress judgement;
//   - established: a tracked flow's packet at the veth plus one at the
//     backend's veth (this build adds a load of the mark there).
//
// Every figure is the median of single runs' kernel durations (a stamped
// packet loses its mark in its run, so runs cannot repeat one packet);
// "x-today" is this build's over the layout-4 build's.
func BenchmarkServiceFlow(b *testing.B) {
	kernel.RequireRoot(b)
	if !AfterNATSupported() {
		b.Skip("no conntrack kfuncs: Services are judged on the frontend here")
	}
	var (
		pod       = netip.MustParseAddr(pod4)
		clusterIP = netip.MustParseAddrPort("10.96.0.10:80")
		backend   = netip.MustParseAddrPort("10.73.2.2:8080")
		sport     = uint16(40000)
	)
	n := netnsutil.New(b)
	// The kernel's entry of the flow, translated as kube-proxy would.
	nsRun(b, n, "", "conntrack", "-I", "-p", "tcp", "-s", pod.String(), "-d", clusterIP.Addr().String(),
		"--sport", fmt.Sprint(sport), "--dport", fmt.Sprint(clusterIP.Port()),
		"-r", backend.Addr().String(), "-q", pod.String(),
		"--reply-port-src", fmt.Sprint(backend.Port()), "--reply-port-dst", fmt.Sprint(sport),
		"--state", "ESTABLISHED", "--timeout", "600")

	set := egressOnly(rule(backend.Addr().String()+"/32", tcpPort(backend.Port())), rule(clusterIP.Addr().String()+"/32", tcpPort(clusterIP.Port())))
	for i := range 1000 {
		set.Egress.Rules = append(set.Egress.Rules, rule(benchPrefix("v4", i).String(), tcpPort(443)))
	}
	h := newHarness(b) // its identifier is the client, sending from pod4 on ifindex 1
	g, cli := h.g, h.id
	web, err := OpenIdentifier(g, identDir(h.root, "web@default"), "web@default")
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { web.Close() })
	if err := cli.ApplyPolicy(set); err != nil {
		b.Fatal(err)
	}
	frontends := []Frontend{{clusterIP.Addr(), clusterIP.Port(), unix.IPPROTO_TCP}}
	for i := range 999 {
		frontends = append(frontends, Frontend{netip.AddrFrom4([4]byte{10, 96, byte(1 + i/250), byte(i % 250)}), 80, unix.IPPROTO_TCP})
	}
	if _, _, err := g.SetServices(frontends); err != nil {
		b.Fatal(err)
	}
	prev := previousEgress(b, layout4Build)
	prev.program(b, set)
	src, err := Sources{Addrs: []netip.Addr{pod}}.encode()
	if err != nil {
		b.Fatal(err)
	}
	if err := prev.coll.Maps[mapSources].Update(uint32(testIfindex), &src, ebpf.UpdateAny); err != nil {
		b.Fatal(err)
	}
	prevIngress := prev.coll.Programs[progIngress]

	toService := syn(tcp(pod4, clusterIP.Addr().String(), sport, clusterIP.Port())).Marshal()
	translated := syn(tcp(pod4, backend.Addr().String(), sport, backend.Port())).Marshal()
	toOther := syn(tcp(pod4, backend.Addr().String(), sport+1, backend.Port())).Marshal()
	ackOut := ackOf(tcp(pod4, backend.Addr().String(), sport+1, backend.Port()))
	ackIn := ackOf(tcp(pod4, backend.Addr().String(), sport+2, backend.Port()))
	stamped := benchContext{Mark: uint32(cli.Slot+1) << 16, IngressIfindex: testIfindex}

	// The established case's flows, opened in both builds' maps by their
	// SYNs (this build's ingress one unstamped: a flow to the backend).
	netnsutil.Do(b, n, func() error {
		for _, r := range []benchRun{
			{prev.egress, syn(ackOut).Marshal(), nil}, {cli.Egress, syn(ackOut).Marshal(), nil},
			{prevIngress, syn(ackIn).Marshal(), nil}, {web.Ingress, syn(ackIn).Marshal(), nil},
		} {
			if ret, _, err := testRun(r.prog, r.frame, r.ctx); err != nil || ret != VerdictAllow {
				return fmt.Errorf("open the established flows: verdict %#x, %v", ret, err)
			}
		}
		return nil
	})
	cases := []struct {
		name       string
		today, now []benchRun
	}{
		{"other-new", []benchRun{{prev.egress, toOther, nil}}, []benchRun{{cli.Egress, toOther, nil}}},
		{"service-new", []benchRun{{prev.egress, toService, nil}, {prevIngress, translated, nil}},
			[]benchRun{{cli.Egress, toService, nil}, {web.Ingress, translated, &stamped}}},
		{"established", []benchRun{{prev.egress, ackOut.Marshal(), nil}, {prevIngress, ackIn.Marshal(), nil}},
			[]benchRun{{cli.Egress, ackOut.Marshal(), nil}, {web.Ingress, ackIn.Marshal(), nil}}},
	}
	for _, c := range cases {
		b.Run(c.name, func(b *testing.B) {
			var today, now float64
			netnsutil.Do(b, n, func() error {
				var err error
				if today, err = medianRuns(b.N, c.today); err != nil {
					return fmt.Errorf("today: %w", err)
				}
				if now, err = medianRuns(b.N, c.now); err != nil {
					return fmt.Errorf("now: %w", err)
				}
				return nil
			})
			b.ReportMetric(now, "ns/op")
			b.ReportMetric(today, "ns-today")
			b.ReportMetric(now/today, "x-today")
		})
	}
}

// ackOf is p as a segment of an established connection.
func ackOf(p packet.Packet) packet.Packet {
	p.TCPFlags = 0x10 // ACK
	return p
}

// benchRun is one program run on one frame, with a context or none.
type benchRun struct {
	prog  *ebpf.Program
	frame []byte
	ctx   *benchContext
}

// medianRuns runs each of runs n times, one packet per run, and returns the
// median over the n rounds of the sum of their kernel durations. Each must
// allow.
func medianRuns(n int, runs []benchRun) (float64, error) {
	totals := make([]float64, n)
	for i := range n {
		for _, r := range runs {
			ret, d, err := testRun(r.prog, r.frame, r.ctx)
			if err != nil {
				return 0, err
			}
			if ret != VerdictAllow {
				return 0, fmt.Errorf("verdict %#x, want an allow", ret)
			}
			totals[i] += float64(d)
		}
	}
	return median(totals), nil
}

// benchContext is the start of struct __sk_buff up to cb, the fields
// BPF_PROG_TEST_RUN takes from a context (mark, priority, ingress_ifindex,
// ifindex; the rest must be zero).
type benchContext struct {
	Len, PktType, Mark, QueueMapping, Protocol, VlanPresent, VlanTCI, VlanProto, Priority uint32
	IngressIfindex, Ifindex, TCIndex                                                      uint32
	CB                                                                                    [5]uint32
}

// testRun runs p once on frame with ctx (nil: none) and returns the
// verdict and the kernel's duration of the run in ns: cilium/ebpf's Run
// does not return the duration, and its Benchmark takes no context.
func testRun(p *ebpf.Program, frame []byte, ctx *benchContext) (uint32, uint32, error) {
	attr := struct {
		progFD, retval, dataSizeIn, dataSizeOut uint32
		dataIn, dataOut                         uint64
		repeat, duration                        uint32
		ctxSizeIn, ctxSizeOut                   uint32
		ctxIn, ctxOut                           uint64
		flags, cpu, batchSize                   uint32
		_                                       uint32
	}{progFD: uint32(p.FD()), dataSizeIn: uint32(len(frame)), dataIn: uint64(uintptr(unsafe.Pointer(&frame[0]))), repeat: 1}
	if ctx != nil {
		attr.ctxSizeIn = uint32(unsafe.Sizeof(*ctx))
		attr.ctxIn = uint64(uintptr(unsafe.Pointer(ctx)))
	}
	_, _, errno := unix.Syscall(unix.SYS_BPF, unix.BPF_PROG_TEST_RUN, uintptr(unsafe.Pointer(&attr)), unsafe.Sizeof(attr))
	runtime.KeepAlive(frame)
	runtime.KeepAlive(ctx)
	if errno != 0 {
		return 0, 0, fmt.Errorf("BPF_PROG_TEST_RUN: %w", errno)
	}
	return attr.retval, attr.duration, nil
}
