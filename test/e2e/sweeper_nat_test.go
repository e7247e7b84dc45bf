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

// The outside of TestSweepNATShapes: a namespace beyond the node, reached
// through its own link, as the Internet or a NodePort client would be.
var (
	nodeOutside = netip.MustParsePrefix("192.0.2.1/24")
	outsideAddr = netip.MustParsePrefix("192.0.2.2/24")
)

const (
	outsidePort  = 9100
	nodePortPort = 30080
)

// nft loads rules into the node namespace; the tables go with it.
func (c *cluster) nft(t *testing.T, rules string) {
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

// TestSweepNATShapes: the other NAT shapes the liveness rule must cover,
// each with real traffic through nftables NAT in the node namespace. While
// the connection lives, every pass keeps the pods' entries as live (the
// pod-side address of each is known; its peer is what NAT made of the
// other side); once the kernel flow is gone, the next pass deletes them.
func TestSweepNATShapes(t *testing.T) {
	for _, tc := range []struct {
		name string
		// setUp builds the shape and returns the connection and the
		// pod-side address:port of each entry it must keep.
		setUp func(t *testing.T, c *cluster) (*echoConn, []netip.AddrPort)
		flow  []string // conntrack -D filter of its kernel flow
	}{{
		name: "pod SNAT to the outside",
		setUp: func(t *testing.T, c *cluster) (*echoConn, []netip.AddrPort) {
			outside := netnsutil.New(t)
			netnsutil.AddVeth(t, c.node, outside, "out0", nodeOutside, outsideAddr)
			c.nft(t, `table ip podfence_e2e_snat {
	chain postrouting {
		type nat hook postrouting priority srcnat;
		ip saddr 10.88.0.0/16 oifname "out0" masquerade
	}
}
`)
			c.writePolicy("client", egressOnly("client", tcpRule(outsideAddr.Masked().String(), outsidePort)))
			client := c.addPod("client", "default")
			routeLikeCluster(t, client.netns, outsideAddr.Masked())
			echoServer(t, outside, outsidePort)
			conn, err := dialFrom(client.netns, netip.AddrPortFrom(outsideAddr.Addr(), outsidePort))
			if err != nil {
				t.Fatalf("pod to the outside: %v", err)
			}
			return conn, []netip.AddrPort{netip.MustParseAddrPort(conn.LocalAddr().String())}
		},
		flow: []string{"-p", "tcp", "--orig-port-dst", fmt.Sprint(outsidePort)},
	}, {
		name: "NodePort with DNAT and SNAT",
		setUp: func(t *testing.T, c *cluster) (*echoConn, []netip.AddrPort) {
			outside := netnsutil.New(t)
			netnsutil.AddVeth(t, c.node, outside, "out0", nodeOutside, outsideAddr)
			c.writePolicy("web", endpointDoc{name: "web", pods: []string{webReplicas[0]}, isolate: []string{"Ingress", "Egress"},
				ingress: []docRule{tcpRule("0.0.0.0/0", backendPort)}}.String())
			web := c.addPod(webReplicas[0], "default")
			echoServer(t, web.netns, backendPort)
			c.nft(t, fmt.Sprintf(`table ip podfence_e2e_nodeport {
	chain prerouting {
		type nat hook prerouting priority dstnat;
		ip daddr %s tcp dport %d dnat to %s:%d
	}
	chain postrouting {
		type nat hook postrouting priority srcnat;
		ip saddr %s ip daddr %s masquerade
	}
}
`, nodeOutside.Addr(), nodePortPort, web.ip, backendPort, outsideAddr.Masked(), web.ip))
			conn, err := dialFrom(outside, netip.AddrPortFrom(nodeOutside.Addr(), nodePortPort))
			if err != nil {
				t.Fatalf("outside client to the NodePort: %v", err)
			}
			return conn, []netip.AddrPort{netip.AddrPortFrom(web.ip, backendPort)}
		},
		flow: []string{"-p", "tcp", "--orig-port-dst", fmt.Sprint(nodePortPort)},
	}, {
		name: "hairpin: a pod through its own service",
		setUp: func(t *testing.T, c *cluster) (*echoConn, []netip.AddrPort) {
			c.writePolicy("web", endpointDoc{name: "web", pods: []string{webReplicas[0]}, isolate: []string{"Ingress", "Egress"},
				ingress: []docRule{tcpRule("0.0.0.0/0", backendPort)},
				egress:  []docRule{tcpRule(serviceVIP.String(), servicePort)}}.String())
			web := c.addPod(webReplicas[0], "default")
			echoServer(t, web.netns, backendPort)
			routeLikeCluster(t, web.netns, serviceVIP)
			// kube-proxy masquerades hairpin traffic, or the pod would see
			// a packet from its own address.
			c.nft(t, fmt.Sprintf(`table ip podfence_e2e_hairpin {
	chain prerouting {
		type nat hook prerouting priority dstnat;
		ip saddr %[1]s ip daddr %[2]s tcp dport %[3]d meta mark set 0x4000 dnat to %[1]s:%[4]d
	}
	chain postrouting {
		type nat hook postrouting priority srcnat;
		meta mark 0x4000 masquerade
	}
}
`, web.ip, serviceVIP.Addr(), servicePort, backendPort))
			conn, err := dialEcho(web.netns)
			if err != nil {
				t.Fatalf("pod to its own service: %v", err)
			}
			return conn, []netip.AddrPort{netip.MustParseAddrPort(conn.LocalAddr().String()), netip.AddrPortFrom(web.ip, backendPort)}
		},
		flow: []string{"-p", "tcp", "--orig-port-dst", fmt.Sprint(servicePort)},
	}} {
		t.Run(tc.name, func(t *testing.T) {
			c := newCluster(t, attachModes(t)[0])
			conn, pods := tc.setUp(t, c)
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
			c.conntrackDelete(t, tc.flow...)
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
