package e2e

import (
	"encoding/json"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/podfence/podfence/bpf"
	"github.com/podfence/podfence/pkg/podid"
	"github.com/podfence/podfence/pkg/policy"
	"github.com/podfence/podfence/test/netnsutil"
)

// clusterDoc is a ClusterPolicyEndpoint as the controller writes one
// (testdata/controller in pkg/policy), selecting pods of namespace default.
type clusterDoc struct {
	name     string
	tier     string // Admin or Baseline
	priority int
	pods     []*pod
	ingress  []clusterRule
	egress   []clusterRule
}

// clusterRule is one rule: action on cidr, TCP port (0: every port).
type clusterRule struct {
	action string
	cidr   string
	port   uint16
}

func (d clusterDoc) String() string {
	var eps []map[string]any
	for _, p := range d.pods {
		eps = append(eps, map[string]any{"name": p.name, "namespace": "default", "podIP": p.ip.String()})
	}
	rules := func(rs []clusterRule) []map[string]any {
		out := []map[string]any{}
		for _, r := range rs {
			rule := map[string]any{"action": r.action, "cidr": r.cidr}
			if r.port != 0 {
				rule["ports"] = []any{map[string]any{"protocol": "TCP", "port": r.port}}
			}
			out = append(out, rule)
		}
		return out
	}
	b, err := json.Marshal(map[string]any{
		"apiVersion": "networking.k8s.aws/v1alpha1",
		"kind":       "ClusterPolicyEndpoint",
		"metadata":   map[string]any{"name": d.name + "-abcde"},
		"spec": map[string]any{
			"policyRef": map[string]any{"name": d.name}, "tier": d.tier, "priority": d.priority,
			"subject": map[string]any{"namespaces": map[string]any{}}, "podSelectorEndpoints": eps,
			"ingress": rules(d.ingress), "egress": rules(d.egress),
		},
	})
	if err != nil {
		panic(err)
	}
	return string(b)
}

// writeCluster puts a ClusterPolicyEndpoint into the policy directory's
// cluster/ as the sweeper's mirror does: a temporary file renamed into place.
func (c *cluster) writeCluster(t *testing.T, d clusterDoc) {
	t.Helper()
	dir := filepath.Join(c.policyDir, policy.ClusterDir)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	tmp := filepath.Join(dir, "."+d.name+".tmp")
	if err := os.WriteFile(tmp, []byte(d.String()), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, filepath.Join(dir, "cpe_"+d.name+".json")); err != nil {
		t.Fatal(err)
	}
}

func (c *cluster) removeCluster(t *testing.T, name string) {
	t.Helper()
	if err := os.Remove(filepath.Join(c.policyDir, policy.ClusterDir, "cpe_"+name+".json")); err != nil {
		t.Fatal(err)
	}
}

// checkTierTools: with the Admin policy "guard" (priority 10) denying
// client's TCP to web's backendPort, why names the tier, the policy, its
// priority and the rule; trace names them for the denied packets; ls shows
// the Admin tier on web's ingress.
func (c *cluster) checkTierTools(t *testing.T, web, client *pod) {
	t.Helper()
	type rule struct {
		Tier, Policy, Action, Source string
		Priority                     int
	}
	wantRule := func(what string, r *rule) {
		t.Helper()
		if r == nil || r.Tier != "Admin" || r.Policy != "guard" || r.Priority != 10 || r.Action != "Deny" ||
			!strings.Contains(r.Source, "cpe_guard.json") {
			t.Errorf("%s names %+v, want the Admin tier's guard, priority 10, Deny, in cpe_guard.json", what, r)
		}
	}
	out, err := c.sweeper(t, "why", "--json", "--pin-root", c.pinRoot, "--policy-dir", c.policyDir,
		"--pod", web.name+".default", "--from", client.ip.String(), fmt.Sprintf("%d/tcp", backendPort))
	if err != nil {
		t.Fatal(err)
	}
	var w struct {
		Verdict, Reason string
		Tier            *rule
	}
	if err := json.Unmarshal(out, &w); err != nil {
		t.Fatalf("%v: %s", err, out)
	}
	if w.Verdict != "deny" || w.Reason != bpf.ReasonAdminDeny.String() {
		t.Errorf("why: %s (%s), want deny (admin-deny)", w.Verdict, w.Reason)
	}
	wantRule("why", w.Tier)

	c.connects(client, web, backendPort)
	out, err = c.sweeper(t, "trace", "--json", "--pin-root", c.pinRoot, "--policy-dir", c.policyDir, "--duration", "1s")
	if err != nil {
		t.Fatal(err)
	}
	found := false
	for _, line := range jsonLines(t, out) {
		var ev struct {
			Reason, Tier string
			Rule         *rule
		}
		if json.Unmarshal(line, &ev) != nil || ev.Reason != bpf.ReasonAdminDeny.String() {
			continue
		}
		found = true
		if ev.Tier != "Admin" {
			t.Errorf("trace: an admin-deny event of tier %q", ev.Tier)
		}
		wantRule("trace", ev.Rule)
	}
	if !found {
		t.Errorf("trace shows no admin-deny event for the client's attempts:\n%s", out)
	}

	out, err = c.sweeper(t, "ls", "--json", "--pin-root", c.pinRoot)
	if err != nil {
		t.Fatal(err)
	}
	var ls []struct {
		Identifier string
		Tiers      []string
	}
	if err := json.Unmarshal(out, &ls); err != nil {
		t.Fatal(err)
	}
	for _, v := range ls {
		want := []string{}
		if v.Identifier == webID {
			want = []string{"admin/ingress"}
		}
		if !slices.Equal(v.Tiers, want) {
			t.Errorf("ls: %s has tiers %q, want %q", v.Identifier, v.Tiers, want)
		}
	}
}

