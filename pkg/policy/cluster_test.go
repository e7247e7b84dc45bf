package policy

import (
	"encoding/json"
	"errors"
	"net/netip"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"

	controller "github.com/aws/amazon-network-policy-controller-k8s/api/v1alpha1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/podfence/podfence/pkg/podid"
)

// TestKnowsEveryClusterControllerField holds the cluster parser to the
// controller's ClusterPolicyEndpoint type, as TestKnowsEveryControllerField
// does for PolicyEndpoints.
func TestKnowsEveryClusterControllerField(t *testing.T) {
	known := map[string][]string{
		"spec":                        clusterSpecFields,
		"spec.policyRef":              {"name"},
		"spec.podSelectorEndpoints[]": endpointFields,
		"spec.ingress[]":              clusterRuleFields,
		"spec.egress[]":               clusterRuleFields,
		"spec.ingress[].ports[]":      portFields,
		"spec.egress[].ports[]":       portFields,
	}
	checkKnowsFields(t, "ClusterPolicyEndpoint", reflect.TypeOf(controller.ClusterPolicyEndpointSpec{}), known, "spec.subject")
}

// TestClusterControllerOutput parses the object the real controller
// (v1.1.10) wrote for ClusterNetworkPolicy no-imds.
func TestClusterControllerOutput(t *testing.T) {
	f, err := os.Open(filepath.Join("testdata", "controller", "ClusterPolicyEndpoint_cluster_no-imds-fgk9c.json"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	docs, err := ParseCluster(f, "no-imds")
	if err != nil || len(docs) != 1 {
		t.Fatalf("ParseCluster: %+v, %v", docs, err)
	}
	d := docs[0]
	want := ClusterDocument{
		Source: "no-imds#0", Name: "no-imds-fgk9c", ChangedAt: d.ChangedAt, Policy: "no-imds", Tier: TierAdmin, Priority: 10,
		Selects: []Endpoint{{"web-7f65cc6544-9j58r", "default"}, {"web-7f65cc6544-x2k4p", "default"},
			{"client-5d8f7c9b6d-q7x2m", "default"}, {"db-0", "other"}},
		Egress: []ClusterRule{
			{CIDR: netip.MustParsePrefix("169.254.169.254/32"), Ports: []PortRange{allPorts}, Action: ActionDeny,
				Priority: 10, Policy: "no-imds", Source: "no-imds#0", Index: 0},
			{CIDR: netip.MustParsePrefix("10.244.0.12/32"), Ports: []PortRange{{ProtocolUDP, 53, 53}}, Action: ActionAccept,
				Priority: 10, Policy: "no-imds", Source: "no-imds#0", Index: 1},
		},
	}
	if !reflect.DeepEqual(d, want) {
		t.Errorf("got\n%+v\nwant\n%+v", d, want)
	}
	if d.ChangedAt.Year() != 2026 {
		t.Errorf("ChangedAt %v, want the controller's %s", d.ChangedAt, ChangeTimeAnnotation)
	}
}

// TestClusterObjectWithEveryField: an object of the controller's types
// with every field set parses with nothing ignored.
func TestClusterObjectWithEveryField(t *testing.T) {
	tcp := corev1.ProtocolTCP
	p80, p90 := int32(80), int32(90)
	cpe := controller.ClusterPolicyEndpoint{
		TypeMeta:   metav1.TypeMeta{APIVersion: "networking.k8s.aws/v1alpha1", Kind: "ClusterPolicyEndpoint"},
		ObjectMeta: metav1.ObjectMeta{Name: "x-1"},
		Spec: controller.ClusterPolicyEndpointSpec{
			PolicyRef: controller.ClusterPolicyReference{Name: "x"},
			Tier:      "Baseline", Priority: 1000,
			Subject: controller.ClusterNetworkPolicySubject{Pods: &controller.NamespacedPod{
				NamespaceSelector: metav1.LabelSelector{MatchLabels: map[string]string{"a": "b"}},
				PodSelector:       metav1.LabelSelector{MatchLabels: map[string]string{"c": "d"}}}},
			PodSelectorEndpoints: []controller.PodEndpoint{{HostIP: "192.0.2.20", PodIP: "10.244.0.10", Name: "web-0", Namespace: "default"}},
			Ingress: []controller.ClusterEndpointInfo{{CIDR: "10.0.0.0/8", Action: "Pass",
				Ports: []controller.Port{{Protocol: &tcp, Port: &p80, EndPort: &p90}}}},
			Egress: []controller.ClusterEndpointInfo{{CIDR: "fd00::/64", Action: "Deny"}},
		},
	}
	b, err := json.Marshal(cpe)
	if err != nil {
		t.Fatal(err)
	}
	docs, err := ParseCluster(strings.NewReader(string(b)), "x")
	if err != nil || len(docs) != 1 {
		t.Fatalf("ParseCluster: %+v, %v", docs, err)
	}
	d := docs[0]
	if len(d.Notes) != 0 || d.Tier != TierBaseline || d.Priority != 1000 || len(d.Ingress) != 1 || len(d.Egress) != 1 ||
		d.Ingress[0].Action != ActionPass || d.Ingress[0].Ports[0] != (PortRange{ProtocolTCP, 80, 90}) {
		t.Errorf("%+v", d)
	}
}

// TestClusterRulesNotAsWritten: what podfence cannot enforce as written is
// never more open than written.
func TestClusterRulesNotAsWritten(t *testing.T) {
	all4, all6 := netip.MustParsePrefix("0.0.0.0/0"), netip.MustParsePrefix("::/0")
	udp53 := []PortRange{{ProtocolUDP, 53, 53}}
	for _, c := range []struct {
		name, rule string
		want       []ClusterRule // CIDR, Ports and Action only
		note       string
	}{
		{"domain accept", `{action: Accept, domainName: example.com, ports: [{protocol: UDP, port: 53}]}`, nil, "the Accept is left out"},
		{"domain pass", `{action: Pass, domainName: example.com, ports: [{protocol: UDP, port: 53}]}`,
			[]ClusterRule{{CIDR: all4, Ports: udp53}, {CIDR: all6, Ports: udp53}}, "the Pass denies its ports to every address"},
		{"domain deny", `{action: Deny, domainName: example.com}`,
			[]ClusterRule{{CIDR: all4, Ports: []PortRange{allPorts}}, {CIDR: all6, Ports: []PortRange{allPorts}}}, "the Deny denies"},
		{"unknown accept", `{action: Accept, cidr: 10.0.0.0/8, future: 1}`, nil, "unknown field spec.egress[0].future"},
		{"unknown pass", `{action: Pass, cidr: 10.0.0.0/8, ports: [{port: 80, future: 1}]}`,
			[]ClusterRule{{CIDR: netip.MustParsePrefix("10.0.0.0/8"), Ports: []PortRange{{ProtocolTCP, 80, 80}}}}, "the Pass denies its cidr"},
		{"as written", `{action: Accept, cidr: 10.1.2.3}`,
			[]ClusterRule{{CIDR: netip.MustParsePrefix("10.1.2.3/32"), Ports: []PortRange{allPorts}, Action: ActionAccept}}, ""},
	} {
		t.Run(c.name, func(t *testing.T) {
			docs, err := ParseCluster(strings.NewReader(clusterDoc("Admin", 5, "web-0", c.rule)), "x")
			if err != nil {
				t.Fatal(err)
			}
			var got []ClusterRule
			for _, r := range docs[0].Egress {
				got = append(got, ClusterRule{CIDR: r.CIDR, Ports: r.Ports, Action: r.Action})
			}
			if !reflect.DeepEqual(got, c.want) {
				t.Errorf("rules %+v, want %+v", got, c.want)
			}
			notes := docs[0].Notes
			if c.note == "" && len(notes) != 0 || c.note != "" && (len(notes) != 1 || !notes[0].Rule || !strings.Contains(notes[0].What, c.note)) {
				t.Errorf("notes %+v, want one saying %q", notes, c.note)
			}
		})
	}
}

func clusterDoc(tier string, priority int, pod, egress string) string {
	return "apiVersion: networking.k8s.aws/v1alpha1\nkind: ClusterPolicyEndpoint\nmetadata: {name: p-1}\n" +
		"spec:\n  policyRef: {name: p}\n  tier: " + tier + "\n  priority: " + itoa(priority) + "\n  subject: {namespaces: {}}\n" +
		"  podSelectorEndpoints: [{name: " + pod + ", namespace: default}]\n  egress: [" + egress + "]\n"
}

func itoa(n int) string { b, _ := json.Marshal(n); return string(b) }

// TestClusterParseErrors: what cannot be placed or read fails the input,
// naming the field.
func TestClusterParseErrors(t *testing.T) {
	good := clusterDoc("Admin", 5, "web-0", "{action: Deny, cidr: 10.0.0.0/8}")
	for _, c := range []struct{ name, doc, field string }{
		{"tier", strings.Replace(good, "tier: Admin", "tier: Root", 1), "spec.tier"},
		{"priority high", strings.Replace(good, "priority: 5", "priority: 1001", 1), "spec.priority"},
		{"priority negative", strings.Replace(good, "priority: 5", "priority: -1", 1), "spec.priority"},
		{"priority text", strings.Replace(good, "priority: 5", "priority: '5'", 1), "spec.priority"},
		{"priority missing", strings.Replace(good, "  priority: 5\n", "", 1), "spec.priority"},
		{"policyRef missing", strings.Replace(good, "  policyRef: {name: p}\n", "", 1), "spec.policyRef"},
		{"action", clusterDoc("Admin", 5, "web-0", "{action: Allow, cidr: 10.0.0.0/8}"), "spec.egress[0].action"},
		{"action missing", clusterDoc("Admin", 5, "web-0", "{cidr: 10.0.0.0/8}"), "spec.egress[0].action"},
		{"no cidr or domain", clusterDoc("Admin", 5, "web-0", "{action: Deny}"), "spec.egress[0].cidr"},
		{"cidr", clusterDoc("Admin", 5, "web-0", "{action: Deny, cidr: 10.0.0.0/33}"), "spec.egress[0].cidr"},
		{"port", clusterDoc("Admin", 5, "web-0", "{action: Deny, cidr: 10.0.0.0/8, ports: [{port: 0}]}"), "spec.egress[0].ports[0].port"},
		{"kind", strings.Replace(good, "kind: ClusterPolicyEndpoint", "kind: PolicyEndpoint", 1), "kind"},
	} {
		t.Run(c.name, func(t *testing.T) {
			_, err := ParseCluster(strings.NewReader(good+"---\n"+c.doc), "f")
			if !errors.Is(err, ErrInvalidDocument) || !strings.Contains(err.Error(), "f#1: "+c.field) {
				t.Errorf("error %v, want one naming f#1: %s", err, c.field)
			}
		})
	}
}

// TestClusterChunks: every chunk of a cluster policy applies to the pods
// any chunk selects, as for PolicyEndpoints; rules come out in evaluation
// order whatever the chunks' order.
func TestClusterChunks(t *testing.T) {
	in := clusterDoc("Admin", 20, "web-0", "{action: Accept, cidr: 10.0.0.0/16}") + "---\n" +
		strings.Replace(clusterDoc("Admin", 20, "nobody-0", "{action: Deny, cidr: 10.0.0.0/16}"), "p-1", "p-2", 1) + "---\n" +
		strings.Replace(strings.Replace(clusterDoc("Baseline", 3, "db-0", "{action: Deny, cidr: 0.0.0.0/0}"), "name: p}", "name: q}", 1), "p-1", "q-1", 1)
	docs, err := ParseCluster(strings.NewReader(in), "x")
	if err != nil {
		t.Fatal(err)
	}
	c := ClusterForIdentifier(docs, podid.ID("web-0@default"))
	if got := c.Admin[Egress]; len(got) != 2 || got[0].Action != ActionDeny || got[1].Action != ActionAccept {
		t.Errorf("admin egress %+v, want the second chunk's Deny, then the first's Accept", got)
	}
	if len(c.Baseline[Egress]) != 0 || len(c.Admin[Ingress]) != 0 || !slices.Equal(c.Sources, []string{"x#0", "x#1"}) {
		t.Errorf("%+v", c)
	}
}
