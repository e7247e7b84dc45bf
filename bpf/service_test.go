package bpf

import (
	"errors"
	"io"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/containernetworking/plugins/pkg/ns"
	"golang.org/x/sys/unix"

	"github.com/podfence/podfence/pkg/attach"
	"github.com/podfence/podfence/pkg/localhook"
	"github.com/podfence/podfence/pkg/pinpath"
	"github.com/podfence/podfence/pkg/podid"
	"github.com/podfence/podfence/pkg/policy"
	"github.com/podfence/podfence/test/kernel"
	"github.com/podfence/podfence/test/netnsutil"
)

// serviceNode is a node namespace that translates Services as kube-proxy
// does (nftables DNAT in prerouting), with the real datapath on its veths:
// a client pod (identifier cli), a backend pod on the node (identifier
// web), and an uplink to a peer namespace standing for another node, with
// a backend there.
type serviceNode struct {
	g            *Global
	cli, web     *Datapath
	node, client ns.NetNS
	back, remote ns.NetNS
	clientVeth   netnsutil.Veth
	local, far   netip.AddrPort // the backends
	clusterIP    netip.AddrPort // -> local
	farIP        netip.AddrPort // -> far, through the uplink
	nodePort     netip.AddrPort // a node address -> local
}

// serviceAddrs are a serviceNode's addresses in one family.
type serviceAddrs struct {
	clusterIP, farIP      netip.AddrPort
	client, nodeCli       netip.Prefix // the client pod's and the node's end of its veth
	backNet, uplink       netip.Prefix // the node's ends of the backend's veth and the uplink
	local, far            netip.AddrPort
	nft, match, anyPrefix string // nftables family, address match, the default route
	wide                  string // a prefix that holds both backends
}

func (a serviceAddrs) nodePort() netip.AddrPort { return netip.AddrPortFrom(a.nodeCli.Addr(), 30080) }

var (
	serviceV4 = serviceAddrs{
		clusterIP: netip.MustParseAddrPort("10.96.0.10:80"), farIP: netip.MustParseAddrPort("10.96.0.11:80"),
		client: netip.MustParsePrefix("10.73.1.2/24"), nodeCli: netip.MustParsePrefix("10.73.1.1/24"),
		backNet: netip.MustParsePrefix("10.73.2.1/24"), uplink: netip.MustParsePrefix("10.73.3.1/24"),
		local: netip.MustParseAddrPort("10.73.2.2:8080"), far: netip.MustParseAddrPort("10.73.3.2:8080"),
		nft: "ip", match: "ip", anyPrefix: "0.0.0.0/0", wide: "10.73.0.0/16",
	}
	serviceV6 = serviceAddrs{
		clusterIP: netip.MustParseAddrPort("[fd00:96::10]:80"), farIP: netip.MustParseAddrPort("[fd00:96::11]:80"),
		client: netip.MustParsePrefix("fd73:1::2/64"), nodeCli: netip.MustParsePrefix("fd73:1::1/64"),
		backNet: netip.MustParsePrefix("fd73:2::1/64"), uplink: netip.MustParsePrefix("fd73:3::1/64"),
		local: netip.MustParseAddrPort("[fd73:2::2]:8080"), far: netip.MustParseAddrPort("[fd73:3::2]:8080"),
		nft: "ip6", match: "ip6", anyPrefix: "::/0", wide: "fd73::/16",
	}
	// The IPv4 scene's, for the tests that use one family.
	svcClusterIP = serviceV4.clusterIP
	svcClient    = serviceV4.client
	svcLocal     = serviceV4.local
	svcFar       = serviceV4.far
)

func requireAfterNAT(t *testing.T) {
	t.Helper()
	kernel.RequireRoot(t)
	if _, err := exec.LookPath("nft"); err != nil {
		t.Skip("needs nft for kube-proxy's DNAT rules (installed by hack/deps.sh; kernel guests have none)")
	}
	if !AfterNATSupported() {
		t.Skip("no conntrack kfuncs (Linux 5.18 and later): Services are judged on the frontend here")
	}
}

