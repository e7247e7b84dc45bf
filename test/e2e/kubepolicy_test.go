package e2e

import (
	"context"
	"encoding/json"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/containernetworking/cni/libcni"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/client-go/dynamic"
	"sigs.k8s.io/yaml"

	"github.com/podfence/podfence/pkg/policy"
	"github.com/podfence/podfence/pkg/policymirror"
	"github.com/podfence/podfence/test/kubeapi"
	"github.com/podfence/podfence/test/netnsutil"
)

// nodeIP is the node's address in the API tests: podSelectorEndpoints name
// it as the hostIP of the pods on this node.
var nodeIP = netip.MustParseAddr("192.0.2.10")

// apiCluster is a cluster whose node namespace also runs an etcd and a
// kube-apiserver, with the PolicyEndpoint CRD and conf/'s sweeper
// manifest (its ServiceAccount and RBAC) installed for real.
type apiCluster struct {
	*cluster
	api *kubeapi.Server
	pes dynamic.NamespaceableResourceInterface
	// kubeconfig holds a token of the sweeper's ServiceAccount, bound only
	// to what conf/podfence-sweeper.yaml grants.
	kubeconfig string
}

func newAPICluster(t testing.TB) *apiCluster {
	t.Helper()
	c := newCluster(t, attachModes(t)[0])
	// Compacting often makes a watch that resumes after a pause meet 410
	// Gone, the path TestKubernetesPolicyRelist is about.
	api := kubeapi.Start(t, kubeapi.Options{Netns: c.node, CompactEvery: time.Second})
	ctx := context.Background()
	api.InstallCRDs(ctx, kubeapi.ControllerCRD(t, "policyendpoints"))
	if _, err := api.Apply(ctx, readConf(t, "podfence-sweeper.yaml"), kubeapi.ApplyOptions{Namespace: "kube-system"}); err != nil {
		t.Fatalf("apply conf/podfence-sweeper.yaml: %v", err)
	}
	token := api.ServiceAccountToken(ctx, "kube-system", "podfence-sweeper")
	c.addNodeAddr(t, nodeIP)
	_, dyn := api.Clients()
	return &apiCluster{cluster: c, api: api, pes: dyn.Resource(policymirror.Resource),
		kubeconfig: api.WriteKubeconfig("sweeper.kubeconfig", token)}
}

func readConf(t testing.TB, name string) []byte {
	t.Helper()
	data, err := os.ReadFile(filepath.Join("..", "..", "conf", name))
	if err != nil {
		t.Fatal(err)
	}
	return data
}

// runKubeSweeper starts `run --policy-source=kubernetes` as the
// ServiceAccount.
func (c *apiCluster) runKubeSweeper(t testing.TB) *syncBuffer {
	t.Helper()
	_, logs := c.runSweeper(t, "--interval-min", "1h", "--interval-max", "1h",
		"--policy-source=kubernetes", "--kubeconfig", c.kubeconfig)
	return logs
}

// object is d as the upstream controller writes it for pods on this node.
func (d endpointDoc) object(tb testing.TB) *unstructured.Unstructured {
	tb.Helper()
	d.hostIP = nodeIP.String()
	obj := &unstructured.Unstructured{}
	if err := yaml.Unmarshal([]byte(d.String()), &obj.Object); err != nil {
		tb.Fatalf("%s: %v", d.name, err)
	}
	return obj
}

// policyEndpoint isolates the ingress of the selected pods and lets each
// client's /32 in on TCP port.
func policyEndpoint(t *testing.T, name string, selected []string, port uint16, clients ...*pod) *unstructured.Unstructured {
	d := endpointDoc{name: name, pods: selected, isolate: []string{"Ingress"}}
	for _, cl := range clients {
		d.ingress = append(d.ingress, tcpRule(cl.ip.String()+"/32", port))
	}
	return d.object(t)
}

func (c *apiCluster) create(t testing.TB, pe *unstructured.Unstructured) {
	t.Helper()
	if _, err := c.pes.Namespace("default").Create(context.Background(), pe, metav1.CreateOptions{}); err != nil {
		t.Fatalf("create PolicyEndpoint: %v", err)
	}
}

