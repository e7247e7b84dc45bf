package realnode

import (
	"context"
	"errors"
	"fmt"
	"os"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/podfence/podfence/test/node"
)

// podfencePrograms are the IDs of the datapath's programs loaded in the
// kernel now (whoever loaded them: this runs alone on the machine).
func podfencePrograms(t *testing.T) []ebpf.ProgramID {
	t.Helper()
	var ids []ebpf.ProgramID
	for id := ebpf.ProgramID(0); ; {
		next, err := ebpf.ProgramGetNextID(id)
		if errors.Is(err, os.ErrNotExist) {
			return ids
		}
		if err != nil {
			t.Fatal(err)
		}
		id = next
		p, err := ebpf.NewProgramFromID(id)
		if err != nil {
			continue // freed meanwhile
		}
		info, err := p.Info()
		p.Close()
		if err == nil && (info.Name == "pod_ingress" || info.Name == "pod_egress") {
			ids = append(ids, id)
		}
	}
}

// TestUninstallOnNode takes podfence off the node as the README says
// (the DaemonSet deleted, then podfence-sweeper uninstall from the image
// in a node debug pod): the pods keep running, a pod the policy fenced is
// reachable by anyone, no program of podfence stays loaded and no pin
// stays. podfence is installed again afterwards, for the other tests.
func TestUninstallOnNode(t *testing.T) {
	n := needNode(t)
	cs := clientset(t, n)
	ns := namespace(t, cs, "uninstall")
	ctx := context.Background()
	stranger := runPod(t, cs, ns, netexecPod("stranger", map[string]string{"app": "stranger"}))
	web := runPod(t, cs, ns, netexecPod("web", map[string]string{"app": "web"}))
	isolateIngress(t, cs, ns, "web")
	strangerReaches := func() error { return reaches(n, stranger.UID, web.Status.PodIP) }
	waitFor(t, "the web pod fenced", 30*time.Second, func() error {
		if strangerReaches() == nil {
			return errors.New("the stranger reaches it")
		}
		return nil
	})
	if len(podfencePrograms(t)) == 0 {
		t.Fatal("no podfence program loaded before the uninstall: the check below proves nothing")
	}
	reinstallAtEnd(t, n)
	uninstallPodfence(t, n, cs, ns)

	if out, err := n.Exec("ls", "-A", "/sys/fs/bpf").CombinedOutput(); err != nil || strings.Contains(string(out), "podfence") {
		t.Errorf("bpffs after the uninstall: %v: %s", err, out)
	}
	if out, err := n.Exec("cat", "/etc/cni/net.d/10-aws.conflist").CombinedOutput(); err != nil || strings.Contains(string(out), "podfence") {
		t.Errorf("the conflist after the uninstall: %v: %s", err, out)
	}
	if err := n.Exec("test", "-e", "/opt/cni/bin/podfence").Run(); err == nil {
		t.Error("the plugin binary is still installed")
	}
	waitFor(t, "podfence's programs freed", 15*time.Second, func() error {
		if ids := podfencePrograms(t); len(ids) > 0 {
			return fmt.Errorf("programs %v still loaded", ids)
		}
		return nil
	})
	if err := strangerReaches(); err != nil {
		t.Errorf("the stranger cannot reach the web pod after the uninstall: %v", err)
	}
	for _, p := range []string{"web", "stranger"} {
		got, err := cs.CoreV1().Pods(ns).Get(ctx, p, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if !ready(got) || got.Status.ContainerStatuses[0].RestartCount != 0 {
			t.Errorf("pod %s after the uninstall: ready %v, restarts %d", p, ready(got), got.Status.ContainerStatuses[0].RestartCount)
		}
	}
}

// uninstallPodfence takes podfence off the node as the README says: the
// DaemonSet deleted, then podfence-sweeper uninstall from the image in a
// node debug pod (in namespace ns).
func uninstallPodfence(t testing.TB, n *node.Node, cs *kubernetes.Clientset, ns string) {
	t.Helper()
	ctx := context.Background()
	if out, err := n.Kubectl("-n", "kube-system", "delete", "ds", "podfence-sweeper", "--wait"); err != nil {
		t.Fatalf("delete the DaemonSet: %v: %s", err, out)
	}
	waitFor(t, "the sweeper's pod gone", 2*time.Minute, func() error {
		out, err := n.Kubectl("-n", "kube-system", "get", "pods", "-l", "app.kubernetes.io/name=podfence-sweeper", "-o", "name")
		if err != nil || len(strings.TrimSpace(string(out))) > 0 {
			return fmt.Errorf("%v %s", err, out)
		}
		return nil
	})
	// The README's command, with the image the node has (no registry here).
	out, err := n.Kubectl("-n", ns, "debug", "node/"+node.NodeName, "--profile=sysadmin",
		"--image=ghcr.io/podfence/podfence:latest", "--image-pull-policy=Never", "--",
		"/usr/local/bin/podfence-sweeper", "uninstall", "--cni-conf-dir=/host/etc/cni/net.d",
		"--cni-bin-dir=/host/opt/cni/bin", "--pin-root=/host/sys/fs/bpf/podfence")
	if err != nil {
		t.Fatalf("kubectl debug: %v: %s", err, out)
	}
	m := regexp.MustCompile(`Creating debugging pod (\S+)`).FindSubmatch(out)
	if m == nil {
		t.Fatalf("kubectl debug did not name its pod: %s", out)
	}
	debugPod := string(m[1])
	waitFor(t, "the uninstall pod done", 2*time.Minute, func() error {
		p, err := cs.CoreV1().Pods(ns).Get(ctx, debugPod, metav1.GetOptions{})
		if err != nil {
			return err
		}
		if p.Status.Phase != corev1.PodSucceeded && p.Status.Phase != corev1.PodFailed {
			return fmt.Errorf("phase %s", p.Status.Phase)
		}
		return nil
	})
	logs, _ := n.Kubectl("-n", ns, "logs", debugPod)
	t.Logf("uninstall:\n%s", logs)
	if p, err := cs.CoreV1().Pods(ns).Get(ctx, debugPod, metav1.GetOptions{}); err != nil || p.Status.Phase != corev1.PodSucceeded {
		t.Fatalf("the uninstall failed: %v", err)
	}

}