func newServiceNode(t *testing.T, a serviceAddrs, masquerade bool) *serviceNode {
	t.Helper()
	root, g := openGlobal(t)
	s := &serviceNode{g: g, local: a.local, far: a.far, clusterIP: a.clusterIP, farIP: a.farIP,
		nodePort: a.nodePort()}
	for _, p := range []struct {
		d  **Datapath
		id podid.ID
	}{{&s.cli, "cli@default"}, {&s.web, "web@default"}} {
		d, err := OpenIdentifier(g, identDir(root, p.id), p.id)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { d.Close() })
		if d.Slot < 0 || d.AfterNAT == nil {
			t.Fatalf("%s has no judge (slot %d) on a kernel with the kfuncs", p.id, d.Slot)
		}
		*p.d = d
	}
	if s.cli.Slot == s.web.Slot {
		t.Fatalf("both identifiers have slot %d", s.cli.Slot)
	}
	s.node, s.client, s.back, s.remote = netnsutil.New(t), netnsutil.New(t), netnsutil.New(t), netnsutil.New(t)
	bits := a.client.Bits()
	s.clientVeth = netnsutil.AddVeth(t, s.node, s.client, "cli", a.nodeCli, a.client)
	bv := netnsutil.AddVeth(t, s.node, s.back, "bck", a.backNet, netip.PrefixFrom(a.local.Addr(), bits))
	uv := netnsutil.AddVeth(t, s.node, s.remote, "up", a.uplink, netip.PrefixFrom(a.far.Addr(), bits))
	for _, r := range []struct {
		n  ns.NetNS
		gw netip.Addr
	}{{s.client, a.nodeCli.Addr()}, {s.back, a.backNet.Addr()}, {s.remote, a.uplink.Addr()}} {
		nsRun(t, r.n, "", "ip", "route", "add", "default", "via", r.gw.String())
	}
	dnat := func(from, to netip.AddrPort) string {
		return "  " + a.match + " daddr " + from.Addr().String() + " tcp dport " + strconv.Itoa(int(from.Port())) + " dnat to " + to.String() + "\n"
	}
	rules := "table " + a.nft + " kp {\n chain pre { type nat hook prerouting priority -100;\n" +
		dnat(a.clusterIP, a.local) + dnat(a.farIP, a.far) + dnat(a.nodePort(), a.local) + " }\n"
	if masquerade {
		rules += " chain post { type nat hook postrouting priority 100;\n  " + a.match + " saddr " + a.client.Addr().String() + " " +
			a.match + " daddr != " + a.client.Addr().String() + " oifname != \"cli\" masquerade\n }\n"
	}
	rules += "}\n"
	netnsutil.Do(t, s.node, func() error { // this namespace's
		if err := os.WriteFile("/proc/sys/net/ipv4/ip_forward", []byte("1"), 0o644); err != nil {
			return err
		}
		return os.WriteFile("/proc/sys/net/ipv6/conf/all/forwarding", []byte("1"), 0o644)
	})
	nsRun(t, s.node, rules, "nft", "-f", "-")

	if err := s.cli.SetSources(uint32(s.clientVeth.HostIndex), Sources{Addrs: []netip.Addr{a.client.Addr()}}); err != nil {
		t.Fatal(err)
	}
	if err := s.web.SetSources(uint32(bv.HostIndex), Sources{Addrs: []netip.Addr{a.local.Addr()}}); err != nil {
		t.Fatal(err)
	}
	if _, _, err := g.SetServices([]Frontend{
		{a.clusterIP.Addr(), a.clusterIP.Port(), unix.IPPROTO_TCP},
		{a.farIP.Addr(), a.farIP.Port(), unix.IPPROTO_TCP},
		{a.nodePort().Addr(), a.nodePort().Port(), unix.IPPROTO_TCP},
	}); err != nil {
		t.Fatal(err)
	}
	uplink, err := LoadUplink(g)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { uplink.Close() })
	netnsutil.Do(t, s.node, func() error {
		for _, a := range []struct {
			ifindex int
			hook    attach.Hook
			prog    *ebpf.Program
		}{
			{s.clientVeth.HostIndex, attach.HookIngress, s.cli.Egress},
			{s.clientVeth.HostIndex, attach.HookEgress, s.cli.Ingress},
			{bv.HostIndex, attach.HookIngress, s.web.Egress},
			{bv.HostIndex, attach.HookEgress, s.web.Ingress},
			{uv.HostIndex, attach.HookEgress, uplink},
		} {
			if _, err := attach.Attach(attach.Options{Ifindex: a.ifindex, Hook: a.hook, Program: a.prog, Mode: attach.ModeTC}); err != nil {
				return err
			}
		}
		return nil
	})
	netnsutil.Listen(t, s.back, a.local.Port())
	netnsutil.Listen(t, s.remote, a.far.Port())
	return s
}

