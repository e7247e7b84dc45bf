package e2e

import (
	"bufio"
	"fmt"
	"net"
	"net/netip"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/containernetworking/plugins/pkg/ns"

	"github.com/podfence/podfence/test/netnsutil"
)

// natFamily is what TestSweepNATShapes needs of one address family.
type natFamily struct {
	name        string       // conntrack -f and the subtest's name
	nft         string       // nftables family, and its address keyword
	podRange    netip.Prefix // the pods' host-local range
	nodeOutside netip.Prefix // the node's address on the outside link
	outside     netip.Prefix // the outside namespace's
	vip         netip.Prefix // the hairpin's service
	any         string       // a CIDR of every address
	podAddr     func(*pod) netip.Addr
}

var natFamilies = []natFamily{
	{"ipv4", "ip", podRange, netip.MustParsePrefix("192.0.2.1/24"), netip.MustParsePrefix("192.0.2.2/24"),
		serviceVIP, "0.0.0.0/0", func(p *pod) netip.Addr { return p.ip }},
	{"ipv6", "ip6", podRange6, netip.MustParsePrefix("2001:db8::1/64"), netip.MustParsePrefix("2001:db8::2/64"),
		serviceVIP6, "::/0", func(p *pod) netip.Addr { return p.ip6 }},
}

const (
	outsidePort  = 9100
	nodePortPort = 30080
)

