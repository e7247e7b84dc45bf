package bpf

import (
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/podfence/podfence/pkg/policy"
)

// tickSlack is how far last_seen may trail CLOCK_MONOTONIC: the coarse
// clock is up to one tick behind, and the per-CPU cache in now_ns one more.
// Two ticks at HZ=100, the slowest tick Linux has.
const tickSlack = 20 * time.Millisecond

// TestConntrackLastSeen checks the contract the sweeper's expiry relies on:
// an entry's last_seen is CLOCK_MONOTONIC nanoseconds, and a later packet of
// the flow moves it forward.
func TestConntrackLastSeen(t *testing.T) {
	h := newHarness(t)
	h.apply(t, isolate(rules(rule("0.0.0.0/0", tcpPort(80)), rule("::/0", tcpPort(80))), nil))
	for _, c := range []struct {
		name      string
		peer, pod string
		ct        *ebpf.Map
	}{
		{"v4", peer4, pod4, h.g.CTv4},
		{"v6", peer6, pod6, h.g.CTv6},
	} {
		t.Run(c.name, func(t *testing.T) {
			h.flushCT(t)
			ack := tcp(c.peer, c.pod, 40000, 80)
			opened := within(t, func() {
				if ret := h.run(t, policy.Ingress, syn(ack).Marshal()); ret != VerdictAllow {
					t.Fatalf("SYN: verdict %#x", ret)
				}
			}, func() uint64 { return onlyLastSeen(t, c.ct) })

			time.Sleep(3 * tickSlack)
			refreshed := within(t, func() {
				if ret := h.run(t, policy.Ingress, ack.Marshal()); ret != VerdictAllow {
					t.Fatalf("ACK: verdict %#x", ret)
				}
			}, func() uint64 { return onlyLastSeen(t, c.ct) })
			if refreshed <= opened {
				t.Fatalf("a tracked packet did not refresh last_seen: %d, then %d", opened, refreshed)
			}
		})
	}
}

// within runs do between two readings of CLOCK_MONOTONIC and checks that
// the timestamp read() then returns lies between them, less tickSlack.
func within(t *testing.T, do func(), read func() uint64) uint64 {
	t.Helper()
	before := monotonic(t)
	do()
	after := monotonic(t)
	ts := read()
	if ts+uint64(tickSlack) < before || ts > after {
		t.Fatalf("last_seen %d is not CLOCK_MONOTONIC ns: the packet ran between %d and %d (slack %v)",
			ts, before, after, tickSlack)
	}
	return ts
}

func monotonic(t *testing.T) uint64 {
	t.Helper()
	var ts unix.Timespec
	if err := unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts); err != nil {
		t.Fatal(err)
	}
	return uint64(ts.Nano())
}

// onlyLastSeen returns last_seen of the one entry m holds.
func onlyLastSeen(t *testing.T, m *ebpf.Map) uint64 {
	t.Helper()
	var (
		n   int
		v   podfenceCtValue
		key = make([]byte, m.KeySize())
	)
	it := m.Iterate()
	for it.Next(&key, &v) {
		n++
	}
	if err := it.Err(); err != nil {
		t.Fatal(err)
	}
	if n != 1 {
		t.Fatalf("conntrack holds %d entries, want 1", n)
	}
	return v.LastSeenNs
}