// connects tells whether the client reaches dst, trying harder when it
// should (a SYN lost to anything else is retried) than when it should not
// (one that gets through at all is the failure); a refusal (RST) would mean
// the SYN got through, which Connects reports as a failure.
func (s *serviceNode) connects(t *testing.T, dst netip.AddrPort, want bool) bool {
	t.Helper()
	if want {
		return netnsutil.Connects(t, s.client, dst, time.Second, 3)
	}
	return netnsutil.Connects(t, s.client, dst, 300*time.Millisecond, 1)
}

// hostPrefix is ap's address as a prefix of its own.
func hostPrefix(ap netip.AddrPort) string {
	return netip.PrefixFrom(ap.Addr(), ap.Addr().BitLen()).String()
}

// bothIsolated is egressOnly(r...) with the ingress isolated too (allowing
// none): a reply nothing tracked is refused as a new flow.
func bothIsolated(r ...policy.Rule) policy.Set {
	s := egressOnly(r...)
	s.Ingress.Isolated = true
	return s
}

func egressOnly(r ...policy.Rule) policy.Set {
	return policy.Set{Mode: policy.ModeStandard, Selected: true, Egress: policy.DirectionPolicy{Isolated: true, Rules: rules(r...)}}
}

// TestServiceJudgedOnBackend: a pod's new flow to a Service is judged on
// the backend kube-proxy translates it to, at the device it leaves by (the
// backend pod's veth, or the uplink for a backend elsewhere), through a
// ClusterIP and a NodePort, with and without a masquerade; a flow through
// the Service gets the verdict of the direct one in each case.
func TestServiceJudgedOnBackend(t *testing.T) {
	requireAfterNAT(t)
	for _, a := range []serviceAddrs{serviceV4, serviceV6} {
		t.Run(a.nft, func(t *testing.T) { serviceJudgedOnBackend(t, a) })
	}
}

