package liveness

import (
	"net/netip"
	"testing"
	"time"
)

// key builds a Key from "addr:port" strings.
func key(proto uint8, src, dst string) Key {
	s, d := netip.MustParseAddrPort(src), netip.MustParseAddrPort(dst)
	k := Key{Family: 6, Proto: proto, SrcPort: s.Port(), DstPort: d.Port()}
	if s.Addr().Is4() {
		k.Family = 4
		a, b := s.Addr().As4(), d.Addr().As4()
		copy(k.Src[:], a[:])
		copy(k.Dst[:], b[:])
	} else {
		k.Src, k.Dst = s.Addr().As16(), d.Addr().As16()
	}
	return k
}

// flow is a kernel flow: its original and reply tuples.
type flow struct{ orig, reply Key }

// live reports whether k is one of the flows' tuples: what the sweeper
// computes from a kernel dump.
func live(k Key, flows []flow) bool {
	for _, f := range flows {
		for _, t := range FlowKeys(f.orig, f.reply) {
			if t == k {
				return true
			}
		}
	}
	return false
}

const (
	tcp  = 6
	udp  = 17
	icmp = 1
)

// TestNATShapes: every way a pod sees a connection through netfilter, each
// entry written from the pod's side as the datapath writes it, against the
// one kernel flow the connection has.
func TestNATShapes(t *testing.T) {
	const (
		a    = "10.0.1.2"   // client pod
		b    = "10.0.1.3"   // backend pod
		vip  = "10.96.0.10" // ClusterIP
		node = "192.168.0.5"
		out  = "203.0.113.9" // outside the cluster
		a6   = "[fd00::2]"
		b6   = "[fd00::3]"
		vip6 = "[fd00:96::10]"
	)
	for _, tc := range []struct {
		name  string
		flows []flow
		entry Key
		want  bool
	}{
		{
			name:  "ClusterIP same node: client's entry is the original tuple",
			flows: []flow{{key(tcp, a+":40000", vip+":80"), key(tcp, b+":8080", a+":40000")}},
			entry: key(tcp, a+":40000", vip+":80"), want: true,
		},
		{
			name:  "ClusterIP same node: backend's entry is the reply tuple (the seed's lost entry)",
			flows: []flow{{key(tcp, a+":40000", vip+":80"), key(tcp, b+":8080", a+":40000")}},
			entry: key(tcp, b+":8080", a+":40000"), want: true,
		},
		{
			name:  "NodePort with SNAT: the backend sees the node's address",
			flows: []flow{{key(tcp, out+":5555", node+":30080"), key(tcp, b+":8080", node+":61000")}},
			entry: key(tcp, b+":8080", node+":61000"), want: true,
		},
		{
			name:  "pod SNAT to the outside: the original tuple",
			flows: []flow{{key(tcp, a+":41000", out+":443"), key(tcp, out+":443", node+":41000")}},
			entry: key(tcp, a+":41000", out+":443"), want: true,
		},
		{
			name:  "hairpin without SNAT: the pod's egress entry",
			flows: []flow{{key(tcp, a+":42000", vip+":80"), key(tcp, a+":8080", a+":42000")}},
			entry: key(tcp, a+":42000", vip+":80"), want: true,
		},
		{
			name:  "hairpin without SNAT: the pod's ingress entry",
			flows: []flow{{key(tcp, a+":42000", vip+":80"), key(tcp, a+":8080", a+":42000")}},
			entry: key(tcp, a+":8080", a+":42000"), want: true,
		},
		{
			name:  "hairpin with masquerade: the ingress entry names the node",
			flows: []flow{{key(tcp, a+":42000", vip+":80"), key(tcp, a+":8080", node+":42000")}},
			entry: key(tcp, a+":8080", node+":42000"), want: true,
		},
		{
			name:  "pod to pod: the client",
			flows: []flow{{key(udp, a+":5353", b+":53"), key(udp, b+":53", a+":5353")}},
			entry: key(udp, a+":5353", b+":53"), want: true,
		},
		{
			name:  "pod to pod: the server",
			flows: []flow{{key(udp, a+":5353", b+":53"), key(udp, b+":53", a+":5353")}},
			entry: key(udp, b+":53", a+":5353"), want: true,
		},
		{
			name:  "ICMP echo: the identifier in both ports",
			flows: []flow{{key(icmp, a+":77", b+":77"), key(icmp, b+":77", a+":77")}},
			entry: key(icmp, b+":77", a+":77"), want: true,
		},
		{
			name:  "IPv6 ClusterIP: the backend's reply tuple",
			flows: []flow{{key(tcp, a6+":40000", vip6+":80"), key(tcp, b6+":8080", a6+":40000")}},
			entry: key(tcp, b6+":8080", a6+":40000"), want: true,
		},
		{
			name:  "the backend keyed as if DNAT had not happened is not the flow",
			flows: []flow{{key(tcp, a+":40000", vip+":80"), key(tcp, b+":8080", a+":40000")}},
			entry: key(tcp, vip+":80", a+":40000"), want: false,
		},
		{
			name:  "another source port is another connection",
			flows: []flow{{key(tcp, a+":40000", vip+":80"), key(tcp, b+":8080", a+":40000")}},
			entry: key(tcp, a+":40001", vip+":80"), want: false,
		},
		{
			name:  "another protocol is another flow",
			flows: []flow{{key(udp, a+":40000", vip+":80"), key(udp, b+":8080", a+":40000")}},
			entry: key(tcp, a+":40000", vip+":80"), want: false,
		},
		{
			name:  "an IPv4 key never matches an IPv6 flow with the same leading bytes",
			flows: []flow{{key(tcp, "[a00:102::]:40000", "[fd00::1]:80"), key(tcp, "[fd00::1]:80", "[a00:102::]:40000")}},
			entry: key(tcp, a+":40000", "10.0.0.1:80"), want: false,
		},
		{
			name:  "no flows: nothing is live",
			entry: key(tcp, a+":40000", vip+":80"), want: false,
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := live(tc.entry, tc.flows); got != tc.want {
				t.Errorf("live(%s) = %v, want %v", tc.entry, got, tc.want)
			}
		})
	}
}

