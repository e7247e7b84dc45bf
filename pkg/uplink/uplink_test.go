package uplink

import (
	"slices"
	"testing"

	"github.com/vishvananda/netlink"

	"github.com/podfence/podfence/bpf"
	"github.com/podfence/podfence/pkg/attach"
	"github.com/podfence/podfence/pkg/objinfo"
	"github.com/podfence/podfence/pkg/pinpath"
	"github.com/podfence/podfence/test/kernel"
	"github.com/podfence/podfence/test/netnsutil"
)

// TestSync: in a node namespace, the judge goes on every interface but
// loopback and veths, including one added later (a hot-added ENI) and a
// branch device; an interface deleted leaves no pin behind, and
// Release takes the judge off everywhere. Both attach mechanisms.
func TestSync(t *testing.T) {
	kernel.RequireRoot(t)
	if !bpf.AfterNATSupported() {
		t.Skip("no conntrack kfuncs: the uplinks' judge is not loaded on this kernel")
	}
	for _, mode := range []attach.Mode{attach.ModeTCX, attach.ModeTC} {
		t.Run(string(mode), func(t *testing.T) {
			if mode == attach.ModeTCX && attach.TCXSupported() != nil {
				t.Skip("no TCX on this kernel")
			}
			root := kernel.PinRoot(t)
			g, err := bpf.OpenGlobal(pinpath.Root(root).Global(), bpf.GlobalOptions{})
			if err != nil {
				t.Fatal(err)
			}
			defer g.Close()
			prog, err := bpf.LoadUplink(g)
			if err != nil {
				t.Fatal(err)
			}
			defer prog.Close()
			want, err := objinfo.ProgramID(prog)
			if err != nil {
				t.Fatal(err)
			}
			h := Hooks{Dir: pinpath.Root(root).Uplinks(), Program: prog, Mode: mode}
			node, pod := netnsutil.New(t), netnsutil.New(t)
			netnsutil.AddVeth(t, node, pod, "eni1", netnsutil.NodeV4, netnsutil.PodV4)
			hooked := func(name string) bool {
				t.Helper()
				l, err := netlink.LinkByName(name)
				if err != nil {
					t.Fatalf("%s: %v", name, err)
				}
				ids, err := attach.Attached(l.Attrs().Index, attach.HookEgress)
				if err != nil {
					t.Fatalf("%s: %v", name, err)
				}
				return slices.Contains(ids, want)
			}
			netnsutil.Do(t, node, func() error {
				eth1 := &netlink.Bridge{LinkAttrs: netlink.LinkAttrs{Name: "eth1"}}
				if err := netlink.LinkAdd(eth1); err != nil {
					return err
				}
				// A branch device on an interface (a macvlan: this kernel
				// has no VLAN module), named as the VPC CNI's VLANs are.
				eni, err := netlink.LinkByName("eni1")
				if err != nil {
					return err
				}
				if err := netlink.LinkAdd(&netlink.Macvlan{LinkAttrs: netlink.LinkAttrs{Name: "eth1.100", ParentIndex: eni.Attrs().Index}}); err != nil {
					return err
				}
				rep, err := h.Sync()
				if err != nil {
					return err
				}
				slices.Sort(rep.Hooked)
				if !slices.Equal(rep.Hooked, []string{"eth1", "eth1.100"}) {
					t.Errorf("hooked %v, want eth1 and eth1.100", rep.Hooked)
				}
				for name, want := range map[string]bool{"eth1": true, "eth1.100": true, "eni1": false, "lo": false} {
					if got := hooked(name); got != want {
						t.Errorf("%s hooked %v, want %v", name, got, want)
					}
				}
				// A hot-added ENI, and a branch that goes. (Bridges stand for
				// the ENIs: this kernel has no dummy links.)
				if err := netlink.LinkAdd(&netlink.Bridge{LinkAttrs: netlink.LinkAttrs{Name: "eth2"}}); err != nil {
					return err
				}
				vlan, err := netlink.LinkByName("eth1.100")
				if err != nil {
					return err
				}
				if err := netlink.LinkDel(vlan); err != nil {
					return err
				}
				if rep, err = h.Sync(); err != nil {
					return err
				}
				if !hooked("eth2") {
					t.Error("eth2, added after the first sync, not hooked")
				}
				if wantReleased := map[attach.Mode]int{attach.ModeTCX: 1, attach.ModeTC: 0}[mode]; rep.Released != wantReleased {
					t.Errorf("released %d pins, want %d (the deleted VLAN's)", rep.Released, wantReleased)
				}
				if err := h.Release(); err != nil {
					return err
				}
				for _, name := range []string{"eth1", "eth2"} {
					if hooked(name) {
						t.Errorf("%s still hooked after Release", name)
					}
				}
				return nil
			})
		})
	}
}
