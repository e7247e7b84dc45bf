package realnode

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
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
	if theNode == nil {
		b.Skip(skipWhy)
	}
	n := theNode
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
	if _, err := cs.AppsV1().Deployments(ns).Create(ctx, deployment("fill", 0), metav1.CreateOptions{}); err != nil {
		b.Fatal(err)
	}
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
			logs, err := n.Kubectl("-n", "kube-system", "logs", "ds/podfence-sweeper", "-c", "sweeper")
			if err != nil {
				return err
			}
			for i, line := range strings.Split(strings.TrimSpace(string(logs)), "\n") {
				var l struct {
					Time    time.Time `json:"time"`
					Msg     string    `json:"msg"`
					Adopted int       `json:"adopted"`
				}
				if json.Unmarshal([]byte(line), &l) != nil {
					continue
				}
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
