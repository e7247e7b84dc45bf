package policy

import (
	"errors"
	"net/netip"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
)

const header = "apiVersion: networking.k8s.aws/v1alpha1\nkind: PolicyEndpoint\n"

// withSpec returns a document with the given spec body (indented by the caller).
func withSpec(spec string) string { return header + "spec:\n" + spec }

// ingressRule returns a document with one ingress rule given as a flow mapping.
func ingressRule(rule string) string { return withSpec("  ingress:\n  - " + rule + "\n") }

// TestParseErrors: a document that does not parse is returned broken,
// with an error that names the file, the document and the field.
func TestParseErrors(t *testing.T) {
	valid := withSpec("  podIsolation: [Ingress]\n")
	tests := []struct {
		name, input, want string
	}{
		{"yaml syntax", valid + "---\n" + header + "spec: {ingress: [\n", "#1: yaml: line 8"},
		{"duplicate key", ingressRule("{cidr: 10.0.0.0/8, cidr: 10.1.0.0/16}"), `#0: yaml: unmarshal errors:`},
		{"list document", "- a\n- b\n", "#0: document is not a mapping but list"},
		{"scalar document", valid + "---\nhello\n", "#1: document is not a mapping but string"},
		{"index counts empty documents", valid + "---\n# nothing\n---\n" + "kind: PolicyEndpoint\n", "#2: apiVersion: missing"},
		{"missing apiVersion", "kind: PolicyEndpoint\nspec: {}\n", "#0: apiVersion: missing"},
		{"wrong apiVersion", "apiVersion: networking.k8s.io/v1\nkind: PolicyEndpoint\nspec: {}\n", `#0: apiVersion: "networking.k8s.io/v1" is not networking.k8s.aws/v1alpha1`},
		{"apiVersion not string", "apiVersion: 1\nkind: PolicyEndpoint\n", "#0: apiVersion: must be a string, not number"},
		{"wrong kind", "apiVersion: networking.k8s.aws/v1alpha1\nkind: NetworkPolicy\nspec: {}\n", `#0: kind: "NetworkPolicy" is not PolicyEndpoint`},
		{"missing kind", "apiVersion: networking.k8s.aws/v1alpha1\nspec: {}\n", "#0: kind: missing"},
		{"metadata not mapping", header + "metadata: web\nspec: {}\n", "#0: metadata: must be a mapping, not string"},
		{"metadata name not string", header + "metadata: {name: 12}\nspec: {}\n", "#0: metadata.name: must be a string, not number"},
		{"missing spec", header, "#0: spec: missing"},
		{"null spec", header + "spec:\n", "#0: spec: missing"},
		{"spec not mapping", header + "spec: [a]\n", "#0: spec: must be a mapping, not list"},
		{"podIsolation not list", withSpec("  podIsolation: Ingress\n"), "#0: spec.podIsolation: must be a list, not string"},
		{"podIsolation lower case", withSpec("  podIsolation: [Egress, ingress]\n"), `#0: spec.podIsolation[1]: "ingress" is not Ingress or Egress`},
		{"podIsolation not string", withSpec("  podIsolation: [{a: b}]\n"), `#0: spec.podIsolation[0]: must be a string, not mapping`},
		{"endpoint not mapping", withSpec("  podSelectorEndpoints: [web]\n"), "#0: spec.podSelectorEndpoints[0]: must be a mapping, not string"},
		{"endpoint missing name", withSpec("  podSelectorEndpoints: [{namespace: default}]\n"), "#0: spec.podSelectorEndpoints[0].name: missing"},
		{"endpoint empty namespace", withSpec("  podSelectorEndpoints: [{name: a, namespace: a}, {name: web, namespace: ''}]\n"), "#0: spec.podSelectorEndpoints[1].namespace: must not be empty"},
		{"endpoint namespace boolean", withSpec("  podSelectorEndpoints: [{name: web, namespace: yes}]\n"), "#0: spec.podSelectorEndpoints[0].namespace: must be a string, not boolean"},
		{"rules not list", withSpec("  egress: {cidr: 10.0.0.0/8}\n"), "#0: spec.egress: must be a list, not mapping"},
		{"rule not mapping", withSpec("  egress: [10.0.0.0/8]\n"), "#0: spec.egress[0]: must be a mapping, not string"},
		{"rule key case", ingressRule("{CIDR: 10.0.0.0/8}"), "#0: spec.ingress[0].cidr: missing"},
		{"rule missing cidr", ingressRule("{ports: []}"), "#0: spec.ingress[0].cidr: missing"},
		{"cidr bits", ingressRule("{cidr: 10.1.0.0/33}"), `#0: spec.ingress[0].cidr: "10.1.0.0/33" is not a CIDR or IP address`},
		{"cidr word", ingressRule("{cidr: any}"), `#0: spec.ingress[0].cidr: "any" is not a CIDR or IP address`},
		{"cidr zone", ingressRule("{cidr: 'fe80::1%eth0'}"), `#0: spec.ingress[0].cidr: "fe80::1%eth0" is not a CIDR or IP address`},
		{"cidr mapped", ingressRule("{cidr: '::ffff:10.0.0.0/104'}"), `#0: spec.ingress[0].cidr: "::ffff:10.0.0.0/104" is an IPv4-mapped IPv6 prefix`},
		{"cidr mapped address", ingressRule("{cidr: '::ffff:10.0.0.1'}"), `#0: spec.ingress[0].cidr: "::ffff:10.0.0.1" is an IPv4-mapped`},
		{"cidr number", ingressRule("{cidr: 10}"), "#0: spec.ingress[0].cidr: must be a string, not number"},
		{"except not list", ingressRule("{cidr: 10.1.0.0/16, except: 10.1.5.0/24}"), "#0: spec.ingress[0].except: must be a list, not string"},
		{"except outside", withSpec("  egress:\n  - {cidr: 10.0.0.0/8}\n  - {cidr: 10.1.0.0/16, except: [10.1.5.0/24, 10.2.0.0/24]}\n"), "#0: spec.egress[1].except[1]: 10.2.0.0/24 is not inside cidr 10.1.0.0/16"},
		{"except shorter", ingressRule("{cidr: 10.1.0.0/16, except: [10.0.0.0/8]}"), "#0: spec.ingress[0].except[0]: 10.0.0.0/8 is not inside cidr 10.1.0.0/16"},
		{"except family", ingressRule("{cidr: 10.1.0.0/16, except: ['fd00::/64']}"), "#0: spec.ingress[0].except[0]: fd00::/64 is not of the address family of cidr 10.1.0.0/16"},
		{"except syntax", ingressRule("{cidr: 10.1.0.0/16, except: [10.1.0.0/40]}"), `#0: spec.ingress[0].except[0]: "10.1.0.0/40" is not a CIDR or IP address`},
		{"except not string", ingressRule("{cidr: 10.1.0.0/16, except: [[]]}"), `#0: spec.ingress[0].except[0]: must be a string, not list`},
		{"ports not list", ingressRule("{cidr: 10.0.0.0/8, ports: {port: 80}}"), "#0: spec.ingress[0].ports: must be a list, not mapping"},
		{"port entry not mapping", ingressRule("{cidr: 10.0.0.0/8, ports: [80]}"), "#0: spec.ingress[0].ports[0]: must be a mapping, not number"},
		{"protocol ICMP", ingressRule("{cidr: 10.0.0.0/8, ports: [{protocol: UDP}, {protocol: ICMP}]}"), `#0: spec.ingress[0].ports[1].protocol: "ICMP" is not TCP, UDP or SCTP`},
		{"protocol lower case", ingressRule("{cidr: 10.0.0.0/8, ports: [{protocol: tcp}]}"), `#0: spec.ingress[0].ports[0].protocol: "tcp" is not TCP, UDP or SCTP`},
		{"protocol number", ingressRule("{cidr: 10.0.0.0/8, ports: [{protocol: 6}]}"), `#0: spec.ingress[0].ports[0].protocol: must be a string, not number`},
		{"port zero", ingressRule("{cidr: 10.0.0.0/8, ports: [{port: 0}]}"), "#0: spec.ingress[0].ports[0].port: 0 is not a port number in 1..65535"},
		{"port negative", ingressRule("{cidr: 10.0.0.0/8, ports: [{port: -1}]}"), "#0: spec.ingress[0].ports[0].port: -1 is not a port number"},
		{"port too big", ingressRule("{cidr: 10.0.0.0/8, ports: [{port: 65536}]}"), "#0: spec.ingress[0].ports[0].port: 65536 is not a port number"},
		{"port fraction", ingressRule("{cidr: 10.0.0.0/8, ports: [{port: 1.5}]}"), "#0: spec.ingress[0].ports[0].port: 1.5 is not a port number"},
		{"port string", ingressRule("{cidr: 10.0.0.0/8, ports: [{port: '80'}]}"), "#0: spec.ingress[0].ports[0].port: must be a number, not string"},
		{"named port", ingressRule("{cidr: 10.0.0.0/8, ports: [{port: http}]}"), "#0: spec.ingress[0].ports[0].port: must be a number, not string"},
		{"endPort without port", ingressRule("{cidr: 10.0.0.0/8, ports: [{endPort: 90}]}"), "#0: spec.ingress[0].ports[0].endPort: requires port"},
		{"endPort below port", ingressRule("{cidr: 10.0.0.0/8, ports: [{port: 80, endPort: 70}]}"), "#0: spec.ingress[0].ports[0].endPort: 70 is below port 80"},
		{"endPort too big", ingressRule("{cidr: 10.0.0.0/8, ports: [{port: 80, endPort: 70000}]}"), "#0: spec.ingress[0].ports[0].endPort: 70000 is not a port number"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			docs, err := Parse(strings.NewReader(tt.input), "policies/web.yaml")
			if err != nil {
				t.Fatalf("Parse failed as a whole: %v", err)
			}
			err = Strict(docs)
			if err == nil {
				t.Fatalf("no document broken: %+v", docs)
			}
			t.Log(err)
			if !errors.Is(err, ErrInvalidDocument) {
				t.Errorf("error %q does not wrap ErrInvalidDocument", err)
			}
			if want := "policies/web.yaml" + tt.want; !strings.Contains(err.Error(), want) {
				t.Errorf("error %q\ndoes not contain %q", err, want)
			}
		})
	}
}

