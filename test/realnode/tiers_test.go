package realnode

import (
	"context"
	"fmt"
	"net"
	"net/netip"
	"os"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"

	"github.com/podfence/podfence/test/node"
)

// tierScene is a namespace with netexec pods labelled app=<name>, whose
// server admits only the client by NetworkPolicy, and a way to write
// ClusterNetworkPolicy objects that the real controller turns into
// ClusterPolicyEndpoints for the node.
type tierScene struct {
	t    testing.TB
	n    *node.Node
	cs   *kubernetes.Clientset
	cnps dynamic.ResourceInterface
	ns   string
	pods map[string]*corev1.Pod
}

func newTierScene(t testing.TB) *tierScene {
	n := needNode(t)
	cs := clientset(t, n)
	s := &tierScene{t: t, n: n, cs: cs, cnps: dynamicClient(t, n).Resource(clusterNetworkPolicies),
		ns: namespace(t, cs, "tiers"), pods: map[string]*corev1.Pod{}}
	isolateIngress(t, cs, s.ns, "server", "client")
	for _, app := range []string{"server", "client", "intruder", "other"} {
		s.pods[app] = runPod(t, cs, s.ns, netexecPod(app, map[string]string{"app": app}))
	}
	s.waitReach("client", "server", true, time.Minute)
	s.waitReach("intruder", "server", false, time.Minute)
	return s
}

// reaches tells whether app from connects to app to's netexec port.
func (s *tierScene) reaches(from, to string) bool {
	return reaches(s.n, s.pods[from].UID, s.pods[to].Status.PodIP) == nil
}

// waitReach waits until from's connections to to succeed (want) or fail,
// and returns how long that took.
func (s *tierScene) waitReach(from, to string, want bool, within time.Duration) time.Duration {
	s.t.Helper()
	start := time.Now()
	waitFor(s.t, fmt.Sprintf("%s -> %s connects=%v", from, to, want), within, func() error {
		if s.reaches(from, to) != want {
			return fmt.Errorf("not yet")
		}
		return nil
	})
	return time.Since(start)
}

// peer is a ClusterNetworkPolicy peer or subject: the pods of the scene's
// namespace labelled app in apps.
func (s *tierScene) peer(apps ...string) map[string]any {
	return map[string]any{"pods": map[string]any{
		"namespaceSelector": map[string]any{"matchLabels": map[string]any{"kubernetes.io/metadata.name": s.ns}},
		"podSelector": map[string]any{"matchExpressions": []any{map[string]any{
			"key": "app", "operator": "In", "values": toAny(apps)}}},
	}}
}

func toAny(ss []string) []any {
	out := make([]any, len(ss))
	for i, s := range ss {
		out[i] = s
	}
	return out
}

// rule is an ingress ("from") or egress ("to") rule of a ClusterNetworkPolicy.
func rule(action, key string, peers ...map[string]any) map[string]any {
	var ps []any
	for _, p := range peers {
		ps = append(ps, p)
	}
	return map[string]any{"action": action, key: ps}
}

// create writes a ClusterNetworkPolicy, deleted when the test ends, and
// returns when the API accepted it.
func (s *tierScene) create(name, tier string, priority int64, subject map[string]any, ingress, egress []any) time.Time {
	s.t.Helper()
	name = s.ns + "-" + name
	spec := map[string]any{"tier": tier, "priority": priority, "subject": subject}
	if ingress != nil {
		spec["ingress"] = ingress
	}
	if egress != nil {
		spec["egress"] = egress
	}
	obj := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "networking.k8s.aws/v1alpha1", "kind": "ClusterNetworkPolicy",
		"metadata": map[string]any{"name": name}, "spec": spec,
	}}
	if _, err := s.cnps.Create(context.Background(), obj, metav1.CreateOptions{}); err != nil {
		s.t.Fatal(err)
	}
	at := time.Now()
	s.t.Cleanup(func() { s.cnps.Delete(context.Background(), name, metav1.DeleteOptions{}) })
	return at
}

