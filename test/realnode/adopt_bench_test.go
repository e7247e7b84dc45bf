package realnode

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"slices"
	"strings"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/podfence/podfence/test/node"
)

// BenchmarkAdoption reports how long podfence takes to fence a full node
// it is installed on: from the sweeper's first log line to the end of its
// first adoption pass (whose log line counts the pods adopted), with the
// node at the kubelet's default maximum of 110 pods, in tc and in tcx
// mode (TCX pays two RCU grace periods per pod, tc none). The pods are
// made once; podfence is taken off and installed again for each mode,
// with the mode set in its conflist entry beforehand (install-cni keeps
// an entry it finds).
func BenchmarkAdoption(b *testing.B) {
	n := needNode(b)
	cs := clientset(b, n)
	ns := namespace(b, cs, "adoptbench")
	ctx := context.Background()
	reinstallAtEnd(b, n)
	manifest, err := os.ReadFile("../../conf/podfence-sweeper.yaml")
	if err != nil {
		b.Fatal(err)
	}
	all, err := cs.CoreV1().Pods("").List(ctx, metav1.ListOptions{})
	if err != nil {
		b.Fatal(err)
	}
	// The node's own pods count against its 110; the sweeper's comes back.
	fill := int32(110 - len(all.Items) - 1)
	createDeployment(b, cs, ns, "fill")
	scale(b, cs, ns, "fill", fill)
	for _, mode := range []string{"tc", "tcx"} {
		uninstallPodfence(b, n, cs, ns)
		// The entry install-cni will keep, with the mode.
		conf, err := n.Exec("cat", "/etc/cni/net.d/10-aws.conflist").Output()
		if err != nil {
			b.Fatal(err)
		}
		var list map[string]any
		if err := json.Unmarshal(conf, &list); err != nil {
			b.Fatal(err)
		}
		list["plugins"] = append(list["plugins"].([]any), map[string]any{"type": "podfence",
			"pinRoot": "/sys/fs/bpf/podfence", "policyDir": "/etc/podfence/policies", "attachMode": mode})
		out, err := json.MarshalIndent(list, "", "  ")
		if err != nil {
			b.Fatal(err)
		}
		writeConflist(b, n, string(out))
		if err := n.InstallPodfence(manifest); err != nil {
			b.Fatal(err)
		}
		var first, done time.Time
		var adopted int
		waitFor(b, "the first adoption pass", 5*time.Minute, func() error {
			for i, l := range sweeperLogs(b, n) {
				if i == 0 {
					first = l.Time
				}
				if l.Msg == "adoption pass" {
					done, adopted = l.Time, l.Adopted
					return nil
				}
			}
			return fmt.Errorf("no adoption pass yet")
		})
		if adopted < int(fill) {
			b.Errorf("%s: the first pass adopted %d pods, want at least %d", mode, adopted, fill)
		}
		d := done.Sub(first)
		b.Logf("%s: %d pods adopted %v after the sweeper's start (%.1f ms a pod)", mode, adopted, d.Round(time.Millisecond), float64(d.Milliseconds())/float64(adopted))
		b.ReportMetric(d.Seconds(), mode+"-s")
		b.ReportMetric(float64(adopted), mode+"-pods")
	}
	b.ReportMetric(0, "ns/op")
}

// sweeperLog is a line of the sweeper's JSON log.
type sweeperLog struct {
	Time        time.Time `json:"time"`
	Msg         string    `json:"msg"`
	Pod         string    `json:"pod"`
	UnfencedFor string    `json:"unfenced_for"`
	Adopted     int       `json:"adopted"`
	Selected    int       `json:"selected"`
}

// sweeperLogs reads the DaemonSet sweeper's log.
func sweeperLogs(tb testing.TB, n *node.Node) []sweeperLog {
	tb.Helper()
	out, err := n.Kubectl("-n", "kube-system", "logs", "ds/podfence-sweeper", "-c", "sweeper")
	if err != nil {
		tb.Fatal(err)
	}
	var lines []sweeperLog
	for _, line := range strings.Split(string(out), "\n") {
		var l sweeperLog
		if json.Unmarshal([]byte(line), &l) == nil {
			lines = append(lines, l)
		}
	}
	return lines
}

const adoptedMsg = "adopted a running pod podfence's ADD never saw"