func serviceJudgedOnBackend(t *testing.T, a serviceAddrs) {
	wide := a.wide
	backendNet := netip.PrefixFrom(a.local.Addr(), a.client.Bits()).Masked().String()
	frontends := netip.PrefixFrom(a.clusterIP.Addr(), a.clusterIP.Addr().BitLen()-16).Masked().String()
	cases := []struct {
		name string
		set  policy.Set
		// Whether the local and the far backend are allowed, directly and
		// so through their Services.
		local, far bool
	}{
		{"an ipBlock naming the backends admits their Services",
			egressOnly(rule(hostPrefix(a.local), tcpPort(8080)), rule(hostPrefix(a.far), tcpPort(8080))), true, true},
		{"an except of the backend refuses its Service",
			egressOnly(except(rule(wide), hostPrefix(a.local))), false, true},
		{"the backend's port, not the Service's, is judged",
			egressOnly(rule(wide, tcpPort(80))), false, false},
		{"a rule for the ClusterIPs alone admits nothing",
			egressOnly(rule(frontends)), false, false},
		{"an Admin Deny of the backends' range refuses their Services", func() policy.Set {
			s := egressOnly(rule(a.anyPrefix))
			s.Cluster.Admin[policy.Egress] = policy.TierRules{{CIDR: netip.MustParsePrefix(backendNet),
				Ports: []policy.PortRange{ports(policy.ProtocolTCP, 1, 65535)}, Action: policy.ActionDeny}}
			return s
		}(), false, true},
	}
	for _, masquerade := range []bool{false, true} {
		name := "dnat"
		if masquerade {
			name = "dnat+masquerade"
		}
		t.Run(name, func(t *testing.T) {
			s := newServiceNode(t, a, masquerade)
			// The scene works before the cases: every path connects with
			// nothing isolated (IPv6 neighbours are found meanwhile).
			for _, dst := range []netip.AddrPort{s.local, s.clusterIP, s.nodePort, s.far, s.farIP} {
				if !netnsutil.Connects(t, s.client, dst, time.Second, 3) {
					t.Fatalf("%s does not connect with no policy", dst)
				}
			}
			for _, c := range cases {
				if err := s.cli.ApplyPolicy(c.set); err != nil {
					t.Fatalf("%s: %v", c.name, err)
				}
				for _, p := range []struct {
					what string
					dst  netip.AddrPort
					want bool
				}{
					{"the local backend", s.local, c.local},
					{"its ClusterIP", s.clusterIP, c.local},
					{"its NodePort", s.nodePort, c.local},
					{"the far backend", s.far, c.far},
					{"its ClusterIP, through the uplink", s.farIP, c.far},
				} {
					if got := s.connects(t, p.dst, p.want); got != p.want {
						t.Errorf("%s: %s (%s) connects %v, want %v", c.name, p.what, p.dst, got, p.want)
					}
				}
			}
		})
	}
}

