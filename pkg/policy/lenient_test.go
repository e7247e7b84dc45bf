package policy

import (
	"net/netip"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"github.com/podfence/podfence/pkg/podid"
)

// TestNotes: what podfence cannot enforce as written is never more open
// than the document. A rule with a domainName, or with a field podfence
// does not know (its own or a port's), is left out and allows nothing,
// while the isolation and the other rules apply; a field podfence does not
// know elsewhere is ignored. Each is noted.
func TestNotes(t *testing.T) {
	doc := header + "metadata: {name: fqdn, namespace: default}\nspec:\n" +
		"  podIsolation: [Ingress, Egress]\n" +
		"  podSelectorEndpoints: [{name: web-0, namespace: default, labels: {a: b}}]\n" +
		"  future: true\n" +
		"  egress:\n" +
		"  - {domainName: example.com, ports: [{port: 443, protocol: TCP}]}\n" +
		"  - {cidr: 10.0.0.0/8, ports: [{port: 53, protocol: UDP}]}\n" +
		"  - {cidr: 0.0.0.0/0, action: Accept}\n" +
		"  - {cidr: 0.0.0.0/0, ports: [{port: 80, portName: http}]}\n" +
		"  ingress:\n" +
		"  - {cidr: 10.1.0.0/16}\n"
	docs, err := Parse(strings.NewReader(doc), "f")
	if err != nil || len(docs) != 1 {
		t.Fatalf("Parse: %+v, %v", docs, err)
	}
	d := docs[0]
	if d.Broken != nil {
		t.Fatalf("broken: %v", d.Broken)
	}
	wantNotes := []Note{
		{Field: "spec.future", What: "unknown field, ignored (known: podIsolation, podSelectorEndpoints, ingress, egress, podSelector, policyRef)"},
		{Field: "spec.podSelectorEndpoints[0].labels", What: "unknown field, ignored (known: name, namespace, podIP, hostIP)"},
		{Field: "spec.egress[0]", What: `domainName "example.com" is not enforced: the rule allows nothing`, Rule: true},
		{Field: "spec.egress[2]", What: "unknown field spec.egress[2].action: the rule is not enforced and allows nothing", Rule: true},
		{Field: "spec.egress[3]", What: "unknown field spec.egress[3].ports[0].portName: the rule is not enforced and allows nothing", Rule: true},
	}
	if !reflect.DeepEqual(d.Notes, wantNotes) {
		t.Errorf("notes\n%+v\nwant\n%+v", d.Notes, wantNotes)
	}
	if d.NotEnforcedRules() != 3 {
		t.Errorf("%d rules not enforced, want 3", d.NotEnforcedRules())
	}
	set := ForIdentifier(docs, "web-0@default", ModeStandard)
	for _, c := range []struct {
		d     Direction
		addr  string
		proto uint8
		port  uint16
		want  bool
	}{
		{Egress, "93.184.215.14", 6, 443, false}, // example.com: not enforced
		{Egress, "10.2.3.4", 17, 53, true},       // the rule podfence enforces
		{Egress, "8.8.8.8", 6, 80, false},        // the rules with unknown fields
		{Ingress, "10.1.2.3", 6, 22, true},
		{Ingress, "10.2.2.3", 6, 22, false},
	} {
		if got := set.Direction(c.d).Allows(netip.MustParseAddr(c.addr), c.proto, c.port); got != c.want {
			t.Errorf("%s %s %d/%d: allows %v, want %v", c.d, c.addr, c.proto, c.port, got, c.want)
		}
	}
	if r := d.Report(); len(r) != 5 || !strings.Contains(r[2], "f#0 (default/fqdn): spec.egress[0]: domainName") {
		t.Errorf("report %q", r)
	}
}

// TestSalvage: a document that does not parse keeps its selection and
// isolation when those parse (its pods are closed, allowing nothing), and
// changes nothing otherwise.
func TestSalvage(t *testing.T) {
	for _, c := range []struct {
		name, doc string
		want      Fallback
		in, eg    bool
	}{
		{"bad cidr", header + "metadata: {name: a, namespace: default}\nspec:\n  podIsolation: [Ingress, Egress]\n  podSelectorEndpoints: [{name: web-0, namespace: default}]\n  ingress: [{cidr: 10.0.0.0/33}]\n", FallbackIsolation, true, true},
		{"bad port, ingress only", header + "spec:\n  podIsolation: [Ingress]\n  podSelectorEndpoints: [{name: web-0, namespace: default}]\n  ingress: [{cidr: 10.0.0.0/8, ports: [{port: 0}]}]\n", FallbackIsolation, true, false},
		{"bad isolation", header + "spec:\n  podIsolation: [ingress]\n  podSelectorEndpoints: [{name: web-0, namespace: default}]\n", FallbackNothing, false, false},
		{"bad selection", header + "spec:\n  podIsolation: [Ingress]\n  podSelectorEndpoints: [{name: web-0}]\n", FallbackNothing, false, false},
		{"another kind", "apiVersion: networking.k8s.aws/v1alpha1\nkind: ClusterPolicyEndpoint\nspec:\n  podIsolation: [Ingress]\n  podSelectorEndpoints: [{name: web-0, namespace: default}]\n", FallbackNothing, false, false},
		{"yaml syntax", header + "spec: {podIsolation: [Ingress\n", FallbackNothing, false, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			docs, err := Parse(strings.NewReader(c.doc), "f")
			if err != nil || len(docs) != 1 || docs[0].Broken == nil {
				t.Fatalf("Parse: %+v, %v; want one broken document", docs, err)
			}
			d := docs[0]
			if d.Fallback != c.want || len(d.Ingress)+len(d.Egress) != 0 {
				t.Fatalf("fallback %s with %d rules, want %s and none", d.Fallback, len(d.Ingress)+len(d.Egress), c.want)
			}
			set := ForIdentifier(docs, "web-0@default", ModeStandard)
			if set.Ingress.Isolated != c.in || set.Egress.Isolated != c.eg || set.Selected != (c.want == FallbackIsolation) {
				t.Errorf("set %+v, want ingress isolated %v, egress %v", set, c.in, c.eg)
			}
		})
	}
}

