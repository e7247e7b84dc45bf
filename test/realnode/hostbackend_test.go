package realnode

import (
	"context"
	"fmt"
	"net"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/client-go/kubernetes"

	"github.com/podfence/podfence/test/node"
)

// The host-network backend's ports: the node's own, so apart from any
// other test's.
const hostHTTP, hostUDP = 18080, 18081

// TestServiceToHostNetworkBackend: a Service whose backend is a
// host-network pod is delivered to a socket of the node, with no TC egress
// on the way; the client's egress is judged on the backend (the node's
// address and the pod's port) all the same: an except of the node's
// address refuses the Service over TCP and UDP, the refused datagram never
// reaching the backend (the sweeper's local judge, at the node's cgroup
// root); an ipBlock naming the node's address and the ports admits it.
// The direct path gets the same verdict in each case.
func TestServiceToHostNetworkBackend(t *testing.T) {
	n := needNode(t)
	cs := clientset(t, n)
	ns := namespace(t, cs, "host-backend")
	ctx := context.Background()
	srv := netexecPod("hostsrv", map[string]string{"app": "hostsrv"})
	srv.Spec.HostNetwork = true
	// Its UDP server bound to the node's address, as a UDP server on a
	// node of several addresses must be for its answers to leave from the
	// address the datagram came to (and so be translated back).
	srv.Spec.Containers[0].Args = []string{"netexec", fmt.Sprintf("--http-port=%d", hostHTTP), fmt.Sprintf("--udp-port=%d", hostUDP),
		"--udp-listen-addresses=" + node.NodeIP.String()}
	srv.Spec.Containers[0].Ports = []corev1.ContainerPort{{Name: "http", ContainerPort: hostHTTP}, {Name: "udp", ContainerPort: hostUDP, Protocol: corev1.ProtocolUDP}}
	runPod(t, cs, ns, srv)
	client := runPod(t, cs, ns, netexecPod("client", map[string]string{"app": "client"}))
	svc, err := cs.CoreV1().Services(ns).Create(ctx, &corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Name: "hostsrv"},
		Spec: corev1.ServiceSpec{
			Selector: map[string]string{"app": "hostsrv"},
			Ports: []corev1.ServicePort{
				{Name: "http", Port: 80, TargetPort: intstr.FromInt32(hostHTTP)},
				{Name: "udp", Port: 81, TargetPort: intstr.FromInt32(hostUDP), Protocol: corev1.ProtocolUDP},
			},
		},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	vip := svc.Spec.ClusterIP
	waitTranslated(t, n, vip, "tcp", 80)
	waitTranslated(t, n, vip, "udp", 81)
	nodeIP := node.NodeIP.String()
	paths := []struct {
		what     string
		tcp, udp string
	}{
		{"through the Service", net.JoinHostPort(vip, "80"), net.JoinHostPort(vip, "81")},
		{"directly", net.JoinHostPort(nodeIP, fmt.Sprint(hostHTTP)), net.JoinHostPort(nodeIP, fmt.Sprint(hostUDP))},
	}
	waitFor(t, "the client through the Service before any policy", 30*time.Second, func() error {
		return connects(n, client.UID, paths[0].tcp)
	})

	token := 0
	check := func(name string, allowed bool) {
		t.Helper()
		for _, p := range paths {
			waitFor(t, fmt.Sprintf("%s: TCP %s allowed %v", name, p.what, allowed), 30*time.Second, func() error {
				if err := connects(n, client.UID, p.tcp); (err == nil) != allowed {
					return fmt.Errorf("connect %s: %v", p.tcp, err)
				}
				return nil
			})
			token++
			word := fmt.Sprintf("podfence%d", token)
			answered := udpEcho(n, string(client.UID), p.udp, word)
			if answered != allowed {
				t.Errorf("%s: UDP %s (%s) answered %v, want %v", name, p.what, p.udp, answered, allowed)
			}
			if got := echoed(t, n, ns, word, allowed); got != allowed {
				t.Errorf("%s: the backend read the datagram %s sent %s: %v, want %v", name, word, p.what, got, allowed)
			}
		}
	}
	egress(t, cs, ns, "client", networkingv1.NetworkPolicyEgressRule{To: []networkingv1.NetworkPolicyPeer{{
		IPBlock: &networkingv1.IPBlock{CIDR: "0.0.0.0/0", Except: []string{nodeIP + "/32"}}}}})
	check("an except of the node's address", false)
	egress(t, cs, ns, "client", networkingv1.NetworkPolicyEgressRule{
		To: []networkingv1.NetworkPolicyPeer{{IPBlock: &networkingv1.IPBlock{CIDR: nodeIP + "/32"}}},
		Ports: []networkingv1.NetworkPolicyPort{
			{Protocol: new(corev1.ProtocolTCP), Port: new(intstr.FromInt32(hostHTTP))},
			{Protocol: new(corev1.ProtocolUDP), Port: new(intstr.FromInt32(hostUDP))},
		}})
	check("an ipBlock naming the node's address and the ports", true)
}

