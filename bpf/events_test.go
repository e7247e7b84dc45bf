package bpf

import (
	"errors"
	"net/netip"
	"os"
	"testing"
	"time"
)

func TestDenyEvents(t *testing.T) {
	h := newHarness(t)
	h.apply(t, isolate(rules(rule("10.1.0.0/16", tcpPort(80))), rules()))
	events, err := OpenDenyEvents(h.g)
	if err != nil {
		t.Fatal(err)
	}
	defer events.Close()

	// Earlier tests in this process may have spent the budget; the bucket
	// refills at about one token per millisecond.
	time.Sleep(100 * time.Millisecond)

	cases := []struct {
		frame  []byte
		egress bool
		src    string
		dst    string
	}{
		{tcp(peer4, pod4, 40000, 81).Marshal(), false, peer4 + ":40000", pod4 + ":81"},
		{tcp(pod6, peer6, 5000, 443).Marshal(), true, "[" + pod6 + "]:5000", "[" + peer6 + "]:443"},
	}
	for _, c := range cases {
		d := policyDir(c.egress)
		if ret := h.run(t, d, c.frame); ret != VerdictDrop {
			t.Fatalf("not dropped: %#x", ret)
		}
		events.SetDeadline(time.Now().Add(time.Second))
		e, err := events.Read()
		if err != nil {
			t.Fatal(err)
		}
		if e.Egress != c.egress || e.Reason != ReasonPolicyDeny || e.Proto != 6 ||
			e.Src != netip.MustParseAddrPort(c.src) || e.Dst != netip.MustParseAddrPort(c.dst) || e.Ifindex != 1 {
			t.Errorf("event %+v, want %s -> %s egress=%v", e, c.src, c.dst, c.egress)
		}
	}

	// A flood is rate-limited: a burst, then about one event per millisecond.
	// The bucket is per CPU, and a long test run that yields to the
	// scheduler may resume on another CPU with a full bucket of its own:
	// keep the thread on one CPU, as a flood through one queue would be.
	flood := tcp(peer4, pod4, 40000, 81).Marshal()
	defer onOneCPU(t)()
	droppedBefore, err := h.g.DroppedEvents()
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	if _, _, err := h.id.Ingress.Benchmark(flood, 100000, nil); err != nil {
		t.Fatal(err)
	}
	// The bucket refills by one every 2^20 ns while the flood runs (long
	// under emulation), on top of the burst of 64.
	allowed := 64 + int(time.Since(start)>>20) + 8
	n := 0
	for {
		events.SetDeadline(time.Now().Add(50 * time.Millisecond))
		if _, err := events.Read(); err != nil {
			if !errors.Is(err, os.ErrDeadlineExceeded) {
				t.Fatal(err)
			}
			break
		}
		n++
	}
	if n == 0 || n > allowed {
		t.Errorf("100000 denied packets produced %d events, want at most %d (a burst of 64 plus refills)", n, allowed)
	}
	// Every denied packet is an event or a dropped one.
	dropped, err := h.g.DroppedEvents()
	if err != nil {
		t.Fatal(err)
	}
	if got := dropped - droppedBefore; got != uint64(100000-n) {
		t.Errorf("%d events written and %d counted dropped, want them to add up to the 100000 denied packets", n, got)
	}
	t.Logf("100000 denied packets, %d events", n)
}

func TestDenyEventShort(t *testing.T) {
	var e DenyEvent
	if err := e.UnmarshalBinary(make([]byte, 10)); !errors.Is(err, ErrShortEvent) {
		t.Errorf("got %v, want ErrShortEvent", err)
	}
}
