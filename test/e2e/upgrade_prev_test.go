package e2e

import (
	"fmt"
	"net/netip"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/cilium/ebpf"

	"github.com/podfence/podfence/bpf"
	"github.com/podfence/podfence/pkg/membership"
	"github.com/podfence/podfence/pkg/packet"
	"github.com/podfence/podfence/pkg/pinpath"
	"github.com/podfence/podfence/pkg/podid"
	"github.com/podfence/podfence/test/builds"
)

// TestUpgradeFromPreviousLayout: a node of the build before the policy
// had two sides (layout 3: one set of policy tries and tiers) carries live
// traffic through a service VIP while this build's plugin adds a replica
// and its sweeper starts, as a rollout does. No allowed connection fails
// and the stranger never gets through (so the take-over's copy of the
// policy into side 1 is in place whichever side the generation selects);
// every member keeps its sources entry (else its new flows would be
// dropped as spoofed); the counters keep their reasons; the moved members
// are held to their own addresses; and a cluster policy written after the
// take-over is enforced on the moved identifiers, through a side change.
func TestUpgradeFromPreviousLayout(t *testing.T) {
	prev := builds.Previous(t)
	for _, mode := range attachModes(t) {
		t.Run(mode, func(t *testing.T) { testUpgradeFromPrevious(t, mode, prev) })
	}
}

func testUpgradeFromPrevious(t *testing.T, mode, prev string) {
	c := newCluster(t, mode)
	c.useBuild(prev)
	client, stranger, web := c.vipScene(t)
	web2 := c.addPod(webReplicas[1], "default")
	webID, clientID, strangerID := podid.ID("web-7f65cc6544@default"), podid.ID("client@default"), podid.ID("stranger@default")
	ids := []podid.ID{webID, clientID, strangerID}
	if m := readMarker(t, pinpath.Root(c.pinRoot).Global()); m != fmt.Sprintf("v%d", builds.PreviousLayout) {
		t.Fatalf("the previous build wrote global marker %q, want v%d", m, builds.PreviousLayout)
	}

	traffic := startTraffic(t, client, stranger, 2)
	time.Sleep(time.Second)
	before := map[podid.ID]bpf.Counters{}
	for _, id := range ids {
		before[id] = previousCounters(t, c, id)
	}

	c.useBuild(binDir)
	web3 := c.addPod(webReplicas[2], "default")
	time.Sleep(500 * time.Millisecond)
	sweeper, _ := c.runSweeper(t, "--interval-min", "1s", "--interval-max", "1s")
	c.waitHealthy(t)
	time.Sleep(time.Second)
	traffic.Stop()
	traffic.Check(t)
	t.Logf("%d client connections, %d long-lived messages, %d stranger attempts through the take-over",
		traffic.Allowed.Load(), traffic.LongMessages.Load(), traffic.StrangerTries.Load())

	want := fmt.Sprintf("v%d", bpf.LayoutVersion)
	for _, id := range ids {
		if m := readMarker(t, c.identifierDir(string(id))); !strings.HasPrefix(m, want+" object=") || strings.HasSuffix(m, " moving") {
			t.Errorf("%s: layout marker %q, want %q and the object, its members moved", id, m, want)
		}
		info, err := bpf.InspectIdentifier(c.identifierDir(string(id)), id)
		if err != nil {
			t.Fatal(err)
		}
		for d := range 2 {
			for r := range bpf.Reason(builds.PreviousReasonCount) {
				if info.Counters[d][r] < before[id][d][r] {
					t.Errorf("%s: counter %s of direction %d went from %d to %d: counters were moved to other reasons",
						id, r, d, before[id][d][r], info.Counters[d][r])
				}
			}
		}
	}

	// Every member, moved or new, has exactly its own addresses.
	members := map[podid.ID][]*pod{webID: {web, web2, web3}, clientID: {client}, strangerID: {stranger}}
	for id, pods := range members {
		sources := readSources(t, c, id)
		for _, p := range pods {
			got, ok := sources[uint32(lcIfindex(t, c, p.hostVeth))]
			if !ok || len(got.Addrs) != 1 || got.Addrs[0] != p.ip || got.Any {
				t.Errorf("%s (%s): sources %+v (%v), want %s alone", p.name, id, got, ok, p.ip)
			}
		}
	}

	// The moved stranger can no longer speak for the client.
	spoofedBefore := c.counter(t, stranger, bpf.ReasonSpoofed)
	sendFrame(t, c, stranger, packet.Packet{Src: client.ip, Dst: web.ip, Proto: 6, SrcPort: 40123, DstPort: backendPort, TCPFlags: 0x02})
	if n := c.counter(t, stranger, bpf.ReasonSpoofed); n != spoofedBefore+1 {
		t.Errorf("the stranger's SYN in the client's name: spoofed count %d -> %d, want one more", spoofedBefore, n)
	}

	gen, changed := c.generation(t, webID), time.Now()
	c.writeCluster(t, clusterDoc{name: "after-upgrade", tier: "Admin", priority: 1, pods: []*pod{web, web2, web3},
		ingress: []clusterRule{{"Deny", host(client), 0}}})
	c.waitGeneration(t, webID, gen, changed)
	if c.connects(client, web, backendPort) {
		t.Error("an Admin Deny written after the take-over is not enforced on a moved member")
	}
	if err := sweeper.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	sweeper.Wait()
}

