package bpf

import (
	"bytes"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/cilium/ebpf/btf"
	"github.com/containernetworking/plugins/pkg/ns"
	"github.com/vishvananda/netlink"

	"github.com/podfence/podfence/bpf/bound"
	"github.com/podfence/podfence/pkg/attach"
	"github.com/podfence/podfence/test/kernel"
	"github.com/podfence/podfence/test/netnsutil"
)

// TestAfterNATFacilities checks on this kernel what the chosen design for
// judging egress after Service translation (README, "Judging egress after
// Service translation", design M+C) relies on, with bpf/bound's programs
// on a node namespace that DNATs a ClusterIP with an nftables rule as
// kube-proxy does, with and without a masquerade:
//
//   - a mark the sending pod's veth writes at its TC ingress is still on
//     the packet at the TC egress of the device the DNATed packet leaves
//     by (the backend's veth), and finds the sender's judge there;
//   - at that hook the kernel's conntrack entry of the new flow exists
//     (confirmed), is found by the packet's reversed tuple, and gives the
//     tuple the pod sent: its source though a masquerade replaced it, the
//     ClusterIP and port though the DNAT replaced them;
//   - the judgement is taken on the backend's address: a trie that names
//     the backend admits the Service, one that does not refuses it, and
//     traffic no pod stamped is left alone.
func TestAfterNATFacilities(t *testing.T) {
	kernel.RequireRoot(t)
	if _, err := exec.LookPath("nft"); err != nil {
		t.Skip("needs nft for the DNAT rule (installed by hack/deps.sh; kernel guests have none)")
	}
	if k, err := btf.LoadKernelSpec(); err != nil {
		t.Skipf("no kernel BTF: %v", err)
	} else if _, err := k.AnyTypeByName("bpf_skb_ct_lookup"); err != nil {
		t.Skip("no conntrack kfuncs (Linux 5.18 and later): design M+C cannot run here")
	}
	var (
		clusterIP = netip.MustParseAddrPort("10.96.0.10:80")
		clientNet = netip.MustParsePrefix("10.71.1.1/24") // the node's end
		client    = netip.MustParsePrefix("10.71.1.2/24")
		backNet   = netip.MustParsePrefix("10.71.2.1/24")
		backend   = netip.MustParseAddrPort("10.71.2.2:8080")
	)
	for _, masquerade := range []bool{false, true} {
		name := "dnat"
		if masquerade {
			name = "dnat+masquerade"
		}
		t.Run(name, func(t *testing.T) {
			node, cli, back := netnsutil.New(t), netnsutil.New(t), netnsutil.New(t)
			cv := netnsutil.AddVeth(t, node, cli, "cli", clientNet, client)
			bv := netnsutil.AddVeth(t, node, back, "bck", backNet, netip.PrefixFrom(backend.Addr(), 24))
			defaultRoute(t, cli, clientNet.Addr())
			defaultRoute(t, back, backNet.Addr())
			nftRules := "table ip kp {\n chain pre { type nat hook prerouting priority -100;\n" +
				"  ip daddr " + clusterIP.Addr().String() + " tcp dport " + strconv.Itoa(int(clusterIP.Port())) +
				" dnat to " + backend.String() + "\n }\n"
			if masquerade {
				nftRules += " chain post { type nat hook postrouting priority 100;\n" +
					"  oifname \"bck\" ip saddr " + client.Addr().String() + " masquerade\n }\n"
			}
			nftRules += "}\n"
			netnsutil.Do(t, node, func() error {
				return os.WriteFile("/proc/sys/net/ipv4/ip_forward", []byte("1"), 0o644) // this namespace's
			})
			nsRun(t, node, nftRules, "nft", "-f", "-")
			seen := netnsutil.Listen(t, back, backend.Port())

			o, err := bound.LoadCopy(bound.CopyOptions{Slot: 0})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { o.Close() })
			if err := o.Judges.Put(uint32(0), o.JudgeAfterNat); err != nil {
				t.Fatal(err)
			}
			netnsutil.Do(t, node, func() error {
				if _, err := attach.Attach(attach.Options{Ifindex: cv.HostIndex, Hook: attach.HookIngress,
					Program: o.StampSlot, Mode: attach.ModeTC}); err != nil {
					return err
				}
				_, err := attach.Attach(attach.Options{Ifindex: bv.HostIndex, Hook: attach.HookEgress,
					Program: o.AfterNat, Mode: attach.ModeTC})
				return err
			})
			backendKey := lpmKey(netip.PrefixFrom(backend.Addr(), 32))

			// The trie does not name the backend: the Service is refused at
			// the backend's veth, and nothing reaches the backend.
			if netnsutil.Connects(t, cli, clusterIP, 300*time.Millisecond, 2) {
				t.Fatalf("connected to %s with no rule for its backend %s", clusterIP, backend)
			}
			// Named: admitted, and the flow is recorded under the tuple the
			// pod sent.
			if err := o.PolInV4.Put(backendKey, make([]byte, o.PolInV4.ValueSize())); err != nil {
				t.Fatal(err)
			}
			if !netnsutil.Connects(t, cli, clusterIP, time.Second, 3) {
				t.Fatalf("connection to %s refused with a rule for its backend %s", clusterIP, backend)
			}
			// The backend's accept may be recorded after the dial returned;
			// nothing else has reached it yet.
			from := seen()
			for deadline := time.Now().Add(2 * time.Second); !from.IsValid() && time.Now().Before(deadline); from = seen() {
				time.Sleep(10 * time.Millisecond)
			}
			wantFrom := client.Addr()
			if masquerade {
				wantFrom = backNet.Addr()
			}
			if from != wantFrom {
				t.Fatalf("the backend saw the connection from %s, want %s (masquerade %v)", from, wantFrom, masquerade)
			}
			var (
				k     podfenceCtKeyV4
				v     podfenceCtValue
				found bool
			)
			for it := o.CtV4.Iterate(); it.Next(&k, &v); {
				if netip.AddrFrom4(k.Src) == client.Addr() && netip.AddrFrom4(k.Dst) == clusterIP.Addr() &&
					k.Dport == clusterIP.Port() && k.Proto == 6 {
					found = true
				}
				if netip.AddrFrom4(k.Dst) == backend.Addr() || netip.AddrFrom4(k.Src) != client.Addr() {
					t.Errorf("flow recorded under the translated tuple: %v -> %v:%d", k.Src, k.Dst, k.Dport)
				}
			}
			if !found {
				t.Fatalf("no flow %s -> %s recorded: the conntrack kfunc did not give the original tuple", client.Addr(), clusterIP)
			}
			// Revoked: refused again.
			if err := o.PolInV4.Delete(backendKey); err != nil {
				t.Fatal(err)
			}
			if netnsutil.Connects(t, cli, clusterIP, 300*time.Millisecond, 2) {
				t.Fatalf("connected to %s after its backend's rule was removed", clusterIP)
			}
			// Unstamped traffic to the same backend is not judged there.
			if !netnsutil.Connects(t, node, backend, time.Second, 3) {
				t.Fatalf("the node's own connection to %s was dropped", backend)
			}
		})
	}
}

// defaultRoute routes everything in n via gw.
func defaultRoute(t *testing.T, n ns.NetNS, gw netip.Addr) {
	t.Helper()
	netnsutil.Do(t, n, func() error {
		return netlink.RouteAdd(&netlink.Route{Dst: &net.IPNet{IP: net.IPv4zero, Mask: net.CIDRMask(0, 32)}, Gw: gw.AsSlice()})
	})
}

// nsRun runs a command with stdin in n's network namespace (nsenter: no
// remount of /sys, unlike ip netns exec).
func nsRun(tb testing.TB, n ns.NetNS, stdin, name string, args ...string) {
	tb.Helper()
	cmd := exec.Command("nsenter", append([]string{"--net=" + n.Path(), name}, args...)...)
	cmd.Stdin = strings.NewReader(stdin)
	if out, err := cmd.CombinedOutput(); err != nil {
		tb.Fatalf("%s %s: %v: %s", name, strings.Join(args, " "), err, bytes.TrimSpace(out))
	}
}
