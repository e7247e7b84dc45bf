package realnode

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"strings"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/podfence/podfence/test/node"
)

// keepAlive is one HTTP/1.1 connection kept open between requests: a
// long-lived connection of a pod.
type keepAlive struct {
	conn net.Conn
	r    *bufio.Reader
}

func (k *keepAlive) get(path string) error {
	k.conn.SetDeadline(time.Now().Add(5 * time.Second))
	if _, err := fmt.Fprintf(k.conn, "GET %s HTTP/1.1\r\nHost: web\r\n\r\n", path); err != nil {
		return err
	}
	resp, err := http.ReadResponse(k.r, nil)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if _, err := io.Copy(io.Discard, resp.Body); err != nil {
		return err
	}
	if resp.StatusCode != http.StatusOK || resp.Close {
		return fmt.Errorf("%s: %s (close %v)", path, resp.Status, resp.Close)
	}
	return nil
}

// createDeployment makes a Deployment of netexec pods labelled app=name,
// with no replica yet (scale sets them).
func createDeployment(tb testing.TB, cs *kubernetes.Clientset, ns, name string) {
	tb.Helper()
	if _, err := cs.AppsV1().Deployments(ns).Create(context.Background(), deployment(name, 0), metav1.CreateOptions{}); err != nil {
		tb.Fatal(err)
	}
}

// deployment is a Deployment of replicas netexec pods labelled app=name.
func deployment(name string, replicas int32) *appsv1.Deployment {
	pod := netexecPod("", map[string]string{"app": name})
	return &appsv1.Deployment{
		ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec: appsv1.DeploymentSpec{
			Replicas: &replicas,
			Selector: &metav1.LabelSelector{MatchLabels: pod.Labels},
			Template: corev1.PodTemplateSpec{ObjectMeta: pod.ObjectMeta, Spec: pod.Spec},
		},
	}
}

// reinstallAtEnd installs podfence again when the test ends, if a step
// took it off and did not put it back: the other tests need it.
func reinstallAtEnd(t testing.TB, n *node.Node) {
	t.Helper()
	manifest, err := os.ReadFile("../../conf/podfence-sweeper.yaml")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if n.WaitPodfence(time.Second) == nil {
			return
		}
		if err := n.InstallPodfence(manifest); err != nil {
			t.Errorf("podfence not installed again: %v", err)
		}
	})
}

