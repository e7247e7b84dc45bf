package e2e

import (
	"bufio"
	"bytes"
	"encoding/json"
	"slices"
	"strings"
	"testing"
)

// TestTrace: packets the policy drops reach `trace` from the ring buffer,
// named by pod, direction, reason and the documents that selected the pod;
// --pod filters, and the summary counts what was not reported.
func TestTrace(t *testing.T) {
	c := newCluster(t, attachModes(t)[0])
	client, intruder, web := c.guardedWeb(t)
	if c.connects(intruder, web, backendPort) {
		t.Fatal("the intruder is let in")
	}
	if !c.connects(client, web, backendPort) {
		t.Fatal("the client is kept out")
	}

	out, err := c.sweeper(t, "trace", "--json", "--pin-root", c.pinRoot, "--policy-dir", c.policyDir,
		"--count", "1", "--duration", "10s")
	if err != nil {
		t.Fatal(err)
	}
	lines := jsonLines(t, out)
	if len(lines) != 2 {
		t.Fatalf("trace --count 1 printed %d lines, want an event and a summary:\n%s", len(lines), out)
	}
	type event struct {
		Identifier, Direction, Reason, Protocol, Src, Dst string
		Policy                                            []string
	}
	var ev event
	if err := json.Unmarshal(lines[0], &ev); err != nil || ev.Identifier != webID {
		t.Fatalf("trace --count 1 printed %s (%v), want an event of %s", lines[0], err, webID)
	}

	// The intruder's attempt among what follows (other packets a pod
	// sends unasked may be denied too, at any moment).
	c.connects(intruder, web, backendPort)
	out, err = c.sweeper(t, "trace", "--json", "--pin-root", c.pinRoot, "--policy-dir", c.policyDir, "--duration", "1s")
	if err != nil {
		t.Fatal(err)
	}
	found := false
	for _, line := range jsonLines(t, out) {
		var ev event
		if json.Unmarshal(line, &ev) != nil || ev.Protocol != "TCP" {
			continue
		}
		found = true
		if ev.Identifier != webID || ev.Direction != "ingress" || ev.Reason != "policy-deny" ||
			!strings.HasPrefix(ev.Src, intruder.ip.String()+":") || ev.Dst != web.ip.String()+":8080" {
			t.Errorf("event %+v, want the intruder's TCP to %s:8080 denied at %s's ingress", ev, web.ip, webID)
		}
		if !slices.ContainsFunc(ev.Policy, func(s string) bool { return strings.Contains(s, "web") }) {
			t.Errorf("event names the policy %q, want the document web", ev.Policy)
		}
	}
	if !found {
		t.Errorf("trace printed no TCP event for the intruder's attempt:\n%s", out)
	}

	// Another pod's events are filtered out (and consumed).
	out, err = c.sweeper(t, "trace", "--json", "--pin-root", c.pinRoot, "--policy-dir", c.policyDir,
		"--pod", "client@default", "--duration", "1s")
	if err != nil {
		t.Fatal(err)
	}
	lines = jsonLines(t, out)
	var sum struct {
		Summary struct{ Events int } `json:"summary"`
	}
	if len(lines) != 1 || json.Unmarshal(lines[0], &sum) != nil || sum.Summary.Events != 0 {
		t.Errorf("trace --pod client@default printed %q, want only a summary of 0 events", out)
	}

	// The human form, of a new attempt (the other run read what was
	// left).
	c.connects(intruder, web, backendPort)
	out, err = c.sweeper(t, "trace", "--pin-root", c.pinRoot, "--policy-dir", c.policyDir, "--duration", "1s")
	if err != nil {
		t.Fatal(err)
	}
	want := webID + " ingress TCP " + intruder.ip.String() + ":"
	if !slices.ContainsFunc(strings.Split(string(out), "\n"), func(l string) bool {
		return strings.Contains(l, want) && strings.Contains(l, "no rule of")
	}) {
		t.Errorf("trace printed %q, want a line with %q and the policy that did not allow it", out, want)
	}
}

func jsonLines(t *testing.T, out []byte) [][]byte {
	t.Helper()
	var lines [][]byte
	sc := bufio.NewScanner(bytes.NewReader(out))
	for sc.Scan() {
		if line := bytes.TrimSpace(sc.Bytes()); len(line) > 0 {
			lines = append(lines, append([]byte(nil), line...))
		}
	}
	return lines
}
