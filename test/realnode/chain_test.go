package realnode

import (
	"context"
	"encoding/json"
	"fmt"
	"os/exec"
	"strings"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/podfence/podfence/test/node"
)

// keepChain puts the node's conflist back as it is now when the test ends,
// if podfence is not chained last then, and returns it.
func keepChain(tb testing.TB, n *node.Node) string {
	tb.Helper()
	chained, err := n.Exec("cat", "/etc/cni/net.d/10-aws.conflist").Output()
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() {
		if chainedLast(n) != nil {
			writeConflist(tb, n, string(chained))
		}
	})
	return string(chained)
}

// sweeperPID is the process ID of the DaemonSet's sweeper on the node.
func sweeperPID(t testing.TB) string {
	t.Helper()
	out, err := exec.Command("pgrep", "-f", "^/usr/local/bin/podfence-sweeper run").Output()
	pids := strings.Fields(string(out))
	if err != nil || len(pids) != 1 {
		t.Fatalf("the sweeper's process: %v %q", err, out)
	}
	return pids[0]
}

// chainedLast says whether the node's conflist has podfence last.
func chainedLast(n *node.Node) error {
	b, err := n.Exec("cat", "/etc/cni/net.d/10-aws.conflist").Output()
	if err != nil {
		return err
	}
	var list struct {
		Plugins []struct{ Type string } `json:"plugins"`
	}
	if err := json.Unmarshal(b, &list); err != nil {
		return err
	}
	if len(list.Plugins) == 0 || list.Plugins[len(list.Plugins)-1].Type != "podfence" {
		return fmt.Errorf("plugins %+v", list.Plugins)
	}
	return nil
}

// TestChainKeptOnNode: the sweeper pod, as the manifest runs it, puts
// podfence back into the chain when the conflist is rewritten from the
// primary CNI's template (as aws-node does at every start) while a
// Deployment scales up, and the plugin binary back when it is removed:
// every pod the Deployment gets is fenced (a stranger cannot reach it
// under a default-deny policy), and pods created while the binary was
// gone (the sweeper held stopped to keep that window open) start once the
// kubelet retries them.
func TestChainKeptOnNode(t *testing.T) {
	n := needNode(t)
	cs := clientset(t, n)
	ns := namespace(t, cs, "chain")
	ctx := context.Background()
	stranger := runPod(t, cs, ns, netexecPod("stranger", map[string]string{"app": "stranger"}))
	isolateIngress(t, cs, ns, "web")
	createDeployment(t, cs, ns, "web")
	// Whatever happens, the node keeps its chain for the other tests.
	keepChain(t, n)

	// aws-node's start: the template written over the list while pods
	// are being created.
	done := make(chan struct{})
	go func() {
		defer close(done)
		scale(t, cs, ns, "web", 5)
	}()
	writeConflist(t, n, node.PrimaryConflist())
	waitFor(t, "podfence chained again", 30*time.Second, func() error { return chainedLast(n) })
	<-done

	// A primary CNI's upgrade that cleans the plugin directory. The
	// sweeper puts the binary back within milliseconds, too soon for a
	// pod to be created meanwhile: it is held stopped until a pod's ADD
	// has failed for want of the binary.
	sweeper := sweeperPID(t)
	signal := func(sig string) {
		if out, err := exec.Command("kill", "-"+sig, sweeper).CombinedOutput(); err != nil {
			t.Fatalf("kill -%s %s: %v: %s", sig, sweeper, err, out)
		}
	}
	signal("STOP")
	t.Cleanup(func() { exec.Command("kill", "-CONT", sweeper).Run() })
	if out, err := n.Exec("rm", "/opt/cni/bin/podfence").CombinedOutput(); err != nil {
		t.Fatalf("rm: %v: %s", err, out)
	}
	setReplicas(t, cs, ns, "web", 8)
	waitFor(t, "a pod's sandbox refused for want of the plugin", time.Minute, func() error {
		evs, err := cs.CoreV1().Events(ns).List(ctx, metav1.ListOptions{FieldSelector: "reason=FailedCreatePodSandBox"})
		if err != nil {
			return err
		}
		for _, e := range evs.Items {
			if strings.Contains(e.Message, "podfence") {
				t.Logf("while the binary was gone: %s", e.Message)
				return nil
			}
		}
		return fmt.Errorf("%d sandbox failures, none about podfence", len(evs.Items))
	})
	signal("CONT")
	waitFor(t, "the plugin binary back", 10*time.Second, func() error {
		if out, err := n.Exec("test", "-x", "/opt/cni/bin/podfence").CombinedOutput(); err != nil {
			return fmt.Errorf("%v: %s", err, out)
		}
		return nil
	})
	// The kubelet retries the refused sandboxes, now with podfence.
	scale(t, cs, ns, "web", 8)

	pods, err := cs.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{LabelSelector: "app=web"})
	if err != nil {
		t.Fatal(err)
	}
	if len(pods.Items) != 8 {
		t.Fatalf("%d web pods, want 8", len(pods.Items))
	}
	// Each is fenced: the stranger's SYN is dropped (a timeout), while
	// the pod answers its kubelet's probes (it is Ready).
	for _, p := range pods.Items {
		// A pod whose ADD ran in the gap is adopted once it is ready:
		// within the adopter's second pass after the repair (5 s), or
		// its periodic one.
		waitFor(t, "web pod "+p.Name+" fenced", 45*time.Second, func() error {
			err := reaches(n, stranger.UID, p.Status.PodIP)
			if err == nil {
				return fmt.Errorf("the stranger reaches %s at %s", p.Name, p.Status.PodIP)
			}
			if !isTimeout(err) {
				return fmt.Errorf("dial %s: %v, want a timeout", p.Status.PodIP, err)
			}
			return nil
		})
	}
	logs, err := n.Kubectl("-n", "kube-system", "logs", "ds/podfence-sweeper", "-c", "sweeper")
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"chained podfence last again", "put the podfence binary back"} {
		if !strings.Contains(string(logs), want) {
			t.Errorf("the sweeper's log does not say %q", want)
		}
	}
}
