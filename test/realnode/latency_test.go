package realnode

import (
	"context"
	"fmt"
	"net"
	"os"
	"slices"
	"strconv"
	"testing"
	"time"

	networkingv1 "k8s.io/api/networking/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/podfence/podfence/test/node"
)

// latencyScene is a server whose ingress a default-deny NetworkPolicy
// closes, a client, and a second NetworkPolicy that a change creates,
// points at the client or away from it, or deletes: each change flips
// whether the client gets in.
type latencyScene struct {
	n         *node.Node
	cs        *kubernetes.Clientset
	ns        string
	clientUID string // the client pod's, to connect from its namespace
	server    string // the server's address and port
}

func newLatencyScene(t testing.TB, n *node.Node) *latencyScene {
	cs := clientset(t, n)
	ns := namespace(t, cs, "latency")
	ctx := context.Background()
	_, err := cs.NetworkingV1().NetworkPolicies(ns).Create(ctx, &networkingv1.NetworkPolicy{
		ObjectMeta: metav1.ObjectMeta{Name: "default-deny"},
		Spec: networkingv1.NetworkPolicySpec{
			PodSelector: metav1.LabelSelector{MatchLabels: map[string]string{"app": "server"}},
			PolicyTypes: []networkingv1.PolicyType{networkingv1.PolicyTypeIngress},
		},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	server := runPod(t, cs, ns, netexecPod("server", map[string]string{"app": "server"}))
	client := runPod(t, cs, ns, netexecPod("client", map[string]string{"app": "client"}))
	s := &latencyScene{n: n, cs: cs, ns: ns, clientUID: string(client.UID), server: net.JoinHostPort(server.Status.PodIP, "8080")}
	waitFor(t, "the default deny", 30*time.Second, func() error {
		if s.connects() {
			return fmt.Errorf("the client gets in")
		}
		return nil
	})
	return s
}

// connects is one attempt of the client to connect to the server: its
// first SYN, which the server's ingress program judges.
func (s *latencyScene) connects() bool {
	ctx, cancel := context.WithTimeout(context.Background(), 25*time.Millisecond)
	defer cancel()
	c, err := s.n.DialFromPod(ctx, s.clientUID, "tcp", s.server)
	if err != nil {
		return false
	}
	c.Close()
	return true
}

func allowFrom(app string) *networkingv1.NetworkPolicy {
	return &networkingv1.NetworkPolicy{
		ObjectMeta: metav1.ObjectMeta{Name: "allow"},
		Spec: networkingv1.NetworkPolicySpec{
			PodSelector: metav1.LabelSelector{MatchLabels: map[string]string{"app": "server"}},
			PolicyTypes: []networkingv1.PolicyType{networkingv1.PolicyTypeIngress},
			Ingress: []networkingv1.NetworkPolicyIngressRule{{From: []networkingv1.NetworkPolicyPeer{{
				PodSelector: &metav1.LabelSelector{MatchLabels: map[string]string{"app": app}},
			}}}},
		},
	}
}

// change makes the i-th change of the cycle create (client in), update
// away (out), update back (in), delete (out), and returns when the API
// accepted it and what the client should see.
func (s *latencyScene) change(i int) (time.Time, bool, error) {
	ctx := context.Background()
	nps := s.cs.NetworkingV1().NetworkPolicies(s.ns)
	var err error
	var want bool
	switch i % 4 {
	case 0:
		_, err = nps.Create(ctx, allowFrom("client"), metav1.CreateOptions{})
		want = true
	case 1, 2:
		app := "nobody"
		if i%4 == 2 {
			app, want = "client", true
		}
		var cur *networkingv1.NetworkPolicy
		if cur, err = nps.Get(ctx, "allow", metav1.GetOptions{}); err == nil {
			cur.Spec = allowFrom(app).Spec
			_, err = nps.Update(ctx, cur, metav1.UpdateOptions{})
		}
	case 3:
		err = nps.Delete(ctx, "allow", metav1.DeleteOptions{})
	}
	return time.Now(), want, err
}

// measure makes changes changes and returns how long each took from the
// API's answer to the client's first attempt with the new outcome.
func (s *latencyScene) measure(tb testing.TB, changes int, limit time.Duration) []time.Duration {
	var out []time.Duration
	for i := range changes {
		at, want, err := s.change(i)
		if err != nil {
			tb.Fatalf("change %d: %v", i, err)
		}
		for s.connects() != want {
			if time.Since(at) > limit {
				tb.Fatalf("change %d: the client's access is not %v %v after the API write", i, want, limit)
			}
		}
		took := time.Since(at)
		if took > time.Second {
			tb.Logf("change %d (%s the client) took %v", i, map[bool]string{true: "letting in", false: "shutting out"}[want], took)
		}
		out = append(out, took)
	}
	return out
}

// TestPolicyLatency: NetworkPolicy creates, updates and deletes reach
// traffic, through the controller, the sweeper's mirror and the maps (a
// few changes: BenchmarkPolicyLatency measures how fast).
func TestPolicyLatency(t *testing.T) {
	n := needNode(t)
	s := newLatencyScene(t, n)
	for i, d := range s.measure(t, 4, time.Minute) {
		t.Logf("change %d enforced %v after the API write", i, d.Round(time.Millisecond))
	}
}

// BenchmarkPolicyLatency reports p50 and p99 over 100 changes (or
// PODFENCE_LATENCY_CHANGES) from the API write of a NetworkPolicy to the
// first connection with the new outcome, through the controller; the
// target is a p99 below 1 s. It runs once whatever b.N: make latency.
func BenchmarkPolicyLatency(b *testing.B) {
	n := needNode(b)
	changes := 100
	if v, err := strconv.Atoi(os.Getenv("PODFENCE_LATENCY_CHANGES")); err == nil && v > 0 {
		changes = v
	}
	s := newLatencyScene(b, n)
	b.ResetTimer()
	lat := s.measure(b, changes, time.Minute)
	b.StopTimer()
	reportLatencies(b, lat)
}

// reportLatencies reports the p50, p99 and largest of lat, and how many.
func reportLatencies(b *testing.B, lat []time.Duration) {
	slices.Sort(lat)
	q := func(p float64) float64 { return lat[min(len(lat)-1, int(p*float64(len(lat))))].Seconds() }
	b.ReportMetric(q(0.5), "p50-s")
	b.ReportMetric(q(0.99), "p99-s")
	b.ReportMetric(lat[len(lat)-1].Seconds(), "max-s")
	b.ReportMetric(float64(len(lat)), "changes")
	b.ReportMetric(0, "ns/op")
}
