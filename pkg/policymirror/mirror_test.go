package policymirror

import (
	"bytes"
	"context"
	"net/netip"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/client-go/dynamic"

	"github.com/podfence/podfence/pkg/policy"
	"github.com/podfence/podfence/test/kubeapi"
	"github.com/podfence/podfence/test/netnsutil"
)

var (
	thisNode  = netip.MustParseAddr("192.0.2.10")
	otherNode = netip.MustParseAddr("192.0.2.99")
)

// pe is a PolicyEndpoint selecting one pod on the node at hostIP, letting
// cidr in on TCP port.
func pe(name string, hostIP netip.Addr, cidr string, port int64) *unstructured.Unstructured {
	return &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "networking.k8s.aws/v1alpha1",
		"kind":       "PolicyEndpoint",
		"metadata":   map[string]any{"name": name, "namespace": "default"},
		"spec": map[string]any{
			"policyRef":    map[string]any{"name": name, "namespace": "default"},
			"podIsolation": []any{"Ingress"},
			"podSelectorEndpoints": []any{map[string]any{
				"name": name + "-pod", "namespace": "default", "podIP": "10.0.0.1", "hostIP": hostIP.String()}},
			"ingress": []any{map[string]any{"cidr": cidr,
				"ports": []any{map[string]any{"protocol": "TCP", "port": port}}}},
		},
	}}
}

// fixture is an API server with the CRD, a policy directory, and a Mirror
// of it whose node addresses the test sets.
type fixture struct {
	api     *kubeapi.Server
	pes     dynamic.ResourceInterface
	dir     string
	mu      sync.Mutex
	addrs   []netip.Addr
	reports chan Report
}

func newFixture(t *testing.T) *fixture {
	api := kubeapi.Start(t, kubeapi.Options{Netns: netnsutil.New(t)})
	api.InstallCRDs(context.Background(), kubeapi.ControllerCRD(t, "policyendpoints"))
	_, dyn := api.Clients()
	return &fixture{api: api, pes: dyn.Resource(Resource).Namespace("default"), dir: t.TempDir(),
		addrs: []netip.Addr{thisNode}, reports: make(chan Report, 100)}
}

func (f *fixture) setAddrs(a ...netip.Addr) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.addrs = a
}

func (f *fixture) start(t *testing.T) *Mirror {
	t.Helper()
	_, dyn := f.api.Clients()
	m, err := New(dyn, Options{
		Dir: f.dir,
		NodeAddrs: func() ([]netip.Addr, error) {
			f.mu.Lock()
			defer f.mu.Unlock()
			return f.addrs, nil
		},
		OnReconcile: func(r Report, err error) {
			if err != nil {
				t.Errorf("reconcile: %v", err)
			}
			f.reports <- r
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error)
	go func() { done <- m.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run: %v", err)
		}
	})
	return m
}