// nft loads rules into the node namespace; the tables go with it.
func (c *cluster) nft(t testing.TB, rules string) {
	t.Helper()
	cmd := exec.Command("nft", "-f", "-")
	cmd.Stdin = strings.NewReader(rules)
	if err := c.inNode(func() error {
		if out, err := cmd.CombinedOutput(); err != nil {
			return fmt.Errorf("nft: %w: %s", err, out)
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
}

// dialFrom opens an echo connection from n to dst.
func dialFrom(n ns.NetNS, dst netip.AddrPort) (*echoConn, error) {
	var conn net.Conn
	err := n.Do(func(ns.NetNS) error {
		var err error
		conn, err = net.DialTimeout("tcp", dst.String(), time.Second)
		return err
	})
	if err != nil {
		return nil, err
	}
	return &echoConn{Conn: conn, r: bufio.NewReader(conn)}, nil
}

// isolatedWeb is a policy isolating the web replica both ways, open to
// ingress from anywhere on the backend port and to egress per egress.
func isolatedWeb(f natFamily, egress ...docRule) string {
	return endpointDoc{name: "web", pods: []string{webReplicas[0]}, isolate: []string{"Ingress", "Egress"},
		ingress: []docRule{tcpRule(f.any, backendPort)}, egress: egress}.String()
}

// TestSweepNATShapes: the other NAT shapes the liveness rule must cover,
// each with real traffic through nftables NAT in the node namespace, over
// IPv4 and IPv6 (dual-stack pods). While the connection lives, every pass
// keeps the pods' entries as live (the pod-side address of each is known;
// its peer is what NAT made of the other side); once the kernel flow is
// gone, the next pass deletes them.
func TestSweepNATShapes(t *testing.T) {
	shapes := []struct {
		name string
		// setUp builds the shape and returns the connection and the
		// pod-side address:port of each entry it must keep.
		setUp func(t *testing.T, c *cluster, f natFamily) (*echoConn, []netip.AddrPort)
		port  uint16 // its kernel flow's original destination port
	}{{
		name: "pod SNAT to the outside",
		port: outsidePort,
		setUp: func(t *testing.T, c *cluster, f natFamily) (*echoConn, []netip.AddrPort) {
			outside := netnsutil.New(t)
			netnsutil.AddVeth(t, c.node, outside, "out0", f.nodeOutside, f.outside)
			c.nft(t, fmt.Sprintf(`table %[1]s podfence_e2e_snat {
	chain postrouting {
		type nat hook postrouting priority srcnat;
		%[1]s saddr %[2]s oifname "out0" masquerade
	}
}
`, f.nft, f.podRange))
			c.writePolicy("client", egressOnly("client", tcpRule(f.outside.Masked().String(), outsidePort)))
			client := c.addPod("client", "default")
			routeVia(t, client.netns, f.outside.Masked())
			netnsutil.Echo(t, outside, outsidePort)
			conn, err := dialFrom(client.netns, netip.AddrPortFrom(f.outside.Addr(), outsidePort))
			if err != nil {
				t.Fatalf("pod to the outside: %v", err)
			}
			return conn, []netip.AddrPort{netip.MustParseAddrPort(conn.LocalAddr().String())}
		},
	}, {
		name: "NodePort with DNAT and SNAT",
		port: nodePortPort,
		setUp: func(t *testing.T, c *cluster, f natFamily) (*echoConn, []netip.AddrPort) {
			outside := netnsutil.New(t)
			netnsutil.AddVeth(t, c.node, outside, "out0", f.nodeOutside, f.outside)
			c.writePolicy("web", isolatedWeb(f))
			web := c.addPod(webReplicas[0], "default")
			netnsutil.Echo(t, web.netns, backendPort)
			backend := netip.AddrPortFrom(f.podAddr(web), backendPort)
			c.nft(t, fmt.Sprintf(`table %[1]s podfence_e2e_nodeport {
	chain prerouting {
		type nat hook prerouting priority dstnat;
		%[1]s daddr %[2]s tcp dport %[3]d dnat to %[4]s
	}
	chain postrouting {
		type nat hook postrouting priority srcnat;
		%[1]s saddr %[5]s %[1]s daddr %[6]s masquerade
	}
}
`, f.nft, f.nodeOutside.Addr(), nodePortPort, backend, f.outside.Masked(), backend.Addr()))
			conn, err := dialFrom(outside, netip.AddrPortFrom(f.nodeOutside.Addr(), nodePortPort))
			if err != nil {
				t.Fatalf("outside client to the NodePort: %v", err)
			}
			return conn, []netip.AddrPort{backend}
		},
	}, {
		name: "hairpin: a pod through its own service",
		port: servicePort,
		setUp: func(t *testing.T, c *cluster, f natFamily) (*echoConn, []netip.AddrPort) {
			c.writePolicy("web", isolatedWeb(f, tcpRule(f.vip.String(), servicePort)))
			web := c.addPod(webReplicas[0], "default")
			netnsutil.Echo(t, web.netns, backendPort)
			routeVia(t, web.netns, f.vip)
			backend := netip.AddrPortFrom(f.podAddr(web), backendPort)
			// kube-proxy masquerades hairpin traffic, or the pod would see
			// a packet from its own address.
			c.nft(t, fmt.Sprintf(`table %[1]s podfence_e2e_hairpin {
	chain prerouting {
		type nat hook prerouting priority dstnat;
		%[1]s saddr %[2]s %[1]s daddr %[3]s tcp dport %[4]d meta mark set 0x4000 dnat to %[5]s
	}
	chain postrouting {
		type nat hook postrouting priority srcnat;
		meta mark 0x4000 masquerade
	}
}
`, f.nft, backend.Addr(), f.vip.Addr(), servicePort, backend))
			conn, err := dialFrom(web.netns, netip.AddrPortFrom(f.vip.Addr(), servicePort))
			if err != nil {
				t.Fatalf("pod to its own service: %v", err)
			}
			return conn, []netip.AddrPort{netip.MustParseAddrPort(conn.LocalAddr().String()), backend}
		},
	}}
	for _, f := range natFamilies {
		for _, shape := range shapes {
			t.Run(f.name+"/"+shape.name, func(t *testing.T) {
				c := newDualStackCluster(t, attachModes(t)[0])
				conn, pods := shape.setUp(t, c, f)
				defer conn.Close()
				if err := conn.roundTrip("hello"); err != nil {
					t.Fatal(err)
				}
				for pass := range 3 {
					time.Sleep(50 * time.Millisecond) // the entries are older than the pass
					r := c.sweep(t)
					for _, p := range pods {
						e := r.byPod(p)
						if len(e) != 1 || e[0].Decision != "kept" || e[0].Reason != "live" {
							t.Fatalf("pass %d: entries of %s: %+v, want one kept as live; all: %+v", pass, p, e, r.Entries)
						}
					}
					if pass == 0 {
						t.Logf("entries: %+v", r.Entries)
					}
					if err := conn.roundTrip(fmt.Sprintf("after pass %d", pass)); err != nil {
						t.Fatalf("pass %d broke the connection: %v", pass, err)
					}
				}
				conn.Close()
				time.Sleep(50 * time.Millisecond) // the close's packets are tracked
				c.conntrackDelete(t, "-f", f.name, "-p", "tcp", "--orig-port-dst", fmt.Sprint(shape.port))
				time.Sleep(50 * time.Millisecond)
				r := c.sweep(t)
				for _, p := range pods {
					if e := r.byPod(p); len(e) != 1 || e[0].Decision != "deleted" || e[0].Reason != "no-flow" {
						t.Errorf("entries of %s after the kernel flow went: %+v, want one deleted for no-flow", p, e)
					}
				}
			})
		}
	}
}

// byPod returns the pass's entries whose pod side is p.
func (r sweepResult) byPod(p netip.AddrPort) []sweptEntry {
	var out []sweptEntry
	for _, e := range r.Entries {
		if e.Pod == p.String() {
			out = append(out, e)
		}
	}
	return out
}
