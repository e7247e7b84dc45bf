package realnode

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"os"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/util/retry"

	"github.com/podfence/podfence/pkg/podid"
	"github.com/podfence/podfence/test/node"
)

// TestChurn is the seed system's leak test, larger: a Deployment scaled
// between 0 and 50 replicas (twice in make test: 100 pods; PODFENCE_CHURN_ROUNDS
// sets it, make churn runs 40: 2,000 pods; after a warm-up round that is
// not measured), all replicas sharing one pod
// identifier. Afterwards nothing of podfence is left beyond the running
// pods' identifiers and the node's global maps, and the plugin's ADD and
// DEL take as long at the end as at the start: from 40 rounds on, in the
// last tenth of the run, the p50 of its own phases, of its CPU time and of
// the whole call within 1.2 times the first tenth's, from the plugin's own
// log (every phase's p50 is logged, whatever the rounds).
func TestChurn(t *testing.T) {
	n := needNode(t)
	rounds := 2
	if v, err := strconv.Atoi(os.Getenv("PODFENCE_CHURN_ROUNDS")); err == nil && v > 0 {
		rounds = v
	}
	const replicas = 50
	cs := clientset(t, n)
	ns := namespace(t, cs, "churn")
	ctx := context.Background()
	labels := map[string]string{"app": "churn"}
	dep := &appsv1.Deployment{
		ObjectMeta: metav1.ObjectMeta{Name: "churn"},
		Spec: appsv1.DeploymentSpec{
			Replicas: new(int32),
			Selector: &metav1.LabelSelector{MatchLabels: labels},
			Template: corev1.PodTemplateSpec{
				ObjectMeta: metav1.ObjectMeta{Labels: labels},
				Spec: corev1.PodSpec{
					TerminationGracePeriodSeconds: new(int64),
					Containers: []corev1.Container{{Name: "pause", Image: node.AgnhostImage,
						ImagePullPolicy: corev1.PullIfNotPresent, Args: []string{"pause"}}},
				},
			},
		},
	}
	if _, err := cs.AppsV1().Deployments(ns).Create(ctx, dep, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	// A warm-up round, not measured: the first pods of a fresh node start
	// one by one while its caches fill (their ADDs waited 0.1 ms for the
	// lock, later rounds' seconds), so a first tenth taken from them is
	// no baseline for the 50 concurrent ADDs of every later round.
	scale(t, cs, ns, "churn", replicas)
	scale(t, cs, ns, "churn", 0)
	setPluginLog(t, n, "/var/log/podfence/churn.log")
	start := time.Now()
	for r := range rounds {
		for _, want := range []int32{replicas, 0} {
			scale(t, cs, ns, "churn", want)
		}
		t.Logf("round %d: %d pods so far, %v", r+1, (r+1)*replicas, time.Since(start).Round(time.Second))
	}

	// What is left of podfence is the running pods'.
	pods, err := cs.CoreV1().Pods("").List(ctx, metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]bool{}
	for _, p := range pods.Items {
		if p.Spec.HostNetwork || p.DeletionTimestamp != nil {
			continue
		}
		if id, err := podid.FromPod(p.Name, p.Namespace); err == nil {
			want[string(id)] = true
		}
	}
	// A pod's object goes when its containers have stopped; its sandbox's
	// teardown (the CNI DEL) may finish a moment later.
	var extra []string
	deadline := time.Now().Add(30 * time.Second)
	for {
		out, err := n.Exec("ls", "/sys/fs/bpf/podfence/ids").Output()
		if err != nil {
			t.Fatal(err)
		}
		extra = extra[:0]
		for _, id := range strings.Fields(string(out)) {
			if !want[id] {
				extra = append(extra, id)
			}
		}
		if len(extra) == 0 || time.Now().After(deadline) {
			break
		}
		time.Sleep(time.Second)
	}
	for _, id := range extra {
		t.Errorf("pins of identifier %s, which no running pod has, 30 s after its last pod went", id)
	}
	if out, err := n.Exec("ls", "/sys/fs/bpf/podfence/global").Output(); err != nil || !strings.Contains(string(out), "ct_v4") {
		t.Errorf("the node's global maps: %q, %v", out, err)
	}

	// The plugin's ADD and DEL keep their speed. Three p50s, each of the
	// last tenth of the run within 1.2 times the first tenth's:
	//   - the wall-clock time of podfence's own phases (loggedCall.work);
	//   - the CPU time, what podfence itself spends on a call (in a 4-round
	//     run: 31.1 and 31.5 ms for ADD, 20.2 and 23.1 ms for DEL, one
	//     round's 50 calls too few for a steady p50);
	//   - the whole call, as a runtime sees it (the
	//     issue's measure): it is mostly the wait for the identifier's lock,
	//     that is the call's place in its burst's queue, which varies from
	//     round to round (3.9 s and 5.0 s for the first and the fourth of a
	//     4-round run), so a tenth must hold several rounds to compare.
	// A tenth is rounded up to whole rounds: log order is finishing order,
	// and a burst's last ADDs are those that queued longest, so a tenth
	// that cut a burst in two would compare short waits with long ones.
	log, err := n.Exec("cat", "/var/log/podfence/churn.log").Output()
	if err != nil {
		t.Fatal(err)
	}
	tenthRounds := max(1, rounds/10)
	tenth := tenthRounds * replicas
	// The speeds are a target of make churn (40 rounds), not of the short
	// form in make test, which logs them: a tenth of 4 rounds is one burst,
	// and its wall-clock phases hold the node's load (the own phases' p50
	// went 192.5 to 239.5 ms in one CI run while the CPU time went 35.5 to
	// 35.8 ms).
	timed := tenthRounds >= 4
	for _, cmd := range []string{"ADD", "DEL"} {
		calls := workCalls(log, cmd)
		if len(calls) < replicas*rounds {
			t.Errorf("%d %ss that did their work in the plugin's log, want %d", len(calls), cmd, replicas*rounds)
			continue
		}
		firstCalls, lastCalls := calls[:tenth], calls[len(calls)-tenth:]
		for _, m := range []struct {
			what string
			of   func(loggedCall) float64
		}{
			{"CPU time", loggedCall.cpu},
			{"own phases' wall-clock time", loggedCall.work},
			{"whole call", loggedCall.total},
		} {
			first, last := p50(firstCalls, m.of), p50(lastCalls, m.of)
			t.Logf("%s p50 of the %s: first tenth %.1f ms, last tenth %.1f ms (%d calls a tenth)", cmd, m.what, first, last, tenth)
			switch {
			case first <= 0 || last <= 0:
				t.Errorf("%s: no %s in the plugin's log", cmd, m.what)
			case timed && last > 1.2*first:
				t.Errorf("%s p50 of the %s grew from %.1f ms to %.1f ms over the run", cmd, m.what, first, last)
			}
		}
		// Where the time goes, so that a slower run says which phase grew.
		for _, phase := range slices.Sorted(maps.Keys(calls[0].Phases)) {
			of := func(c loggedCall) float64 { return c.Phases[phase] }
			t.Logf("  %s phase %s p50: first tenth %.1f ms, last tenth %.1f ms", cmd, phase, p50(firstCalls, of), p50(lastCalls, of))
		}
	}
}

// scale sets the Deployment's replicas and waits until that many pods are
// Ready and no other remains.
func scale(t testing.TB, cs *kubernetes.Clientset, ns, name string, replicas int32) {
	t.Helper()
	ctx := context.Background()
	setReplicas(t, cs, ns, name, replicas)
	waitFor(t, fmt.Sprintf("%d replicas of %s", replicas, name), 5*time.Minute, func() error {
		pods, err := cs.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{LabelSelector: "app=" + name})
		if err != nil {
			return err
		}
		readyPods := 0
		for _, p := range pods.Items {
			if ready(&p) {
				readyPods++
			}
		}
		if readyPods != int(replicas) || len(pods.Items) != int(replicas) {
			return fmt.Errorf("%d pods, %d ready", len(pods.Items), readyPods)
		}
		return nil
	})
}

