package e2e

import (
	"errors"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"testing"
	"time"

	"github.com/podfence/podfence/bpf"
	"github.com/podfence/podfence/pkg/liveness"
	"github.com/podfence/podfence/pkg/membership"
	"github.com/podfence/podfence/pkg/pinpath"
	"github.com/podfence/podfence/pkg/podid"
)

// writeEntry puts an old conntrack entry owned by ifindex into the node's
// map, as the datapath would have written it long ago.
func (c *cluster) writeEntry(t *testing.T, src, dst netip.AddrPort, ifindex int) bpf.CTEntry {
	t.Helper()
	g, err := bpf.OpenGlobal(globalDir(c.pinRoot), bpf.GlobalOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer g.Close()
	k := liveness.Key{Family: 4, Proto: 6, SrcPort: src.Port(), DstPort: dst.Port()}
	s4, d4 := src.Addr().As4(), dst.Addr().As4()
	copy(k.Src[:], s4[:])
	copy(k.Dst[:], d4[:])
	e := bpf.CTEntry{Key: k, Ifindex: uint32(ifindex), Value: bpf.CTValue{LastSeenNs: 1}}
	key := bpf.CTKeyV4{Src: s4, Dst: d4, Ifindex: uint32(ifindex), Sport: src.Port(), Dport: dst.Port(), Proto: 6}
	if err := g.CTv4.Put(&key, &e.Value); err != nil {
		t.Fatal(err)
	}
	return e
}

// conntrackInsert adds an established TCP flow src -> dst to the node's
// kernel table, as if the connection were open.
func (c *cluster) conntrackInsert(t *testing.T, src, dst netip.AddrPort) {
	t.Helper()
	cmd := exec.Command("conntrack", "-I", "-p", "tcp", "-s", src.Addr().String(), "-d", dst.Addr().String(),
		"--sport", fmt.Sprint(src.Port()), "--dport", fmt.Sprint(dst.Port()),
		"--state", "ESTABLISHED", "-u", "SEEN_REPLY", "-t", "600")
	if err := c.inNode(func() error {
		if out, err := cmd.CombinedOutput(); err != nil {
			return fmt.Errorf("conntrack -I: %w: %s", err, out)
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
}

func (c *cluster) hasEntry(t *testing.T, e bpf.CTEntry) bool {
	t.Helper()
	g, err := bpf.OpenGlobal(globalDir(c.pinRoot), bpf.GlobalOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer g.Close()
	ok, err := g.LookupConntrack(&e)
	if err != nil {
		t.Fatal(err)
	}
	return ok
}

// TestSweepRemovesOrphans: pods whose namespace and veth vanish without a
// DEL (a node's runtime lost them). After the grace period the sweeper
// removes their membership, and with the last member the identifier's
// pins; a live replica's attachments and entries are untouched; the gone
// pod's entries go, so a pod given its address (or its ifindex) later
// inherits none of them.
func TestSweepRemovesOrphans(t *testing.T) {
	for _, mode := range attachModes(t) {
		t.Run(mode, func(t *testing.T) {
			c := lcCluster(t, mode)
			live := c.addPod(webReplicas[0], "default")
			gone, destroyGone := lcAddPodOwnNS(t, c, webReplicas[1])
			alone, destroyAlone := lcAddPodOwnNS(t, c, "db-0")
			peer := netip.MustParseAddrPort("10.99.0.1:443")
			liveEntry := c.writeEntry(t, netip.AddrPortFrom(live.ip, 40000), peer, lcIfindex(t, c, live.hostVeth))
			goneEntry := c.writeEntry(t, netip.AddrPortFrom(gone.ip, 40001), peer, lcIfindex(t, c, gone.hostVeth))
			// Both have kernel flows: the gone pod's entry must go although
			// its tuple is live (the flow outlives the pod by its timeout).
			c.conntrackInsert(t, netip.AddrPortFrom(live.ip, 40000), peer)
			c.conntrackInsert(t, netip.AddrPortFrom(gone.ip, 40001), peer)
			destroyGone()
			destroyAlone()

			// Within the grace period no membership is removed, but the gone
			// pod's entries go at once: no live veth owns them.
			r := c.sweep(t, "--orphan-grace", "1h")
			if e, ok := r.find(netip.AddrPortFrom(gone.ip, 40001), peer); !ok || e.Reason != "owner-gone" {
				t.Errorf("the gone pod's entry: %+v (seen %v), want deleted as owner-gone", e, ok)
			}
			if len(r.Orphans) != 0 {
				t.Fatalf("orphans removed within the grace period: %+v", r.Orphans)
			}
			if _, err := membership.New(c.pinRoot).FindContainer(gone.containerID, "eth0"); err != nil {
				t.Fatalf("the gone pod's record went within the grace period: %v", err)
			}

			r = c.sweep(t, "--orphan-grace", "0")
			removed := map[string]bool{}
			for _, o := range r.Orphans {
				removed[o.ContainerID] = true
				if want := o.ContainerID == alone.containerID; o.IdentifierRemoved != want {
					t.Errorf("orphan %s: identifier removed %v, want %v", o.ContainerID, o.IdentifierRemoved, want)
				}
			}
			if len(removed) != 2 || !removed[gone.containerID] || !removed[alone.containerID] {
				t.Fatalf("orphans removed %+v, want %s and %s", r.Orphans, gone.containerID, alone.containerID)
			}
			lcRequireGone(t, c, gone)
			lcRequireGone(t, c, alone)
			dbID, _ := podid.FromPod("db-0", "default")
			if _, err := os.Stat(pinpath.Root(c.pinRoot).Identifier(dbID)); !os.IsNotExist(err) {
				t.Errorf("the last member's identifier keeps its directory: %v", err)
			}
			lcRequireEnforced(t, c, live)
			if !c.hasEntry(t, liveEntry) {
				t.Error("the live replica's entry was deleted")
			}
			if c.hasEntry(t, goneEntry) {
				t.Error("the gone pod's entry is still there: the next pod on its ifindex and address would inherit it")
			}
			if e, ok := r.find(netip.AddrPortFrom(live.ip, 40000), peer); !ok || e.Reason != "live" {
				t.Errorf("the live replica's entry: %+v (seen %v), want kept as live", e, ok)
			}
			// Nothing of the gone pods is left for a pod given their
			// address or their veth's ifindex to inherit.
			for _, e := range c.sweep(t).Entries {
				if pod := netip.MustParseAddrPort(e.Pod); pod.Addr() == gone.ip || pod.Addr() == alone.ip {
					t.Errorf("an entry of a gone pod's address is left: %+v", e)
				}
			}
		})
	}
}

// TestRunZeroGraces: run's --orphan-grace 0 removes an orphaned member at
// the first pass that sees its veth gone (it once meant the default, 60 s),
// and --grace 0 is taken as set, with a warning of what it risks.
func TestRunZeroGraces(t *testing.T) {
	c := lcCluster(t, attachModes(t)[0])
	gone, destroy := lcAddPodOwnNS(t, c, "db-0")
	destroy()
	_, logs := c.runSweeper(t, "--interval-min", "1h", "--interval-max", "1h", "--orphan-grace", "0", "--grace", "0")
	logs.waitFor(t, "--grace 0: a new flow's entry may be deleted", 2*time.Second)
	logs.waitFor(t, "removed an orphaned member", 2*time.Second)
	if _, err := membership.New(c.pinRoot).FindContainer(gone.containerID, "eth0"); !errors.Is(err, membership.ErrNotMember) {
		t.Errorf("the orphan's record after the first pass: %v, want it gone", err)
	}
}

// TestRunRemovesMemberOfDeletedVeth: run removes a member as soon as the
// kernel deletes its host veth (RTM_DELLINK), without waiting for a pass
// or the orphan grace, and leaves the members of veths that stay.
func TestRunRemovesMemberOfDeletedVeth(t *testing.T) {
	c := lcCluster(t, attachModes(t)[0])
	live := c.addPod(webReplicas[0], "default")
	gone, destroy := lcAddPodOwnNS(t, c, webReplicas[1])
	_, logs := c.runSweeper(t, "--interval-min", "1h", "--interval-max", "1h", "--orphan-grace", "1h")
	logs.waitFor(t, "serving metrics", 5*time.Second)
	destroy()
	logs.waitFor(t, "removed an orphaned member: its veth was deleted", 5*time.Second)
	if _, err := membership.New(c.pinRoot).FindContainer(gone.containerID, "eth0"); !errors.Is(err, membership.ErrNotMember) {
		t.Errorf("the member of the deleted veth: %v, want it gone", err)
	}
	lcRequireGone(t, c, gone)
	lcRequireEnforced(t, c, live)
}
