package ctnetlink

import (
	"errors"
	"net/netip"
	"os"
	"testing"
	"time"

	"github.com/containernetworking/plugins/pkg/ns"
	"github.com/mdlayher/netlink"
	"github.com/ti-mo/conntrack"
	"golang.org/x/sys/unix"

	"github.com/podfence/podfence/test/netnsutil"
)

// Kernel tests: flows created with ctnetlink (github.com/ti-mo/conntrack,
// an independent encoder) in a scratch namespace, read back with this
// package. Need root.

func scratch(tb testing.TB) (ns.NetNS, *conntrack.Conn) {
	tb.Helper()
	if os.Geteuid() != 0 {
		tb.Skip("needs root")
	}
	n := netnsutil.New(tb)
	c, err := conntrack.Dial(&netlink.Config{NetNS: int(n.Fd())})
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { c.Close() })
	return n, c
}

// natFlow is a flow whose reply tuple is reply, not the original inverted:
// what a DNAT or SNAT leaves in the table.
func natFlow(proto uint8, orig, reply [2]netip.AddrPort) conntrack.Flow {
	f := conntrack.NewFlow(proto, 0, orig[0].Addr(), orig[1].Addr(), orig[0].Port(), orig[1].Port(), 120, 0)
	f.TupleReply.IP.SourceAddress, f.TupleReply.IP.DestinationAddress = reply[0].Addr(), reply[1].Addr()
	f.TupleReply.Proto.SourcePort, f.TupleReply.Proto.DestinationPort = reply[0].Port(), reply[1].Port()
	return f
}

func ap(s string) netip.AddrPort { return netip.MustParseAddrPort(s) }

func tupleOf(a, b netip.AddrPort, proto uint8) Tuple {
	t := Tuple{Family: 4, Proto: proto, SrcPort: a.Port(), DstPort: b.Port()}
	if a.Addr().Is6() {
		t.Family = 6
	}
	copy(t.Src[:], a.Addr().AsSlice())
	copy(t.Dst[:], b.Addr().AsSlice())
	return t
}

func newDumper(tb testing.TB, n ns.NetNS) *Dumper {
	tb.Helper()
	var d *Dumper
	netnsutil.Do(tb, n, func() (err error) { d, err = NewDumper(); return err })
	tb.Cleanup(func() { d.Close() })
	return d
}

func dumpAll(t *testing.T, d *Dumper) map[Flow]int {
	t.Helper()
	got := map[Flow]int{}
	if err := d.Dump(func(f *Flow) error { got[*f]++; return nil }); err != nil {
		t.Fatal(err)
	}
	return got
}

func TestDump(t *testing.T) {
	n, c := scratch(t)
	d := newDumper(t, n)
	if got := dumpAll(t, d); len(got) != 0 {
		t.Fatalf("a fresh namespace has flows: %v", got)
	}

	client, vip, backend := ap("10.1.0.1:40000"), ap("172.20.0.10:80"), ap("10.1.0.2:8080")
	c6, s6 := ap("[fd00::1]:5353"), ap("[fd00::2]:53")
	ping := conntrack.NewFlow(1, 0, netip.MustParseAddr("10.1.0.1"), netip.MustParseAddr("10.1.0.3"), 0, 0, 30, 0)
	ping.TupleOrig.Proto = conntrack.ProtoTuple{Protocol: 1, ICMPv4: true, ICMPID: 77, ICMPType: 8}
	ping.TupleReply.Proto = conntrack.ProtoTuple{Protocol: 1, ICMPv4: true, ICMPID: 77, ICMPType: 0}
	for _, f := range []conntrack.Flow{
		natFlow(unix.IPPROTO_TCP, [2]netip.AddrPort{client, vip}, [2]netip.AddrPort{backend, client}),
		natFlow(unix.IPPROTO_UDP, [2]netip.AddrPort{c6, s6}, [2]netip.AddrPort{s6, c6}),
		ping,
	} {
		if err := c.Create(f); err != nil {
			t.Fatalf("create %v: %v", f, err)
		}
	}
	icmp := func(a, b string) Tuple {
		return tupleOf(netip.AddrPortFrom(netip.MustParseAddr(a), 77), netip.AddrPortFrom(netip.MustParseAddr(b), 77), 1)
	}
	want := map[Flow]int{
		{tupleOf(client, vip, 6), tupleOf(backend, client, 6)}:       1,
		{tupleOf(c6, s6, 17), tupleOf(s6, c6, 17)}:                   1,
		{icmp("10.1.0.1", "10.1.0.3"), icmp("10.1.0.3", "10.1.0.1")}: 1,
	}
	got := dumpAll(t, d)
	if len(got) != len(want) {
		t.Fatalf("dumped %d flows, want %d: %+v", len(got), len(want), got)
	}
	for f := range want {
		if got[f] != 1 {
			t.Fatalf("missing %+v in %+v", f, got)
		}
	}

	// An error from fn ends the dump and leaves the Dumper usable.
	stop := errors.New("stop")
	calls := 0
	if err := d.Dump(func(*Flow) error { calls++; return stop }); !errors.Is(err, stop) || calls != 1 {
		t.Fatalf("Dump returned %v after %d calls, want %v after 1", err, calls, stop)
	}
	if got := dumpAll(t, d); len(got) != len(want) {
		t.Fatalf("after an abandoned dump: %d flows, want %d", len(got), len(want))
	}
}