// setReplicas sets the Deployment's replicas.
func setReplicas(t testing.TB, cs *kubernetes.Clientset, ns, name string, replicas int32) {
	t.Helper()
	ctx := context.Background()
	// The Deployment controller writes the object too: retry a conflict.
	if err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		s, err := cs.AppsV1().Deployments(ns).GetScale(ctx, name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		s.Spec.Replicas = replicas
		_, err = cs.AppsV1().Deployments(ns).UpdateScale(ctx, name, s, metav1.UpdateOptions{})
		return err
	}); err != nil {
		t.Fatal(err)
	}
}

// loggedCall is one line of the plugin's log.
type loggedCall struct {
	Cmd      string             `json:"cmd"`
	Action   string             `json:"action"`
	Duration float64            `json:"duration_ms"`
	CPU      float64            `json:"cpu_ms"`
	Phases   map[string]float64 `json:"phases_ms"`
	Error    string             `json:"error"`
}

// total is the call's time in ms; cpu the CPU time of the plugin's
// process, which holds its Go runtime's start. work is the wall-clock time
// of the phases whose time depends on what podfence keeps on the node
// (policy read, maps opened, policy applied, programs attached), leaving
// out: the wait for the identifier's lock; find-veth, netlink lookups of
// the runtime's veth, which queue behind the veths the runtime creates and
// deletes for the burst's other pods; and check-policy, the attach mode's
// probe. Those phases still hold waits that are not podfence's work: for
// the CPUs, which the kubelet, containerd and the API server share with
// it, and for RCU grace periods (TCX attach and detach).
func (c loggedCall) total() float64 { return c.Duration }
func (c loggedCall) cpu() float64   { return c.CPU }
func (c loggedCall) work() float64 {
	return c.Duration - c.Phases["lock"] - c.Phases["find-veth"] - c.Phases["check-policy"]
}

// workCalls are, in log order, the plugin's calls of cmd that did their
// work (ADDs that attached, DELs that detached).
func workCalls(log []byte, cmd string) []loggedCall {
	var out []loggedCall
	sc := bufio.NewScanner(strings.NewReader(string(log)))
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		var c loggedCall
		if json.Unmarshal(sc.Bytes(), &c) != nil || c.Cmd != cmd || c.Error != "" ||
			!strings.HasPrefix(c.Action, "attached") && c.Action != "detached" {
			continue
		}
		out = append(out, c)
	}
	return out
}

// p50 is the median of f over calls.
func p50(calls []loggedCall, f func(loggedCall) float64) float64 {
	s := make([]float64, len(calls))
	for i, c := range calls {
		s[i] = f(c)
	}
	slices.Sort(s)
	return s[len(s)/2]
}

// setPluginLog has the plugin log its calls to path for the rest of the
// test (a key of its conflist entry, as an operator would set it).
func setPluginLog(t *testing.T, n *node.Node, path string) {
	t.Helper()
	editPodfenceEntry(t, n, func(e map[string]any) { e["logFile"] = path })
}