// TestAdoptOnNode installs podfence (standard mode, the manifest as
// shipped) on a node that already runs pods: 20 under a policy that lets
// only a client in, 20 that no policy selects, and a long-lived connection
// from the client to one of the first. Adoption fences them: the first 20
// refuse a stranger, the others answer it, the connection lives, and no
// pod restarted.
func TestAdoptOnNode(t *testing.T) {
	n := needNode(t)
	cs := clientset(t, n)
	ns := namespace(t, cs, "adopt")
	ctx := context.Background()
	reinstallAtEnd(t, n)
	uninstallPodfence(t, n, cs, ns)

	const each = 20
	stranger := runPod(t, cs, ns, netexecPod("stranger", map[string]string{"app": "stranger"}))
	client := runPod(t, cs, ns, netexecPod("client", map[string]string{"app": "client"}))
	isolateIngress(t, cs, ns, "guarded", "client")
	// The pusher lets the client in and sends nothing of its own: a
	// connection the client opened to it lives on only as a flow the
	// client opened, which its conntrack entry must say. Its first packet
	// after the install goes from the pusher: judged as a new flow of the
	// pusher's, it would be refused.
	pusher := runPod(t, cs, ns, netexecPod("pusher", map[string]string{"app": "pusher"}))
	if _, err := cs.NetworkingV1().NetworkPolicies(ns).Create(ctx, &networkingv1.NetworkPolicy{
		ObjectMeta: metav1.ObjectMeta{Name: "pusher"},
		Spec: networkingv1.NetworkPolicySpec{
			PodSelector: metav1.LabelSelector{MatchLabels: map[string]string{"app": "pusher"}},
			PolicyTypes: []networkingv1.PolicyType{networkingv1.PolicyTypeIngress, networkingv1.PolicyTypeEgress},
			Ingress: []networkingv1.NetworkPolicyIngressRule{{From: []networkingv1.NetworkPolicyPeer{{
				PodSelector: &metav1.LabelSelector{MatchLabels: map[string]string{"app": "client"}}}}}},
		},
	}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	ln, err := n.ListenInPod(string(pusher.UID), "tcp", ":9000")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	pushClient, err := n.DialFromPod(ctx, string(client.UID), "tcp", net.JoinHostPort(pusher.Status.PodIP, "9000"))
	if err != nil {
		t.Fatal(err)
	}
	defer pushClient.Close()
	pushServer, err := ln.Accept()
	if err != nil {
		t.Fatal(err)
	}
	defer pushServer.Close()
	// Keepalive probes from the client would open the flow again in the
	// client's direction while the connection idles through the install:
	// the test is about which side sends first, so neither end probes.
	for _, c := range []net.Conn{pushClient, pushServer} {
		if err := c.(*net.TCPConn).SetKeepAlive(false); err != nil {
			t.Fatal(err)
		}
	}
	push := func(what string) error {
		if _, err := pushServer.Write([]byte(what)); err != nil {
			return err
		}
		pushClient.SetReadDeadline(time.Now().Add(5 * time.Second))
		b := make([]byte, len(what))
		if _, err := io.ReadFull(pushClient, b); err != nil {
			return err
		}
		if string(b) != what {
			return fmt.Errorf("read %q, want %q", b, what)
		}
		return nil
	}
	if err := push("before"); err != nil {
		t.Fatalf("the pushed connection before the install: %v", err)
	}

	for _, name := range []string{"guarded", "open"} {
		createDeployment(t, cs, ns, name)
		scale(t, cs, ns, name, each)
	}
	list := func(app string) []corev1.Pod {
		var sel string
		if app != "" {
			sel = "app=" + app
		}
		pods, err := cs.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{LabelSelector: sel})
		if err != nil {
			t.Fatal(err)
		}
		return pods.Items
	}
	guarded, open := list("guarded"), list("open")
	if err := reaches(n, stranger.UID, guarded[0].Status.PodIP); err != nil {
		t.Fatalf("before podfence, the stranger cannot reach a guarded pod (%v): the test would prove nothing", err)
	}

	c, err := n.DialFromPod(ctx, string(client.UID), "tcp", net.JoinHostPort(guarded[0].Status.PodIP, "8080"))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	long := &keepAlive{conn: c, r: bufio.NewReader(c)}
	if err := long.get("/hostname"); err != nil {
		t.Fatalf("the long-lived connection before the install: %v", err)
	}

	manifest, err := os.ReadFile("../../conf/podfence-sweeper.yaml")
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	if err := n.InstallPodfence(manifest); err != nil {
		t.Fatal(err)
	}
	// Every pod of this test adopted (and its flows seeded) before the
	// checks: otherwise a check could pass on a pod not yet adopted.
	waitFor(t, "this test's pods adopted", 2*time.Minute, func() error {
		logs, err := n.Kubectl("-n", "kube-system", "logs", "ds/podfence-sweeper", "-c", "sweeper")
		if err != nil {
			return err
		}
		if got := strings.Count(string(logs), `"pod":"`+ns+`/`); got < 2*each+3 {
			return fmt.Errorf("%d of this test's pods adopted", got)
		}
		if !strings.Contains(string(logs), `"msg":"adoption pass"`) {
			return errors.New("no adoption pass done")
		}
		return nil
	})
	for _, p := range guarded {
		waitFor(t, "guarded pod "+p.Name+" fenced", time.Minute, func() error {
			err := reaches(n, stranger.UID, p.Status.PodIP)
			if err == nil {
				return errors.New("the stranger reaches it")
			}
			if !isTimeout(err) {
				return fmt.Errorf("%v, want a timeout", err)
			}
			return nil
		})
	}
	t.Logf("every guarded pod fenced %v after the install began", time.Since(start).Round(time.Millisecond))
	if logs, err := n.Kubectl("-n", "kube-system", "logs", "ds/podfence-sweeper", "-c", "sweeper"); err == nil {
		for _, line := range strings.Split(string(logs), "\n") {
			if strings.Contains(line, `"msg":"adoption pass"`) {
				t.Logf("sweeper: %s", line)
			}
		}
	}
	for _, p := range open {
		if err := reaches(n, stranger.UID, p.Status.PodIP); err != nil {
			t.Errorf("open pod %s: the stranger cannot reach it: %v", p.Name, err)
		}
	}
	if err := reaches(n, client.UID, guarded[1].Status.PodIP); err != nil {
		t.Errorf("the client cannot open a connection the policy allows: %v", err)
	}
	for i := range 3 {
		if err := long.get("/hostname"); err != nil {
			t.Errorf("the long-lived connection after adoption (request %d): %v", i, err)
		}
	}
	if err := push("after"); err != nil {
		t.Errorf("the pusher's connection after adoption, its first packet from the pusher: %v (its flow was not seeded as the client's)", err)
	}
	for _, p := range list("") {
		for _, st := range p.Status.ContainerStatuses {
			if st.RestartCount != 0 {
				t.Errorf("pod %s restarted %d times", p.Name, st.RestartCount)
			}
		}
	}
}
