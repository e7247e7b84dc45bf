package realnode

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/podfence/podfence/test/node"
)

// clientset is an admin client of the node's API server, from this
// namespace (through the node's forwarder).
func clientset(t testing.TB, n *node.Node) *kubernetes.Clientset {
	t.Helper()
	cfg, err := clientcmd.BuildConfigFromFlags("", n.Kubeconfig)
	if err != nil {
		t.Fatal(err)
	}
	cfg.QPS, cfg.Burst = 100, 200
	cs, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return cs
}

// namespace makes a namespace for one test, removed when it ends.
func namespace(t testing.TB, cs *kubernetes.Clientset, prefix string) string {
	t.Helper()
	ns, err := cs.CoreV1().Namespaces().Create(context.Background(),
		&corev1.Namespace{ObjectMeta: metav1.ObjectMeta{GenerateName: prefix + "-"}}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cs.CoreV1().Namespaces().Delete(context.Background(), ns.Name, metav1.DeleteOptions{})
	})
	// Pods are admitted once the namespace's default ServiceAccount exists.
	waitFor(t, "the default ServiceAccount of "+ns.Name, 30*time.Second, func() error {
		_, err := cs.CoreV1().ServiceAccounts(ns.Name).Get(context.Background(), "default", metav1.GetOptions{})
		return err
	})
	return ns.Name
}

// waitFor polls check until it succeeds or timeout passes.
func waitFor(t testing.TB, what string, timeout time.Duration, check func() error) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		err := check()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within %v: %v", what, timeout, err)
		}
		time.Sleep(250 * time.Millisecond)
	}
}

// netexecPod is an agnhost netexec server: HTTP on 8080 answers /clientip
// with the caller's address, and /dial makes the pod itself connect.
func netexecPod(name string, labels map[string]string) *corev1.Pod {
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Labels: labels},
		Spec: corev1.PodSpec{
			TerminationGracePeriodSeconds: new(int64),
			Containers: []corev1.Container{{
				Name: "netexec", Image: node.AgnhostImage, ImagePullPolicy: corev1.PullIfNotPresent,
				Args:  []string{"netexec", "--http-port=8080", "--udp-port=8081"},
				Ports: []corev1.ContainerPort{{Name: "http", ContainerPort: 8080}},
				ReadinessProbe: &corev1.Probe{ProbeHandler: corev1.ProbeHandler{
					HTTPGet: &corev1.HTTPGetAction{Path: "/healthz", Port: intOrName("http")}}, PeriodSeconds: 1},
			}},
		},
	}
}