// fileWriter writes files into dir, failing the test on an error.
func fileWriter(t *testing.T, dir string) func(name, content string) {
	return func(name, content string) {
		t.Helper()
		if err := os.WriteFile(filepath.Join(dir, name), []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
	}
}

// isolatedWeb is a PolicyEndpoint named name that isolates pod name-0's
// ingress and lets cidr in.
func isolatedWeb(name, cidr string) string {
	return header + "metadata: {name: " + name + ", namespace: default}\nspec:\n  podIsolation: [Ingress]\n" +
		"  podSelectorEndpoints: [{name: " + name + "-0, namespace: default}]\n  ingress: [{cidr: '" + cidr + "'}]\n"
}

// TestLastGood: a file that parsed whole is kept as the last good version
// of its documents; when an update breaks one of them, that one is
// enforced as it was, by name, while the file's other documents are read
// anew; a new document that breaks has no last good version. A file that
// goes is forgotten.
func TestLastGood(t *testing.T) {
	dir := t.TempDir()
	write := fileWriter(t, dir)
	pe := isolatedWeb
	allows := func(docs []Document, pod, addr string) bool {
		set := ForIdentifier(docs, podid.ID(pod+"-0@default"), ModeStandard)
		return set.Ingress.Allows(netip.MustParseAddr(addr), 6, 80)
	}
	load := func() ([]Document, *Dir) {
		t.Helper()
		d, err := ReadDir(dir)
		if err != nil {
			t.Fatal(err)
		}
		if err := d.KeepLastGood(); err != nil {
			t.Fatal(err)
		}
		return d.Documents(), d
	}

	write("a.yaml", pe("web", "10.1.0.0/16")+"---\n"+pe("db", "10.2.0.0/16"))
	docs, _ := load()
	if !allows(docs, "web", "10.1.2.3") || !allows(docs, "db", "10.2.2.3") {
		t.Fatal("the valid file is not enforced")
	}

	// An update breaks web's document and changes db's.
	write("a.yaml", pe("web", "10.1.0.0/33")+"---\n"+pe("db", "10.3.0.0/16"))
	docs, _ = load()
	if docs[0].Broken == nil || docs[0].Fallback != FallbackLastGood || !allows(docs, "web", "10.1.2.3") {
		t.Errorf("web's broken update: %+v; want its last good version enforced", docs[0])
	}
	if !allows(docs, "db", "10.3.2.3") || allows(docs, "db", "10.2.2.3") {
		t.Error("db's valid update is not enforced")
	}
	// The broken file is not recorded: its last good version stays.
	docs, _ = load()
	if docs[0].Fallback != FallbackLastGood {
		t.Errorf("after a second load: %s", docs[0].Fallback)
	}

	// A document new in the file has no last good version.
	write("a.yaml", pe("web", "10.1.0.0/33")+"---\n"+pe("db", "10.3.0.0/16")+"---\n"+pe("cache", "bad"))
	docs, _ = load()
	if docs[2].Fallback != FallbackIsolation || allows(docs, "cache", "10.9.9.9") {
		t.Errorf("a new broken document: %+v; want its pods isolated, allowing nothing", docs[2])
	}

	// A file that goes is forgotten: written again broken, it has none.
	os.Remove(filepath.Join(dir, "a.yaml"))
	load()
	write("a.yaml", pe("web", "10.1.0.0/33"))
	docs, _ = load()
	if docs[0].Fallback != FallbackIsolation {
		t.Errorf("a file written again after it went: %s, want no last good version", docs[0].Fallback)
	}
	if _, err := os.Stat(filepath.Join(dir, lastGoodDir, "a.yaml")); !os.IsNotExist(err) {
		t.Errorf("the last good copy of a broken file: %v", err)
	}
}

// TestDigest: reads of the same files give the same digest; a changed
// file, a new one, or another last good copy behind a broken document
// give another.
func TestDigest(t *testing.T) {
	dir := t.TempDir()
	write := fileWriter(t, dir)
	pe := func(cidr string) string { return isolatedWeb("web", cidr) }
	digest := func(keep bool) Digest {
		t.Helper()
		d, err := ReadDir(dir)
		if err != nil {
			t.Fatal(err)
		}
		if keep {
			if err := d.KeepLastGood(); err != nil {
				t.Fatal(err)
			}
		}
		return d.Digest()
	}
	empty := digest(false)
	write("a.yaml", pe("10.1.0.0/16"))
	a := digest(true)
	if a == empty || digest(false) != a {
		t.Fatal("a file's digest: not stable, or the same as an empty directory's")
	}
	write("a.yaml", pe("10.2.0.0/16"))
	b := digest(true)
	if b == a {
		t.Error("a changed file kept its digest")
	}
	write("a.yaml", pe("10.2.0.0/33")) // broken: 10.2.0.0/16 stands
	broken := digest(false)
	write("a.yaml", pe("10.3.0.0/16"))
	digest(true)
	write("a.yaml", pe("10.2.0.0/33")) // the same bytes, now 10.3.0.0/16 stands
	if digest(false) == broken {
		t.Error("a broken file falling back to another last good copy kept its digest")
	}
	before := digest(false)
	write("b.yaml", "")
	if digest(false) == before {
		t.Error("a new file did not change the digest")
	}
}
