package e2e

import (
	"flag"
	"fmt"
	"os"
	"sort"
	"sync"
	"testing"
	"time"

	"github.com/podfence/podfence/test/kernel"
)

var (
	benchCalls = flag.Int("plugin.calls", 200, "measured calls per case in BenchmarkPlugin")
	benchLog   = flag.String("plugin.log", "", "BenchmarkPlugin copies the plugin's log, with each call's phase timings, to this path plus the attach mode")
)

func percentiles(b *testing.B, name string, d []time.Duration) {
	sort.Slice(d, func(i, j int) bool { return d[i] < d[j] })
	ms := func(x time.Duration) float64 { return float64(x.Microseconds()) / 1000 }
	b.ReportMetric(ms(d[len(d)/2]), name+"-p50-ms")
	b.ReportMetric(ms(d[len(d)*99/100]), name+"-p99-ms")
}

// BenchmarkPlugin measures the podfence binary's own ADD and DEL, invoked
// with a prevResult as libcni invokes it (no primary plugin runs; the
// sandboxes are the race test's slots): for the first replica of an
// identifier (programs loaded, verified and pinned), for later replicas
// (pins reused), and 64 concurrent ADDs of one identifier; in each attach
// mode the kernel has (tcx is what auto picks from Linux 6.6). Each case
// makes -plugin.calls measured calls whatever b.N is; run it with
// -benchtime=1x (hack/bench.sh does). The plugin's log has each call's
// phase timings; -plugin.log keeps it.
//
// In tcx mode every attach and detach waits for an RCU grace period in the
// kernel (see BenchmarkAttach in pkg/attach), two per ADD and two per DEL.
func BenchmarkPlugin(b *testing.B) {
	kernel.RequireRoot(b)
	for _, mode := range attachModes(b) {
		b.Run(mode, func(b *testing.B) { benchPlugin(b, mode) })
	}
}

func benchPlugin(b *testing.B, mode string) {
	c := newCluster(b, mode)
	if *benchLog != "" {
		b.Cleanup(func() {
			if data, err := os.ReadFile(c.logFile); err == nil {
				_ = os.WriteFile(*benchLog+"."+mode, data, 0o644)
			}
		})
	}
	c.writePolicy("web", selectPolicy("web-7f65cc6544-9j58r"))
	slots := c.newSlots(64)
	call := func(cmd, container, pod string, i int) time.Duration {
		b.Helper()
		d, err := c.timedExec(invocation{command: cmd, containerID: container, pod: pod, slot: slots[i]})
		if err != nil {
			b.Fatal(err)
		}
		return d
	}

	b.Run("first-replica", func(b *testing.B) {
		for n := 0; n < b.N; n++ {
			var add, del []time.Duration
			for i := 0; i < *benchCalls; i++ {
				pod := fmt.Sprintf("solo-%d", i) // a bare pod: an identifier of its own
				add = append(add, call("ADD", pod, pod, i%len(slots)))
				del = append(del, call("DEL", pod, pod, i%len(slots))) // the last member: removes the pins too
			}
			percentiles(b, "add", add)
			percentiles(b, "del-last", del)
		}
	})

	b.Run("later-replica", func(b *testing.B) {
		call("ADD", "web-keep", "web-7f65cc6544-9j58r", 0)
		defer call("DEL", "web-keep", "web-7f65cc6544-9j58r", 0)
		for n := 0; n < b.N; n++ {
			var add, del []time.Duration
			for i := 0; i < *benchCalls; i++ {
				ctr, v := fmt.Sprintf("web-%d", i), 1+i%(len(slots)-1)
				add = append(add, call("ADD", ctr, "web-7f65cc6544-x2k4p", v))
				del = append(del, call("DEL", ctr, "web-7f65cc6544-x2k4p", v))
			}
			percentiles(b, "add", add)
			percentiles(b, "del", del)
		}
	})

	b.Run("64-concurrent-adds", func(b *testing.B) {
		for n := 0; n < b.N; n++ {
			var wg sync.WaitGroup
			errs := make([]error, len(slots))
			start := time.Now()
			for i := range slots {
				wg.Add(1)
				go func() {
					defer wg.Done()
					errs[i] = c.exec(invocation{command: "ADD", containerID: fmt.Sprintf("burst-%d", i), pod: "web-7f65cc6544-bcdfg", slot: slots[i]})
				}()
			}
			wg.Wait()
			took := time.Since(start)
			failed := 0
			for _, err := range errs {
				if err != nil {
					failed++
					b.Error(err)
				}
			}
			b.ReportMetric(float64(took.Milliseconds()), "all-64-ms")
			b.ReportMetric(float64(failed), "failed")
			for i := range slots {
				call("DEL", fmt.Sprintf("burst-%d", i), "web-7f65cc6544-bcdfg", i)
			}
		}
	})
}
