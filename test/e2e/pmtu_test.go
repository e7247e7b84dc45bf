package e2e

import (
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"strconv"
	"testing"
	"time"

	"github.com/containernetworking/plugins/pkg/ns"
	"github.com/vishvananda/netlink"

	"github.com/podfence/podfence/bpf"
	"github.com/podfence/podfence/pkg/policy"
	"github.com/podfence/podfence/test/netnsutil"
)

// The path of TestPathMTUThroughClosedIngress: node - router - server, the
// router's link to the server with a smaller MTU than the pod's.
var (
	nodeToRouter = netip.MustParsePrefix("10.55.0.1/30")
	routerToNode = netip.MustParsePrefix("10.55.0.2/30")
	routerToSrv  = netip.MustParsePrefix("10.66.0.1/24")
	serverAddr   = netip.MustParsePrefix("10.66.0.2/24")
	podRange     = netip.MustParsePrefix("10.88.0.0/16") // the cluster's host-local range
)

const (
	smallMTU      = 1280
	bulkBytes     = 1 << 20
	bulkPort      = uint16(9000)
	bulkTransferT = 10 * time.Second
)

// TestPathMTUThroughClosedIngress is a live connection that depends on an
// ICMP error from an address no rule allows. A pod whose ingress is closed
// streams to a server behind a router whose next link has a smaller MTU;
// the router answers the pod's full-size segments with "fragmentation
// needed" from its own address. Only its relation to the pod's tracked flow
// lets that in; dropping it is the Path MTU black hole, where the stream
// stalls for good (Linux does not probe for it unless tcp_mtu_probing is
// set).
func TestPathMTUThroughClosedIngress(t *testing.T) {
	for _, mode := range attachModes(t) {
		t.Run(mode, func(t *testing.T) {
			c := newCluster(t, mode)
			router, server := netnsutil.New(t), netnsutil.New(t)
			buildRoutedPath(t, c.node, router, server)

			c.writePolicy("client", egressOnly("client", tcpRule(serverAddr.Masked().String(), bulkPort)))
			client := c.addPod("client", "default")
			routeVia(t, client.netns, serverAddr.Masked())

			got, err := streamTo(t, client.netns, server)
			if err != nil {
				t.Fatalf("stream from the pod through the small-MTU link: %v", err)
			}
			if got != bulkBytes {
				t.Fatalf("server received %d bytes, want %d", got, bulkBytes)
			}

			related := c.counters(t, "client@default")[policy.Ingress][bpf.ReasonCTRelated]
			if related == 0 {
				t.Error("the stream completed without a related ICMP error: the path did not need Path MTU discovery, so this test proves nothing")
			}
			t.Logf("%d bytes through a %d-byte MTU; %d ICMP errors passed as related", got, smallMTU, related)
		})
	}
}

// buildRoutedPath joins node to router and router to server, with routes
// between the pods' range and the server and forwarding on the router. The
// router's link towards the server has smallMTU on the router's side only:
// the server still announces a full-size MSS, so the pod's segments must be
// cut down by Path MTU discovery.
func buildRoutedPath(t *testing.T, node, router, server ns.NetNS) {
	t.Helper()
	netnsutil.AddVeth(t, node, router, "rtr0", nodeToRouter, routerToNode)
	netnsutil.AddVeth(t, router, server, "srv0", routerToSrv, serverAddr)
	route := func(n ns.NetNS, dst netip.Prefix, via netip.Prefix) {
		t.Helper()
		netnsutil.Do(t, n, func() error {
			return netlink.RouteAdd(&netlink.Route{Dst: prefixNet(dst), Gw: via.Addr().AsSlice()})
		})
	}
	route(node, serverAddr.Masked(), routerToNode)
	route(router, podRange, nodeToRouter)
	route(server, netip.MustParsePrefix("0.0.0.0/0"), routerToSrv)
	netnsutil.Do(t, router, func() error {
		l, err := netlink.LinkByName("srv0")
		if err != nil {
			return err
		}
		if err := netlink.LinkSetMTU(l, smallMTU); err != nil {
			return err
		}
		return os.WriteFile("/proc/sys/net/ipv4/ip_forward", []byte("1"), 0o644) // this namespace's
	})
	netnsutil.Do(t, node, func() error {
		return os.WriteFile("/proc/sys/net/ipv4/ip_forward", []byte("1"), 0o644)
	})
}

func prefixNet(p netip.Prefix) *net.IPNet {
	return &net.IPNet{IP: p.Addr().AsSlice(), Mask: net.CIDRMask(p.Bits(), p.Addr().BitLen())}
}

// streamTo sends bulkBytes from the pod to a server in server that counts
// them and answers with the count; it returns that count.
func streamTo(t *testing.T, pod, server ns.NetNS) (int, error) {
	t.Helper()
	var ln net.Listener
	netnsutil.Do(t, server, func() error {
		var err error
		ln, err = net.Listen("tcp4", netip.AddrPortFrom(serverAddr.Addr(), bulkPort).String())
		return err
	})
	defer ln.Close()
	go func() {
		conn, err := ln.Accept()
		if err != nil {
			return
		}
		defer conn.Close()
		_ = conn.SetDeadline(time.Now().Add(bulkTransferT))
		n, _ := io.Copy(io.Discard, conn)
		_, _ = conn.Write([]byte(strconv.FormatInt(n, 10)))
	}()

	var conn net.Conn
	netnsutil.Do(t, pod, func() error {
		var err error
		conn, err = net.DialTimeout("tcp4", netip.AddrPortFrom(serverAddr.Addr(), bulkPort).String(), 2*time.Second)
		return err
	})
	defer conn.Close()
	if err := conn.SetDeadline(time.Now().Add(bulkTransferT)); err != nil {
		return 0, err
	}
	if _, err := conn.Write(make([]byte, bulkBytes)); err != nil {
		return 0, fmt.Errorf("send: %w", err)
	}
	if err := conn.(*net.TCPConn).CloseWrite(); err != nil {
		return 0, err
	}
	reply, err := io.ReadAll(conn)
	if err != nil {
		return 0, fmt.Errorf("read the server's count: %w", err)
	}
	return strconv.Atoi(string(reply))
}