func host(p *pod) string { return netip.PrefixFrom(p.ip, p.ip.BitLen()).String() }

// TestClusterTiers: with the sweeper running, ClusterPolicyEndpoint files
// change traffic as the tiers' semantics say (policy.Decide): an Admin
// Deny over a NetworkPolicy allow cuts the established connection it
// revokes; an Admin Pass of higher priority hands the client back to the
// NetworkPolicy; an Admin Accept lets in whom the NetworkPolicy denies; a
// Baseline deny-all is not consulted for a pod a NetworkPolicy isolates,
// denies a pod none does, and lets the node's own addresses through
// (kubelet probes), and a Baseline Accept of higher priority opens one
// client. Each change bumps the generation, and the verdicts are counted
// under the tier's reasons.
func TestClusterTiers(t *testing.T) {
	c := newCluster(t, attachModes(t)[0])
	client, intruder, web := c.guardedWeb(t)
	other := c.addPod("other", "default")
	netnsutil.Echo(t, other.netns, backendPort)
	webIdent, otherID := podid.ID(webID), podid.ID("other@default")
	conn, err := dialFrom(client.netns, netip.AddrPortFrom(web.ip, backendPort))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	if err := conn.roundTrip("before"); err != nil {
		t.Fatal(err)
	}
	c.runSweeper(t, "--interval-min", "1h", "--interval-max", "1h")
	c.waitHealthy(t)

	// Admin Deny over the NetworkPolicy's allow: the connection is cut.
	gen, changed := c.generation(t, webIdent), time.Now()
	c.writeCluster(t, clusterDoc{name: "guard", tier: "Admin", priority: 10, pods: []*pod{web},
		ingress: []clusterRule{{"Deny", host(client), backendPort}}})
	t.Logf("admin deny programmed %v after the write", c.waitGeneration(t, webIdent, gen, changed))
	if err := conn.roundTrip("after the admin deny"); err == nil {
		t.Fatal("the connection an Admin Deny revokes still carries data")
	}
	if c.connects(client, web, backendPort) {
		t.Fatal("the client connects through an Admin Deny")
	}
	if n := c.counters(t, webIdent)[policy.Ingress][bpf.ReasonAdminDeny]; n == 0 {
		t.Error("no ingress packet counted as admin-deny")
	}
	c.checkTierTools(t, web, client)

	// A Pass of higher priority: the NetworkPolicy decides again.
	gen, changed = c.generation(t, webIdent), time.Now()
	c.writeCluster(t, clusterDoc{name: "guard", tier: "Admin", priority: 5, pods: []*pod{web},
		ingress: []clusterRule{{"Pass", host(client), 0}}})
	c.writeCluster(t, clusterDoc{name: "guard-deny", tier: "Admin", priority: 10, pods: []*pod{web},
		ingress: []clusterRule{{"Deny", host(client), backendPort}}})
	c.waitGeneration(t, webIdent, gen, changed)
	waitConnects(t, client, web, backendPort, true, changed, 2*time.Second)
	if c.connects(intruder, web, backendPort) {
		t.Error("the intruder connects: the NetworkPolicy denies it and no Admin rule accepts it")
	}

	// An Admin Accept over the NetworkPolicy's deny.
	changed = time.Now()
	c.writeCluster(t, clusterDoc{name: "let-in", tier: "Admin", priority: 1, pods: []*pod{web},
		ingress: []clusterRule{{"Accept", host(intruder), 0}}})
	waitConnects(t, intruder, web, backendPort, true, changed, 2*time.Second)
	if n := c.counters(t, webIdent)[policy.Ingress][bpf.ReasonAdminAccept]; n == 0 {
		t.Error("no ingress packet counted as admin-accept")
	}
	for _, name := range []string{"guard", "guard-deny", "let-in"} {
		c.removeCluster(t, name)
	}

	// Baseline deny-all: web is isolated by its NetworkPolicy, other by
	// nothing but the Baseline.
	gen, changed = c.generation(t, otherID), time.Now()
	c.writeCluster(t, clusterDoc{name: "baseline", tier: "Baseline", priority: 10, pods: []*pod{web, other},
		ingress: []clusterRule{{"Deny", "0.0.0.0/0", 0}}})
	c.waitGeneration(t, otherID, gen, changed)
	waitConnects(t, intruder, web, backendPort, false, changed, 2*time.Second)
	if !c.connects(client, web, backendPort) {
		t.Error("a Baseline Deny overrode the NetworkPolicy that isolates web")
	}
	if c.connects(client, other, backendPort) {
		t.Error("the client reaches other through a Baseline deny-all")
	}
	if !netnsutil.Connects(t, c.node, netip.AddrPortFrom(other.ip, backendPort), 300*time.Millisecond, 3) {
		t.Error("the node cannot reach other under a Baseline deny-all: kubelet probes would fail")
	}
	if n := c.counters(t, otherID)[policy.Ingress][bpf.ReasonBaselineDeny]; n == 0 {
		t.Error("no ingress packet of other counted as baseline-deny")
	}

	// A Baseline Accept of higher priority opens the client alone.
	changed = time.Now()
	c.writeCluster(t, clusterDoc{name: "baseline-client", tier: "Baseline", priority: 5, pods: []*pod{other},
		ingress: []clusterRule{{"Accept", host(client), backendPort}}})
	waitConnects(t, client, other, backendPort, true, changed, 2*time.Second)
	if c.connects(intruder, other, backendPort) {
		t.Error("the intruder reaches other: only the client's Baseline Accept should open it")
	}

	// cluster/ removed: no cluster policy applies; made again, it is
	// followed again.
	changed = time.Now()
	if err := os.RemoveAll(filepath.Join(c.policyDir, policy.ClusterDir)); err != nil {
		t.Fatal(err)
	}
	waitConnects(t, intruder, other, backendPort, true, changed, 2*time.Second)
	changed = time.Now()
	c.writeCluster(t, clusterDoc{name: "back", tier: "Baseline", priority: 10, pods: []*pod{other},
		ingress: []clusterRule{{"Deny", host(intruder), 0}}})
	waitConnects(t, intruder, other, backendPort, false, changed, 2*time.Second)
	changed = time.Now()
	c.writeCluster(t, clusterDoc{name: "back", tier: "Baseline", priority: 10, pods: []*pod{other},
		ingress: []clusterRule{{"Deny", host(client), 0}}})
	waitConnects(t, intruder, other, backendPort, true, changed, 2*time.Second)
}

