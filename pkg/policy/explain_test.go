package policy

import (
	"math/rand/v2"
	"net/netip"
	"testing"

	"github.com/podfence/podfence/pkg/podid"
)

// TestExplainMatchesAllows: over random documents, Explain names an
// allowing rule exactly when the identifier's Set allows the connection,
// and every rule it names does what it says of it.
func TestExplainMatchesAllows(t *testing.T) {
	id := podid.ID("web-7f65cc6544@default")
	sel := []Endpoint{{Name: "web-7f65cc6544-9j58r", Namespace: "default"}}
	rng := rand.New(rand.NewPCG(7, 11))
	for round := range 300 {
		var docs []Document
		for i := range 1 + rng.IntN(3) {
			d := Document{Source: "d.yaml#" + string(rune('0'+i)), Name: "d", Namespace: "default",
				IsolateIngress: rng.IntN(4) > 0}
			if rng.IntN(5) > 0 {
				d.Selects = sel
			}
			for range rng.IntN(4) {
				d.Ingress = append(d.Ingress, randRule(rng))
			}
			docs = append(docs, d)
		}
		set := ForIdentifier(docs, id, ModeStandard)
		for range 30 {
			addr := clusterAddr(rng, rng.IntN(2) == 0)
			if set.Selected && len(set.Ingress.Rules) > 0 && rng.IntN(2) == 0 {
				addr = set.Ingress.Rules[rng.IntN(len(set.Ingress.Rules))].CIDR.Addr()
			}
			proto := []uint8{6, 17, 132}[rng.IntN(3)]
			port := uint16(rng.IntN(26))
			e := Explain(docs, id, ModeStandard, Ingress, addr, proto, port)
			want := set.Ingress.Allows(addr, proto, port)
			if got := !e.Isolated || len(e.Allowing) > 0; got != want {
				t.Fatalf("round %d: %s %d/%d: Explain allows=%v (%+v), Allows=%v", round, addr, port, proto, got, e, want)
			}
			for _, r := range e.Allowing {
				if !r.CIDR.Contains(addr.Unmap()) || r.Ports == nil || !r.Ports.Contains(proto, port) || r.Except != nil {
					t.Fatalf("round %d: allowing rule %+v does not allow %s %d/%d", round, r, addr, port, proto)
				}
			}
			for _, r := range e.Near {
				if r.Except != nil && !r.Except.Contains(addr.Unmap()) {
					t.Fatalf("round %d: near rule %+v: its except does not hold %s", round, r, addr)
				}
			}
		}
	}
}

func TestExplainNamesTheRule(t *testing.T) {
	docs, err := LoadDir("../../conf/policies")
	if err != nil {
		t.Fatal(err)
	}
	id := podid.ID("web-7f65cc6544@default")
	e := Explain(docs, id, ModeStandard, Ingress, netip.MustParseAddr("192.168.3.4"), 6, 8080)
	if len(e.Allowing) != 1 || e.Allowing[0].Name != "web-allow-abcde" || e.Allowing[0].Rule != 0 {
		t.Errorf("192.168.3.4 TCP 8080: %+v, want rule 0 of web-allow-abcde", e)
	}
	e = Explain(docs, id, ModeStandard, Ingress, netip.MustParseAddr("192.168.100.9"), 6, 8080)
	if len(e.Allowing) != 0 || len(e.Near) == 0 || e.Near[0].Except == nil || e.Near[0].Except.String() != "192.168.100.0/24" {
		t.Errorf("192.168.100.9 TCP 8080: %+v, want denied, the except 192.168.100.0/24 named", e)
	}
}