// egress writes (or rewrites) the client's egress NetworkPolicy with rule.
func egress(t *testing.T, cs *kubernetes.Clientset, ns, app string, rule networkingv1.NetworkPolicyEgressRule) {
	t.Helper()
	ctx := context.Background()
	np := &networkingv1.NetworkPolicy{
		ObjectMeta: metav1.ObjectMeta{Name: app + "-egress"},
		Spec: networkingv1.NetworkPolicySpec{
			PodSelector: metav1.LabelSelector{MatchLabels: map[string]string{"app": app}},
			PolicyTypes: []networkingv1.PolicyType{networkingv1.PolicyTypeEgress},
			Egress:      []networkingv1.NetworkPolicyEgressRule{rule},
		},
	}
	old, err := cs.NetworkingV1().NetworkPolicies(ns).Get(ctx, np.Name, metav1.GetOptions{})
	if err == nil {
		np.ResourceVersion = old.ResourceVersion
		_, err = cs.NetworkingV1().NetworkPolicies(ns).Update(ctx, np, metav1.UpdateOptions{})
	} else {
		_, err = cs.NetworkingV1().NetworkPolicies(ns).Create(ctx, np, metav1.CreateOptions{})
	}
	if err != nil {
		t.Fatal(err)
	}
}

// udpEcho sends "echo word" from the pod with uid to hostport (netexec's
// UDP server answers with word) and tells whether the answer came, in
// three tries.
func udpEcho(n *node.Node, uid, hostport, word string) bool {
	for range 3 {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		c, err := n.DialFromPod(ctx, uid, "udp", hostport)
		cancel()
		if err != nil {
			continue
		}
		c.SetDeadline(time.Now().Add(time.Second)) //nolint:errcheck // a failed read says it
		_, err = c.Write([]byte("echo " + word))
		b := make([]byte, 64)
		k, rerr := c.Read(b)
		c.Close()
		if err == nil && rerr == nil && strings.TrimSpace(string(b[:k])) == word {
			return true
		}
	}
	return false
}

// echoed tells whether the host-network server logged echoing word: that
// it read the datagram. Its log reaches the runtime's file a moment after:
// read for up to 5 s when the line is expected, once after 1 s when not.
func echoed(t *testing.T, n *node.Node, ns, word string, expected bool) bool {
	t.Helper()
	if !expected {
		time.Sleep(time.Second)
	}
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(200 * time.Millisecond) {
		out, err := n.Kubectl("-n", ns, "logs", "hostsrv")
		if err != nil {
			t.Fatal(err)
		}
		if strings.Contains(string(out), "Echoing "+word+" to ") {
			return true
		}
		if !expected || time.Now().After(deadline) {
			return false
		}
	}
}

// waitTranslated waits until kube-proxy translates vip:port/proto, in
// whichever mode it runs (serviceFor says why no flow may go first).
func waitTranslated(t testing.TB, n *node.Node, vip, proto string, port int) {
	t.Helper()
	waitFor(t, fmt.Sprintf("kube-proxy (%s) to DNAT %s %d/%s", n.ProxyMode, vip, port, proto), 30*time.Second, func() error {
		if n.ProxyMode == "nftables" {
			out, err := n.Exec("nft", "list", "table", "ip", "kube-proxy").Output()
			if err != nil {
				return err
			}
			if strings.Contains(string(out), fmt.Sprintf("%s . %s . %d : goto service-", vip, proto, port)) {
				return nil
			}
			return fmt.Errorf("kube-proxy's service-ips map has no element for %s . %s . %d", vip, proto, port)
		}
		out, err := n.Exec("iptables-save", "-t", "nat").Output()
		if err != nil {
			return err
		}
		for _, rule := range strings.Split(string(out), "\n") {
			if strings.Contains(rule, "-d "+vip+"/32") && strings.Contains(rule, "-p "+proto) &&
				strings.Contains(rule, fmt.Sprintf("--dport %d", port)) && strings.Contains(rule, "-j KUBE-SVC-") {
				return nil
			}
		}
		return fmt.Errorf("no rule of the nat table sends %s %d/%s to its endpoints", vip, port, proto)
	})
}
