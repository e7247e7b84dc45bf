package realnode

import (
	"context"
	"net"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"

	"github.com/podfence/podfence/test/node"
)

// TestHostKeptWhileRunning: with the kubelet running, the host keeps the
// machine-wide sysctls the kubelet writes (TestMain checks the whole host
// again once the node is gone).
func TestHostKeptWhileRunning(t *testing.T) {
	n := needNode(t)
	now, err := node.SnapshotHost()
	if err != nil {
		t.Fatal(err)
	}
	for k, v := range hostBefore {
		if strings.HasPrefix(k, "sysctl ") && now[k] != v {
			t.Errorf("%s is %s with the node running, was %s", k, now[k], v)
		}
	}
	// The node itself has the kubelet's values.
	out, err := n.Exec("cat", "/proc/sys/vm/overcommit_memory").Output()
	if err != nil || strings.TrimSpace(string(out)) != "1" {
		t.Errorf("the node's vm.overcommit_memory: %q, %v; want the kubelet's 1", out, err)
	}
}

// TestServiceKeepsClientAddress: kube-proxy knows the pod range, so a pod
// reaching another through its Service is not masqueraded: the backend
// sees the client pod's address, never one of the node's (which podfence
// always lets in, and which would hide the client from its policy).
func TestServiceKeepsClientAddress(t *testing.T) {
	n := needNode(t)
	cs := clientset(t, n)
	ns := namespace(t, cs, "svc-client")
	ctx := context.Background()
	backend := runPod(t, cs, ns, netexecPod("backend", map[string]string{"app": "backend"}))
	client := runPod(t, cs, ns, netexecPod("client", map[string]string{"app": "client"}))
	svc, err := cs.CoreV1().Services(ns).Create(ctx, &corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Name: "backend"},
		Spec: corev1.ServiceSpec{
			Selector: map[string]string{"app": "backend"},
			Ports:    []corev1.ServicePort{{Port: 80, TargetPort: intstr.FromInt32(8080)}},
		},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	var seen string
	waitFor(t, "the client through the Service", 30*time.Second, func() error {
		answers, err := dialFrom(n, client.Status.PodIP, svc.Spec.ClusterIP, 80, "clientip")
		if err != nil {
			return err
		}
		seen = answers[0]
		return nil
	})
	host, _, err := net.SplitHostPort(seen)
	if err != nil {
		t.Fatalf("the backend answered %q", seen)
	}
	if host != client.Status.PodIP {
		t.Errorf("the backend %s saw %s through the Service, want the client pod's %s (node %s)",
			backend.Status.PodIP, host, client.Status.PodIP, node.NodeIP)
	}
}
