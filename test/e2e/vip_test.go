package e2e

import (
	"bufio"
	"fmt"
	"net"
	"net/netip"
	"testing"
	"time"

	"github.com/containernetworking/plugins/pkg/ns"

	"github.com/podfence/podfence/bpf"
	"github.com/podfence/podfence/pkg/membership"
	"github.com/podfence/podfence/pkg/podid"
	"github.com/podfence/podfence/pkg/policy"
	"github.com/podfence/podfence/test/netnsutil"
)

// The service of TestServiceVIPConnection: kube-proxy's DNAT, played by an
// nftables rule in the node namespace.
var serviceVIP = netip.MustParsePrefix("10.96.0.10/32")

const (
	servicePort = 80
	backendPort = 8080
)

// TestServiceVIPConnection is the seed's second scene at the datapath: pod
// A talks to a ClusterIP whose backend B is on the same node. A's egress
// program sees the VIP (it runs before the node's DNAT), B's ingress
// program sees A; each tracks the one kernel flow under its own key. A live
// connection must survive a policy change that still allows it, at both
// ends, and end when B's policy revokes it. Both ways A's egress is
// judged: on the VIP (no frontends in the services map: a kernel without
// the conntrack kfuncs, or a node whose sweeper follows no Services) and
// on B after the DNAT (the VIP a frontend; A's policy names B, not the VIP).
func TestServiceVIPConnection(t *testing.T) {
	for _, mode := range attachModes(t) {
		for _, judged := range []string{"frontend", "backend"} {
			t.Run(mode+"/"+judged, func(t *testing.T) {
				if judged == "backend" && !bpf.AfterNATSupported() {
					t.Skip("no conntrack kfuncs: Services are judged on the frontend here")
				}
				serviceVIPConnection(t, mode, judged == "backend")
			})
		}
	}
}

func serviceVIPConnection(t *testing.T, mode string, onBackend bool) {
	c := newCluster(t, mode)
	const clientID = "client@default"
	toVIP := tcpRule(serviceVIP.String(), servicePort)
	client, stranger, web := c.vipScene(t)
	if onBackend {
		c.setServices(t, bpf.Frontend{Addr: serviceVIP.Addr(), Port: servicePort, Proto: 6})
		toVIP = tcpRule(host(web), backendPort)
		c.writePolicy("client", egressOnly("client", toVIP))
		c.applyPolicy(t, clientID)
	}

	if conn, err := dialEcho(stranger.netns); err == nil {
		conn.Close()
		t.Fatal("a client the backend's policy does not name reached it through the VIP")
	}
	conn, err := dialEcho(client.netns)
	if err != nil {
		t.Fatalf("client to the VIP: %v", err)
	}
	defer conn.Close()
	if err := conn.roundTrip("before"); err != nil {
		t.Fatalf("first message: %v", err)
	}

	// A new generation at both ends that still allows the flow: the
	// live connection's entries are re-checked and kept. Traffic
	// alone cannot tell, since a lost entry is re-created by the
	// next segment where the policy allows a new flow; the reasons
	// can: nothing revoked and no new flow allowed, only tracked
	// packets. (Other reasons are left alone: a pod's own IPv6
	// router solicitations may be denied meanwhile.)
	c.writePolicy("web", backendPolicy(client.ip, backendPort, backendPort+1))
	c.applyPolicy(t, webID)
	c.writePolicy("client", egressOnly("client", toVIP, docRule{cidr: "10.97.0.0/16"}))
	c.applyPolicy(t, clientID)
	before := map[podid.ID]bpf.Counters{webID: c.counters(t, webID), clientID: c.counters(t, clientID)}
	if err := conn.roundTrip("after an unrelated change"); err != nil {
		t.Fatalf("live VIP connection broken by a policy change that still allows it: %v", err)
	}
	for id, b := range before {
		a := c.counters(t, id)
		tracked := uint64(0)
		for d := range a {
			for _, r := range []bpf.Reason{bpf.ReasonRevoked, bpf.ReasonPolicyAllow, bpf.ReasonNotIsolated} {
				if n := a[d][r] - b[d][r]; n != 0 {
					t.Errorf("%s %s: %d packets %s after a change that keeps the flow", id, policy.Direction(d), n, r)
				}
			}
			tracked += a[d][bpf.ReasonCTEstablished] - b[d][bpf.ReasonCTEstablished] + a[d][bpf.ReasonCTReply] - b[d][bpf.ReasonCTReply]
		}
		if tracked == 0 {
			t.Errorf("%s: the round trip passed no tracked packet", id)
		}
	}

	c.writePolicy("web", backendPolicy(stranger.ip, backendPort))
	c.applyPolicy(t, webID)
	if err := conn.roundTrip("after revocation"); err == nil {
		t.Fatal("connection still works after the backend's policy revoked it")
	}
	if n := c.counters(t, webID)[policy.Ingress][bpf.ReasonRevoked]; n == 0 {
		t.Error("the backend dropped the revoked connection without counting it revoked")
	}
}