// TestServiceFlowTrackedAndRevoked: a Service flow opened before the pod
// was isolated is judged on its backend once it is, and kept; it is
// tracked under the tuple the client's veth sees (the ClusterIP), so its
// later packets and replies pass as established; a policy change that no
// longer allows its backend cuts it, judged again on the backend.
func TestServiceFlowTrackedAndRevoked(t *testing.T) {
	requireAfterNAT(t)
	s := newServiceNode(t, serviceV4, false)
	const echo = 9090
	netnsutil.Echo(t, s.back, echo)
	front := netip.AddrPortFrom(svcClusterIP.Addr(), 90)
	nsRun(t, s.node, "add rule ip kp pre ip daddr "+front.Addr().String()+" tcp dport 90 dnat to "+netip.AddrPortFrom(svcLocal.Addr(), echo).String()+"\n", "nft", "-f", "-")
	if _, _, err := s.g.SetServices([]Frontend{{front.Addr(), front.Port(), unix.IPPROTO_TCP}}); err != nil {
		t.Fatal(err)
	}
	// Ingress isolated too (bothIsolated): a pod open to ingress would take
	// the backend's next segment after the revocation as a new flow towards
	// it (as for any revoked egress flow), and the client's packets as its
	// replies.
	var c net.Conn
	netnsutil.Do(t, s.client, func() error {
		var err error
		c, err = net.DialTimeout("tcp", front.String(), time.Second)
		return err
	})
	defer c.Close()
	roundTrip := func() error {
		if err := c.SetDeadline(time.Now().Add(500 * time.Millisecond)); err != nil {
			return err
		}
		if _, err := c.Write([]byte("x")); err != nil {
			return err
		}
		b := make([]byte, 1)
		_, err := io.ReadFull(c, b)
		return err
	}
	// Opened while the client is not isolated: tracked at the veth with
	// no judgement. Isolated by a policy that allows the backend (and not
	// the ClusterIP), the flow is judged on the backend and kept.
	if err := roundTrip(); err != nil {
		t.Fatalf("round trip before any policy: %v", err)
	}
	if err := s.cli.ApplyPolicy(bothIsolated(rule(svcLocal.Addr().String()+"/32", tcpPort(echo)))); err != nil {
		t.Fatal(err)
	}
	for range 3 {
		if err := roundTrip(); err != nil {
			t.Fatalf("round trip on an admitted Service flow: %v", err)
		}
	}
	var (
		k       podfenceCtKeyV4
		v       podfenceCtValue
		tracked bool
	)
	for it := s.g.CTv4.Iterate(); it.Next(&k, &v); {
		if netip.AddrFrom4(k.Src) == svcClient.Addr() && netip.AddrFrom4(k.Dst) == front.Addr() && k.Dport == front.Port() {
			tracked = v.Flags&4 != 0 && v.Flags&1 != 0 && k.Ifindex == uint32(s.clientVeth.HostIndex) // CT_SERVICE, CT_EGRESS
		}
	}
	if !tracked {
		t.Fatalf("no Service entry %s -> %s on the client's veth", svcClient.Addr(), front)
	}
	before, err := s.cli.ReadCounters()
	if err != nil {
		t.Fatal(err)
	}
	if before[policy.Egress][ReasonCTEstablished] == 0 || before[policy.Ingress][ReasonCTReply] == 0 {
		t.Errorf("counters %v: the flow's packets did not pass as established and replies", before)
	}
	// Revoked: the backend is no longer allowed.
	if err := s.cli.ApplyPolicy(bothIsolated(rule(svcFar.Addr().String() + "/32"))); err != nil {
		t.Fatal(err)
	}
	if err := roundTrip(); err == nil {
		c, _ := s.cli.ReadCounters()
		w, _ := s.web.ReadCounters()
		for it := s.g.CTv4.Iterate(); it.Next(&k, &v); {
			t.Logf("ct %v:%d -> %v:%d if %d flags %d gen %d", k.Src, k.Sport, k.Dst, k.Dport, k.Ifindex, v.Flags, v.Generation)
		}
		g, _ := s.cli.Generation()
		t.Fatalf("the Service flow still carries data after its backend's rule was removed; counters %v web %v gen %d", c, w, g)
	} else if !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Logf("after revocation: %v", err)
	}
	after, err := s.cli.ReadCounters()
	if err != nil {
		t.Fatal(err)
	}
	if after[policy.Egress][ReasonRevoked] == before[policy.Egress][ReasonRevoked] {
		t.Errorf("no revocation counted (egress revoked %d)", after[policy.Egress][ReasonRevoked])
	}
}

// TestServiceDeliveredOnNode: a Service whose backend is a socket of the
// node (a host-network pod, the node itself) is delivered without meeting
// a TC egress; its flow is judged on the backend on arrival (the local
// judge) and at the first reply, before the client sees it, and tracked so
// that the rest of the flow passes. A frontend the kernel does not
// translate (a socket bound to the ClusterIP behind a notrack rule, as
// node-local DNS does) is judged on itself, and tracked by the local judge.
// The client is ingress-isolated too, so that an untracked reply would be
// refused as a new flow, as is a packet from a frontend's address and port
// that answers nothing.
func TestServiceDeliveredOnNode(t *testing.T) {
	requireAfterNAT(t)
	for _, a := range []serviceAddrs{serviceV4, serviceV6} {
		t.Run(a.nft, func(t *testing.T) { serviceDeliveredOnNode(t, a) })
	}
}