// setPriority edits a ClusterNetworkPolicy's priority.
func (s *tierScene) setPriority(name string, priority int) {
	s.t.Helper()
	patch := fmt.Sprintf(`{"spec":{"priority":%d}}`, priority)
	if _, err := s.cnps.Patch(context.Background(), s.ns+"-"+name, types.MergePatchType, []byte(patch), metav1.PatchOptions{}); err != nil {
		s.t.Fatal(err)
	}
}

func (s *tierScene) remove(names ...string) {
	s.t.Helper()
	for _, name := range names {
		if err := s.cnps.Delete(context.Background(), s.ns+"-"+name, metav1.DeleteOptions{}); err != nil {
			s.t.Fatal(err)
		}
	}
}

// TestClusterTiersOnNode: ClusterNetworkPolicy objects, through the real
// controller and the sweeper's mirror, change the traffic of real pods as
// the tiers' semantics say: an Admin Deny over a NetworkPolicy's allow, an
// Admin Pass of higher priority handing the client back to the
// NetworkPolicy, a Baseline deny-all that does not touch a pod a
// NetworkPolicy isolates but closes one none does (whose kubelet probes
// still pass), and an Admin Accept of UDP/53 to the DNS pods for all pods,
// which decides over a NetworkPolicy that isolates a pod's egress and
// over an Admin deny of everything else of lower priority. The time from each API write to the
// traffic's change is logged.
func TestClusterTiersOnNode(t *testing.T) {
	s := newTierScene(t)
	subject := s.peer("server")

	at := s.create("deny-client", "Admin", 10, subject, []any{rule("Deny", "from", s.peer("client"))}, nil)
	s.waitReach("client", "server", false, time.Minute)
	t.Logf("Admin Deny enforced %v after the API write", time.Since(at).Round(time.Millisecond))

	at = s.create("pass-client", "Admin", 5, subject, []any{rule("Pass", "from", s.peer("client"))}, nil)
	s.waitReach("client", "server", true, time.Minute)
	t.Logf("Admin Pass of higher priority enforced %v after the API write", time.Since(at).Round(time.Millisecond))
	if s.reaches("intruder", "server") {
		t.Error("the intruder reaches the server: its NetworkPolicy denies it, and no Admin rule accepts it")
	}
	s.remove("deny-client", "pass-client")

	all := map[string]any{"namespaces": map[string]any{}}
	at = s.create("baseline-deny", "Baseline", 10, s.peer("server", "other"), []any{rule("Deny", "from", all)}, nil)
	s.waitReach("client", "other", false, time.Minute)
	t.Logf("Baseline Deny enforced %v after the API write", time.Since(at).Round(time.Millisecond))
	if !s.reaches("client", "server") {
		t.Error("a Baseline Deny overrode the NetworkPolicy that isolates the server")
	}
	if s.reaches("intruder", "server") {
		t.Error("the intruder reaches the server under a NetworkPolicy and a Baseline Deny")
	}
	time.Sleep(5 * time.Second) // three failed probes (period 1 s) would make it unready
	if p, err := s.cs.CoreV1().Pods(s.ns).Get(context.Background(), "other", metav1.GetOptions{}); err != nil || !ready(p) {
		t.Errorf("other under a Baseline deny-all: %v, ready=%v; the kubelet's probes come from the node and must pass", err, p != nil && ready(p))
	}
	s.remove("baseline-deny")

	dns := s.dnsPod()
	s.lookup("client", dns) // before: DNS works
	isolateEgress(t, s.cs, s.ns, "other")
	waitFor(t, "other's DNS query refused by its NetworkPolicy", time.Minute, func() error {
		if s.lookupErr("other", dns) == nil {
			return fmt.Errorf("answered")
		}
		return nil
	})
	s.create("dns", "Admin", 1, all, nil, []any{map[string]any{
		"action": "Accept",
		"to": []any{map[string]any{"pods": map[string]any{
			"namespaceSelector": map[string]any{"matchLabels": map[string]any{"kubernetes.io/metadata.name": "kube-system"}},
			"podSelector":       map[string]any{"matchLabels": map[string]any{"k8s-app": "kube-dns"}},
		}}},
		"ports": []any{map[string]any{"portNumber": map[string]any{"protocol": "UDP", "port": int64(53)}}},
	}})
	// An Admin Accept decides without the NetworkPolicy.
	waitFor(t, "other's DNS query accepted by the Admin tier over its NetworkPolicy", time.Minute, func() error {
		return s.lookupErr("other", dns)
	})
	at = s.create("deny-egress", "Admin", 2, s.peer("client"), nil, []any{rule("Deny", "to", map[string]any{"networks": []any{"0.0.0.0/0"}})})
	s.waitReach("client", "server", false, time.Minute)
	t.Logf("Admin egress Deny enforced %v after the API write", time.Since(at).Round(time.Millisecond))
	if err := s.lookupErr("client", dns); err != nil {
		t.Errorf("a DNS query to the DNS pod under an Admin Accept of UDP/53 for all pods (priority 1) and a deny-all (2): %v", err)
	}
}

