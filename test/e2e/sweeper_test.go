package e2e

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/netip"
	"os/exec"
	"testing"
	"time"

	"github.com/containernetworking/plugins/pkg/ns"
	"github.com/vishvananda/netlink"

	"github.com/podfence/podfence/test/netnsutil"
)

// sweepResult is what `podfence-sweeper sweep --json` prints.
type sweepResult struct {
	KernelFlows int            `json:"kernel_flows"`
	Scanned     int            `json:"scanned"`
	Kept        map[string]int `json:"kept"`
	Deleted     map[string]int `json:"deleted"`
	Orphans     []struct {
		Identifier        string `json:"identifier"`
		ContainerID       string `json:"container_id"`
		IdentifierRemoved bool   `json:"identifier_removed"`
	} `json:"orphans_removed"`
	Entries []sweptEntry `json:"entries"`
}

type sweptEntry struct {
	Proto    string `json:"proto"`
	Pod      string `json:"pod"`
	Peer     string `json:"peer"`
	Ifindex  uint32 `json:"ifindex"`
	Owner    string `json:"owner"`
	Decision string `json:"decision"`
	Reason   string `json:"reason"`
}

// find returns the entry of pod -> peer, if the pass saw one.
func (r sweepResult) find(pod, peer netip.AddrPort) (sweptEntry, bool) {
	for _, e := range r.Entries {
		if e.Pod == pod.String() && e.Peer == peer.String() {
			return e, true
		}
	}
	return sweptEntry{}, false
}

// sweeper runs podfence-sweeper in the node namespace and returns its stdout.
func (c *cluster) sweeper(t testing.TB, args ...string) ([]byte, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, c.sweeperBin, args...)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := c.inNode(cmd.Run)
	if err != nil {
		return stdout.Bytes(), fmt.Errorf("podfence-sweeper %v: %w: %s", args, err, stderr.Bytes())
	}
	return stdout.Bytes(), nil
}

// sweep runs one pass. The grace is short so that entries are judged by
// the kernel table, not kept for being recent.
func (c *cluster) sweep(t *testing.T, extra ...string) sweepResult {
	t.Helper()
	args := append([]string{"sweep", "--json", "--pin-root", c.pinRoot, "--grace", "1ms"}, extra...)
	out, err := c.sweeper(t, args...)
	if err != nil {
		t.Fatal(err)
	}
	var r sweepResult
	if err := json.Unmarshal(out, &r); err != nil {
		t.Fatalf("sweep output: %v: %s", err, out)
	}
	return r
}