func TestParseValid(t *testing.T) {
	tests := []struct {
		name, input string
		want        []Document
	}{
		{"empty input", "", nil},
		{"only comments and markers", "# a\n---\n--- # b\n\n---\n", nil},
		{
			"defaults",
			ingressRule("{cidr: 10.1.2.3, ports: [{}, {protocol: UDP, port: 53}, {protocol: SCTP, port: 1, endPort: 65535}]}") +
				"--- {apiVersion: networking.k8s.aws/v1alpha1, kind: PolicyEndpoint,\n  spec: {ingress: [{cidr: '10.9.9.9/8', ports: []}]}}\n",
			[]Document{
				{Source: "x#0", Ingress: []Rule{{
					CIDR:  netip.MustParsePrefix("10.1.2.3/32"),
					Ports: []PortRange{{ProtocolTCP, 0, 65535}, {ProtocolUDP, 53, 53}, {ProtocolSCTP, 1, 65535}},
				}}},
				{Source: "x#1", Ingress: []Rule{{CIDR: netip.MustParsePrefix("10.0.0.0/8"), Ports: []PortRange{allPorts}}}},
			},
		},
		{
			"comment after marker, CRLF, nulls as absent, ignored fields",
			"--- # comment\r\n" + strings.ReplaceAll(header, "\n", "\r\n") + "status: {x: 1}\r\nspec:\r\n  podIsolation: [Egress, Egress]\r\n  podSelector: {matchLabels: {a: b}}\r\n  egress:\r\n  - {cidr: 'fd00::1', except: null, ports: null}\r\n",
			[]Document{{Source: "x#0", IsolateEgress: true, Egress: []Rule{{CIDR: netip.MustParsePrefix("fd00::1/128"), Ports: []PortRange{allPorts}}}}},
		},
		{
			"json object",
			`{"apiVersion": "networking.k8s.aws/v1alpha1", "kind": "PolicyEndpoint", "metadata": {"name": "n", "namespace": "ns"}, "spec": {"podIsolation": ["Ingress"], "podSelectorEndpoints": [{"name": "db-0", "namespace": "ns", "hostIP": "1.2.3.4"}]}}`,
			[]Document{{Source: "x#0", Name: "n", Namespace: "ns", IsolateIngress: true, Selects: []Endpoint{{"db-0", "ns"}}}},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := Parse(strings.NewReader(tt.input), "x")
			if err != nil {
				t.Fatal(err)
			}
			if !reflect.DeepEqual(got, tt.want) {
				t.Errorf("got  %+v\nwant %+v", got, tt.want)
			}
		})
	}
}