// TestClusterTierPrioritiesOnNode: of two Admin rules that match a
// connection, the one of lower priority number decides, whatever their
// prefix lengths: an egress Deny of the pod range and an Accept of the
// server's address, swapped by editing the Accept's priority; `why` names
// the rule each time. And the Deny of the pod range covers the server's
// Service too: the client's flow to the ClusterIP is judged on the server,
// after kube-proxy's DNAT (the sweeper writes the Service's frontend), and
// the Accept of the server opens it again.
func TestClusterTierPrioritiesOnNode(t *testing.T) {
	s := newTierScene(t)
	vip := serviceFor(t, s.n, s.cs, s.ns, "server")
	server := s.pods["server"].Status.PodIP
	podRange := netip.PrefixFrom(netip.MustParseAddr(server), 16).Masked().String()
	decides := func(policy, action string, priority int) {
		t.Helper()
		w := askWhy(t, s.n, "--pod", s.pods["client"].Name+"."+s.ns, "--to", server, "8080/tcp")
		if w.Tier == nil || w.Tier.Tier != "Admin" || w.Tier.Policy != s.ns+"-"+policy || w.Tier.Action != action || w.Tier.Priority != priority {
			t.Errorf("why client -> server: %+v (tier %+v), want the Admin %s of %s at priority %d", w, w.Tier, action, policy, priority)
		}
	}

	s.create("deny-range", "Admin", 20, s.peer("client"), nil, []any{rule("Deny", "to", map[string]any{"networks": []any{podRange}})})
	s.waitReach("client", "server", false, time.Minute)
	decides("deny-range", "Deny", 20)
	if got := s.tiers(); !slices.Equal(got["client"], []string{"admin/egress"}) || got["server"] == nil || len(got["server"]) != 0 {
		t.Errorf("ls: tiers by pod %v, want admin/egress for the client, none for the server", got)
	}
	waitFor(t, "the client refused through the server's Service under an Admin Deny of "+podRange+" (judged on the backend)", 10*time.Second, func() error {
		if err := connects(s.n, s.pods["client"].UID, vip); err == nil {
			return fmt.Errorf("the client reaches the server through %s", vip)
		}
		return nil
	})

	s.create("accept-server", "Admin", 10, s.peer("client"), nil, []any{rule("Accept", "to", s.peer("server"))})
	s.waitReach("client", "server", true, time.Minute)
	decides("accept-server", "Accept", 10)
	waitFor(t, "the client through the server's Service under the Accept", 10*time.Second, func() error {
		return connects(s.n, s.pods["client"].UID, vip)
	})

	// The Accept's /32 is longer than the Deny's /16: the priority decides.
	s.setPriority("accept-server", 30)
	s.waitReach("client", "server", false, time.Minute)
	decides("deny-range", "Deny", 20)
}

