package e2e

import (
	"fmt"
	"os/exec"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"

	"github.com/podfence/podfence/pkg/podid"
	"github.com/podfence/podfence/test/kernel"
)

// BenchmarkPolicy measures the file path of live policy:
//
//   - change-to-enforced: a web pod, `run` following the policy directory;
//     100 rename-writes alternating two policies, each timed from the
//     rename to the identifier's new generation (its tries written and
//     its flows due for a re-check): p50 and p99.
//
//   - sync-1000-documents: 100 identifiers with a pod each, 1,000
//     documents of 10 rules (10 per identifier); `podfence-sweeper apply`
//     programs all of them: its wall time and peak RSS.
//
//   - api-change-to-enforced: the same with `run --policy-source=kubernetes`
//     and a real API server: 100 updates of the web pod's PolicyEndpoint,
//     each timed from the update call to the new generation.
//
//   - api-sync-1000: the same 1,000 documents as PolicyEndpoints in the
//     API; a sweeper starts with none mirrored: time from its start to
//     all 100 identifiers programmed, and its peak RSS.
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
		docs := []string{
			selectPolicy(webReplicas[0]),
			endpointDoc{name: "select", pods: []string{webReplicas[0]}, isolate: []string{"Ingress"},
				ingress: []docRule{tcpRule("10.78.0.0/16", 8443)}}.String(),
		}
		for range b.N {
			percentiles(b, "change", changesToEnforced(b, c, func(i int) {
				c.renamePolicy(b, "web", docs[(i+1)%2])
			}))
		}
	})
	b.Run("api-change-to-enforced", func(b *testing.B) {
		c := newAPICluster(b)
		docs := []*unstructured.Unstructured{
			endpointDoc{name: "web", pods: []string{webReplicas[0]}, isolate: []string{"Ingress"},
				ingress: []docRule{tcpRule("10.77.0.0/16", 8080)}}.object(b),
			endpointDoc{name: "web", pods: []string{webReplicas[0]}, isolate: []string{"Ingress"},
				ingress: []docRule{tcpRule("10.78.0.0/16", 8443)}}.object(b),
		}
		c.create(b, docs[0])
		logs := c.runKubeSweeper(b)
		logs.waitFor(b, "policy directory synced with the API", 20*time.Second)
		if err := c.exec(invocation{command: "ADD", containerID: "bench-web", pod: webReplicas[0], slot: c.newSlots(1)[0]}); err != nil {
			b.Fatal(err)
		}
		for range b.N {
			percentiles(b, "change", changesToEnforced(b, c.cluster, func(i int) {
				c.update(b, docs[(i+1)%2])
			}))
		}
	})
	b.Run("sync-1000-documents", func(b *testing.B) {
		c := newCluster(b, attachModes(b)[0])
		for _, d := range syncSet(b, c) {
			c.writePolicy(d.name, d.String())
		}
		for range b.N {
			cmd := exec.Command(filepath.Join(binDir, "podfence-sweeper"), "apply", "--pin-root", c.pinRoot, "--policy-dir", c.policyDir)
			start := time.Now()
			out, err := cmd.CombinedOutput()
			took := time.Since(start)
			if err != nil {
				b.Fatalf("apply: %v: %s", err, out)
			}
			want := fmt.Sprintf("programmed %d identifiers", syncIdentifiers)
			if got := string(out); len(got) < len(want) || got[:len(want)] != want {
				b.Fatalf("apply printed %q, want %q", got, want)
			}
			b.ReportMetric(float64(took.Milliseconds()), "apply-ms")
			b.ReportMetric(float64(cmd.ProcessState.SysUsage().(*syscall.Rusage).Maxrss)/1024, "peak-RSS-MiB")
		}
	})
	b.Run("api-sync-1000", func(b *testing.B) {
		c := newAPICluster(b)
		for _, d := range syncSet(b, c.cluster) {
			c.create(b, d.object(b))
		}
		for range b.N {
			start := time.Now()
			cmd, logs := c.runSweeper(b, "--interval-min", "1h", "--interval-max", "1h",
				"--policy-source=kubernetes", "--kubeconfig", c.kubeconfig)
			// The mirror's signal or inotify, whichever comes first.
			logs.waitFor(b, `changed","identifiers":100`, time.Minute)
			took := time.Since(start)
			cmd.Process.Signal(syscall.SIGTERM)
			cmd.Wait()
			b.ReportMetric(float64(took.Milliseconds()), "sync-ms")
			b.ReportMetric(float64(cmd.ProcessState.SysUsage().(*syscall.Rusage).Maxrss)/1024, "peak-RSS-MiB")
		}
	})
}

// The sync benchmarks' set: 100 identifiers with a pod each, and 10
// documents of 10 rules for each identifier.
const syncIdentifiers = 100

func syncSet(b *testing.B, c *cluster) []endpointDoc {
	const perID, rules = 10, 10
	var docs []endpointDoc
	for i, s := range c.newSlots(syncIdentifiers) {
		pod := fmt.Sprintf("app%d-7f65cc6544-9j58r", i)
		if err := c.exec(invocation{command: "ADD", containerID: fmt.Sprintf("bench-%d", i), pod: pod, slot: s}); err != nil {
			b.Fatal(err)
		}
		for j := range perID {
			d := endpointDoc{name: fmt.Sprintf("app%d-%d", i, j), pods: []string{pod}, isolate: []string{"Ingress", "Egress"}}
			for k := range rules {
				d.ingress = append(d.ingress, tcpRule(fmt.Sprintf("10.%d.%d.0/24", 100+j, k), uint16(8000+k)))
			}
			docs = append(docs, d)
		}
	}
	return docs
}

// changesToEnforced makes 100 changes of the web identifier's policy and
// times each from the change to the identifier's next generation (its tries
// written and its flows due for a re-check).
func changesToEnforced(b *testing.B, c *cluster, change func(i int)) []time.Duration {
	id := podid.ID(webID)
	var took []time.Duration
	for i := range 100 {
		gen := c.generation(b, id)
		start := time.Now()
		change(i)
		for c.generation(b, id) == gen {
			if time.Since(start) > 5*time.Second {
				b.Fatalf("change %d not enforced after 5s", i)
			}
			time.Sleep(time.Millisecond)
		}
		took = append(took, time.Since(start))
	}
	return took
}
