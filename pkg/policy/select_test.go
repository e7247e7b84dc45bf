package policy

import (
	"net/netip"
	"reflect"
	"testing"

	"github.com/podfence/podfence/pkg/podid"
)

func TestParseMode(t *testing.T) {
	for in, want := range map[string]Mode{"": ModeStandard, "standard": ModeStandard, "strict": ModeStrict} {
		if got, err := ParseMode(in); err != nil || got != want {
			t.Errorf("ParseMode(%q) = %q, %v; want %q", in, got, err, want)
		}
	}
	for _, in := range []string{"Strict", "enforcing", " strict"} {
		if got, err := ParseMode(in); err == nil {
			t.Errorf("ParseMode(%q) = %q, want an error", in, got)
		}
	}
}

func TestDirection(t *testing.T) {
	if Ingress.String() != "ingress" || Egress.String() != "egress" || Direction(7).String() != "direction(7)" {
		t.Errorf("String: %s %s %s", Ingress, Egress, Direction(7))
	}
	var s Set
	s.Direction(Egress).Isolated = true
	if !s.Egress.Isolated || s.Ingress.Isolated || s.Direction(Ingress) != &s.Ingress {
		t.Errorf("Direction does not point into the Set: %+v", s)
	}
}

func TestForIdentifier(t *testing.T) {
	allowWeb := Rule{CIDR: netip.MustParsePrefix("10.1.0.0/16"), Ports: []PortRange{{ProtocolTCP, 80, 80}}}
	allowDNS := Rule{CIDR: netip.MustParsePrefix("0.0.0.0/0"), Ports: []PortRange{{ProtocolUDP, 53, 53}}}
	allowMon := Rule{CIDR: netip.MustParsePrefix("10.2.0.0/24"), Ports: []PortRange{allPorts}}
	docs := []Document{
		{
			Source:  "a#0",
			Selects: []Endpoint{{"web-7f65cc6544-9j58r", "default"}, {"db-0", "data"}},
			// Only ingress isolated: the egress rule counts for nothing,
			// as in Kubernetes, also where another document isolates egress.
			IsolateIngress: true,
			Ingress:        []Rule{allowWeb},
			Egress:         []Rule{allowDNS},
		},
		{
			Source: "a#1",
			// An invalid name is skipped; the second entry selects another replica.
			Selects:       []Endpoint{{"Web_Bad", "default"}, {"web-7f65cc6544-x2k4p", "default"}},
			IsolateEgress: true,
			Ingress:       []Rule{allowMon},
		},
		{Source: "a#2", Selects: []Endpoint{{"web-7f65cc6544-9j58r", "other"}}, IsolateIngress: true, IsolateEgress: true},
	}
	id := func(name, ns string) podid.ID {
		t.Helper()
		id, err := podid.FromPod(name, ns)
		if err != nil {
			t.Fatal(err)
		}
		return id
	}
	tests := []struct {
		name string
		id   podid.ID
		mode Mode
		want Set
	}{
		{
			"replicas share documents, each counts for what it isolates",
			id("web-7f65cc6544-zx2k4", "default"), ModeStandard,
			Set{Mode: ModeStandard, Selected: true, Sources: []string{"a#0", "a#1"},
				Ingress: DirectionPolicy{Isolated: true, Rules: []Rule{allowWeb}},
				Egress:  DirectionPolicy{Isolated: true}},
		},
		{
			"selected in strict mode: documents decide",
			id("db-0", "data"), ModeStrict,
			Set{Mode: ModeStrict, Selected: true, Sources: []string{"a#0"},
				Ingress: DirectionPolicy{Isolated: true, Rules: []Rule{allowWeb}}},
		},
		{
			"other namespace",
			id("web-7f65cc6544-9j58r", "other"), ModeStandard,
			Set{Mode: ModeStandard, Selected: true, Sources: []string{"a#2"}, Ingress: DirectionPolicy{Isolated: true}, Egress: DirectionPolicy{Isolated: true}},
		},
		{
			"not selected, standard: allow all",
			id("db-1", "data"), ModeStandard,
			Set{Mode: ModeStandard},
		},
		{
			"not selected, strict: deny all",
			id("db-1", "data"), ModeStrict,
			Set{Mode: ModeStrict, Ingress: DirectionPolicy{Isolated: true}, Egress: DirectionPolicy{Isolated: true}},
		},
		{
			"no documents, strict",
			id("web-7f65cc6544-9j58r", "default"), ModeStrict,
			Set{Mode: ModeStrict, Ingress: DirectionPolicy{Isolated: true}, Egress: DirectionPolicy{Isolated: true}},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			in := docs
			if tt.name == "no documents, strict" {
				in = nil
			}
			if got := ForIdentifier(in, tt.id, tt.mode); !reflect.DeepEqual(got, tt.want) {
				t.Errorf("got  %+v\nwant %+v", got, tt.want)
			}
		})
	}
}

// TestLoadAndSelect runs the path the plugin takes: files to a Set to
// entries, and checks the result against the example files.
func TestLoadAndSelect(t *testing.T) {
	docs, err := LoadDir("testdata")
	if err != nil {
		t.Fatal(err)
	}
	web, err := podid.FromPod("web-7f65cc6544-9j58r", "default")
	if err != nil {
		t.Fatal(err)
	}
	s := ForIdentifier(docs, web, ModeStrict)
	in := s.Direction(Ingress)
	for _, c := range []struct {
		addr  string
		proto uint8
		port  uint16
		want  bool
	}{
		{"10.1.0.1", 6, 85, true},
		{"10.1.5.1", 6, 85, false}, // except
		{"10.1.5.1", 17, 1, false},
		{"10.1.9.9", 17, 1, true},
		{"10.2.0.7", 6, 9090, true}, // second document
		{"10.2.0.7", 6, 9091, false},
		{"fd00::1", 1, 0, true},
		{"fd00::2", 1, 0, false},
	} {
		if got := in.Allows(netip.MustParseAddr(c.addr), c.proto, c.port); got != c.want {
			t.Errorf("ingress Allows(%s, %d, %d) = %v, want %v", c.addr, c.proto, c.port, got, c.want)
		}
	}
	v4, v6, err := in.Compile()
	if err != nil {
		t.Fatal(err)
	}
	if len(v4) != 3 || len(v6) != 1 {
		t.Errorf("ingress entries v4 %v v6 %v", v4, v6)
	}
}

// Documents that isolate the same direction add up: NetworkPolicies are a
// union.
func TestForIdentifierUnion(t *testing.T) {
	a := Rule{CIDR: netip.MustParsePrefix("10.1.0.0/16"), Ports: []PortRange{{ProtocolTCP, 80, 80}}}
	b := Rule{CIDR: netip.MustParsePrefix("10.2.0.0/16")}
	sel := []Endpoint{{"db-0", "data"}}
	docs := []Document{
		{Source: "u#0", Selects: sel, IsolateIngress: true, Ingress: []Rule{a}},
		{Source: "u#1", Selects: sel, IsolateIngress: true, IsolateEgress: true, Ingress: []Rule{b}, Egress: []Rule{a}},
	}
	got := ForIdentifier(docs, "db-0@data", ModeStandard)
	want := Set{Mode: ModeStandard, Selected: true, Sources: []string{"u#0", "u#1"},
		Ingress: DirectionPolicy{Isolated: true, Rules: []Rule{a, b}},
		Egress:  DirectionPolicy{Isolated: true, Rules: []Rule{a}}}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("got  %+v\nwant %+v", got, want)
	}
}
