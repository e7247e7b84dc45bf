package realnode

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/netip"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/podfence/podfence/test/node"
)

// ghostNode is a Node object without a kubelet: the controller resolves
// pods bound to it by their status alone, so a test can give a policy
// hundreds of peers without running them.
const ghostNode = "ghost-node"

// TestPolicyOf500Peers: a NetworkPolicy whose peers are 500 pods (499 on
// a node without a kubelet, whose status the test writes, and one real
// pod) becomes PolicyEndpoints of at most 200 entries each, which the
// sweeper mirrors one by one as the controller writes them. The test
// samples what the server pod sees meanwhile (the chunks mirrored, and
// whether the real peer gets in), and then that every chunk is enforced
// together: peers of the first, a middle and the last chunk are allowed,
// an address of none is not.
func TestPolicyOf500Peers(t *testing.T) {
	n := needNode(t)
	cs := clientset(t, n)
	ns := namespace(t, cs, "chunks")
	ctx := context.Background()
	server := runPod(t, cs, ns, netexecPod("server", map[string]string{"app": "server"}))
	peer := runPod(t, cs, ns, netexecPod("peer", map[string]string{"role": "peer"}))
	ghostPeers(t, cs, ns, 499)

	start := time.Now()
	if _, err := cs.NetworkingV1().NetworkPolicies(ns).Create(ctx, &networkingv1.NetworkPolicy{
		ObjectMeta: metav1.ObjectMeta{Name: "many-peers"},
		Spec: networkingv1.NetworkPolicySpec{
			PodSelector: metav1.LabelSelector{MatchLabels: map[string]string{"app": "server"}},
			PolicyTypes: []networkingv1.PolicyType{networkingv1.PolicyTypeIngress},
			Ingress: []networkingv1.NetworkPolicyIngressRule{{From: []networkingv1.NetworkPolicyPeer{{
				PodSelector: &metav1.LabelSelector{MatchLabels: map[string]string{"role": "peer"}},
			}}}},
		},
	}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	// What the server sees while the chunks arrive: the mirrored files of
	// the policy, the peers they hold, and the real peer's access.
	var timeline []string
	last := ""
	for time.Since(start) < 20*time.Second {
		files, peers := mirrored(t, n, ns)
		in := peerConnects(n, string(peer.UID), server.Status.PodIP)
		state := fmt.Sprintf("%d chunks mirrored holding %d peers; the real peer %s", files, peers, map[bool]string{true: "gets in", false: "is refused"}[in])
		if state != last {
			timeline = append(timeline, fmt.Sprintf("+%v: %s", time.Since(start).Round(10*time.Millisecond), state))
			last = state
		}
		if peers == 500 && in {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Logf("what the server saw while the controller wrote the policy:\n  %s", strings.Join(timeline, "\n  "))
	files, peers := mirrored(t, n, ns)
	if files != 3 || peers != 500 {
		t.Fatalf("%d PolicyEndpoints with %d peers mirrored, want 3 chunks of at most 200 holding 500", files, peers)
	}
	// Every chunk is enforced: why answers for addresses of each.
	for _, c := range []struct {
		addr string
		want string
	}{
		{ghostIP(0), "allow"}, {ghostIP(250), "allow"}, {ghostIP(498), "allow"},
		{peer.Status.PodIP, "allow"}, {ghostIP(600), "deny"},
	} {
		if got := why(t, n, "server."+ns, c.addr); got != c.want {
			t.Errorf("why from %s: %s, want %s", c.addr, got, c.want)
		}
	}
}

// ghostIP is the i-th ghost peer's address, outside the node's pod range.
func ghostIP(i int) string {
	return netip.AddrFrom4([4]byte{10, 245, byte(i / 250), byte(i%250 + 1)}).String()
}

// ghostPeers makes count pods labelled role=peer on ghostNode, with the
// status a kubelet would have written: Running, with an address.
func ghostPeers(t *testing.T, cs *kubernetes.Clientset, ns string, count int) {
	t.Helper()
	ctx := context.Background()
	if _, err := cs.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: ghostNode}},
		metav1.CreateOptions{}); err != nil && !strings.Contains(err.Error(), "already exists") {
		t.Fatal(err)
	}
	t.Cleanup(func() { cs.CoreV1().Nodes().Delete(context.Background(), ghostNode, metav1.DeleteOptions{}) })
	for i := range count {
		p, err := cs.CoreV1().Pods(ns).Create(ctx, &corev1.Pod{
			ObjectMeta: metav1.ObjectMeta{Name: fmt.Sprintf("ghost-%d", i), Labels: map[string]string{"role": "peer"}},
			Spec: corev1.PodSpec{NodeName: ghostNode,
				Containers: []corev1.Container{{Name: "c", Image: node.AgnhostImage}}},
		}, metav1.CreateOptions{})
		if err != nil {
			t.Fatal(err)
		}
		p.Status = corev1.PodStatus{Phase: corev1.PodRunning, HostIP: "192.168.50.99", PodIP: ghostIP(i),
			PodIPs: []corev1.PodIP{{IP: ghostIP(i)}}}
		if _, err := cs.CoreV1().Pods(ns).UpdateStatus(ctx, p, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
}

// mirrored counts the sweeper's files of the namespace's PolicyEndpoints
// on the node, and the ingress peers they hold.
func mirrored(t *testing.T, n *node.Node, ns string) (files, peers int) {
	t.Helper()
	out, err := n.Exec("sh", "-c", "cat /etc/podfence/policies/pe_"+ns+"_*.json 2>/dev/null").Output()
	if err != nil {
		return 0, 0
	}
	dec := json.NewDecoder(strings.NewReader(string(out)))
	for dec.More() {
		var pe struct {
			Spec struct {
				Ingress []json.RawMessage `json:"ingress"`
			} `json:"spec"`
		}
		if dec.Decode(&pe) != nil {
			break
		}
		files++
		peers += len(pe.Spec.Ingress)
	}
	return files, peers
}

func peerConnects(n *node.Node, uid, ip string) bool {
	ctx, cancel := context.WithTimeout(context.Background(), 25*time.Millisecond)
	defer cancel()
	c, err := n.DialFromPod(ctx, uid, "tcp", net.JoinHostPort(ip, "8080"))
	if err != nil {
		return false
	}
	c.Close()
	return true
}

// why asks the sweeper on the node what the pod's datapath decides for a
// connection from addr to its port 8080.
func why(t *testing.T, n *node.Node, pod, addr string) string {
	t.Helper()
	return askWhy(t, n, "--pod", pod, "--from", addr, "8080/tcp").Verdict
}

// whyAnswer is what the sweeper's `why --json` says (the fields tests read).
type whyAnswer struct {
	Verdict string
	Tier    *struct {
		Tier, Policy, Action string
		Priority             int
	}
}

// askWhy runs the node's sweeper's `why --json` with args.
func askWhy(t testing.TB, n *node.Node, args ...string) whyAnswer {
	t.Helper()
	var w whyAnswer
	sweeperJSON(t, n, &w, append([]string{"why", "--json"}, args...)...)
	return w
}
