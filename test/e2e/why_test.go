package e2e

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/podfence/podfence/bpf"
)

// whyOut is the part of `why --json` the tests read.
type whyOut struct {
	Identifier, Direction, Verdict, Reason string
	Explanation                            struct {
		Documents []string
		Allowing  []struct {
			Name string
			Rule int
			CIDR string
		}
	}
}

// TestWhy: `why` answers what the live datapath does for a pod's
// connection, names the rule, and creates no conntrack entry.
func TestWhy(t *testing.T) {
	c := newCluster(t, attachModes(t)[0])
	client, intruder, web := c.guardedWeb(t)
	why := func(args ...string) whyOut {
		t.Helper()
		out, err := c.sweeper(t, append([]string{"why", "--json", "--pin-root", c.pinRoot, "--policy-dir", c.policyDir,
			"--pod", webReplicas[0] + ".default"}, args...)...)
		if err != nil {
			t.Fatal(err)
		}
		var w whyOut
		if err := json.Unmarshal(out, &w); err != nil {
			t.Fatalf("%v: %s", err, out)
		}
		return w
	}
	// Counters are not compared here: the pods' own IPv6 multicast
	// chatter moves them meanwhile. bpf's TestTrialMatchesReference shows
	// that trials leave them alone; this checks the IPv4 conntrack table,
	// which only the test's connections touch.
	before := c.ctEntries(t)

	allowed := why("--from", client.ip.String(), "8080/tcp")
	if allowed.Identifier != webID || allowed.Direction != "ingress" || allowed.Verdict != "allow" || allowed.Reason != "policy-allow" {
		t.Errorf("client -> web:8080: %+v, want allow (policy-allow) at %s's ingress", allowed, webID)
	}
	if a := allowed.Explanation.Allowing; len(a) != 1 || a[0].Name != "web" || a[0].Rule != 0 || a[0].CIDR != client.ip.String()+"/32" {
		t.Errorf("allowing rules %+v, want rule 0 of web, %s/32", a, client.ip)
	}
	denied := why("--from", intruder.ip.String(), "8080/tcp")
	if denied.Verdict != "deny" || denied.Reason != "policy-deny" || len(denied.Explanation.Allowing) != 0 ||
		len(denied.Explanation.Documents) != 1 {
		t.Errorf("intruder -> web:8080: %+v, want deny (policy-deny) by the one selecting document", denied)
	}
	if port := why("--from", client.ip.String(), "9090/tcp"); port.Verdict != "deny" {
		t.Errorf("client -> web:9090: %+v, want deny", port)
	}
	if out := why("--to", client.ip.String(), "53/udp"); out.Direction != "egress" || out.Verdict != "deny" {
		t.Errorf("web -> client:53/udp: %+v, want deny at egress (isolated, no rule)", out)
	}

	// Side effects: none. The datapath agrees when the packets are real.
	if after := c.ctEntries(t); after != before {
		t.Errorf("why changed the conntrack table: %d entries, then %d", before, after)
	}
	if !c.connects(client, web, backendPort) || c.connects(intruder, web, backendPort) {
		t.Error("the datapath disagrees with why")
	}

	// The human form names the rule.
	out, err := c.sweeper(t, "why", "--pin-root", c.pinRoot, "--policy-dir", c.policyDir,
		"--pod", webID, "--from", client.ip.String(), "8080/tcp")
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(out), "allow (policy-allow)") || !strings.Contains(string(out), "allowed by default/web") {
		t.Errorf("why printed %q", out)
	}

	// Bad input: a clear usage error.
	for _, args := range [][]string{
		{"--from", "10.0.0.1", "8080/icmp"},
		{"--from", "10.0.0.1", "--to", "10.0.0.2", "80/tcp"},
		{"--from", "not-an-ip", "80/tcp"},
		{"--from", "10.0.0.1", "0/tcp"},
	} {
		if _, err := c.sweeper(t, append([]string{"why", "--pin-root", c.pinRoot, "--pod", webID}, args...)...); err == nil ||
			!strings.Contains(err.Error(), "exit status 2") {
			t.Errorf("why %q: %v, want a usage error", args, err)
		}
	}
}

// ctEntries counts the node's IPv4 eBPF conntrack entries (the pods' IPv6
// link-local chatter comes and goes on its own).
func (c *cluster) ctEntries(t *testing.T) int {
	t.Helper()
	g, err := bpf.OpenGlobal(globalDir(c.pinRoot), bpf.GlobalOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer g.Close()
	n := 0
	if err := g.ScanConntrack(func(b []bpf.CTEntry) error {
		for _, e := range b {
			if e.Key.Family == 4 {
				n++
			}
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	return n
}