func TestParseFile(t *testing.T) {
	docs, err := ParseFile("testdata/web.yaml")
	if err != nil {
		t.Fatal(err)
	}
	want := []Document{
		{
			Source: "testdata/web.yaml#0", Name: "web-allow-xk2pq", Namespace: "default", Policy: "default/web-allow",
			Selects:        []Endpoint{{"web-7f65cc6544-9j58r", "default"}, {"web-7f65cc6544-x2k4p", "default"}},
			IsolateIngress: true, IsolateEgress: true,
			Ingress: []Rule{
				{
					CIDR:   netip.MustParsePrefix("10.1.0.0/16"),
					Except: []netip.Prefix{netip.MustParsePrefix("10.1.5.0/24")},
					Ports:  []PortRange{{ProtocolTCP, 80, 90}, {ProtocolUDP, 0, 65535}},
				},
				{CIDR: netip.MustParsePrefix("fd00::1/128"), Ports: []PortRange{allPorts}},
			},
			Egress: []Rule{{CIDR: netip.MustParsePrefix("0.0.0.0/0"), Ports: []PortRange{{ProtocolUDP, 53, 53}, {ProtocolTCP, 53, 53}}}},
		},
		{
			Source: "testdata/web.yaml#2", Name: "web-monitoring", Namespace: "default",
			Selects:        []Endpoint{{"web-7f65cc6544-9j58r", "default"}},
			IsolateIngress: true,
			Ingress:        []Rule{{CIDR: netip.MustParsePrefix("10.2.0.0/24"), Ports: []PortRange{{ProtocolTCP, 9090, 9090}}}},
		},
	}
	if !reflect.DeepEqual(docs, want) {
		t.Errorf("got  %+v\nwant %+v", docs, want)
	}

	if _, err := ParseFile("testdata/missing.yaml"); err == nil || errors.Is(err, ErrInvalidDocument) || !strings.Contains(err.Error(), "testdata/missing.yaml") {
		t.Errorf("missing file: got %v, want a read error naming the file", err)
	}
}