// previousCounters reads an identifier's counters as the previous layout
// indexes them (direction*PreviousReasonCount + reason).
func previousCounters(t *testing.T, c *cluster, id podid.ID) bpf.Counters {
	t.Helper()
	m, err := ebpf.LoadPinnedMap(filepath.Join(c.identifierDir(string(id)), pinpath.MapCounters), &ebpf.LoadPinOptions{ReadOnly: true})
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	if m.MaxEntries() != 2*builds.PreviousReasonCount {
		t.Fatalf("%s: counters of %d entries, want the previous layout's %d", id, m.MaxEntries(), 2*builds.PreviousReasonCount)
	}
	var out bpf.Counters
	for d := range 2 {
		for r := range builds.PreviousReasonCount {
			var perCPU []uint64
			if err := m.Lookup(uint32(d*builds.PreviousReasonCount+r), &perCPU); err != nil {
				t.Fatal(err)
			}
			for _, v := range perCPU {
				out[d][r] += v
			}
		}
	}
	return out
}

// readSources is what an identifier's sources map holds.
func readSources(t *testing.T, c *cluster, id podid.ID) map[uint32]bpf.Sources {
	t.Helper()
	g, err := bpf.OpenGlobal(globalDir(c.pinRoot), bpf.GlobalOptions{KeepLayout: true})
	if err != nil {
		t.Fatal(err)
	}
	defer g.Close()
	ident, err := bpf.OpenIdentifier(g, c.identifierDir(string(id)), id)
	if err != nil {
		t.Fatal(err)
	}
	defer ident.Close()
	s, err := ident.ReadSources()
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// setSources writes p's sources entry as its ADD did, under the
// identifier's lock.
func (c *cluster) setSources(t *testing.T, id podid.ID, p *pod) {
	t.Helper()
	lock, err := membership.New(c.pinRoot).Lock(id)
	if err != nil {
		t.Fatal(err)
	}
	defer lock.Unlock()
	g, err := bpf.OpenGlobal(globalDir(c.pinRoot), bpf.GlobalOptions{KeepLayout: true})
	if err != nil {
		t.Fatal(err)
	}
	defer g.Close()
	ident, err := bpf.OpenIdentifier(g, c.identifierDir(string(id)), id)
	if err != nil {
		t.Fatal(err)
	}
	defer ident.Close()
	if err := ident.SetSources(uint32(lcIfindex(t, c, p.hostVeth)), bpf.Sources{Addrs: []netip.Addr{p.ip}}); err != nil {
		t.Fatal(err)
	}
}