// Many flows span many reads; every one is dumped once.
func TestDumpMany(t *testing.T) {
	n, c := scratch(t)
	const flows = 5000
	createFlows(t, c, flows)
	got := dumpAll(t, newDumper(t, n))
	if len(got) != flows {
		t.Fatalf("dumped %d distinct flows, want %d", len(got), flows)
	}
	for f, k := range got {
		if k != 1 {
			t.Fatalf("%+v dumped %d times", f, k)
		}
	}
}

// createFlows adds n UDP flows from 10.2.x.y to 10.3.0.1:53.
func createFlows(tb testing.TB, c *conntrack.Conn, n int) {
	tb.Helper()
	dst := netip.MustParseAddr("10.3.0.1")
	for i := range n {
		src := netip.AddrFrom4([4]byte{10, 2, byte(i >> 16), byte(i >> 8)})
		f := conntrack.NewFlow(unix.IPPROTO_UDP, 0, src, dst, uint16(1024+i&0xff), 53, 600, 0)
		if err := c.Create(f); err != nil {
			tb.Fatalf("create flow %d: %v", i, err)
		}
	}
}

func openEvents(tb testing.TB, n ns.NetNS) *Events {
	tb.Helper()
	var e *Events
	netnsutil.Do(tb, n, func() (err error) { e, err = OpenEvents(); return err })
	tb.Cleanup(func() { e.Close() })
	return e
}

func TestEvents(t *testing.T) {
	n, c := scratch(t)
	e := openEvents(t, n)
	client, server := ap("10.1.0.1:40000"), ap("10.1.0.2:80")
	f := conntrack.NewFlow(unix.IPPROTO_TCP, 0, client.Addr(), server.Addr(), client.Port(), server.Port(), 120, 0)
	if err := c.Create(f); err != nil {
		t.Fatal(err)
	}
	if err := c.Delete(f); err != nil {
		t.Fatal(err)
	}
	want := Flow{tupleOf(client, server, 6), tupleOf(server, client, 6)}
	got := make(chan Flow, 4)
	go e.Read(func(f *Flow) { got <- *f }) //nolint:errcheck // checked through got
	select {
	case f := <-got:
		if f != want {
			t.Fatalf("destroy event\n got %+v\nwant %+v", f, want)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("no destroy event within 5s")
	}
}

func TestEventsClose(t *testing.T) {
	n, _ := scratch(t)
	e := openEvents(t, n)
	done := make(chan error)
	go func() { done <- e.Read(func(*Flow) {}) }()
	time.Sleep(50 * time.Millisecond)
	e.Close()
	select {
	case err := <-done:
		if !errors.Is(err, os.ErrClosed) {
			t.Fatalf("Read after Close: %v, want os.ErrClosed", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("Close did not end a blocked Read")
	}
}

// A reader that falls behind learns that it lost events.
func TestEventsLost(t *testing.T) {
	n, c := scratch(t)
	e := openEvents(t, n)
	if err := e.c.setReadBuffer(4096); err != nil {
		t.Fatal(err)
	}
	createFlows(t, c, 2000)
	if err := c.Flush(); err != nil {
		t.Fatal(err)
	}
	// A read that finds nothing ends at the deadline rather than hanging.
	e.c.f.SetReadDeadline(time.Now().Add(5 * time.Second))
	var err error
	for range 1000 {
		if err = e.Read(func(*Flow) {}); err != nil {
			break
		}
	}
	if !errors.Is(err, ErrLost) {
		t.Fatalf("Read: %v, want ErrLost", err)
	}
}