// runPod creates pod in ns and waits until it is Ready.
func runPod(t testing.TB, cs *kubernetes.Clientset, ns string, pod *corev1.Pod) *corev1.Pod {
	t.Helper()
	ctx := context.Background()
	if _, err := cs.CoreV1().Pods(ns).Create(ctx, pod, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	var got *corev1.Pod
	waitFor(t, "pod "+ns+"/"+pod.Name+" Ready", 2*time.Minute, func() error {
		p, err := cs.CoreV1().Pods(ns).Get(ctx, pod.Name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		for _, c := range p.Status.Conditions {
			if c.Type == corev1.PodReady && c.Status == corev1.ConditionTrue {
				got = p
				return nil
			}
		}
		return fmt.Errorf("phase %s", p.Status.Phase)
	})
	return got
}

// httpGet fetches url from inside the node's network namespace.
func httpGet(n *node.Node, url string, timeout time.Duration) (string, error) {
	c := &http.Client{Timeout: timeout, Transport: &http.Transport{
		DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
			return n.DialContext(ctx, network, addr)
		},
		DisableKeepAlives: true,
	}}
	resp, err := c.Get(url)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK {
		return string(b), fmt.Errorf("%s: %s", url, resp.Status)
	}
	return string(b), err
}

// dialFrom makes the netexec pod at podIP connect to host:port over HTTP,
// asking path, and returns the answers (agnhost's /dial).
func dialFrom(n *node.Node, podIP, host string, port int, path string) ([]string, error) {
	url := fmt.Sprintf("http://%s/dial?request=%s&protocol=http&host=%s&port=%d&tries=1",
		net.JoinHostPort(podIP, "8080"), path, host, port)
	body, err := httpGet(n, url, 10*time.Second)
	if err != nil {
		return nil, err
	}
	var r struct {
		Responses []string `json:"responses"`
		Errors    []string `json:"errors"`
	}
	if err := json.Unmarshal([]byte(body), &r); err != nil {
		return nil, fmt.Errorf("%s: %w", body, err)
	}
	if len(r.Errors) > 0 {
		return r.Responses, fmt.Errorf("dial errors: %s", strings.Join(r.Errors, "; "))
	}
	return r.Responses, nil
}

func intOrName(name string) intstr.IntOrString { return intstr.FromString(name) }

// isolateIngress writes a NetworkPolicy that isolates the ingress of the
// pods labelled app=app, allowing only the pods labelled app=<from> (none:
// default deny).
func isolateIngress(t testing.TB, cs *kubernetes.Clientset, ns, app string, from ...string) {
	t.Helper()
	var rules []networkingv1.NetworkPolicyIngressRule
	for _, f := range from {
		rules = append(rules, networkingv1.NetworkPolicyIngressRule{From: []networkingv1.NetworkPolicyPeer{{
			PodSelector: &metav1.LabelSelector{MatchLabels: map[string]string{"app": f}}}}})
	}
	if _, err := cs.NetworkingV1().NetworkPolicies(ns).Create(context.Background(), &networkingv1.NetworkPolicy{
		ObjectMeta: metav1.ObjectMeta{Name: app + "-ingress"},
		Spec: networkingv1.NetworkPolicySpec{
			PodSelector: metav1.LabelSelector{MatchLabels: map[string]string{"app": app}},
			PolicyTypes: []networkingv1.PolicyType{networkingv1.PolicyTypeIngress},
			Ingress:     rules,
		},
	}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
}

// isolateEgress writes a NetworkPolicy that isolates the egress of the
// pods labelled app=app, allowing nothing.
func isolateEgress(t testing.TB, cs *kubernetes.Clientset, ns, app string) {
	t.Helper()
	if _, err := cs.NetworkingV1().NetworkPolicies(ns).Create(context.Background(), &networkingv1.NetworkPolicy{
		ObjectMeta: metav1.ObjectMeta{Name: app + "-egress"},
		Spec: networkingv1.NetworkPolicySpec{
			PodSelector: metav1.LabelSelector{MatchLabels: map[string]string{"app": app}},
			PolicyTypes: []networkingv1.PolicyType{networkingv1.PolicyTypeEgress},
		},
	}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
}

// sweeperJSON runs a command of the sweeper in its pod on the node and
// decodes what it prints into v.
func sweeperJSON(t testing.TB, n *node.Node, v any, args ...string) {
	t.Helper()
	out, err := n.Kubectl(append([]string{"-n", "kube-system", "exec", "ds/podfence-sweeper", "-c", "sweeper", "--",
		"/usr/local/bin/podfence-sweeper"}, args...)...)
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(out, v); err != nil {
		t.Fatalf("podfence-sweeper %s: %s: %v", strings.Join(args, " "), out, err)
	}
}

// serviceFor creates a Service named app in front of the pods labelled
// app=<app> (port 80 to netexec's 8080) and returns its ClusterIP's
// host:port once kube-proxy DNATs it. No connection may go to a ClusterIP
// before that: a SYN kube-proxy does not know yet is routed as it is, to
// the node's default gateway (which does not answer here), and the kernel
// keeps that flow's conntrack entry, not NATed, for 120 s
// (nf_conntrack_tcp_timeout_syn_sent) after the connect failed. A later
// connection the kernel gives the same source port matches it and fails
// the same way, 3 s later, with "no route to host": kube-proxy flushes such
// entries for UDP only. A test would then count a failure that is the
// Service's creation's.
func serviceFor(t testing.TB, n *node.Node, cs *kubernetes.Clientset, ns, app string) string {
	t.Helper()
	svc, err := cs.CoreV1().Services(ns).Create(context.Background(), &corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Name: app},
		Spec: corev1.ServiceSpec{
			Selector: map[string]string{"app": app},
			Ports:    []corev1.ServicePort{{Port: 80, TargetPort: intstr.FromInt32(8080)}},
		},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	vip := svc.Spec.ClusterIP
	waitTranslated(t, n, vip, "tcp", 80)
	return net.JoinHostPort(vip, "80")
}

// reaches connects from the pod with uid to ip's port 8080 (netexec's).
func reaches(n *node.Node, uid types.UID, ip string) error {
	return connects(n, uid, net.JoinHostPort(ip, "8080"))
}

// connects opens a TCP connection from the pod with uid to hostport, and
// closes it.
func connects(n *node.Node, uid types.UID, hostport string) error {
	ctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
	defer cancel()
	c, err := n.DialFromPod(ctx, string(uid), "tcp", hostport)
	if err != nil {
		return err
	}
	return c.Close()
}