func TestDecide(t *testing.T) {
	p := Pass{Start: 100 * time.Second, Grace: 10 * time.Second}
	for _, tc := range []struct {
		name string
		e    Entry
		want Reason
	}{
		{"touched during the pass, no kernel flow (port reuse)", Entry{LastSeen: 100 * time.Second}, KeptRecent},
		{"touched after the pass began, owner unknown yet (a new pod)", Entry{LastSeen: 101 * time.Second}, KeptRecent},
		{"within grace, no kernel flow yet", Entry{LastSeen: 95 * time.Second, OwnerLive: true}, KeptGrace},
		{"at the grace boundary", Entry{LastSeen: 90 * time.Second, OwnerLive: true}, KeptGrace},
		{"old and live", Entry{LastSeen: 10 * time.Second, OwnerLive: true, InKernel: true}, KeptLive},
		{"old, live tuple, owner gone: its address may be the next pod's", Entry{LastSeen: 10 * time.Second, InKernel: true}, DeletedGone},
		{"old and dead", Entry{LastSeen: 89 * time.Second, OwnerLive: true}, DeletedDead},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := p.Decide(tc.e)
			if got != tc.want {
				t.Errorf("Decide = %s, want %s", got, tc.want)
			}
			if got.Delete() != (tc.want == DeletedGone || tc.want == DeletedDead) {
				t.Errorf("%s.Delete() = %v", got, got.Delete())
			}
		})
	}
}

func TestKeyString(t *testing.T) {
	for _, tc := range []struct {
		k    Key
		want string
	}{
		{key(tcp, "10.0.1.2:40000", "10.96.0.10:80"), "TCP 10.0.1.2:40000 -> 10.96.0.10:80"},
		{key(udp, "[fd00::2]:53", "[fd00::3]:5353"), "UDP [fd00::2]:53 -> [fd00::3]:5353"},
		{Key{Family: 4, Proto: 99}, "proto-99 0.0.0.0:0 -> 0.0.0.0:0"},
	} {
		if got := tc.k.String(); got != tc.want {
			t.Errorf("String() = %q, want %q", got, tc.want)
		}
	}
}
