package bpf

import (
	"errors"
	"os"
	"slices"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"
)

// BenchmarkDenyFlood: what one denied packet of a flood costs, with a
// deny event written for it (the budget has tokens) and without (the steady
// state of a flood: the budget is spent and refills one token per
// millisecond). The kernel writes at most about 1,000 events a second per
// CPU, so the events' share of a CPU is bounded by that rate times the
// difference; hack/bench.sh prints it.
func BenchmarkDenyFlood(b *testing.B) {
	h := newHarness(b)
	h.apply(b, isolate(rules(rule("10.1.0.0/16", tcpPort(80))), nil))
	frame := syn(tcp(peer4, pod4, 40000, 81)).Marshal()
	events, err := OpenDenyEvents(h.g)
	if err != nil {
		b.Fatal(err)
	}
	defer events.Close()
	ncpu, err := ebpf.PossibleCPU()
	if err != nil {
		b.Fatal(err)
	}
	fill := func() {
		var now unix.Timespec
		if err := unix.ClockGettime(unix.CLOCK_MONOTONIC, &now); err != nil {
			b.Fatal(err)
		}
		// A little in the past: the datapath's clock lags by up to a
		// tick, and a last refill "in the future" would underflow.
		budget := slices.Repeat([]podfenceEventBudget{{LastNs: uint64(now.Nano()) - uint64(10*time.Millisecond), Tokens: 64}}, ncpu)
		if err := h.g.EventBudget.Put(uint32(0), budget); err != nil {
			b.Fatal(err)
		}
	}
	drain := func() int {
		n := 0
		for {
			events.SetDeadline(time.Now())
			if _, err := events.Read(); err != nil {
				if !errors.Is(err, os.ErrDeadlineExceeded) {
					b.Fatal(err)
				}
				return n
			}
			n++
		}
	}
	defer onOneCPU(b)()
	const burst = 64
	var with, without []float64
	for range b.N {
		fill()
		_, d, err := h.id.Ingress.Benchmark(frame, burst, nil)
		if err != nil {
			b.Fatal(err)
		}
		with = append(with, float64(d.Nanoseconds()))
		// The budget is spent now: the same packets write no event.
		_, d, err = h.id.Ingress.Benchmark(frame, burst, nil)
		if err != nil {
			b.Fatal(err)
		}
		without = append(without, float64(d.Nanoseconds()))
		if n := drain(); n < burst {
			b.Fatalf("%d events for a full budget of %d", n, burst)
		}
	}
	we, wo := median(with), median(without)
	b.ReportMetric(we, "event-ns")
	b.ReportMetric(wo, "no-event-ns")
	// 1,000 events a second at (we-wo) ns each, as a share of one CPU.
	b.ReportMetric(max(we-wo, 0)*1000/1e9*100, "event-cpu-%")
}