func (c *apiCluster) update(t testing.TB, pe *unstructured.Unstructured) {
	t.Helper()
	cur, err := c.pes.Namespace("default").Get(context.Background(), pe.GetName(), metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	pe.SetResourceVersion(cur.GetResourceVersion())
	if _, err := c.pes.Namespace("default").Update(context.Background(), pe, metav1.UpdateOptions{}); err != nil {
		t.Fatalf("update PolicyEndpoint: %v", err)
	}
}

func (c *apiCluster) delete(t *testing.T, name string) {
	t.Helper()
	if err := c.pes.Namespace("default").Delete(context.Background(), name, metav1.DeleteOptions{}); err != nil {
		t.Fatalf("delete PolicyEndpoint: %v", err)
	}
}

// waitConnects dials from one pod to another, one short attempt at a time,
// until the outcome is want or within has passed since since, and returns
// when it was first seen.
func waitConnects(t *testing.T, from, to *pod, port uint16, want bool, since time.Time, within time.Duration) time.Duration {
	t.Helper()
	for {
		got := netnsutil.Connects(t, from.netns, netip.AddrPortFrom(to.ip, port), 100*time.Millisecond, 1)
		took := time.Since(since)
		if got == want {
			return took
		}
		if took > within {
			t.Fatalf("%s -> %s:%d connects=%v %v after the change, want %v", from.name, to.name, port, got, took, want)
		}
	}
}

// TestKubernetesPolicyLive: the sweeper, as its ServiceAccount, mirrors
// the PolicyEndpoints of its node into policyDir. A pod whose
// PolicyEndpoint existed before it gets the policy at ADD; creating,
// updating and deleting one changes traffic within a second, and an
// established connection the update revokes is cut.
func TestKubernetesPolicyLive(t *testing.T) {
	c := newAPICluster(t)
	client := c.addPod("client", "default")
	intruder := c.addPod("intruder", "default")
	logs := c.runKubeSweeper(t)
	logs.waitFor(t, "policy directory synced with the API", 20*time.Second)

	// Before the pod: its ADD reads the mirrored file.
	c.create(t, policyEndpoint(t, "web", []string{webReplicas[0]}, backendPort, client))
	file := filepath.Join(c.policyDir, policymirror.FileName("default", "web"))
	deadline := time.Now().Add(time.Second)
	for !exists(file) {
		if time.Now().After(deadline) {
			t.Fatalf("%s not written a second after the PolicyEndpoint was created", file)
		}
		time.Sleep(5 * time.Millisecond)
	}
	web := c.addPod(webReplicas[0], "default")
	netnsutil.Echo(t, web.netns, backendPort)
	if !c.connects(client, web, backendPort) {
		t.Fatal("the client is not let in by the policy the pod got at ADD")
	}
	if c.connects(intruder, web, backendPort) {
		t.Fatal("the intruder is let in: the pod's ADD did not get its PolicyEndpoint")
	}
	conn, err := dialFrom(client.netns, netip.AddrPortFrom(web.ip, backendPort))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	if err := conn.roundTrip("before"); err != nil {
		t.Fatal(err)
	}

	// Update: the intruder in, the client out, its connection cut.
	programmed := func() int { return strings.Count(logs.String(), `"msg":"policy programmed"`) }
	before := programmed()
	changed := time.Now()
	c.update(t, policyEndpoint(t, "web", []string{webReplicas[0]}, backendPort, intruder))
	took := waitConnects(t, intruder, web, backendPort, true, changed, time.Second)
	t.Logf("update enforced %v after the API call", took)
	// The mirror's write reaches the sweeper twice, by its signal and by
	// inotify (past its quiet time): it is programmed once.
	time.Sleep(300 * time.Millisecond)
	if n := programmed() - before; n != 1 {
		t.Errorf("one PolicyEndpoint update programmed %d times", n)
	}
	if err := conn.roundTrip("after revocation"); err == nil {
		t.Fatal("the connection the update revoked still carries data")
	}
	if c.connects(client, web, backendPort) {
		t.Error("the client is still let in after the update")
	}

	// Delete: no policy selects the pod, standard mode opens it.
	changed = time.Now()
	c.delete(t, "web")
	took = waitConnects(t, client, web, backendPort, true, changed, time.Second)
	t.Logf("delete enforced %v after the API call", took)
	if exists(file) {
		t.Errorf("%s still there after its PolicyEndpoint was deleted", file)
	}

	// Create on a running pod.
	changed = time.Now()
	c.create(t, policyEndpoint(t, "web2", []string{webReplicas[0]}, backendPort, intruder))
	took = waitConnects(t, client, web, backendPort, false, changed, time.Second)
	t.Logf("create enforced %v after the API call", took)
	if !c.connects(intruder, web, backendPort) {
		t.Error("the created policy does not let the intruder in")
	}

	// A PolicyEndpoint of another node is not mirrored.
	other := policyEndpoint(t, "elsewhere", []string{"elsewhere-pod"}, backendPort, client)
	eps, _, _ := unstructured.NestedSlice(other.Object, "spec", "podSelectorEndpoints")
	eps[0].(map[string]any)["hostIP"] = "192.0.2.99"
	unstructured.SetNestedSlice(other.Object, eps, "spec", "podSelectorEndpoints")
	c.create(t, other)
	time.Sleep(300 * time.Millisecond)
	if f := filepath.Join(c.policyDir, policymirror.FileName("default", "elsewhere")); exists(f) {
		t.Errorf("%s written for a PolicyEndpoint whose pods run on another node", f)
	}
}

// TestKubernetesPolicyAPIRestart: with the API server down the node keeps
// enforcing the last policy; once it is back the watch resumes and a
// change made then reaches the pod.
func TestKubernetesPolicyAPIRestart(t *testing.T) {
	c := newAPICluster(t)
	client := c.addPod("client", "default")
	intruder := c.addPod("intruder", "default")
	c.create(t, policyEndpoint(t, "web", []string{webReplicas[0]}, backendPort, client))
	logs := c.runKubeSweeper(t)
	logs.waitFor(t, "policy directory synced with the API", 20*time.Second)
	web := c.addPod(webReplicas[0], "default")
	netnsutil.Echo(t, web.netns, backendPort)

	c.api.StopAPI()
	logs.waitFor(t, "API server unreachable", 20*time.Second)
	if !c.connects(client, web, backendPort) || c.connects(intruder, web, backendPort) {
		t.Fatal("the node stopped enforcing the last policy while the API server was down")
	}
	if !exists(filepath.Join(c.policyDir, policymirror.FileName("default", "web"))) {
		t.Fatal("the mirrored policy was removed while the API server was down")
	}
	c.api.StartAPI()
	logs.waitFor(t, "API server reachable again", 30*time.Second)

	// The reflector retries with a backoff of up to a few seconds; the
	// change is made once the server answers, and must land.
	changed := time.Now()
	c.update(t, policyEndpoint(t, "web", []string{webReplicas[0]}, backendPort, intruder))
	took := waitConnects(t, intruder, web, backendPort, true, changed, 30*time.Second)
	t.Logf("update after the API server restart enforced %v after the call", took)
	if c.connects(client, web, backendPort) {
		t.Error("the client is still let in after the update")
	}
}

// TestKubernetesPolicyRelist: changes the watch never saw converge. The
// sweeper is frozen (SIGSTOP) while the API server restarts and a
// PolicyEndpoint is then deleted and another created, and etcd's history
// is compacted past the sweeper's last resourceVersion: the resumed watch
// is answered 410 Gone and the reflector lists again. The deletion and the
// creation both reach the directory and the pods.
func TestKubernetesPolicyRelist(t *testing.T) {
	c := newAPICluster(t)
	client := c.addPod("client", "default")
	intruder := c.addPod("intruder", "default")
	c.create(t, policyEndpoint(t, "web", []string{webReplicas[0]}, backendPort, client))
	sweeper, logs := c.runSweeper(t, "--interval-min", "1h", "--interval-max", "1h",
		"--policy-source=kubernetes", "--kubeconfig", c.kubeconfig)
	logs.waitFor(t, "policy directory synced with the API", 20*time.Second)
	web := c.addPod(webReplicas[0], "default")
	netnsutil.Echo(t, web.netns, backendPort)
	if !c.connects(client, web, backendPort) || c.connects(intruder, web, backendPort) {
		t.Fatal("the first policy does not hold")
	}

	if err := sweeper.Process.Signal(syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	// Changes made before the restart would wait in the frozen sweeper's
	// socket for it to read; made after, only a new watch or list sees them.
	c.api.StopAPI()
	c.api.StartAPI()
	c.delete(t, "web")
	c.create(t, policyEndpoint(t, "web-v2", []string{webReplicas[0]}, backendPort, intruder))
	time.Sleep(3 * time.Second) // two compactions: the sweeper's resourceVersion is gone
	if err := sweeper.Process.Signal(syscall.SIGCONT); err != nil {
		t.Fatal(err)
	}
	resumed := time.Now()
	took := waitConnects(t, intruder, web, backendPort, true, resumed, 30*time.Second)
	t.Logf("converged %v after the sweeper resumed", took)
	if c.connects(client, web, backendPort) {
		t.Error("the client is still let in: the deletion the watch missed did not converge")
	}
	if exists(filepath.Join(c.policyDir, policymirror.FileName("default", "web"))) {
		t.Error("the deleted PolicyEndpoint's file is still mirrored")
	}
	logs.waitFor(t, "PolicyEndpoint found deleted at a relist", 5*time.Second)
}

// TestKubernetesStrictUntilSynced: a sweeper that restarts while the API is
// unreachable leaves what the policy directory held from its last run
// marked unsynced. A strict pod added meanwhile opens nothing on the word
// of those files, and gets the API's policy at the first sync; a
// PolicyEndpoint deleted while no sweeper ran is removed then.
func TestKubernetesStrictUntilSynced(t *testing.T) {
	c := newAPICluster(t)
	c.setPluginConf(t, "enforcingMode", "strict")
	client := c.addPod("client", "default")
	// Strict closes the client's egress too, until a policy opens it.
	c.create(t, endpointDoc{name: "client-out", pods: []string{"client"}, isolate: []string{"Egress"},
		egress: []docRule{tcpRule("0.0.0.0/0", backendPort)}}.object(t))
	c.create(t, policyEndpoint(t, "web", []string{webReplicas[0]}, backendPort, client))
	c.create(t, policyEndpoint(t, "gone", []string{webReplicas[0]}, backendPort, client))
	first, logs := c.runSweeper(t, "--interval-min", "1h", "--interval-max", "1h",
		"--policy-source=kubernetes", "--kubeconfig", c.kubeconfig)
	logs.waitFor(t, "policy directory synced with the API", 20*time.Second)
	first.Process.Kill()
	first.Wait()

	// Meanwhile: "gone" deleted, and the API server down. The directory
	// still holds both files from the last run.
	c.delete(t, "gone")
	c.api.StopAPI()
	gone := filepath.Join(c.policyDir, policymirror.FileName("default", "gone"))
	if !exists(gone) {
		t.Fatal("test setup: the stopped sweeper's file is missing")
	}
	logs = c.runKubeSweeper(t)
	logs.waitFor(t, "policy not programmed until the first sync", 10*time.Second)

	web := c.addPod(webReplicas[0], "default")
	netnsutil.Echo(t, web.netns, backendPort)
	if c.connects(client, web, backendPort) {
		t.Fatal("a strict pod was opened by policy files not synced with the API")
	}

	c.api.StartAPI()
	logs.waitFor(t, "policy directory synced with the API", 30*time.Second)
	waitConnects(t, client, web, backendPort, true, time.Now(), 2*time.Second)
	if exists(gone) {
		t.Errorf("%s: deleted while no sweeper ran, still mirrored after the sync", gone)
	}
}

// setPluginConf sets one key of podfence's entry in the cluster's conflist.
func (c *cluster) setPluginConf(t *testing.T, key string, value any) {
	t.Helper()
	var conf map[string]any
	if err := json.Unmarshal(c.confBytes, &conf); err != nil {
		t.Fatal(err)
	}
	plugins := conf["plugins"].([]any)
	plugins[len(plugins)-1].(map[string]any)[key] = value
	data, err := json.Marshal(conf)
	if err != nil {
		t.Fatal(err)
	}
	c.confBytes = data
	if c.list, err = libcni.ConfListFromBytes(data); err != nil {
		t.Fatal(err)
	}
}

// TestFilesSourceClearsUnsyncedMark: a Kubernetes-source sweeper that died
// before its first sync leaves the directory marked unsynced; a sweeper
// that follows files instead takes the files as the truth, removes the
// mark, and programs them.
func TestFilesSourceClearsUnsyncedMark(t *testing.T) {
	c := newCluster(t, attachModes(t)[0])
	client, intruder, web := c.guardedWeb(t)
	if err := policy.MarkUnsynced(c.policyDir); err != nil {
		t.Fatal(err)
	}
	c.renamePolicy(t, "web", backendPolicy(intruder.ip, backendPort))
	_, logs := c.runSweeper(t, "--interval-min", "1h", "--interval-max", "1h")
	logs.waitFor(t, "removed the unsynced mark", 10*time.Second)
	if synced, err := policy.Synced(c.policyDir); err != nil || !synced {
		t.Errorf("Synced = %v, %v after a files-source start, want true", synced, err)
	}
	waitConnects(t, intruder, web, backendPort, true, time.Now(), 2*time.Second)
	if c.connects(client, web, backendPort) {
		t.Error("the client is still let in: the files were not programmed")
	}
}

// TestKubernetesPolicyNotReadable: objects the API admits and podfence
// cannot read whole, through a real API server and the controller's CRD.
// A new object with a domainName rule isolates its pod both ways as it
// says: the rule podfence cannot enforce allows nothing, the others apply.
// A new object whose values do not parse (the CRD leaves cidr free)
// isolates its pod, allowing nothing. Neither is left open to everyone.
func TestKubernetesPolicyNotReadable(t *testing.T) {
	c := newAPICluster(t)
	client := c.addPod("client", "default")
	stranger := c.addPod("stranger", "default")
	fqdn := c.addPod("fqdn", "default")
	typo := c.addPod("typo", "default")
	for _, p := range []*pod{client, fqdn, typo, stranger} {
		netnsutil.Echo(t, p.netns, backendPort)
	}
	logs := c.runKubeSweeper(t)
	c.waitHealthy(t)

	obj := endpointDoc{name: "fqdn", pods: []string{"fqdn"}, isolate: []string{"Ingress", "Egress"},
		ingress: []docRule{tcpRule(client.ip.String()+"/32", backendPort)}}.object(t)
	egress := []any{map[string]any{"domainName": "example.com", "ports": []any{map[string]any{"protocol": "TCP", "port": int64(backendPort)}}}}
	if err := unstructured.SetNestedSlice(obj.Object, egress, "spec", "egress"); err != nil {
		t.Fatal(err)
	}
	c.create(t, obj)
	bad := policyEndpoint(t, "typo", []string{"typo"}, backendPort, client)
	rules, _, _ := unstructured.NestedSlice(bad.Object, "spec", "ingress")
	rules[0].(map[string]any)["cidr"] = "10.0.0.300/32"
	unstructured.SetNestedSlice(bad.Object, rules, "spec", "ingress")
	c.create(t, bad)

	start := time.Now()
	waitConnects(t, stranger, fqdn, backendPort, false, start, 5*time.Second)
	waitConnects(t, client, typo, backendPort, false, start, 5*time.Second)
	if !c.connects(client, fqdn, backendPort) {
		t.Error("the rule podfence can enforce does not let the client in")
	}
	if c.connects(fqdn, client, backendPort) {
		t.Error("the pod's egress, whose one rule is a domainName, is open")
	}
	if c.connects(stranger, typo, backendPort) {
		t.Error("the pod of an object that does not parse is open")
	}
	logs.waitFor(t, `domainName \"example.com\" is not enforced`, 2*time.Second)
	logs.waitFor(t, "PolicyEndpoint does not parse", 2*time.Second)
}

// TestKubernetesPushedOncePerChange: each change of a PolicyEndpoint and
// of a ClusterPolicyEndpoint reaches the identifiers in one push, though
// it reaches the sweeper twice (the mirror's signal, and inotify on the
// policy directory or on its cluster/); each step is seen in traffic, then
// the pushes are counted once the second signal is past.
func TestKubernetesPushedOncePerChange(t *testing.T) {
	c := newAPICluster(t)
	ctx := context.Background()
	c.api.InstallCRDs(ctx, kubeapi.ControllerCRD(t, "clusterpolicyendpoints"))
	_, dyn := c.api.Clients()
	cpes := dyn.Resource(policymirror.ClusterResource)
	client := c.addPod("client", "default")
	other := c.addPod("other", "default")
	web := c.addPod(webReplicas[0], "default")
	netnsutil.Echo(t, web.netns, backendPort)
	logs := c.runKubeSweeper(t)
	logs.waitFor(t, "policy directory synced with the API", 20*time.Second)

	cpe := func(action string) *unstructured.Unstructured {
		d := clusterDoc{name: "admin", tier: "Admin", priority: 10, pods: []*pod{web},
			ingress: []clusterRule{{action: action, cidr: client.ip.String() + "/32"}}}
		obj := &unstructured.Unstructured{}
		if err := json.Unmarshal([]byte(d.String()), &obj.Object); err != nil {
			t.Fatal(err)
		}
		eps, _, _ := unstructured.NestedSlice(obj.Object, "spec", "podSelectorEndpoints")
		for _, ep := range eps {
			ep.(map[string]any)["hostIP"] = nodeIP.String()
		}
		if err := unstructured.SetNestedSlice(obj.Object, eps, "spec", "podSelectorEndpoints"); err != nil {
			t.Fatal(err)
		}
		return obj
	}
	updateCPE := func(obj *unstructured.Unstructured) {
		cur, err := cpes.Get(ctx, obj.GetName(), metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		obj.SetResourceVersion(cur.GetResourceVersion())
		if _, err := cpes.Update(ctx, obj, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	clusterFile := func() bool {
		entries, _ := os.ReadDir(filepath.Join(c.policyDir, policy.ClusterDir))
		for _, e := range entries {
			if !strings.HasPrefix(e.Name(), ".") {
				return true
			}
		}
		return false
	}
	programmed := func() int { return strings.Count(logs.String(), `"msg":"policy programmed"`) }
	// The first sync's pushes (its signal, then inotify's) may still be
	// on their way: counting starts once a second has passed without one
	// (a cold CI run counted the second in the first step's).
	settle := time.Now().Add(10 * time.Second)
	for last, quiet := programmed(), time.Now(); time.Since(quiet) < time.Second && time.Now().Before(settle); time.Sleep(50 * time.Millisecond) {
		if n := programmed(); n != last {
			last, quiet = n, time.Now()
		}
	}
	for _, step := range []struct {
		name   string
		change func()
		done   func() bool // the change is in force
	}{
		{"PolicyEndpoint created", func() { c.create(t, policyEndpoint(t, "web", []string{webReplicas[0]}, backendPort, other)) },
			func() bool { return !c.connects(client, web, backendPort) }},
		{"PolicyEndpoint updated", func() { c.update(t, policyEndpoint(t, "web", []string{webReplicas[0]}, backendPort, client)) },
			func() bool { return c.connects(client, web, backendPort) }},
		{"ClusterPolicyEndpoint created", func() {
			if _, err := cpes.Create(ctx, cpe("Deny"), metav1.CreateOptions{}); err != nil {
				t.Fatal(err)
			}
		}, func() bool { return !c.connects(client, web, backendPort) }},
		{"ClusterPolicyEndpoint updated", func() { updateCPE(cpe("Pass")) },
			func() bool { return c.connects(client, web, backendPort) }},
		{"ClusterPolicyEndpoint deleted", func() {
			if err := cpes.Delete(ctx, cpe("Pass").GetName(), metav1.DeleteOptions{}); err != nil {
				t.Fatal(err)
			}
		}, func() bool { return !clusterFile() }},
	} {
		before := programmed()
		step.change()
		deadline := time.Now().Add(5 * time.Second)
		for !step.done() {
			if time.Now().After(deadline) {
				t.Fatalf("%s: not in force after 5 s; log:\n%s", step.name, logs)
			}
			time.Sleep(20 * time.Millisecond)
		}
		// inotify's signal comes past its quiet time after the mirror's.
		time.Sleep(500 * time.Millisecond)
		if n := programmed() - before; n != 1 {
			t.Errorf("%s: programmed %d times, want once", step.name, n)
		}
	}
}
