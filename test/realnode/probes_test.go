package realnode

import (
	"context"
	"encoding/json"
	"errors"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/podfence/podfence/test/node"
)

// TestProbesUnderDefaultDeny: a pod with HTTP readiness and liveness
// probes under a NetworkPolicy that denies everything both ways becomes
// Ready and stays so (no restart), in standard and in strict mode: the
// kubelet's probes come from the node's address, which podfence always
// allows. A client is refused all the while, so the policy is in force.
func TestProbesUnderDefaultDeny(t *testing.T) {
	n := needNode(t)
	cs := clientset(t, n)
	for _, mode := range []string{"standard", "strict"} {
		t.Run(mode, func(t *testing.T) {
			if mode == "strict" {
				setEnforcingMode(t, n, "strict")
			}
			ns := namespace(t, cs, "probes-"+mode)
			ctx := context.Background()
			if _, err := cs.NetworkingV1().NetworkPolicies(ns).Create(ctx, &networkingv1.NetworkPolicy{
				ObjectMeta: metav1.ObjectMeta{Name: "deny-all"},
				Spec: networkingv1.NetworkPolicySpec{
					PodSelector: metav1.LabelSelector{MatchLabels: map[string]string{"app": "probed"}},
					PolicyTypes: []networkingv1.PolicyType{networkingv1.PolicyTypeIngress, networkingv1.PolicyTypeEgress},
				},
			}, metav1.CreateOptions{}); err != nil {
				t.Fatal(err)
			}
			// The controller writes the PolicyEndpoint once the pod exists;
			// strict closes the pod from its first packet anyway.
			client := runPod(t, cs, ns, netexecPod("client", map[string]string{"app": "client"}))
			pod := netexecPod("probed", map[string]string{"app": "probed"})
			pod.Spec.Containers[0].LivenessProbe = pod.Spec.Containers[0].ReadinessProbe.DeepCopy()
			pod.Spec.Containers[0].LivenessProbe.FailureThreshold = 2
			probed := runPod(t, cs, ns, pod)
			waitFor(t, "the client refused", 30*time.Second, func() error {
				if _, err := dialFrom(n, client.Status.PodIP, probed.Status.PodIP, 8080, "hostname"); err == nil {
					return errors.New("the client reached the probed pod")
				}
				return nil
			})
			time.Sleep(10 * time.Second) // five liveness periods
			p, err := cs.CoreV1().Pods(ns).Get(ctx, "probed", metav1.GetOptions{})
			if err != nil {
				t.Fatal(err)
			}
			if !ready(p) || p.Status.ContainerStatuses[0].RestartCount != 0 {
				t.Errorf("after 10 s: ready %v, %d restarts; want Ready and none", ready(p), p.Status.ContainerStatuses[0].RestartCount)
			}
		})
	}
}

func ready(p *corev1.Pod) bool {
	for _, c := range p.Status.Conditions {
		if c.Type == corev1.PodReady {
			return c.Status == corev1.ConditionTrue
		}
	}
	return false
}

// setEnforcingMode sets podfence's enforcingMode in the node's conflist,
// as an operator would, until the test ends: ADDs after it use it.
func setEnforcingMode(t *testing.T, n *node.Node, mode string) {
	t.Helper()
	editPodfenceEntry(t, n, func(e map[string]any) { e["enforcingMode"] = mode })
}

// editPodfenceEntry changes podfence's entry of the node's conflist until
// the test ends.
func editPodfenceEntry(t *testing.T, n *node.Node, edit func(map[string]any)) {
	t.Helper()
	const path = "/etc/cni/net.d/10-aws.conflist"
	before, err := n.Exec("cat", path).Output()
	if err != nil {
		t.Fatal(err)
	}
	var conf map[string]any
	if err := json.Unmarshal(before, &conf); err != nil {
		t.Fatal(err)
	}
	plugins := conf["plugins"].([]any)
	edit(plugins[len(plugins)-1].(map[string]any))
	after, err := json.MarshalIndent(conf, "", "  ")
	if err != nil {
		t.Fatal(err)
	}
	writeConflist(t, n, string(after))
	t.Cleanup(func() { writeConflist(t, n, string(before)) })
}
