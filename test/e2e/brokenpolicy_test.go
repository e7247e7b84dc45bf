package e2e

import (
	"encoding/json"
	"os"
	"slices"
	"strings"
	"testing"

	"github.com/podfence/podfence/test/netnsutil"
)

// TestBrokenPolicyDocuments: a document podfence cannot read affects only
// the pods it selects, never leaves them more open than it says, and is
// reported. In the files source, through the runtime's ADDs and the
// sweeper's apply:
//   - a new document that does not parse closes the pods it names in the
//     directions it names (its selection and isolation parse), and every
//     other pod is programmed and added as usual;
//   - a rule with a domainName allows nothing, while the document's
//     isolation and its other rules apply;
//   - a broken update of a document the sweeper saw whole keeps its last
//     good version in force;
//   - the plugin's log, ls and why name what is not enforced as written.
func TestBrokenPolicyDocuments(t *testing.T) {
	c := newCluster(t, attachModes(t)[0])
	client := c.addPod("client", "default")
	server := c.addPod("server", "default")
	netnsutil.Echo(t, server.netns, backendPort)
	c.writePolicy("web", backendPolicy(client.ip, backendPort))
	c.writePolicy("other", `apiVersion: networking.k8s.aws/v1alpha1
kind: PolicyEndpoint
metadata: {name: other, namespace: default}
spec:
  podIsolation: [Ingress]
  podSelectorEndpoints: [{name: other, namespace: default}]
  ingress: [{cidr: 10.0.0.300/8}]
`)
	c.writePolicy("fqdn", `apiVersion: networking.k8s.aws/v1alpha1
kind: PolicyEndpoint
metadata: {name: fqdn, namespace: default}
spec:
  podIsolation: [Egress]
  podSelectorEndpoints: [{name: fqdn, namespace: default}]
  egress:
  - {domainName: example.com, ports: [{protocol: TCP, port: 8080}]}
  - {cidr: `+server.ip.String()+`, ports: [{protocol: TCP, port: 8080}]}
`)
	// Every ADD proceeds: one bad document does not stop pod creation.
	web := c.addPod(webReplicas[0], "default")
	other := c.addPod("other", "default")
	fqdn := c.addPod("fqdn", "default")
	for _, p := range []*pod{web, other, client, fqdn} {
		netnsutil.Echo(t, p.netns, backendPort)
	}

	for _, x := range []struct {
		what     string
		from, to *pod
		want     bool
	}{
		{"the client to web, which a valid document lets in", client, web, true},
		{"a stranger to web", server, web, false},
		{"the client to the pod of a broken new document", client, other, false},
		{"fqdn to the server its cidr rule allows", fqdn, server, true},
		{"fqdn to the client, which only its domainName rule could allow", fqdn, client, false},
		{"the client to fqdn, whose ingress is open", client, fqdn, true},
	} {
		if got := c.connects(x.from, x.to, backendPort); got != x.want {
			t.Errorf("%s: connects %v, want %v", x.what, got, x.want)
		}
	}
	plog, err := os.ReadFile(c.logFile)
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"other.yaml#0 (default/other): does not parse", `domainName \"example.com\" is not enforced`} {
		if !strings.Contains(string(plog), want) {
			t.Errorf("the plugin's log does not say %q", want)
		}
	}

	// The sweeper programs the directory, records web's file as its last
	// good version and lists what is not enforced.
	c.applyPolicies()
	problems := c.policyProblems(t)
	if len(problems) != 2 || !slices.ContainsFunc(problems, func(p string) bool {
		return strings.Contains(p, "other.yaml#0") && strings.Contains(p, "allowing nothing")
	}) ||
		!slices.ContainsFunc(problems, func(p string) bool {
			return strings.Contains(p, "fqdn.yaml#0") && strings.Contains(p, "spec.egress[0]")
		}) {
		t.Errorf("ls shows %q, want the broken document and the domainName rule", problems)
	}
	out, err := c.sweeper(t, "why", "--json", "--pin-root", c.pinRoot, "--policy-dir", c.policyDir, "--pod", "fqdn",
		"--to", client.ip.String(), "8080/tcp")
	if err != nil {
		t.Fatal(err)
	}
	var why struct {
		Verdict     string
		Explanation struct {
			NotAsWritten []string `json:"not_enforced_as_written"`
		}
	}
	if err := json.Unmarshal(out, &why); err != nil || why.Verdict != "deny" || len(why.Explanation.NotAsWritten) != 1 {
		t.Errorf("why: %s (%v), want a deny that names the domainName rule", out, err)
	}

	// A typo in an update of web's document: its last good version stays.
	c.writePolicy("web", strings.Replace(backendPolicy(client.ip, backendPort), "/32", "/33", 1))
	c.applyPolicies()
	if !c.connects(client, web, backendPort) || c.connects(server, web, backendPort) {
		t.Error("a broken update changed what web enforces")
	}
	if problems := c.policyProblems(t); !slices.ContainsFunc(problems, func(p string) bool {
		return strings.Contains(p, "web.yaml#0") && strings.Contains(p, "last good version")
	}) {
		t.Errorf("ls shows %q, want web's broken update on its last good version", problems)
	}
	// The fix is enforced, and the report goes.
	c.writePolicy("web", backendPolicy(server.ip, backendPort))
	c.applyPolicies()
	if c.connects(client, web, backendPort) || !c.connects(server, web, backendPort) {
		t.Error("the fixed document is not enforced")
	}
	if problems := c.policyProblems(t); slices.ContainsFunc(problems, func(p string) bool { return strings.Contains(p, "web.yaml") }) {
		t.Errorf("ls still shows %q", problems)
	}
}

// policyProblems is what ls says the policy directory holds that is not
// enforced as written.
func (c *cluster) policyProblems(t *testing.T) []string {
	t.Helper()
	out, err := c.sweeper(t, "ls", "--json", "--pin-root", c.pinRoot)
	if err != nil {
		t.Fatal(err)
	}
	var views []struct {
		Problems []string `json:"policy_problems"`
	}
	if err := json.Unmarshal(out, &views); err != nil || len(views) == 0 {
		t.Fatalf("ls --json: %s (%v)", out, err)
	}
	return views[0].Problems
}
