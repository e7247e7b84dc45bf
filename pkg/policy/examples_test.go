package policy

import (
	"net/netip"
	"testing"

	"github.com/podfence/podfence/pkg/podid"
)

// The examples shipped in conf/policies must stay valid and mean what their
// comments say.
func TestShippedExamples(t *testing.T) {
	docs, err := LoadDir("../../conf/policies")
	if err != nil {
		t.Fatal(err)
	}
	if len(docs) == 0 {
		t.Fatal("no example policies found")
	}
	id, err := podid.FromPod("web-7f65cc6544-9j58r", "default")
	if err != nil {
		t.Fatal(err)
	}
	set := ForIdentifier(docs, id, ModeStandard)
	for _, c := range []struct {
		d     Direction
		addr  string
		proto uint8
		port  uint16
		want  bool
	}{
		{Ingress, "192.168.3.4", 6, 8080, true},
		{Ingress, "192.168.100.4", 6, 8080, false},
		{Ingress, "192.168.3.4", 6, 22, false},
		{Egress, "10.100.0.10", 17, 53, true},
		{Egress, "192.168.50.9", 6, 5439, true},
		{Egress, "192.168.50.9", 6, 5440, false},
	} {
		if got := set.Direction(c.d).Allows(netip.MustParseAddr(c.addr), c.proto, c.port); got != c.want {
			t.Errorf("%s %s %d/%d: allows=%v, want %v", c.d, c.addr, c.proto, c.port, got, c.want)
		}
	}
}