// TestClusterEgressThroughService: an Admin egress Deny of a backend's
// address stops the client's connections to that address and, with the
// Service's frontend in the services map, those through the Service in
// front of it, judged on the backend after the DNAT. Without the frontend
// (a kernel without the conntrack kfuncs, a node whose sweeper follows no
// Services) the Service is judged on its address, which the Deny does not
// name: that way round it still connects (README, "Cluster-wide tiers").
// The backend's own ingress rules, judged after the DNAT, hold either way.
func TestClusterEgressThroughService(t *testing.T) {
	c := newCluster(t, attachModes(t)[0])
	client, _, web := c.vipScene(t)
	// The client's NetworkPolicy also allows the backend directly, so
	// that only the Admin tier can deny it.
	c.writePolicy("client", egressOnly("client", tcpRule(serviceVIP.String(), servicePort), tcpRule(host(web), backendPort)))
	vip := netip.AddrPortFrom(serviceVIP.Addr(), servicePort)
	c.runSweeper(t, "--interval-min", "1h", "--interval-max", "1h")
	c.waitHealthy(t)

	if !c.connects(client, web, backendPort) {
		t.Fatal("before any cluster policy, the client does not reach web directly")
	}
	changed := time.Now()
	c.writeCluster(t, clusterDoc{name: "no-web", tier: "Admin", priority: 10, pods: []*pod{client},
		egress: []clusterRule{{"Deny", host(web), 0}}})
	waitConnects(t, client, web, backendPort, false, changed, 2*time.Second)
	if !netnsutil.Connects(t, client.netns, vip, 300*time.Millisecond, 3) {
		t.Fatal("without the frontend in the services map, the client no longer reaches web through its Service")
	}
	if bpf.AfterNATSupported() {
		c.setServices(t, bpf.Frontend{Addr: vip.Addr(), Port: vip.Port(), Proto: 6})
		if netnsutil.Connects(t, client.netns, vip, 300*time.Millisecond, 2) {
			t.Fatal("an Admin egress Deny of the backend does not stop the client's connections through its Service")
		}
		if n := c.counters(t, "client@default")[policy.Egress][bpf.ReasonAdminDeny]; n == 0 {
			t.Error("the Service's connections were refused without counting admin-deny")
		}
		// why says that the ClusterIP is judged on its backend.
		out, err := c.sweeper(t, "why", "--json", "--pin-root", c.pinRoot, "--policy-dir", c.policyDir,
			"--pod", client.name+".default", "--to", vip.Addr().String(), fmt.Sprintf("%d/tcp", vip.Port()))
		if err != nil {
			t.Fatal(err)
		}
		var w struct {
			ServiceFrontend bool `json:"service_frontend"`
			Backends        []struct {
				Backend, Verdict, Reason string
			} `json:"backends"`
		}
		if err := json.Unmarshal(out, &w); err != nil || !w.ServiceFrontend {
			t.Errorf("why --to %s: %s (%v), want service_frontend", vip, out, err)
		}
		// The refused connections' conntrack entries name the backend.
		want := netip.AddrPortFrom(web.ip, backendPort).String()
		if len(w.Backends) != 1 || w.Backends[0].Backend != want || w.Backends[0].Verdict != "deny" || w.Backends[0].Reason != "admin-deny" {
			t.Errorf("why --to %s: backends %+v, want %s denied by admin-deny", vip, w.Backends, want)
		}
		c.setServices(t)
	}

	c.writeCluster(t, clusterDoc{name: "guard-web", tier: "Admin", priority: 10, pods: []*pod{web},
		ingress: []clusterRule{{"Deny", host(client), 0}}})
	deadline := time.Now().Add(2 * time.Second)
	for netnsutil.Connects(t, client.netns, vip, 100*time.Millisecond, 1) {
		if time.Now().After(deadline) {
			t.Fatal("an Admin ingress Deny on the backend does not stop the client's connections through the Service")
		}
	}
}