// conntrackDelete deletes the node's kernel flows that match the conntrack
// tool's filter arguments.
func (c *cluster) conntrackDelete(t *testing.T, args ...string) {
	t.Helper()
	cmd := exec.Command("conntrack", append([]string{"-D"}, args...)...)
	if err := c.inNode(func() error {
		out, err := cmd.CombinedOutput()
		// Exit status 1 with "0 flow entries": nothing matched.
		if err != nil && !bytes.Contains(out, []byte("flow entries have been deleted")) {
			return fmt.Errorf("conntrack -D %v: %w: %s", args, err, out)
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
}

// The IPv6 service of TestSweepKeepsVIPConnection.
var serviceVIP6 = netip.MustParsePrefix("fd96::10/128")

// TestSweepKeepsVIPConnection is the seed's second failure made
// impossible: pod A reaches pod B on the same node through a ClusterIP;
// both pods are isolated and allow only that connection. The kernel holds
// one flow, the maps two entries (A's towards the VIP, B's towards A):
// every pass keeps both while the connection lives, and the pass after
// the kernel flow is gone removes both. IPv4 and IPv6 (dual-stack pods).
func TestSweepKeepsVIPConnection(t *testing.T) {
	for _, family := range []string{"ipv4", "ipv6"} {
		t.Run(family, func(t *testing.T) {
			c := newDualStackCluster(t, attachModes(t)[0])
			vipPrefix, addr := serviceVIP, func(p *pod) netip.Addr { return p.ip }
			if family == "ipv6" {
				vipPrefix, addr = serviceVIP6, func(p *pod) netip.Addr { return p.ip6 }
			}
			vip := netip.AddrPortFrom(vipPrefix.Addr(), servicePort)
			c.writePolicy("client", egressOnly("client", tcpRule(vipPrefix.String(), servicePort)))
			client := c.addPod("client", "default")
			c.writePolicy("web", endpointDoc{name: "web", pods: []string{webReplicas[0]}, isolate: []string{"Ingress", "Egress"},
				ingress: []docRule{tcpRule(netip.PrefixFrom(addr(client), addr(client).BitLen()).String(), backendPort)}}.String())
			web := c.addPod(webReplicas[0], "default")
			netnsutil.Echo(t, web.netns, backendPort)
			backend := netip.AddrPortFrom(addr(web), backendPort)
			table := "ip"
			if family == "ipv6" {
				table = "ip6"
			}
			c.nft(t, fmt.Sprintf(`table %s podfence_e2e_vip {
	chain prerouting {
		type nat hook prerouting priority dstnat;
		%s daddr %s tcp dport %d dnat to %s
	}
}
`, table, table, vip.Addr(), vip.Port(), backend))
			routeVia(t, client.netns, vipPrefix)

			conn, err := dialFrom(client.netns, vip)
			if err != nil {
				t.Fatalf("client to the VIP: %v", err)
			}
			defer conn.Close()
			if err := conn.roundTrip("hello"); err != nil {
				t.Fatal(err)
			}
			local := netip.MustParseAddrPort(conn.LocalAddr().String())

			for pass := range 10 {
				time.Sleep(150 * time.Millisecond) // the entries are older than the pass
				r := c.sweep(t)
				a, okA := r.find(local, vip)
				b, okB := r.find(backend, local)
				if !okA || !okB {
					t.Fatalf("pass %d: client's entry found %v, backend's %v; entries %+v", pass, okA, okB, r.Entries)
				}
				for _, e := range []sweptEntry{a, b} {
					if e.Decision != "kept" || e.Reason != "live" {
						t.Fatalf("pass %d: entry %s -> %s %s (%s), want kept as live", pass, e.Pod, e.Peer, e.Decision, e.Reason)
					}
				}
				if err := conn.roundTrip(fmt.Sprintf("after pass %d", pass)); err != nil {
					t.Fatalf("pass %d broke the connection: %v", pass, err)
				}
			}

			conn.Close()
			time.Sleep(50 * time.Millisecond) // the close's packets are tracked
			c.conntrackDelete(t, "-f", family, "-p", "tcp", "--orig-src", local.Addr().String())
			time.Sleep(150 * time.Millisecond)
			r := c.sweep(t)
			for _, e := range [][2]netip.AddrPort{{local, vip}, {backend, local}} {
				got, ok := r.find(e[0], e[1])
				if !ok || got.Decision != "deleted" || got.Reason != "no-flow" {
					t.Errorf("entry %s -> %s after its kernel flow went: %+v (seen %v), want deleted for no-flow", e[0], e[1], got, ok)
				}
			}
			r = c.sweep(t)
			for _, e := range [][2]netip.AddrPort{{local, vip}, {backend, local}} {
				if got, ok := r.find(e[0], e[1]); ok {
					t.Errorf("entry %s -> %s still in the map after its deletion: %+v", e[0], e[1], got)
				}
			}
		})
	}
}

// routeVia sends the pod's traffic for dst the way its traffic for the
// pod range of dst's family goes (the ptp conflist routes only that).
func routeVia(t *testing.T, pod ns.NetNS, dst netip.Prefix) {
	t.Helper()
	family, podNet := netlink.FAMILY_V4, podRange
	if dst.Addr().Is6() {
		family, podNet = netlink.FAMILY_V6, podRange6
	}
	netnsutil.Do(t, pod, func() error {
		routes, err := netlink.RouteList(nil, family)
		if err != nil {
			return err
		}
		for _, r := range routes {
			if r.Dst != nil && r.Dst.String() == podNet.String() && r.Gw != nil {
				return netlink.RouteAdd(&netlink.Route{LinkIndex: r.LinkIndex, Dst: prefixNet(dst), Gw: r.Gw})
			}
		}
		return fmt.Errorf("no route for %s in the pod: %v", podNet, routes)
	})
}