func serviceDeliveredOnNode(t *testing.T, a serviceAddrs) {
	s := newServiceNode(t, a, false)
	const hostPort, bound = 8081, 8053
	// On the node: a backend on its uplink address, and a socket bound to
	// a frontend of its own.
	onNode := netip.AddrPortFrom(a.uplink.Addr(), hostPort)
	toNode := netip.AddrPortFrom(a.farIP.Addr().Next(), 80)
	direct := netip.AddrPortFrom(toNode.Addr().Next(), bound)
	nsRun(t, s.node, "", "ip", "addr", "add", netip.PrefixFrom(direct.Addr(), direct.Addr().BitLen()).String(), "dev", "lo")
	nsRun(t, s.node, "add rule "+a.nft+" kp pre "+a.match+" daddr "+toNode.Addr().String()+" tcp dport 80 dnat to "+onNode.String()+"\n"+
		"add table "+a.nft+" raw\n"+
		"add chain "+a.nft+" raw pre { type filter hook prerouting priority -300; }\n"+
		"add chain "+a.nft+" raw out { type filter hook output priority -300; }\n"+
		"add rule "+a.nft+" raw pre "+a.match+" daddr "+direct.Addr().String()+" notrack\n"+
		"add rule "+a.nft+" raw out "+a.match+" saddr "+direct.Addr().String()+" notrack\n", "nft", "-f", "-")
	// The servers' sockets in the cgroup the local judge hooks.
	inside := hookedCgroup(t, s.g)
	inside(func() {
		netnsutil.Echo(t, s.node, hostPort)
		netnsutil.Echo(t, s.node, bound)
	})
	// A listener in the client pod, for packets from a frontend's address
	// and port that answer nothing the pod sent.
	forged := netip.AddrPortFrom(a.client.Addr(), 7777)
	received := udpEcho(t, s.client, forged)
	if _, _, err := s.g.SetServices([]Frontend{
		{a.clusterIP.Addr(), a.clusterIP.Port(), unix.IPPROTO_TCP},
		{toNode.Addr(), toNode.Port(), unix.IPPROTO_TCP},
		{direct.Addr(), direct.Port(), unix.IPPROTO_TCP},
		{direct.Addr(), direct.Port(), unix.IPPROTO_UDP},
	}); err != nil {
		t.Fatal(err)
	}
	for _, dst := range []netip.AddrPort{onNode, toNode, direct} {
		if !netnsutil.Connects(t, s.client, dst, time.Second, 3) {
			t.Fatalf("%s does not connect with no policy", dst)
		}
	}
	cases := []struct {
		name          string
		set           policy.Set
		node, bounded bool // through toNode, to direct
	}{
		{"an ipBlock naming the node's backend admits its Service", bothIsolated(rule(hostPrefix(onNode), tcpPort(hostPort))), true, false},
		{"an except of the node's backend refuses its Service", bothIsolated(except(rule(a.anyPrefix), hostPrefix(onNode))), false, true},
		{"a rule for the frontends alone admits only the untranslated one",
			bothIsolated(rule(hostPrefix(toNode), tcpPort(80)), rule(hostPrefix(direct), tcpPort(bound))), false, true},
	}
	for _, c := range cases {
		if err := s.cli.ApplyPolicy(c.set); err != nil {
			t.Fatalf("%s: %v", c.name, err)
		}
		for _, p := range []struct {
			what string
			dst  netip.AddrPort
			want bool
		}{
			{"the node's backend", onNode, c.node},
			{"its ClusterIP", toNode, c.node},
			{"the frontend bound on the node", direct, c.bounded},
		} {
			got := roundTrips(t, s.client, p.dst, p.want)
			if got != p.want {
				t.Errorf("%s: %s (%s) carries data %v, want %v", c.name, p.what, p.dst, got, p.want)
			}
		}
		// The pod's ingress admits nothing: a datagram from the
		// frontend's address and port is a new flow, not a reply,
		// whatever the egress allows.
		before := received()
		sendFrom(t, s.node, direct, forged)
		time.Sleep(200 * time.Millisecond)
		if received() != before {
			t.Errorf("%s: a datagram from %s, answering nothing, reached the ingress-isolated pod", c.name, direct)
		}
	}
	c, err := s.cli.ReadCounters()
	if err != nil {
		t.Fatal(err)
	}
	if c[policy.Egress][ReasonCTEstablished] == 0 || c[policy.Ingress][ReasonCTReply] == 0 {
		t.Errorf("counters %v: the flows' later packets did not pass as established and replies", c)
	}
}

