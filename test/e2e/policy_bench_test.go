package e2e

import (
	"fmt"
	"os/exec"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/podfence/podfence/pkg/podid"
	"github.com/podfence/podfence/test/kernel"
)

// BenchmarkPolicy measures the file path of live policy:
//
//   - change-to-enforced: a web pod, `run` following the policy directory;
//     100 rename-writes alternating two policies, each timed from the
//     rename to the identifier's new generation (its tries written and
//     its flows due for a re-check): p50 and p99.
//   - sync-1000-documents: 100 identifiers with a pod each, 1,000
//     documents of 10 rules (10 per identifier); `podfence-sweeper apply`
//     programs all of them: its wall time and peak RSS.
//
// Run it with -benchtime=1x (hack/bench.sh does).
func BenchmarkPolicy(b *testing.B) {
	kernel.RequireRoot(b)
	b.Run("change-to-enforced", func(b *testing.B) {
		c := newCluster(b, attachModes(b)[0])
		c.writePolicy("web", selectPolicy(webReplicas[0]))
		slot := c.newSlots(1)[0]
		if err := c.exec(invocation{command: "ADD", containerID: "bench-web", pod: webReplicas[0], slot: slot}); err != nil {
			b.Fatal(err)
		}
		c.runSweeper(b, "--interval-min", "1h", "--interval-max", "1h")
		c.waitHealthy(b)
		id := podid.ID(webID)
		docs := []string{
			selectPolicy(webReplicas[0]),
			endpointDoc{name: "select", pods: []string{webReplicas[0]}, isolate: []string{"Ingress"},
				ingress: []docRule{tcpRule("10.78.0.0/16", 8443)}}.String(),
		}
		for range b.N {
			var took []time.Duration
			for i := range 100 {
				gen := c.generation(b, id)
				start := time.Now()
				c.renamePolicy(b, "web", docs[(i+1)%2])
				for c.generation(b, id) == gen {
					if time.Since(start) > 5*time.Second {
						b.Fatalf("change %d not enforced after 5s", i)
					}
					time.Sleep(time.Millisecond)
				}
				took = append(took, time.Since(start))
			}
			percentiles(b, "change", took)
		}
	})
	b.Run("sync-1000-documents", func(b *testing.B) {
		const identifiers, perID, rules = 100, 10, 10
		c := newCluster(b, attachModes(b)[0])
		slots := c.newSlots(identifiers)
		for i, s := range slots {
			pod := fmt.Sprintf("app%d-7f65cc6544-9j58r", i)
			if err := c.exec(invocation{command: "ADD", containerID: fmt.Sprintf("bench-%d", i), pod: pod, slot: s}); err != nil {
				b.Fatal(err)
			}
			for j := range perID {
				d := endpointDoc{name: fmt.Sprintf("app%d-%d", i, j), pods: []string{pod}, isolate: []string{"Ingress", "Egress"}}
				for k := range rules {
					d.ingress = append(d.ingress, tcpRule(fmt.Sprintf("10.%d.%d.0/24", 100+j, k), uint16(8000+k)))
				}
				c.writePolicy(d.name, d.String())
			}
		}
		for range b.N {
			cmd := exec.Command(filepath.Join(binDir, "podfence-sweeper"), "apply", "--pin-root", c.pinRoot, "--policy-dir", c.policyDir)
			start := time.Now()
			out, err := cmd.CombinedOutput()
			took := time.Since(start)
			if err != nil {
				b.Fatalf("apply: %v: %s", err, out)
			}
			want := fmt.Sprintf("programmed %d identifiers", identifiers)
			if got := string(out); len(got) < len(want) || got[:len(want)] != want {
				b.Fatalf("apply printed %q, want %q", got, want)
			}
			b.ReportMetric(float64(took.Milliseconds()), "apply-ms")
			b.ReportMetric(float64(cmd.ProcessState.SysUsage().(*syscall.Rusage).Maxrss)/1024, "peak-RSS-MiB")
		}
	})
}