func TestLoadDir(t *testing.T) {
	docs, err := LoadDir("testdata")
	if err != nil {
		t.Fatal(err)
	}
	var sources []string
	for _, d := range docs {
		sources = append(sources, d.Source)
	}
	want := []string{"testdata/db.json#0", "testdata/web.yaml#0", "testdata/web.yaml#2"}
	if !reflect.DeepEqual(sources, want) {
		t.Errorf("sources %q, want %q", sources, want)
	}

	docs, err = LoadDir(filepath.Join(t.TempDir(), "missing"))
	if err != nil || docs != nil {
		t.Errorf("missing dir: got %v, %v; want no documents, no error", docs, err)
	}

	// A ConfigMap-like directory: keys are symlinks through ..data, hidden
	// entries and directories are skipped.
	dir := t.TempDir()
	data := filepath.Join(dir, "..2024_01_01")
	write := func(path, content string) {
		t.Helper()
		if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(path, []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	write(filepath.Join(data, "a.yml"), withSpec("  podIsolation: [Ingress]\n"))
	write(filepath.Join(dir, ".hidden.yaml"), "not: [valid")
	write(filepath.Join(dir, "notes.txt"), "not: [valid")
	write(filepath.Join(dir, "sub.yaml", "b.yaml"), "not: [valid")
	for _, err := range []error{
		os.Symlink("..2024_01_01", filepath.Join(dir, "..data")),
		os.Symlink(filepath.Join("..data", "a.yml"), filepath.Join(dir, "a.yml")),
	} {
		if err != nil {
			t.Fatal(err)
		}
	}
	docs, err = LoadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	if len(docs) != 1 || docs[0].Source != filepath.Join(dir, "a.yml#0") || !docs[0].IsolateIngress {
		t.Errorf("configmap dir: got %+v", docs)
	}

	// One bad file fails only its own documents, which are named.
	write(filepath.Join(dir, "z.json"), `{"apiVersion": "v1"}`)
	docs, err = LoadDir(dir)
	if err != nil || len(docs) != 2 || docs[0].Broken != nil || !errors.Is(docs[1].Broken, ErrInvalidDocument) ||
		!strings.Contains(docs[1].Broken.Error(), filepath.Join(dir, "z.json#0")+": apiVersion") {
		t.Errorf("bad file: got %+v, %v", docs, err)
	}

	if _, err := LoadDir("testdata/web.yaml"); err == nil {
		t.Error("a file as dir: no error")
	}
}