// BenchmarkAdoptionGap reports how long a pod whose ADD ran while podfence
// was out of the chain stays open, with the sweeper as the manifest runs
// it (--keep-chained, --adopt):
//   - held: the sweeper stopped (SIGSTOP) while the conflist is rewritten
//     from the primary CNI's template and 10 pods start, then resumed:
//     the time from its resumption to the chain repaired and to each pod
//     adopted (the gap itself is as long as the benchmark holds it);
//   - live: the sweeper running while the template is written and pods
//     are created at once, five times: how many pods landed in the gap
//     the keeper leaves (its repair takes milliseconds), and how long each
//     of those ran unfenced, from its sandbox's creation to its adoption.
func BenchmarkAdoptionGap(b *testing.B) {
	n := needNode(b)
	cs := clientset(b, n)
	ns := namespace(b, cs, "adoptgap")
	createDeployment(b, cs, ns, "gap")
	keepChain(b, n)
	adoptedHere := func(after time.Time) []sweeperLog {
		var out []sweeperLog
		for _, l := range sweeperLogs(b, n) {
			if l.Msg == adoptedMsg && strings.HasPrefix(l.Pod, ns+"/") && l.Time.After(after) {
				out = append(out, l)
			}
		}
		return out
	}

	// Held.
	const held = 10
	sweeper := sweeperPID(b)
	if out, err := exec.Command("kill", "-STOP", sweeper).CombinedOutput(); err != nil {
		b.Fatalf("kill -STOP: %v: %s", err, out)
	}
	b.Cleanup(func() { exec.Command("kill", "-CONT", sweeper).Run() })
	writeConflist(b, n, node.PrimaryConflist())
	scale(b, cs, ns, "gap", held)
	resumed := time.Now()
	if out, err := exec.Command("kill", "-CONT", sweeper).CombinedOutput(); err != nil {
		b.Fatalf("kill -CONT: %v: %s", err, out)
	}
	var adopted []sweeperLog
	waitFor(b, "the held pods adopted", time.Minute, func() error {
		if adopted = adoptedHere(resumed); len(adopted) < held {
			return fmt.Errorf("%d of %d adopted", len(adopted), held)
		}
		return nil
	})
	var repaired time.Time
	for _, l := range sweeperLogs(b, n) {
		if l.Msg == "chained podfence last again" && l.Time.After(resumed) {
			repaired = l.Time
			break
		}
	}
	if repaired.IsZero() {
		b.Fatal("the sweeper's log does not say it chained podfence again after it resumed")
	}
	var after []time.Duration
	for _, l := range adopted {
		after = append(after, l.Time.Sub(resumed))
	}
	slices.Sort(after)
	b.Logf("held: chain repaired %v after the sweeper resumed; %d pods adopted %v to %v after it",
		repaired.Sub(resumed).Round(time.Millisecond), len(adopted), after[0].Round(time.Millisecond), after[len(after)-1].Round(time.Millisecond))
	b.ReportMetric(repaired.Sub(resumed).Seconds()*1000, "held-repair-ms")
	b.ReportMetric(after[len(after)-1].Seconds()*1000, "held-all-adopted-ms")

	// Live.
	scale(b, cs, ns, "gap", 0)
	start := time.Now()
	const rounds, each = 5, 4
	for i := range rounds {
		writeConflist(b, n, node.PrimaryConflist())
		scale(b, cs, ns, "gap", int32((i+1)*each))
	}
	// Past the periodic pass, which catches a pod that became ready more
	// than repairSettle after the repair.
	time.Sleep(35 * time.Second)
	var open []time.Duration
	for _, l := range adoptedHere(start) {
		d, err := time.ParseDuration(l.UnfencedFor)
		if err != nil {
			b.Fatalf("unfenced_for %q: %v", l.UnfencedFor, err)
		}
		open = append(open, d)
	}
	slices.Sort(open)
	b.Logf("live: %d of %d pods landed in the gap; unfenced for %v", len(open), rounds*each, open)
	b.ReportMetric(float64(len(open)), "live-pods-in-gap")
	if len(open) > 0 {
		b.ReportMetric(open[len(open)/2].Seconds(), "live-unfenced-p50-s")
		b.ReportMetric(open[len(open)-1].Seconds(), "live-unfenced-max-s")
	}
	b.ReportMetric(0, "ns/op")
}
