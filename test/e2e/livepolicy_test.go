package e2e

import (
	"encoding/json"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/podfence/podfence/bpf"
	"github.com/podfence/podfence/pkg/podid"
	"github.com/podfence/podfence/test/netnsutil"
)

// renamePolicy writes a policy file the way editors and ConfigMap updates
// do: a hidden temporary file renamed over the old one.
func (c *cluster) renamePolicy(t testing.TB, name, doc string) {
	t.Helper()
	tmp := filepath.Join(c.policyDir, "."+name+".tmp")
	if err := os.WriteFile(tmp, []byte(doc), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, filepath.Join(c.policyDir, name+".yaml")); err != nil {
		t.Fatal(err)
	}
}

func (c *cluster) generation(t testing.TB, id podid.ID) uint32 {
	t.Helper()
	info, err := bpf.InspectIdentifier(c.identifierDir(string(id)), id)
	if err != nil {
		t.Fatal(err)
	}
	return info.Generation
}

// waitGeneration waits up to a second for id's generation to leave old,
// and returns how long it took.
func (c *cluster) waitGeneration(t *testing.T, id podid.ID, old uint32, since time.Time) time.Duration {
	t.Helper()
	for c.generation(t, id) == old {
		if time.Since(since) > time.Second {
			t.Fatalf("%s still at generation %d a second after the policy changed", id, old)
		}
		time.Sleep(5 * time.Millisecond)
	}
	return time.Since(since)
}

// guardedWeb adds a client, an intruder, and a web pod with an echo server
// on backendPort that the policy file "web" opens to the client only.
func (c *cluster) guardedWeb(t *testing.T) (client, intruder, web *pod) {
	t.Helper()
	client = c.addPod("client", "default")
	intruder = c.addPod("intruder", "default")
	c.writePolicy("web", backendPolicy(client.ip, backendPort))
	web = c.addPod(webReplicas[0], "default")
	netnsutil.Echo(t, web.netns, backendPort)
	return client, intruder, web
}

// TestSweeperRunLivePolicy: `run` follows the policy directory. A broken
// update of a document keeps its last good version and says so (log,
// metric, ls); a policy that revokes an established connection cuts it,
// by traffic, within a second of the change; removing the policy returns
// the pod to standard mode's default, open.
func TestSweeperRunLivePolicy(t *testing.T) {
	c := newCluster(t, attachModes(t)[0])
	client, intruder, web := c.guardedWeb(t)
	id := podid.ID(webID)
	backend := web.ip.String() + ":8080"
	conn, err := dialFrom(client.netns, mustAddrPort(backend))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	if err := conn.roundTrip("before"); err != nil {
		t.Fatal(err)
	}
	_, logs := c.runSweeper(t, "--interval-min", "1h", "--interval-max", "1h")
	c.waitHealthy(t)

	// A half-edited document: its last good version stays in force, and
	// the node says so (log, metrics, ls).
	gen := c.generation(t, id)
	c.renamePolicy(t, "web", "apiVersion: networking.k8s.aws/v1alpha1\nkind: PolicyEndpoint\nspec: [unclosed\n")
	logs.waitFor(t, "its last good version is enforced", 2*time.Second)
	page, err := c.get("/metrics")
	if err != nil {
		t.Fatal(err)
	}
	if v := metric(t, page, "podfence_policy_documents_invalid"); v != "1" {
		t.Errorf("podfence_policy_documents_invalid %s after a broken document, want 1", v)
	}
	if v := metric(t, page, "podfence_policy_valid"); v != "1" {
		t.Errorf("podfence_policy_valid %s: the directory itself could be read", v)
	}
	out, err := c.sweeper(t, "ls", "--json", "--pin-root", c.pinRoot)
	if err != nil {
		t.Fatal(err)
	}
	var ls []struct {
		Identifier     string   `json:"identifier"`
		Generation     uint32   `json:"generation"`
		PolicyProblems []string `json:"policy_problems"`
	}
	if err := json.Unmarshal(out, &ls); err != nil {
		t.Fatal(err)
	}
	for _, v := range ls {
		if len(v.PolicyProblems) != 1 || !strings.Contains(v.PolicyProblems[0], "web.yaml#0") ||
			!strings.Contains(v.PolicyProblems[0], "last good version") {
			t.Errorf("ls shows %q for %s, want the broken document and its last good version", v.PolicyProblems, v.Identifier)
		}
	}
	if got := c.generation(t, id); got != gen {
		t.Errorf("an invalid document moved the generation from %d to %d", gen, got)
	}
	if err := conn.roundTrip("after the invalid document"); err != nil {
		t.Fatalf("an invalid document broke an allowed connection: %v", err)
	}
	if c.connects(intruder, web, backendPort) {
		t.Fatal("an invalid document opened the pod")
	}

	// A policy that no longer lets the client in: the established
	// connection is cut.
	changed := time.Now()
	c.renamePolicy(t, "web", backendPolicy(intruder.ip, backendPort))
	took := c.waitGeneration(t, id, gen, changed)
	t.Logf("revoking policy programmed %v after the rename", took)
	if err := conn.roundTrip("after revocation"); err == nil {
		t.Fatal("the revoked connection still carries data")
	}
	if !c.connects(intruder, web, backendPort) {
		t.Error("the new policy does not let the intruder in")
	}
	if _, err := os.Readlink(filepath.Join(c.pinRoot, "policy-error")); !os.IsNotExist(err) {
		t.Errorf("the policy error is still recorded after a valid document: %v", err)
	}

	// No policy selects the pod any more: standard mode is open.
	gen = c.generation(t, id)
	changed = time.Now()
	if err := os.Remove(filepath.Join(c.policyDir, "web.yaml")); err != nil {
		t.Fatal(err)
	}
	c.waitGeneration(t, id, gen, changed)
	if !c.connects(client, web, backendPort) {
		t.Error("the pod is not open once no policy selects it")
	}
}

func mustAddrPort(s string) netip.AddrPort { return netip.MustParseAddrPort(s) }

// TestSweeperRunPolicyDirRemoved: the policy directory removed under a
// running sweeper holds no documents: the pods return to their default,
// and documents written into the directory made again are followed.
func TestSweeperRunPolicyDirRemoved(t *testing.T) {
	c := newCluster(t, attachModes(t)[0])
	client := c.addPod("client", "default")
	c.writePolicy("web", backendPolicy(netip.MustParseAddr("10.1.2.3"), backendPort))
	web := c.addPod(webReplicas[0], "default")
	netnsutilListen(t, web, backendPort)
	_, logs := c.runSweeper(t, "--interval-min", "1h", "--interval-max", "1h")
	c.waitHealthy(t)
	if c.connects(client, web, backendPort) {
		t.Fatal("the policy does not hold before the test")
	}

	id := podid.ID(webID)
	gen := c.generation(t, id)
	changed := time.Now()
	if err := os.RemoveAll(c.policyDir); err != nil {
		t.Fatal(err)
	}
	c.waitGeneration(t, id, gen, changed)
	if !c.connects(client, web, backendPort) {
		t.Fatal("the pod stayed closed after its policy directory went")
	}

	logs.waitFor(t, "policy directory watched again", 2*time.Second)
	gen = c.generation(t, id)
	changed = time.Now()
	c.renamePolicy(t, "web", backendPolicy(netip.MustParseAddr("10.1.2.3"), backendPort))
	c.waitGeneration(t, id, gen, changed)
	if c.connects(client, web, backendPort) {
		t.Error("a policy written into the re-made directory is not enforced")
	}
}