// sendFrom sends a datagram from the address and port from, in n, to to.
func sendFrom(t *testing.T, n ns.NetNS, from, to netip.AddrPort) {
	t.Helper()
	netnsutil.Do(t, n, func() error {
		c, err := net.ListenPacket("udp", from.String())
		if err != nil {
			return err
		}
		defer c.Close()
		_, err = c.WriteTo([]byte("x"), net.UDPAddrFromAddrPort(to))
		return err
	})
}

// roundTrips tells whether a connection from n to dst carries a byte there
// and back (an echo server), trying harder when it should than when not.
func roundTrips(t *testing.T, n ns.NetNS, dst netip.AddrPort, want bool) bool {
	return echoes(t, n, "tcp", dst, want)
}

// echoes tells whether a byte from n to dst over network (tcp, udp) comes
// back, trying harder when it should than when not.
func echoes(t *testing.T, n ns.NetNS, network string, dst netip.AddrPort, want bool) bool {
	t.Helper()
	timeout, attempts := 300*time.Millisecond, 1
	if want {
		timeout, attempts = time.Second, 3
	}
	for range attempts {
		err := n.Do(func(ns.NetNS) error {
			c, err := net.DialTimeout(network, dst.String(), timeout)
			if err != nil {
				return err
			}
			defer c.Close()
			if err := c.SetDeadline(time.Now().Add(timeout)); err != nil {
				return err
			}
			if _, err := c.Write([]byte("x")); err != nil {
				return err
			}
			_, err = io.ReadFull(c, make([]byte, 1))
			return err
		})
		if err == nil {
			return true
		}
		var ne net.Error
		if !errors.As(err, &ne) || !ne.Timeout() {
			t.Fatalf("%s: %v", dst, err)
		}
	}
	return false
}

// TestServiceDeliveredOnNodeJudgedOnArrival: with the local judge hooked
// on the cgroup of a socket of the node, a Service flow delivered to it is
// judged on arrival, before the socket reads it: a refused UDP datagram
// never reaches the backend. The same backend on a socket outside the
// hooked cgroup shows what the hook closes: its datagram arrives, unjudged,
// and only the answer is refused (at the first reply).
func TestServiceDeliveredOnNodeJudgedOnArrival(t *testing.T) {
	requireAfterNAT(t)
	for _, a := range []serviceAddrs{serviceV4, serviceV6} {
		t.Run(a.nft, func(t *testing.T) { serviceJudgedOnArrival(t, a) })
	}
}

func serviceJudgedOnArrival(t *testing.T, a serviceAddrs) {
	s := newServiceNode(t, a, false)
	inside := hookedCgroup(t, s.g)
	const hookedPort, unhookedPort = 8081, 8082
	hooked, unhooked := netip.AddrPortFrom(a.uplink.Addr(), hookedPort), netip.AddrPortFrom(a.uplink.Addr(), unhookedPort)
	toHooked := netip.AddrPortFrom(a.farIP.Addr().Next(), 80)
	toUnhooked := netip.AddrPortFrom(a.farIP.Addr().Next(), 81)
	udpDNAT := func(from, to netip.AddrPort) string {
		return "add rule " + a.nft + " kp pre " + a.match + " daddr " + from.Addr().String() + " udp dport " +
			strconv.Itoa(int(from.Port())) + " dnat to " + to.String() + "\n"
	}
	nsRun(t, s.node, udpDNAT(toHooked, hooked)+udpDNAT(toUnhooked, unhooked), "nft", "-f", "-")
	var got map[uint16]func() int
	inside(func() { got = map[uint16]func() int{hookedPort: udpEcho(t, s.node, hooked)} })
	got[unhookedPort] = udpEcho(t, s.node, unhooked)
	if _, _, err := s.g.SetServices([]Frontend{
		{toHooked.Addr(), toHooked.Port(), unix.IPPROTO_UDP},
		{toUnhooked.Addr(), toUnhooked.Port(), unix.IPPROTO_UDP},
	}); err != nil {
		t.Fatal(err)
	}
	udp := func(first, last uint16) policy.PortRange { return ports(policy.ProtocolUDP, first, last) }
	cases := []struct {
		name    string
		set     policy.Set
		allowed bool
	}{
		{"an ipBlock naming the node's backend admits its Service", bothIsolated(rule(hostPrefix(hooked), udp(hookedPort, unhookedPort))), true},
		{"an except of the node's backend refuses its Service", bothIsolated(except(rule(a.anyPrefix), hostPrefix(hooked))), false},
		{"a rule for the frontend alone admits nothing", bothIsolated(rule(hostPrefix(toHooked), udp(80, 81))), false},
	}
	for _, c := range cases {
		if err := s.cli.ApplyPolicy(c.set); err != nil {
			t.Fatalf("%s: %v", c.name, err)
		}
		for _, p := range []struct {
			front netip.AddrPort
			port  uint16
			// Whether the datagram reaches the backend when refused.
			arrivesRefused bool
		}{{toHooked, hookedPort, false}, {toUnhooked, unhookedPort, true}} {
			before := got[p.port]()
			answered := echoes(t, s.client, "udp", p.front, c.allowed)
			arrived := got[p.port]() > before
			if answered != c.allowed {
				t.Errorf("%s: %s answered %v, want %v", c.name, p.front, answered, c.allowed)
			}
			if want := c.allowed || p.arrivesRefused; arrived != want {
				t.Errorf("%s: %s's datagram reached port %d: %v, want %v", c.name, p.front, p.port, arrived, want)
			}
		}
	}
}