// setServices makes the node's services map hold exactly frontends, as the
// sweeper does from the cluster's Services.
func (c *cluster) setServices(t *testing.T, frontends ...bpf.Frontend) {
	t.Helper()
	g, err := bpf.OpenGlobal(globalDir(c.pinRoot), bpf.GlobalOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer g.Close()
	if _, _, err := g.SetServices(frontends); err != nil {
		t.Fatal(err)
	}
}

// vipScene adds a client whose egress policy allows the service VIP, a
// stranger, and the web backend behind the VIP (kube-proxy's DNAT), whose
// policy lets only the client in.
func (c *cluster) vipScene(t *testing.T) (client, stranger, web *pod) {
	t.Helper()
	c.writePolicy("client", egressOnly("client", tcpRule(serviceVIP.String(), servicePort)))
	client = c.addPod("client", "default")
	stranger = c.addPod("stranger", "default")
	c.writePolicy("web", backendPolicy(client.ip, backendPort))
	web = c.addPod(webReplicas[0], "default")
	netnsutil.Echo(t, web.netns, backendPort)
	c.dnat(serviceVIP.Addr(), servicePort, web.ip, backendPort)
	for _, p := range []*pod{client, stranger} {
		routeVia(t, p.netns, serviceVIP)
	}
	return client, stranger, web
}

// backendPolicy selects the web replicas, isolates both directions and
// lets client in on ports.
func backendPolicy(client netip.Addr, ports ...uint16) string {
	return endpointDoc{
		name: "web", pods: []string{webReplicas[0]}, isolate: []string{"Ingress", "Egress"},
		ingress: []docRule{tcpRule(client.String()+"/32", ports...)},
	}.String()
}

// dnat makes connections to vip:port go to backend:backendPort, as
// kube-proxy's nftables mode does. The table goes with the node namespace.
func (c *cluster) dnat(vip netip.Addr, port uint16, backend netip.Addr, backendPort uint16) {
	c.t.Helper()
	c.nft(c.t, fmt.Sprintf(`table ip podfence_e2e {
	chain prerouting {
		type nat hook prerouting priority dstnat;
		ip daddr %s tcp dport %d dnat to %s:%d
	}
}
`, vip, port, backend, backendPort))
}

// applyPolicy programs what the policy directory now says for id into its
// live maps, under the identifier's lock, as a policy push does.
func (c *cluster) applyPolicy(t *testing.T, id podid.ID) {
	t.Helper()
	docs, err := policy.LoadDir(c.policyDir)
	if err != nil {
		t.Fatal(err)
	}
	lock, err := membership.New(c.pinRoot).Lock(id)
	if err != nil {
		t.Fatal(err)
	}
	defer lock.Unlock()
	c.withIdentifier(t, id, func(ident *bpf.Datapath) error {
		return ident.ApplyPolicy(policy.ForIdentifier(docs, id, policy.ModeStandard))
	})
}

// counters reads an identifier's packet counts by direction and reason.
func (c *cluster) counters(t *testing.T, id podid.ID) bpf.Counters {
	t.Helper()
	var counts bpf.Counters
	c.withIdentifier(t, id, func(ident *bpf.Datapath) error {
		var err error
		counts, err = ident.ReadCounters()
		return err
	})
	return counts
}

// withIdentifier runs fn on the pinned objects of an identifier that a
// pod's ADD has created.
func (c *cluster) withIdentifier(t *testing.T, id podid.ID, fn func(*bpf.Datapath) error) {
	t.Helper()
	g, err := bpf.OpenGlobal(globalDir(c.pinRoot), bpf.GlobalOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer g.Close()
	ident, err := bpf.OpenIdentifier(g, c.identifierDir(string(id)), id)
	if err != nil {
		t.Fatal(err)
	}
	defer ident.Close()
	if err := fn(ident); err != nil {
		t.Fatal(err)
	}
}

type echoConn struct {
	net.Conn
	r *bufio.Reader
}

// dialEcho connects from n to the service VIP.
func dialEcho(n ns.NetNS) (*echoConn, error) {
	return dialFrom(n, netip.AddrPortFrom(serviceVIP.Addr(), servicePort))
}

// roundTrip sends msg and expects it back within a second. A dropped
// segment is retransmitted well within that.
func (e *echoConn) roundTrip(msg string) error {
	if err := e.SetDeadline(time.Now().Add(time.Second)); err != nil {
		return err
	}
	if _, err := e.Write([]byte(msg + "\n")); err != nil {
		return err
	}
	got, err := e.r.ReadString('\n')
	if err != nil {
		return err
	}
	if got != msg+"\n" {
		return fmt.Errorf("echo %q, want %q", got, msg)
	}
	return nil
}