// tiers is what the node's sweeper's ls says of the tiers of each scene
// pod's identifier, by app.
func (s *tierScene) tiers() map[string][]string {
	s.t.Helper()
	var idents []struct {
		Tiers   []string
		Members []struct{ IPs []string }
	}
	sweeperJSON(s.t, s.n, &idents, "ls", "--json")
	byApp := map[string][]string{}
	for app, p := range s.pods {
		for _, id := range idents {
			for _, m := range id.Members {
				for _, ip := range m.IPs { // 10.244.0.7/32
					if a, _, _ := strings.Cut(ip, "/"); a == p.Status.PodIP {
						byApp[app] = append([]string{}, id.Tiers...) // not nil: the pod was found
					}
				}
			}
		}
	}
	return byApp
}

// dnsPod is the address of a Ready CoreDNS pod.
func (s *tierScene) dnsPod() string {
	s.t.Helper()
	pods, err := s.cs.CoreV1().Pods("kube-system").List(context.Background(), metav1.ListOptions{LabelSelector: "k8s-app=kube-dns"})
	if err != nil {
		s.t.Fatal(err)
	}
	for _, p := range pods.Items {
		if ready(&p) {
			return p.Status.PodIP
		}
	}
	s.t.Fatalf("no Ready DNS pod among %d", len(pods.Items))
	return ""
}

// lookupErr resolves the API's Service name from app's pod, over UDP to the
// DNS pod at addr directly, the peer the rules under test name.
func (s *tierScene) lookupErr(app, addr string) error {
	r := &net.Resolver{PreferGo: true, Dial: func(ctx context.Context, network, _ string) (net.Conn, error) {
		return s.n.DialFromPod(ctx, string(s.pods[app].UID), "udp", net.JoinHostPort(addr, "53"))
	}}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	_, err := r.LookupHost(ctx, "kubernetes.default.svc.cluster.local")
	return err
}

func (s *tierScene) lookup(app, addr string) {
	s.t.Helper()
	if err := s.lookupErr(app, addr); err != nil {
		s.t.Fatalf("DNS from %s to %s before any cluster policy: %v", app, addr, err)
	}
}

// BenchmarkClusterPolicyLatency reports p50 and p99 over 20 changes (or
// PODFENCE_LATENCY_CHANGES) from the API write of a ClusterNetworkPolicy
// to the client's first connection with the new outcome, through the
// controller, the sweeper's mirror and the tiers: an Admin Deny of the
// client created (out), then deleted (in). It runs once whatever b.N:
// make latency.
func BenchmarkClusterPolicyLatency(b *testing.B) {
	changes := 20
	if v, err := strconv.Atoi(os.Getenv("PODFENCE_LATENCY_CHANGES")); err == nil && v > 0 {
		changes = v
	}
	s := newTierScene(b)
	b.ResetTimer()
	var lat []time.Duration
	for i := range changes {
		name := fmt.Sprintf("latency-%d", i/2)
		var at time.Time
		want := i%2 == 1
		if want {
			if err := s.cnps.Delete(context.Background(), s.ns+"-"+name, metav1.DeleteOptions{}); err != nil {
				b.Fatal(err)
			}
			at = time.Now()
		} else {
			at = s.create(name, "Admin", 10, s.peer("server"), []any{rule("Deny", "from", s.peer("client"))}, nil)
		}
		for s.reaches("client", "server") != want {
			if time.Since(at) > time.Minute {
				b.Fatalf("change %d: the client's access is not %v a minute after the API write", i, want)
			}
		}
		lat = append(lat, time.Since(at))
	}
	b.StopTimer()
	reportLatencies(b, lat)
}