// TestClusterTiersAtAdd: a pod that a ClusterPolicyEndpoint already
// selects is fenced by it from its ADD, with no sweeper running; and a
// cluster file that does not parse fails the ADD, naming it, and leaves
// nothing behind.
func TestClusterTiersAtAdd(t *testing.T) {
	c := newCluster(t, attachModes(t)[0])
	client := c.addPod("client", "default")
	late := &pod{name: "late", ip: netip.MustParseAddr("10.0.0.99")} // its name and address, before its ADD
	c.writeCluster(t, clusterDoc{name: "late", tier: "Baseline", priority: 1, pods: []*pod{late},
		ingress: []clusterRule{{"Deny", host(client), 0}}})
	late = c.addPod("late", "default")
	netnsutil.Echo(t, late.netns, backendPort)
	if c.connects(client, late, backendPort) {
		t.Error("the client reaches a pod whose Baseline denies it from its ADD on")
	}
	if n := c.counters(t, "late@default")[policy.Ingress][bpf.ReasonBaselineDeny]; n == 0 {
		t.Error("no packet counted as baseline-deny")
	}

	broken := filepath.Join(c.policyDir, policy.ClusterDir, "cpe_broken.json")
	if err := os.WriteFile(broken, []byte(`{"apiVersion": "networking.k8s.aws/v1alpha1", "kind": "ClusterPolicyEndpoint", "spec": {"tier": "Sideways"}}`), 0o644); err != nil {
		t.Fatal(err)
	}
	_, err := c.tryAddPod("refused", "default")
	if err == nil || !strings.Contains(err.Error(), "cpe_broken.json") {
		t.Fatalf("ADD with a cluster file that does not parse: %v, want an error naming it", err)
	}
	if exists(c.identifierDir("refused@default")) {
		t.Error("the refused ADD left its identifier's pins")
	}
}