// hookedCgroup makes a cgroup v2 directory for the test, hooks the node's
// local judge at its ingress, and returns a function that runs fn with this
// process in it: a socket belongs to the cgroup of the process that makes
// it, for the socket's life.
func hookedCgroup(t *testing.T, g *Global) (inside func(fn func())) {
	t.Helper()
	dir := kernel.Cgroup(t)
	own, err := os.ReadFile("/proc/self/cgroup")
	if err != nil {
		t.Fatal(err)
	}
	var home string
	for _, l := range strings.Split(string(own), "\n") {
		if p, ok := strings.CutPrefix(l, "0::"); ok {
			home = filepath.Join(filepath.Dir(dir), p)
		}
	}
	if home == "" {
		t.Skip("this process is in no cgroup v2")
	}
	prog, err := LoadLocal(g)
	if err != nil {
		t.Fatal(err)
	}
	defer prog.Close()
	pin := filepath.Join(g.dir, pinpath.LocalLink)
	if err := localhook.Hook(dir, pin, prog); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := localhook.Release(pin); err != nil {
			t.Error(err)
		}
	})
	pid := []byte(strconv.Itoa(os.Getpid()))
	return func(fn func()) {
		if err := os.WriteFile(filepath.Join(dir, "cgroup.procs"), pid, 0o644); err != nil {
			t.Fatal(err)
		}
		defer func() {
			if err := os.WriteFile(filepath.Join(home, "cgroup.procs"), pid, 0o644); err != nil {
				t.Fatalf("back to %s: %v", home, err)
			}
		}()
		fn()
	}
}

// udpEcho answers every datagram to at in n with itself until the test
// ends; the function returned counts those received. Bound to the address,
// as a UDP server on a node of several must be for its answers to leave
// from the address the client's datagram was translated to.
func udpEcho(t *testing.T, n ns.NetNS, at netip.AddrPort) func() int {
	t.Helper()
	var pc net.PacketConn
	netnsutil.Do(t, n, func() error {
		var err error
		pc, err = net.ListenPacket("udp", at.String())
		return err
	})
	var received atomic.Int64
	done := make(chan struct{})
	go func() {
		defer close(done)
		b := make([]byte, 64)
		for {
			k, from, err := pc.ReadFrom(b)
			if err != nil {
				return
			}
			received.Add(1)
			pc.WriteTo(b[:k], from) //nolint:errcheck // the client's loss
		}
	}()
	t.Cleanup(func() {
		pc.Close()
		<-done
	})
	return func() int { return int(received.Load()) }
}
