package policymirror

import (
	"context"
	"net/netip"
	"os"
	"path/filepath"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"

	"github.com/podfence/podfence/pkg/policy"
	"github.com/podfence/podfence/test/kubeapi"
)

// cpe is an Admin ClusterPolicyEndpoint selecting one pod on the node at
// hostIP, denying egress to cidr.
func cpe(name string, hostIP netip.Addr, cidr string) *unstructured.Unstructured {
	return &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "networking.k8s.aws/v1alpha1",
		"kind":       "ClusterPolicyEndpoint",
		"metadata":   map[string]any{"name": name},
		"spec": map[string]any{
			"policyRef": map[string]any{"name": name},
			"tier":      "Admin",
			"priority":  int64(10),
			"subject":   map[string]any{"namespaces": map[string]any{}},
			"podSelectorEndpoints": []any{map[string]any{
				"name": name + "-pod", "namespace": "default", "podIP": "10.0.0.1", "hostIP": hostIP.String()}},
			"egress": []any{map[string]any{"cidr": cidr, "action": "Deny"}},
		},
	}}
}

func (f *fixture) createCluster(t *testing.T, obj *unstructured.Unstructured) {
	t.Helper()
	_, dyn := f.api.Clients()
	if _, err := dyn.Resource(ClusterResource).Create(context.Background(), obj, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
}

func waitSynced(t *testing.T, m *Mirror) {
	t.Helper()
	select {
	case <-m.Synced():
	case <-time.After(20 * time.Second):
		t.Fatal("no first sync")
	}
}

// TestMirrorClusterServedAtStart: with the kind served, the first sync
// holds this node's ClusterPolicyEndpoints, in ClusterDir, where the
// PolicyEndpoint loader (a plugin of an older build) does not look.
func TestMirrorClusterServedAtStart(t *testing.T) {
	f := newFixture(t)
	f.api.InstallCRDs(context.Background(), kubeapi.ControllerCRD(t, "clusterpolicyendpoints"))
	mine, other := cpe("no-imds", thisNode, "169.254.169.254/32"), cpe("other", otherNode, "10.0.0.0/8")
	f.createCluster(t, mine)
	f.createCluster(t, other)
	f.create(t, pe("a", thisNode, "10.1.0.0/16", 80))
	waitSynced(t, f.start(t))
	if r := waitReport(t, f.reports); r.Objects != 1 || r.Selected != 1 || r.ClusterObjects != 2 || r.ClusterSelected != 1 {
		t.Errorf("first report %+v, want 1 of 1 PolicyEndpoints and 1 of 2 ClusterPolicyEndpoints selected", r)
	}

	path := filepath.Join(f.dir, ClusterDir, ClusterFileName("no-imds"))
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("at the first sync: %v", err)
	}
	if want := render(t, mine); string(data) != string(want) {
		t.Errorf("%s = %s, want %s", path, data, want)
	}
	f.waitFile(t, filepath.Join(ClusterDir, ClusterFileName("other")), nil)
	fh, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer fh.Close()
	if docs, err := policy.ParseCluster(fh, path); err != nil || len(docs) != 1 || docs[0].Tier != policy.TierAdmin || len(docs[0].Egress) != 1 {
		t.Errorf("ParseCluster of the mirrored file: %+v, %v", docs, err)
	}
	if docs, err := policy.LoadDir(f.dir); err != nil || len(docs) != 1 || docs[0].Name != "a" {
		t.Errorf("LoadDir of the policy directory = %+v, %v; want the PolicyEndpoint a alone", docs, err)
	}

	_, dyn := f.api.Clients()
	if err := dyn.Resource(ClusterResource).Delete(context.Background(), "no-imds", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	f.waitFile(t, filepath.Join(ClusterDir, ClusterFileName("no-imds")), nil)
}

// TestMirrorClusterServedLater: an API without the kind (a controller of
// before cluster policies) does not hold the sync up, and what an earlier
// run left of the kind goes; once the API serves it, it is mirrored
// without a restart.
func TestMirrorClusterServedLater(t *testing.T) {
	old := probeEvery
	probeEvery = 200 * time.Millisecond
	t.Cleanup(func() { probeEvery = old })
	f := newFixture(t)
	stale := filepath.Join(ClusterDir, ClusterFileName("gone"))
	if err := os.MkdirAll(filepath.Join(f.dir, ClusterDir), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(f.dir, stale), render(t, cpe("gone", thisNode, "10.0.0.0/8")), 0o644); err != nil {
		t.Fatal(err)
	}
	a := pe("a", thisNode, "10.1.0.0/16", 80)
	f.create(t, a)
	waitSynced(t, f.start(t))
	f.waitFile(t, FileName("default", "a"), render(t, a))
	f.waitFile(t, stale, nil)

	f.api.InstallCRDs(context.Background(), kubeapi.ControllerCRD(t, "clusterpolicyendpoints"))
	mine := cpe("no-imds", thisNode, "169.254.169.254/32")
	f.createCluster(t, mine)
	f.waitFile(t, filepath.Join(ClusterDir, ClusterFileName("no-imds")), render(t, mine))
}
