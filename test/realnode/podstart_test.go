package realnode

import (
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/podfence/podfence/test/node"
)

// BenchmarkPodStart reports the median time from a pod's creation to
// Ready, with podfence in the node's chain and without it (the primary
// conflist alone), over PODSTART_PODS pods created one after another, each
// its own pod identifier (so each ADD loads programs: the slow case).
func BenchmarkPodStart(b *testing.B) {
	n := needNode(b)
	cs := clientset(b, n)
	ns := namespace(b, cs, "podstart")
	const pods = 20
	measure := func(prefix string) float64 {
		var d []float64
		for i := range pods {
			start := time.Now()
			runPod(b, cs, ns, &corev1.Pod{
				ObjectMeta: metav1.ObjectMeta{Name: fmt.Sprintf("%s-%d", prefix, i)},
				Spec: corev1.PodSpec{TerminationGracePeriodSeconds: new(int64), Containers: []corev1.Container{{
					Name: "pause", Image: node.AgnhostImage, ImagePullPolicy: corev1.PullIfNotPresent, Args: []string{"pause"}}}},
			})
			d = append(d, time.Since(start).Seconds())
		}
		slices.Sort(d)
		return d[len(d)/2]
	}
	with := measure("with")
	chained, err := n.Exec("cat", "/etc/cni/net.d/10-aws.conflist").Output()
	if err != nil {
		b.Fatal(err)
	}
	// The sweeper keeps podfence in the chain (--keep-chained): it goes
	// off the node while the primary conflist alone is measured.
	pauseSweeper(b, n)
	b.Cleanup(func() {
		writeConflist(b, n, string(chained))
		resumeSweeper(b, n)
	})
	writeConflist(b, n, node.PrimaryConflist())
	without := measure("without")
	b.ReportMetric(with, "with-podfence-p50-s")
	b.ReportMetric(without, "without-podfence-p50-s")
	b.ReportMetric(with/without, "ratio")
	b.ReportMetric(0, "ns/op")
}

// pauseSweeper takes the sweeper's pod off the node (a node selector no
// node has) and waits until it is gone.
func pauseSweeper(tb testing.TB, n *node.Node) {
	tb.Helper()
	if out, err := n.Kubectl("-n", "kube-system", "patch", "ds", "podfence-sweeper", "--type=merge",
		"-p", `{"spec":{"template":{"spec":{"nodeSelector":{"podfence.test/paused":"true"}}}}}`); err != nil {
		tb.Fatalf("pause the sweeper: %v: %s", err, out)
	}
	waitFor(tb, "the sweeper's pod gone", 2*time.Minute, func() error {
		out, err := n.Kubectl("-n", "kube-system", "get", "pods", "-l", "app.kubernetes.io/name=podfence-sweeper", "-o", "name")
		if err != nil || len(strings.TrimSpace(string(out))) > 0 {
			return fmt.Errorf("%v %s", err, out)
		}
		return nil
	})
}

// resumeSweeper undoes pauseSweeper and waits until podfence runs again.
func resumeSweeper(tb testing.TB, n *node.Node) {
	tb.Helper()
	if out, err := n.Kubectl("-n", "kube-system", "patch", "ds", "podfence-sweeper", "--type=merge",
		"-p", `{"spec":{"template":{"spec":{"nodeSelector":{"podfence.test/paused":null}}}}}`); err != nil {
		tb.Fatalf("resume the sweeper: %v: %s", err, out)
	}
	if err := n.WaitPodfence(3 * time.Minute); err != nil {
		tb.Fatal(err)
	}
}

// writeConflist replaces the node's conflist, atomically.
func writeConflist(tb testing.TB, n *node.Node, conf string) {
	tb.Helper()
	const path = "/etc/cni/net.d/10-aws.conflist"
	cmd := n.Exec("sh", "-c", "cat > "+path+".tmp && mv "+path+".tmp "+path)
	cmd.Stdin = strings.NewReader(conf)
	if out, err := cmd.CombinedOutput(); err != nil {
		tb.Fatalf("write %s: %v: %s", path, err, out)
	}
}
