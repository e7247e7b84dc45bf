package realnode

import (
	"context"
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/podfence/podfence/pkg/policy"
	"github.com/podfence/podfence/test/node"
)

var clusterNetworkPolicies = schema.GroupVersionResource{Group: "networking.k8s.aws", Version: "v1alpha1", Resource: "clusternetworkpolicies"}

// clusterDir is where the sweeper mirrors ClusterPolicyEndpoints on the
// node (policymirror.ClusterDir of the manifest's policy directory).
const clusterDir = "/etc/podfence/policies/cluster"

func dynamicClient(t testing.TB, n *node.Node) dynamic.Interface {
	t.Helper()
	cfg, err := clientcmd.BuildConfigFromFlags("", n.Kubeconfig)
	if err != nil {
		t.Fatal(err)
	}
	dc, err := dynamic.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return dc
}

// TestClusterPolicyMirrored: through the real controller, a
// ClusterNetworkPolicy whose subject holds a pod here reaches the node as
// its ClusterPolicyEndpoint in the policy directory's cluster/, where it
// parses as written; the sweeper logs that cluster policies select pods
// here, with the count. Deleted, the file goes and the sweeper says so.
func TestClusterPolicyMirrored(t *testing.T) {
	n := needNode(t)
	cs := clientset(t, n)
	ns := namespace(t, cs, "cnp")
	createDeployment(t, cs, ns, "cnp")
	scale(t, cs, ns, "cnp", 1)
	pods, err := cs.CoreV1().Pods(ns).List(context.Background(), metav1.ListOptions{})
	if err != nil || len(pods.Items) != 1 {
		t.Fatalf("pods of %s: %v, %v", ns, pods, err)
	}
	pod := pods.Items[0].Name

	cnps := dynamicClient(t, n).Resource(clusterNetworkPolicies)
	name := "podfence-" + ns
	cnp := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "networking.k8s.aws/v1alpha1",
		"kind":       "ClusterNetworkPolicy",
		"metadata":   map[string]any{"name": name},
		"spec": map[string]any{
			"tier":     "Admin",
			"priority": int64(10),
			"subject": map[string]any{"pods": map[string]any{
				"namespaceSelector": map[string]any{"matchLabels": map[string]any{"kubernetes.io/metadata.name": ns}},
				"podSelector":       map[string]any{},
			}},
			"egress": []any{map[string]any{"name": "no-imds", "action": "Deny",
				"to": []any{map[string]any{"networks": []any{"169.254.169.254/32"}}}}},
		},
	}}
	start := time.Now()
	if _, err := cnps.Create(context.Background(), cnp, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	deleted := false
	t.Cleanup(func() {
		if !deleted {
			cnps.Delete(context.Background(), name, metav1.DeleteOptions{})
		}
	})

	files := func() (string, error) {
		out, err := n.Exec("sh", "-c", "cat "+clusterDir+"/cpe_"+name+"-*.json 2>/dev/null").Output()
		return string(out), err
	}
	waitFor(t, "the ClusterPolicyEndpoint in "+clusterDir, 60*time.Second, func() error {
		out, err := files()
		if err != nil || out == "" {
			return fmt.Errorf("no file yet (%v)", err)
		}
		docs, err := policy.ParseCluster(strings.NewReader(out), "mirrored")
		if err != nil {
			return err
		}
		if len(docs) != 1 || docs[0].Tier != policy.TierAdmin || docs[0].Priority != 10 || docs[0].Policy != name {
			return fmt.Errorf("documents %+v", docs)
		}
		d := docs[0]
		if !slices.Contains(d.Selects, policy.Endpoint{Name: pod, Namespace: ns}) {
			return fmt.Errorf("selects %v, not the pod %s/%s", d.Selects, ns, pod)
		}
		want := policy.ClusterRule{CIDR: netip.MustParsePrefix("169.254.169.254/32"), Action: policy.ActionDeny}
		if len(d.Egress) != 1 || d.Egress[0].CIDR != want.CIDR || d.Egress[0].Action != want.Action {
			return fmt.Errorf("egress %+v, want one Deny of %s", d.Egress, want.CIDR)
		}
		return nil
	})
	warned := func(prefix string, selected int) func() error {
		return func() error {
			for _, l := range sweeperLogs(t, n) {
				if strings.HasPrefix(l.Msg, prefix) && l.Time.After(start) && l.Selected == selected {
					return nil
				}
			}
			return fmt.Errorf("no %q line with selected=%d since the policy was created", prefix, selected)
		}
	}
	waitFor(t, "the sweeper's log line", 30*time.Second, warned("ClusterPolicyEndpoints select pods on this node", 1))

	if err := cnps.Delete(context.Background(), name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	deleted = true
	waitFor(t, "the mirrored file gone", 60*time.Second, func() error {
		if out, _ := files(); out != "" {
			return fmt.Errorf("still there: %.200s", out)
		}
		return nil
	})
	waitFor(t, "the sweeper's all-clear", 30*time.Second, warned("no ClusterPolicyEndpoint selects a pod on this node", 0))
}
