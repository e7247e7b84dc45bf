package e2e

import (
	"errors"
	"os"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/podfence/podfence/bpf"
	"github.com/podfence/podfence/pkg/attach"
)

const webID = "web-7f65cc6544@default"

var webReplicas = []string{"web-7f65cc6544-9j58r", "web-7f65cc6544-x2k4p", "web-7f65cc6544-bcdfg"}

// TestScaleDownKeepsSharedPins is the seed's first failure: replicas of one
// ReplicaSet share pins, and deleting one must not take them from the others.
func TestScaleDownKeepsSharedPins(t *testing.T) {
	for _, mode := range attachModes(t) {
		t.Run(mode, func(t *testing.T) {
			c := newCluster(t, mode)
			allowed := c.addPod("client-allowed", "default")
			denied := c.addPod("client-denied", "default")
			c.writePolicy("web", allowFrom(webReplicas, 8080, allowed))

			var webs []*pod
			for _, name := range webReplicas {
				w := c.addPod(name, "default")
				netnsutilListen(t, w, 8080)
				webs = append(webs, w)
			}
			ingress, egress, err := bpf.PinnedProgramIDs(c.identifierDir(string(webID)))
			if err != nil {
				t.Fatal(err)
			}
			checkEnforced := func(ws []*pod) {
				t.Helper()
				for _, w := range ws {
					if !c.connects(allowed, w, 8080) {
						t.Errorf("%s: allowed client cannot connect", w.name)
					}
					if c.connects(denied, w, 8080) {
						t.Errorf("%s: denied client connects", w.name)
					}
				}
			}
			checkEnforced(webs)

			c.delPod(webs[0])
			if !exists(c.identifierDir(webID)) {
				t.Fatal("pins removed while two replicas still use them")
			}
			if i2, e2, err := bpf.PinnedProgramIDs(c.identifierDir(string(webID))); err != nil || i2 != ingress || e2 != egress {
				t.Fatalf("programs changed after one replica left: %d/%d -> %d/%d (%v)", ingress, egress, i2, e2, err)
			}
			checkEnforced(webs[1:])

			c.delPod(webs[1])
			c.delPod(webs[2])
			if exists(c.identifierDir(webID)) {
				t.Error("the last replica's DEL left the identifier's pins")
			}
			// Nothing holds the programs any more: no pin, no link, no
			// filter on any interface of the node.
			for _, id := range []ebpf.ProgramID{ingress, egress} {
				if p, err := ebpf.NewProgramFromID(id); err == nil {
					p.Close()
					t.Errorf("program %d still loaded after the last replica left", id)
				} else if !errors.Is(err, os.ErrNotExist) {
					t.Errorf("program %d: %v", id, err)
				}
			}
			if err := c.inNode(func() error {
				h, err := netlink.NewHandle(unix.NETLINK_ROUTE)
				if err != nil {
					return err
				}
				defer h.Close()
				links, err := h.LinkList()
				if err != nil {
					return err
				}
				for _, l := range links {
					for _, hook := range []attach.Hook{attach.HookIngress, attach.HookEgress} {
						ids, err := attach.Attached(l.Attrs().Index, hook)
						if err != nil {
							return err
						}
						for _, id := range ids {
							if id == ingress || id == egress {
								t.Errorf("%s %s still runs a web program", l.Attrs().Name, hook)
							}
						}
					}
				}
				return nil
			}); err != nil {
				t.Fatal(err)
			}
			// The clients are untouched.
			if !exists(c.identifierDir("client-allowed@default")) {
				t.Error("another identifier's pins went with web's")
			}
		})
	}
}
