package policy

import (
	"encoding/json"
	"net/netip"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"

	controller "github.com/aws/amazon-network-policy-controller-k8s/api/v1alpha1"
	corev1 "k8s.io/api/core/v1"
	networking "k8s.io/api/networking/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// jsonFields lists the JSON paths of t's fields below prefix, lists as
// "[]", as the controller's types (v1.1.10, the version the real-node
// tests run) define them. Types from k8s.io are leaves.
func jsonFields(t reflect.Type, prefix string) []string {
	for t.Kind() == reflect.Pointer || t.Kind() == reflect.Slice {
		if t.Kind() == reflect.Slice {
			prefix += "[]"
		}
		t = t.Elem()
	}
	if t.Kind() != reflect.Struct || !strings.HasPrefix(t.PkgPath(), "github.com/aws/") {
		return nil
	}
	var out []string
	for i := range t.NumField() {
		f := t.Field(i)
		name, _, _ := strings.Cut(f.Tag.Get("json"), ",")
		if name == "" || name == "-" {
			continue
		}
		path := prefix + "." + name
		out = append(out, path)
		out = append(out, jsonFields(f.Type, path)...)
	}
	return out
}

// TestKnowsEveryControllerField holds the hand parser to the controller's
// own PolicyEndpoint types: every field of their spec is one podfence
// reads, deliberately ignores (podSelector, policyRef, an endpoint's
// addresses) or enforces as "not enforced" (domainName), and podfence
// knows no field they do not have. A controller upgrade that adds a field
// fails here before it reaches a node.
func TestKnowsEveryControllerField(t *testing.T) {
	known := map[string][]string{
		"spec":                        specFields,
		"spec.podSelectorEndpoints[]": endpointFields,
		"spec.ingress[]":              append(slices.Clone(ruleFields), notEnforcedRuleFields...),
		"spec.egress[]":               append(slices.Clone(ruleFields), notEnforcedRuleFields...),
		"spec.ingress[].ports[]":      portFields,
		"spec.egress[].ports[]":       portFields,
	}
	checkKnowsFields(t, "PolicyEndpoint", reflect.TypeOf(controller.PolicyEndpointSpec{}), known, "spec.policyRef")
}

// checkKnowsFields compares the JSON fields of the controller's spec type
// with known (the field names podfence's parser knows, by parent path);
// fields below unread are accepted without being read.
func checkKnowsFields(t *testing.T, kind string, spec reflect.Type, known map[string][]string, unread string) {
	t.Helper()
	theirs := map[string]bool{}
	for _, path := range jsonFields(spec, "spec") {
		theirs[path] = true
		i := strings.LastIndexByte(path, '.')
		parent, name := path[:i], path[i+1:]
		if strings.HasPrefix(parent, unread) {
			continue // the whole object is accepted unread
		}
		if !slices.Contains(known[parent], name) {
			t.Errorf("the controller's %s has %s, which podfence's parser does not know", kind, path)
		}
	}
	for parent, names := range known {
		for _, name := range names {
			if !theirs[parent+"."+name] {
				t.Errorf("podfence knows %s.%s, which the controller's %s does not have", parent, name, kind)
			}
		}
	}
	if len(theirs) < 15 {
		t.Fatalf("only %d fields found in the controller's types: %v", len(theirs), theirs)
	}
}

// TestControllerObjectWithEveryField: an object of the controller's types
// with every field set parses, whole, with nothing ignored; its domainName
// rule is the one thing not enforced.
func TestControllerObjectWithEveryField(t *testing.T) {
	tcp, udp := corev1.ProtocolTCP, corev1.ProtocolUDP
	p80, p90 := int32(80), int32(90)
	pe := controller.PolicyEndpoint{
		TypeMeta:   metav1.TypeMeta{APIVersion: "networking.k8s.aws/v1alpha1", Kind: "PolicyEndpoint"},
		ObjectMeta: metav1.ObjectMeta{Name: "web-x1", Namespace: "default", Annotations: map[string]string{"networking.k8s.aws/last-change-trigger-time": "2026-12-04T16:07:53Z"}},
		Spec: controller.PolicyEndpointSpec{
			PodSelector:          &metav1.LabelSelector{MatchLabels: map[string]string{"app": "web"}},
			PolicyRef:            controller.PolicyReference{Name: "web", Namespace: "default"},
			PodIsolation:         []networking.PolicyType{networking.PolicyTypeIngress, networking.PolicyTypeEgress},
			PodSelectorEndpoints: []controller.PodEndpoint{{HostIP: "192.0.2.20", PodIP: "10.244.0.10", Name: "web-7f65cc6544-9j58r", Namespace: "default"}},
			Ingress: []controller.EndpointInfo{{CIDR: "10.0.0.0/8", Except: []controller.NetworkAddress{"10.1.0.0/16"},
				Ports: []controller.Port{{Protocol: &tcp, Port: &p80, EndPort: &p90}}}},
			Egress: []controller.EndpointInfo{{CIDR: "10.244.0.11", Ports: []controller.Port{{Protocol: &udp, Port: &p80}}},
				{DomainName: "example.com", Ports: []controller.Port{{Protocol: &tcp, Port: &p80}}}},
		},
	}
	b, err := json.Marshal(pe)
	if err != nil {
		t.Fatal(err)
	}
	docs, err := Parse(strings.NewReader(string(b)), "x")
	if err != nil || len(docs) != 1 || docs[0].Broken != nil {
		t.Fatalf("Parse: %+v, %v", docs, err)
	}
	d := docs[0]
	if len(d.Notes) != 1 || d.Notes[0].Field != "spec.egress[1]" || !d.Notes[0].Rule {
		t.Errorf("notes %+v, want the domainName rule alone", d.Notes)
	}
	if len(d.Ingress) != 1 || len(d.Egress) != 1 || d.Ingress[0].Ports[0] != (PortRange{ProtocolTCP, 80, 90}) {
		t.Errorf("rules %+v %+v", d.Ingress, d.Egress)
	}
}

// TestControllerOutput parses the objects the real controller (v1.1.10)
// wrote for a few NetworkPolicies and an ApplicationNetworkPolicy.
func TestControllerOutput(t *testing.T) {
	pfx := netip.MustParsePrefix
	for _, c := range []struct {
		file           string
		in, eg         bool
		ingress, egres []Rule
		notes          int
	}{
		{"PolicyEndpoint_default_web-ingress-tglpp.json", true, false, []Rule{
			{CIDR: pfx("10.0.0.0/8"), Except: []netip.Prefix{pfx("10.1.0.0/16")}, Ports: []PortRange{{ProtocolTCP, 9000, 9100}}},
			{CIDR: pfx("10.244.0.11/32"), Ports: []PortRange{{ProtocolTCP, 8080, 8080}, {ProtocolUDP, 53, 53}}},
		}, nil, 0},
		{"PolicyEndpoint_default_client-egress-5f64v.json", false, true, nil, []Rule{
			{CIDR: pfx("10.244.0.10/32"), Ports: []PortRange{{ProtocolTCP, 8080, 8080}}},
			{CIDR: pfx("10.244.0.13/32"), Ports: []PortRange{{ProtocolTCP, 8080, 8080}}},
			{CIDR: pfx("10.244.0.12/32"), Ports: []PortRange{allPorts}},
			{CIDR: pfx("10.96.155.36/32"), Ports: []PortRange{{ProtocolTCP, 80, 80}}},
		}, 0},
		{"PolicyEndpoint_other_deny-all-87xs5.json", true, true, nil, nil, 0},
		{"PolicyEndpoint_default_client-fqdn-gmr8t.json", false, true, nil, nil, 2},
	} {
		t.Run(c.file, func(t *testing.T) {
			docs, err := ParseFile(filepath.Join("testdata", "controller", c.file))
			if err != nil || len(docs) != 1 || docs[0].Broken != nil {
				t.Fatalf("ParseFile: %+v, %v", docs, err)
			}
			d := docs[0]
			if d.IsolateIngress != c.in || d.IsolateEgress != c.eg || len(d.Selects) == 0 {
				t.Errorf("isolation %v/%v, selects %v", d.IsolateIngress, d.IsolateEgress, d.Selects)
			}
			if !reflect.DeepEqual(d.Ingress, c.ingress) || !reflect.DeepEqual(d.Egress, c.egres) {
				t.Errorf("rules\n%+v\n%+v\nwant\n%+v\n%+v", d.Ingress, d.Egress, c.ingress, c.egres)
			}
			if d.ChangedAt.IsZero() || d.ChangedAt.Year() != 2026 {
				t.Errorf("ChangedAt %v, want the controller's %s", d.ChangedAt, ChangeTimeAnnotation)
			}
			if len(d.Notes) != c.notes || d.NotEnforcedRules() != c.notes {
				t.Errorf("notes %+v, want %d rules not enforced", d.Notes, c.notes)
			}
		})
	}
}

// TestChunksOfOnePolicy: the controller packs a policy's rules and the
// pods it selects into chunks independently, so a chunk may hold rules and
// no pod (seen on the real node with 500 peers). Every chunk of a policy
// (the same spec.policyRef) applies to the pods any of them selects; a
// chunk of another policy does not.
func TestChunksOfOnePolicy(t *testing.T) {
	chunk := func(policy, pod, cidr string) string {
		s := header + "spec:\n  policyRef: {name: " + policy + ", namespace: default}\n  podIsolation: [Ingress]\n"
		if pod != "" {
			s += "  podSelectorEndpoints: [{name: " + pod + ", namespace: default}]\n"
		}
		return s + "  ingress: [{cidr: '" + cidr + "'}]\n"
	}
	docs, err := Parse(strings.NewReader(chunk("many", "web-0", "10.1.0.1")+"---\n"+chunk("many", "", "10.1.0.2")+
		"---\n"+chunk("many", "", "10.1.0.3")+"---\n"+chunk("other", "", "10.9.0.9")), "x")
	if err != nil || Strict(docs) != nil {
		t.Fatal(err, Strict(docs))
	}
	set := ForIdentifier(docs, "web-0@default", ModeStandard)
	for addr, want := range map[string]bool{"10.1.0.1": true, "10.1.0.2": true, "10.1.0.3": true, "10.9.0.9": false} {
		if got := set.Ingress.Allows(netip.MustParseAddr(addr), 6, 80); got != want {
			t.Errorf("%s: allowed %v, want %v", addr, got, want)
		}
	}
	if e := Explain(docs, "web-0@default", ModeStandard, Ingress, netip.MustParseAddr("10.1.0.3"), 6, 80); len(e.Allowing) != 1 || e.Allowing[0].Source != "x#2" {
		t.Errorf("Explain names %+v, want the third chunk's rule", e.Allowing)
	}
	if set := ForIdentifier(docs, "db-0@default", ModeStandard); set.Selected {
		t.Errorf("a pod no chunk selects: %+v", set)
	}
}