func (f *fixture) create(t *testing.T, obj *unstructured.Unstructured) {
	t.Helper()
	if _, err := f.pes.Create(context.Background(), obj, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
}

// waitFile waits until dir/name holds want (nil: until it is gone).
func (f *fixture) waitFile(t *testing.T, name string, want []byte) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		got, err := os.ReadFile(filepath.Join(f.dir, name))
		if want == nil && os.IsNotExist(err) || want != nil && bytes.Equal(got, want) {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s = %q (%v), want %q", name, got, err, want)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func render(t *testing.T, obj *unstructured.Unstructured) []byte {
	t.Helper()
	data, err := Render(obj)
	if err != nil {
		t.Fatal(err)
	}
	return data
}

// TestMirror: the directory is marked unsynced from New to the first sync;
// the sync writes this node's objects, drops what an earlier run left for
// objects since deleted, and leaves files it does not own alone; later
// events and node address changes follow.
func TestMirror(t *testing.T) {
	f := newFixture(t)
	a := pe("a", thisNode, "10.1.0.0/16", 80)
	elsewhere := pe("elsewhere", otherNode, "10.2.0.0/16", 80)
	f.create(t, a)
	f.create(t, elsewhere)
	mine := []byte("# written by hand\n")
	for name, data := range map[string][]byte{"mine.yaml": mine, FileName("default", "stale"): render(t, pe("stale", thisNode, "10.9.0.0/16", 80))} {
		if err := os.WriteFile(filepath.Join(f.dir, name), data, 0o644); err != nil {
			t.Fatal(err)
		}
	}

	m := f.start(t)
	if synced, err := policy.Synced(f.dir); err != nil || synced {
		t.Fatalf("Synced before the first sync = %v, %v; want false", synced, err)
	}
	select {
	case <-m.Synced():
	case <-time.After(20 * time.Second):
		t.Fatal("no first sync")
	}
	if synced, err := policy.Synced(f.dir); err != nil || !synced {
		t.Fatalf("Synced after the first sync = %v, %v; want true", synced, err)
	}
	f.waitFile(t, FileName("default", "a"), render(t, a))
	f.waitFile(t, FileName("default", "stale"), nil)
	f.waitFile(t, FileName("default", "elsewhere"), nil)
	f.waitFile(t, "mine.yaml", mine)
	docs, err := policy.LoadDir(f.dir)
	if err != nil || len(docs) != 1 || docs[0].Name != "a" {
		t.Fatalf("LoadDir of the mirror = %+v, %v; want the one document a", docs, err)
	}

	// An update that changes only metadata writes nothing.
	drain(f.reports)
	cur, err := f.pes.Get(context.Background(), "a", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	cur.SetLabels(map[string]string{"touched": "yes"})
	if _, err := f.pes.Update(context.Background(), cur, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	if r := waitReport(t, f.reports); r.Written+r.Removed != 0 {
		t.Errorf("a label change rewrote the directory: %+v", r)
	}

	// The node takes the other address: the other object is now its own.
	f.setAddrs(otherNode)
	m.Kick()
	f.waitFile(t, FileName("default", "elsewhere"), render(t, elsewhere))
	f.waitFile(t, FileName("default", "a"), nil)
	select {
	case <-m.Changed():
	case <-time.After(10 * time.Second):
		t.Error("no Changed after the directory changed")
	}

	if err := f.pes.Delete(context.Background(), "elsewhere", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	f.waitFile(t, FileName("default", "elsewhere"), nil)
}

// TestMirrorKeepsLastGoodVersion: an object the CRD admits but podfence's
// parser refuses (an except outside its cidr) is mirrored all the same, and
// the directory's loader enforces its last good version, which the sweeper
// recorded when it was valid (policy.Dir.KeepLastGood); one bad object
// neither freezes the policy of other identifiers nor cuts its own pods off.
// A new object that does not parse has no last good version: its pods are
// isolated as it says, allowing nothing.
func TestMirrorKeepsLastGoodVersion(t *testing.T) {
	f := newFixture(t)
	good := pe("a", thisNode, "10.1.0.0/16", 80)
	f.create(t, good)
	m := f.start(t)
	<-m.Synced()
	f.waitFile(t, FileName("default", "a"), render(t, good))
	d, err := policy.ReadDir(f.dir)
	if err != nil {
		t.Fatal(err)
	}
	if err := d.KeepLastGood(); err != nil { // as the sweeper does after each load
		t.Fatal(err)
	}

	cur, err := f.pes.Get(context.Background(), "a", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	rules, _, _ := unstructured.NestedSlice(cur.Object, "spec", "ingress")
	rules[0].(map[string]any)["except"] = []any{"172.16.0.0/24"}
	unstructured.SetNestedSlice(cur.Object, rules, "spec", "ingress")
	if docs, _ := policy.Parse(bytes.NewReader(render(t, cur)), "check"); policy.Strict(docs) == nil {
		t.Fatal("test setup: the parser accepts an except outside the cidr")
	}
	drain(f.reports)
	if _, err := f.pes.Update(context.Background(), cur, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	for r := waitReport(t, f.reports); r.Invalid == 0; r = waitReport(t, f.reports) {
	}
	f.waitFile(t, FileName("default", "a"), render(t, cur))
	docs, err := policy.LoadDir(f.dir)
	if err != nil || len(docs) != 1 || docs[0].Fallback != policy.FallbackLastGood || len(docs[0].Ingress) != 1 {
		t.Errorf("LoadDir = %+v, %v; want the last good version of the one document", docs, err)
	}

	bad := cur.DeepCopy()
	bad.SetName("b")
	bad.SetResourceVersion("")
	f.create(t, bad)
	f.waitFile(t, FileName("default", "b"), render(t, bad))
	docs, err = policy.LoadDir(f.dir)
	if err != nil || len(docs) != 2 || docs[1].Fallback != policy.FallbackIsolation || !docs[1].IsolateIngress || len(docs[1].Ingress) != 0 {
		t.Errorf("LoadDir = %+v, %v; want the new broken document isolating its pods with no rule", docs, err)
	}
}

func drain(c chan Report) {
	for {
		select {
		case <-c:
		default:
			return
		}
	}
}

func waitReport(t *testing.T, c chan Report) Report {
	t.Helper()
	select {
	case r := <-c:
		return r
	case <-time.After(10 * time.Second):
		t.Fatal("no reconcile")
		return Report{}
	}
}

func TestSelectsNode(t *testing.T) {
	for _, tc := range []struct {
		name   string
		hostIP string
		addrs  []netip.Addr
		want   bool
	}{
		{"its node", "192.0.2.10", []netip.Addr{otherNode, thisNode}, true},
		{"another node", "192.0.2.10", []netip.Addr{otherNode}, false},
		{"v4-mapped hostIP", "::ffff:192.0.2.10", []netip.Addr{thisNode}, true},
		{"garbage hostIP", "node-1", []netip.Addr{thisNode}, false},
		{"no addresses", "192.0.2.10", nil, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			obj := pe("a", thisNode, "10.0.0.0/8", 80)
			eps, _, _ := unstructured.NestedSlice(obj.Object, "spec", "podSelectorEndpoints")
			eps[0].(map[string]any)["hostIP"] = tc.hostIP
			unstructured.SetNestedSlice(obj.Object, eps, "spec", "podSelectorEndpoints")
			if got := SelectsNode(obj, tc.addrs); got != tc.want {
				t.Errorf("SelectsNode = %v, want %v", got, tc.want)
			}
		})
	}
}

// TestMirrorChunksOfAPolicy: a chunk that holds rules and no pod is this
// node's when another chunk of its policy selects a pod here (the
// controller packs rules and pods independently); a chunk of a policy
// whose pods are elsewhere is not.
func TestMirrorChunksOfAPolicy(t *testing.T) {
	f := newFixture(t)
	f.create(t, pe("a", thisNode, "10.1.0.0/16", 80))
	rulesOnly := pe("a-2", thisNode, "10.2.0.0/16", 80)
	unstructured.SetNestedField(rulesOnly.Object, map[string]any{"name": "a", "namespace": "default"}, "spec", "policyRef")
	unstructured.RemoveNestedField(rulesOnly.Object, "spec", "podSelectorEndpoints")
	f.create(t, rulesOnly)
	elsewhere := pe("b", otherNode, "10.3.0.0/16", 80)
	f.create(t, elsewhere)
	otherRules := pe("b-2", otherNode, "10.4.0.0/16", 80)
	unstructured.SetNestedField(otherRules.Object, map[string]any{"name": "b", "namespace": "default"}, "spec", "policyRef")
	unstructured.RemoveNestedField(otherRules.Object, "spec", "podSelectorEndpoints")
	f.create(t, otherRules)
	m := f.start(t)
	<-m.Synced()
	f.waitFile(t, FileName("default", "a-2"), render(t, rulesOnly))
	for _, name := range []string{"b", "b-2"} {
		if _, err := os.Stat(filepath.Join(f.dir, FileName("default", name))); !os.IsNotExist(err) {
			t.Errorf("%s, a chunk of a policy of another node's pods, mirrored: %v", name, err)
		}
	}
}
