package e2e

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/vishvananda/netlink"

	"github.com/podfence/podfence/pkg/attach"
	"github.com/podfence/podfence/pkg/objinfo"
	"github.com/podfence/podfence/pkg/pinpath"
	"github.com/podfence/podfence/pkg/podid"
)

// globalObjects are the node-wide maps pinned now.
func (c *cluster) globalObjects(t *testing.T) kernelObjects {
	t.Helper()
	var o kernelObjects
	for _, name := range pinpath.GlobalMaps() {
		m, err := ebpf.LoadPinnedMap(filepath.Join(pinpath.Root(c.pinRoot).Global(), name), &ebpf.LoadPinOptions{ReadOnly: true})
		if err != nil {
			t.Fatalf("global map %s: %v", name, err)
		}
		id, err := objinfo.MapID(m)
		m.Close()
		if err != nil {
			t.Fatal(err)
		}
		o.maps = append(o.maps, id)
	}
	return o
}

// TestUninstall: `podfence-sweeper uninstall` takes podfence off a node:
// out of the chain, every pod's hooks off its veth, every pin, so that no
// program or map of podfence stays loaded. The pods keep running: a
// connection open before it lives on, and a pod the policy fenced is
// reachable by anyone. A second run finds nothing to do.
func TestUninstall(t *testing.T) {
	for _, mode := range attachModes(t) {
		t.Run(mode, func(t *testing.T) {
			c := lcCluster(t, mode)
			client, intruder, web := c.guardedWeb(t)
			replica := c.addPod(webReplicas[1], "default")
			pods := []*pod{client, intruder, web, replica}
			if c.connects(intruder, web, backendPort) {
				t.Fatal("the intruder reaches the web pod before the uninstall: the policy is not enforced")
			}
			conn, err := dialFrom(client.netns, mustAddrPort(web.ip.String()+":8080"))
			if err != nil {
				t.Fatal(err)
			}
			defer conn.Close()
			if err := conn.roundTrip("before"); err != nil {
				t.Fatal(err)
			}

			objects := c.globalObjects(t)
			ids, err := os.ReadDir(pinpath.Root(c.pinRoot).Identifiers())
			if err != nil || len(ids) != 3 {
				t.Fatalf("identifiers %v (%v), want 3", ids, err)
			}
			for _, id := range ids {
				objects.add(c.pinnedObjects(podid.ID(id.Name())))
			}

			confDir, cniBin := t.TempDir(), t.TempDir()
			vpc, err := os.ReadFile("../../pkg/cniconf/testdata/10-aws.conflist")
			if err != nil {
				t.Fatal(err)
			}
			conflist := filepath.Join(confDir, "10-aws.conflist")
			if err := os.WriteFile(conflist, vpc, 0o644); err != nil {
				t.Fatal(err)
			}
			dirs := []string{"--cni-conf-dir", confDir, "--cni-bin-dir", cniBin}
			if out, err := installCNI(t, append([]string{"install-cni", "--plugin", filepath.Join(binDir, "podfence")}, dirs...)...); err != nil {
				t.Fatalf("install-cni: %v\n%s", err, out)
			}

			uninstall := func() string {
				t.Helper()
				out, err := c.sweeper(t, append([]string{"uninstall", "--pin-root", c.pinRoot}, dirs...)...)
				if err != nil {
					t.Fatalf("uninstall: %v\n%s", err, out)
				}
				return string(out)
			}
			// What a sweeper killed while it recorded a policy error
			// leaves (under the name earlier builds used):
			// the root must go all the same.
			if err := os.Symlink("error=x", filepath.Join(c.pinRoot, pinpath.PolicyErrorTempV2)); err != nil {
				t.Fatal(err)
			}
			out := uninstall()
			if !strings.Contains(out, "took 4 pods' hooks off their veths, removed 3 identifiers") {
				t.Errorf("uninstall said:\n%s", out)
			}

			if exists(c.pinRoot) {
				t.Errorf("the pin root %s is still there", c.pinRoot)
			}
			if got, _ := os.ReadFile(conflist); strings.Contains(string(got), "podfence") {
				t.Errorf("the conflist still names podfence:\n%s", got)
			}
			if exists(filepath.Join(cniBin, "podfence")) {
				t.Error("the plugin binary is still installed")
			}
			for _, p := range pods {
				var ifindex int
				if err := c.inNode(func() error {
					l, err := netlink.LinkByName(p.hostVeth)
					if err == nil {
						ifindex = l.Attrs().Index
					}
					return err
				}); err != nil {
					t.Fatalf("%s's veth: %v", p.name, err)
				}
				for _, h := range []attach.Hook{attach.HookIngress, attach.HookEgress} {
					if progs, err := c.attached(ifindex, h); err != nil || len(progs) > 0 {
						t.Errorf("%s %s: programs %v still attached (%v)", p.hostVeth, h, progs, err)
					}
				}
			}
			waitFreed(t, "after uninstall", objects)

			if err := conn.roundTrip("after"); err != nil {
				t.Errorf("the connection open before the uninstall: %v", err)
			}
			if !c.connects(intruder, web, backendPort) {
				t.Error("the intruder cannot reach the web pod after the uninstall: it is still fenced")
			}
			if out := uninstall(); !strings.Contains(out, "took 0 pods' hooks off their veths, removed 0 identifiers") {
				t.Errorf("a second uninstall said:\n%s", out)
			}
		})
	}
}
