package ipproto

import "testing"

func TestName(t *testing.T) {
	for _, c := range []struct {
		p    uint8
		want string
	}{
		{1, "ICMP"}, {6, "TCP"}, {17, "UDP"}, {58, "ICMPv6"}, {132, "SCTP"},
		{0, "proto-0"}, {47, "proto-47"}, {255, "proto-255"},
	} {
		if got := Name(c.p); got != c.want {
			t.Errorf("Name(%d) = %q, want %q", c.p, got, c.want)
		}
	}
}
