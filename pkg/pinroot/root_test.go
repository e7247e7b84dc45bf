package pinroot

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/podfence/podfence/pkg/membership"
	"github.com/podfence/podfence/pkg/podid"
	"github.com/podfence/podfence/pkg/policy"
	"github.com/podfence/podfence/test/kernel"
)

const testID podid.ID = "web-7f65cc6544@default"

// web is a member record of testID; no veth carries it, which is what a
// pod whose veth went looks like, and what RemoveMember and the
// collections must handle.
var web = membership.Member{ContainerID: "c1", IfName: "eth0", HostVeth: "veth-gone-c1", HostIfindex: 1 << 30, AttachMode: "tcx"}

func openNode(t *testing.T) *Root {
	t.Helper()
	n, err := Open(kernel.PinRoot(t), Options{Create: true})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { n.Close() })
	return n
}

// withPins makes testID's pins, with the given members recorded.
func withPins(t *testing.T, n *Root, members ...membership.Member) {
	t.Helper()
	withPinsOf(t, n, testID, members...)
}

// withPinsOf makes id's pins, with the given members recorded.
func withPinsOf(t *testing.T, n *Root, id podid.ID, members ...membership.Member) {
	t.Helper()
	h, err := n.LockOrCreate(id)
	if err != nil {
		t.Fatal(err)
	}
	defer h.Unlock()
	ident, _, err := h.Open()
	if err != nil {
		t.Fatal(err)
	}
	ident.Close()
	for _, m := range members {
		if err := h.Put(m); err != nil {
			t.Fatal(err)
		}
	}
}

// The handle removes pins only when no member is left, and Lock does not
// bring back an identifier that went.
func TestIdentifierRemoval(t *testing.T) {
	n := openNode(t)
	withPins(t, n, web)
	h, err := n.Lock(testID)
	if err != nil {
		t.Fatal(err)
	}
	if removed, err := h.RemoveIfUnused(); err != nil || removed {
		t.Fatalf("RemoveIfUnused with a member: removed %v, %v; want the pins kept", removed, err)
	}
	if _, err := h.Inspect(); err != nil {
		t.Fatalf("Inspect after a refused removal: %v", err)
	}
	members, removed, err := h.RemoveAll()
	h.Unlock()
	if err != nil || members != 1 || !removed {
		t.Fatalf("RemoveAll: %d members, removed %v, %v; want 1, true", members, removed, err)
	}
	if _, err := os.Stat(h.Dir()); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("the identifier's directory after RemoveAll: %v, want it gone", err)
	}
	if _, err := n.Lock(testID); !errors.Is(err, membership.ErrNoIdentifier) {
		t.Fatalf("Lock after removal: %v, want ErrNoIdentifier", err)
	}
}

func TestCollect(t *testing.T) {
	other := web
	other.ContainerID = "c2"
	for _, tc := range []struct {
		name        string
		stale       map[string]bool
		wantMembers int
		wantGone    bool
	}{
		{"nothing stale", nil, 0, false},
		{"one of two", map[string]bool{web.Key(): true}, 1, false},
		{"both", map[string]bool{web.Key(): true, other.Key(): true}, 2, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			n := openNode(t)
			withPins(t, n, web, other)
			c, err := n.Collect(testID, func(key string, _ *membership.Member, _ bool) bool { return tc.stale[key] })
			if err != nil {
				t.Fatal(err)
			}
			if len(c.Members) != tc.wantMembers || c.Identifier != tc.wantGone {
				t.Fatalf("Collect: %d members, identifier removed %v; want %d, %v", len(c.Members), c.Identifier, tc.wantMembers, tc.wantGone)
			}
			sc, err := n.ScanIdentifier(testID)
			if tc.wantGone {
				if !errors.Is(err, membership.ErrNoIdentifier) {
					t.Fatalf("scan after the last member was collected: %v, want ErrNoIdentifier", err)
				}
				return
			}
			if err != nil || len(sc.Members) != 2-tc.wantMembers {
				t.Fatalf("scan: %d members, %v; want %d", len(sc.Members), err, 2-tc.wantMembers)
			}
		})
	}
	n := openNode(t)
	if c, err := n.Collect(testID, func(string, *membership.Member, bool) bool { return true }); err != nil || c.Identifier {
		t.Fatalf("Collect of a missing identifier: %+v, %v; want nothing", c, err)
	}
}

const webPolicy = `apiVersion: networking.k8s.aws/v1alpha1
kind: PolicyEndpoint
metadata: {name: web-abcde, namespace: default}
spec:
  policyRef: {name: web, namespace: default}
  podIsolation: [Ingress]
  podSelectorEndpoints:
  - {name: web-7f65cc6544-9j58r, namespace: default, podIP: 192.168.7.235}
  ingress:
  - cidr: 192.168.0.0/16
`

