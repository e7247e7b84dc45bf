package realnode

import (
	"context"
	"errors"
	"net"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
)

// TestIPBlockAndEndPort covers what Kubernetes' suite probes only through
// Services (see knownFailures) or not at all, pod to pod, through the real
// controller: an egress ipBlock whose except holds one server, and an
// ingress port range (endPort).
func TestIPBlockAndEndPort(t *testing.T) {
	n := needNode(t)
	cs := clientset(t, n)
	ns := namespace(t, cs, "peers")
	ctx := context.Background()
	client := runPod(t, cs, ns, netexecPod("client", map[string]string{"app": "client"}))
	open := runPod(t, cs, ns, netexecPod("open", map[string]string{"app": "server"}))
	excepted := runPod(t, cs, ns, netexecPod("excepted", map[string]string{"app": "server"}))
	tcp := corev1.ProtocolTCP
	port, end := intstr.FromInt32(8000), int32(8100)
	for _, np := range []*networkingv1.NetworkPolicy{{
		ObjectMeta: metav1.ObjectMeta{Name: "client-egress"},
		Spec: networkingv1.NetworkPolicySpec{
			PodSelector: metav1.LabelSelector{MatchLabels: map[string]string{"app": "client"}},
			PolicyTypes: []networkingv1.PolicyType{networkingv1.PolicyTypeEgress},
			Egress: []networkingv1.NetworkPolicyEgressRule{{To: []networkingv1.NetworkPolicyPeer{{
				IPBlock: &networkingv1.IPBlock{CIDR: "10.244.0.0/16", Except: []string{excepted.Status.PodIP + "/32"}},
			}}}},
		},
	}, {
		ObjectMeta: metav1.ObjectMeta{Name: "server-range"},
		Spec: networkingv1.NetworkPolicySpec{
			PodSelector: metav1.LabelSelector{MatchLabels: map[string]string{"app": "server"}},
			PolicyTypes: []networkingv1.PolicyType{networkingv1.PolicyTypeIngress},
			Ingress: []networkingv1.NetworkPolicyIngressRule{{Ports: []networkingv1.NetworkPolicyPort{
				{Protocol: &tcp, Port: &port, EndPort: &end},
			}}},
		},
	}} {
		if _, err := cs.NetworkingV1().NetworkPolicies(ns).Create(ctx, np, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	// netexec serves 8080; the range 8000-8100 holds it. From the test's
	// own namespace, the node's address is always let in: probe from the
	// client pod's.
	connects := func(ip string, port string) bool {
		ctx, cancel := context.WithTimeout(ctx, 500*time.Millisecond)
		defer cancel()
		c, err := n.DialFromPod(ctx, string(client.UID), "tcp", net.JoinHostPort(ip, port))
		if err != nil {
			return false
		}
		c.Close()
		return true
	}
	waitFor(t, "the except enforced", 30*time.Second, func() error {
		if connects(excepted.Status.PodIP, "8080") {
			return errors.New("the client reaches the excepted server")
		}
		return nil
	})
	if !connects(open.Status.PodIP, "8080") {
		t.Error("the client cannot reach the server its ipBlock allows, on a port of the range")
	}
	// A port outside the range: netexec's UDP port is 8081, TCP only on
	// 8080; 8101 has no listener, so a refused (RST) connection proves the
	// SYN passed, a timeout that it did not.
	ctx2, cancel := context.WithTimeout(ctx, 500*time.Millisecond)
	defer cancel()
	if _, err := n.DialFromPod(ctx2, string(client.UID), "tcp", net.JoinHostPort(open.Status.PodIP, "8101")); err == nil || !isTimeout(err) {
		t.Errorf("port 8101, outside the range: %v, want the SYN dropped (a timeout)", err)
	}
}

func isTimeout(err error) bool {
	var ne net.Error
	return errors.As(err, &ne) && ne.Timeout() || errors.Is(err, context.DeadlineExceeded)
}