// ReapplyPolicies programs identifiers with members once per directory
// digest, records a directory it cannot read for ls, and keeps the time
// that began.
func TestReapplyPolicies(t *testing.T) {
	n := openNode(t)
	withPins(t, n, web)
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "web.yaml"), []byte(webPolicy), 0o644); err != nil {
		t.Fatal(err)
	}
	a, err := n.ReapplyPolicies(dir, policy.Digest{})
	if err != nil || a.Identifiers != 1 || a.Documents != 1 {
		t.Fatalf("ReapplyPolicies: %+v, %v; want 1 identifier, 1 document", a, err)
	}
	h, err := n.Lock(testID)
	if err != nil {
		t.Fatal(err)
	}
	info, err := h.Inspect()
	h.Unlock()
	if err != nil || !info.Isolated[policy.Ingress] || info.Isolated[policy.Egress] {
		t.Fatalf("after ReapplyPolicies: isolated %v, %v; want ingress only", info.Isolated, err)
	}
	if again, err := n.ReapplyPolicies(dir, a.Digest); err != nil || !again.Unchanged || again.Identifiers != 0 {
		t.Fatalf("ReapplyPolicies of the digest just programmed: %+v, %v; want it unchanged", again, err)
	}

	// A directory that cannot be read (a cluster file that does not
	// parse) changes nothing and is recorded.
	bad := t.TempDir()
	if err := os.Mkdir(filepath.Join(bad, policy.ClusterDir), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(bad, policy.ClusterDir, "broken.yaml"), []byte("spec: [\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	var since []string
	for range 2 {
		_, err := n.ReapplyPolicies(bad, policy.Digest{})
		if !errors.Is(err, ErrInvalidPolicy) {
			t.Fatalf("ReapplyPolicies of a broken cluster file: %v, want ErrInvalidPolicy", err)
		}
		st, ok, err := n.ReadPolicyStatus()
		if err != nil || !ok || !strings.Contains(st.Error, "broken.yaml") {
			t.Fatalf("the policy status: %+v, %v, %v; want the error naming the path", st, ok, err)
		}
		since = append(since, st.Since.String())
	}
	if since[0] != since[1] {
		t.Fatalf("the status's time moved from %s to %s across two failed loads in a row", since[0], since[1])
	}
	if _, err := n.ReapplyPolicies(dir, policy.Digest{}); err != nil {
		t.Fatal(err)
	}
	if st, ok, err := n.ReadPolicyStatus(); err != nil || ok {
		t.Fatalf("the policy status after a good load: %+v, %v, %v; want none", st, ok, err)
	}

	// An unsynced mirror changes nothing.
	if err := policy.MarkUnsynced(dir); err != nil {
		t.Fatal(err)
	}
	if _, err := n.ReapplyPolicies(dir, policy.Digest{}); !errors.Is(err, policy.ErrUnsynced) {
		t.Fatalf("ReapplyPolicies of an unsynced directory: %v, want ErrUnsynced", err)
	}
}

// TestReapplyPoliciesInBatches: a push over more identifiers than a batch
// (levelBatch) programs every one, and leaves none of them with its other
// side not level, on both sides of a batch boundary.
func TestReapplyPoliciesInBatches(t *testing.T) {
	n := openNode(t)
	const count = levelBatch + 5
	var pe strings.Builder
	pe.WriteString(`apiVersion: networking.k8s.aws/v1alpha1
kind: PolicyEndpoint
metadata: {name: apps-abcde, namespace: default}
spec:
  policyRef: {name: apps, namespace: default}
  podIsolation: [Ingress]
  podSelectorEndpoints:
`)
	var ids []podid.ID
	for i := range count {
		ids = append(ids, podid.ID(fmt.Sprintf("app%d-7f65cc6544@default", i)))
		m := web
		m.ContainerID = fmt.Sprintf("c%d", i)
		withPinsOf(t, n, ids[i], m)
		fmt.Fprintf(&pe, "  - {name: app%d-7f65cc6544-9j58r, namespace: default, podIP: 192.168.7.%d}\n", i, i+1)
	}
	pe.WriteString("  ingress:\n  - cidr: 192.168.0.0/16\n")
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "apps.yaml"), []byte(pe.String()), 0o644); err != nil {
		t.Fatal(err)
	}
	a, err := n.ReapplyPolicies(dir, policy.Digest{})
	if err != nil || a.Identifiers != count {
		t.Fatalf("ReapplyPolicies: %+v, %v; want %d identifiers", a, err, count)
	}
	for _, id := range ids {
		h, err := n.Lock(id)
		if err != nil {
			t.Fatal(err)
		}
		info, err := h.Inspect()
		h.Unlock()
		if err != nil || !info.Isolated[policy.Ingress] || info.Changing {
			t.Errorf("%s after the push: isolated %v, changing %v (%v); want ingress isolated, both sides level", id, info.Isolated, info.Changing, err)
		}
	}
}
