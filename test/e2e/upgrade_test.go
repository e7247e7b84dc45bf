package e2e

import (
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/cilium/ebpf"

	"github.com/podfence/podfence/bpf"
	"github.com/podfence/podfence/pkg/attach"
	"github.com/podfence/podfence/pkg/objinfo"
	"github.com/podfence/podfence/pkg/pinpath"
	"github.com/podfence/podfence/pkg/podid"
	"github.com/podfence/podfence/pkg/policy"
	"github.com/podfence/podfence/test/builds"
)

// TestUpgrade: pods of this build carry live traffic through a service VIP
// while the next layout's plugin adds a backend replica, which moves the
// backend's identifier onto its datapath, and then its sweeper starts (as a
// DaemonSet rollout does) and moves the others. The client's connections all
// succeed, the long-lived one carries data throughout, the stranger never
// gets through, and the backend, whose egress is isolated with no rule,
// drops none of its replies: the conntrack entries of the old programs are
// honoured by the new ones. Afterwards every member runs the new programs,
// which use tries of the new capacity; a pod added by the new plugin gets
// them; a policy change reaches the moved members; the old programs and
// tries are freed. Then this build, now the older one, refuses the pins
// clearly and changes nothing.
func TestUpgrade(t *testing.T) {
	next := builds.NextLayout(t)
	for _, mode := range attachModes(t) {
		t.Run(mode, func(t *testing.T) { testUpgrade(t, mode, next) })
	}
}

func testUpgrade(t *testing.T, mode, next string) {
	c := newCluster(t, mode)
	client, stranger, web := c.vipScene(t)
	web2 := c.addPod(webReplicas[1], "default")
	webID, clientID, strangerID := podid.ID("web-7f65cc6544@default"), podid.ID("client@default"), podid.ID("stranger@default")
	ids := []podid.ID{webID, clientID, strangerID}
	var old kernelObjects
	for _, id := range ids {
		old.add(c.pinnedObjects(id))
	}
	ctBefore := c.globalMapID(t, pinpath.MapCTv4)

	denials := c.startTrace(t, string(webID))
	traffic := startTraffic(t, client, stranger, 2)
	time.Sleep(time.Second)
	allowedBefore, longBefore := traffic.Allowed.Load(), traffic.LongMessages.Load()

	// The next build's inspection tools read this build's node and do
	// not upgrade it.
	inspect := exec.Command(filepath.Join(next, "podfence-sweeper"), "dump", "conntrack", "--json", "--pin-root", c.pinRoot)
	var inspected []byte
	if err := c.inNode(func() (err error) { inspected, err = inspect.CombinedOutput(); return err }); err != nil {
		t.Errorf("the next build's dump conntrack on this build's node: %v: %s", err, inspected)
	}
	if m := readMarker(t, pinpath.Root(c.pinRoot).Global()); m != fmt.Sprintf("v%d", bpf.LayoutVersion) {
		t.Errorf("the next build's dump conntrack changed the global marker to %q", m)
	}

	// A rollout installs the plugin first: the next ADD takes over the
	// global pins and its identifier, moving the backend's replicas; then
	// the sweeper starts and moves the rest.
	c.useBuild(next)
	web3 := c.addPod(webReplicas[2], "default")
	time.Sleep(500 * time.Millisecond)
	sweeper, logs := c.runSweeper(t, "--interval-min", "1s", "--interval-max", "1s")
	c.waitHealthy(t)
	time.Sleep(time.Second)
	traffic.Check(t)
	if traffic.Allowed.Load() <= allowedBefore || traffic.LongMessages.Load() <= longBefore {
		t.Errorf("no traffic after the upgrade: %d client connections and %d long-lived messages before it, %d and %d in all",
			allowedBefore, longBefore, traffic.Allowed.Load(), traffic.LongMessages.Load())
	}
	t.Logf("%d client connections, %d long-lived messages, %d stranger attempts through the upgrade",
		traffic.Allowed.Load(), traffic.LongMessages.Load(), traffic.StrangerTries.Load())
	plog, err := os.ReadFile(c.logFile)
	if err != nil {
		t.Fatal(err)
	}
	if n := strings.Count(string(plog), fmt.Sprintf(`"renewed_pins":"from layout %d`, bpf.LayoutVersion)); n != 1 {
		t.Errorf("the plugin logged %d ADDs that took over pins, want the one of %s", n, web3.name)
	}
	if n := strings.Count(logs.String(), `"msg":"identifier upgraded"`); n != len(ids)-1 {
		t.Errorf("the sweeper logged %d identifiers upgraded, want %d (the plugin did the backend's)", n, len(ids)-1)
	}

	// The backend dropped none of its TCP replies: its egress allows only
	// tracked flows. Its ingress dropped the stranger.
	evs := denials.stop(t)
	info, err := bpf.InspectIdentifier(c.identifierDir(string(webID)), webID)
	if err != nil {
		t.Fatal(err)
	}
	strangerDenied := 0
	for _, ev := range evs {
		switch {
		case ev.Direction == "egress" && ev.Protocol != "ICMPv6":
			t.Errorf("the backend dropped its own %s packet %s -> %s (%s): a reply of an allowed flow was not recognised", ev.Protocol, ev.Src, ev.Dst, ev.Reason)
		case ev.Direction == "ingress" && strings.HasPrefix(ev.Src, stranger.ip.String()+":"):
			strangerDenied++
		}
	}
	if strangerDenied == 0 || denied(info.Counters, policy.Ingress) == 0 {
		t.Errorf("the backend's ingress denied %d of the stranger's packets (%s): its attempts were not denied", strangerDenied, reasons(info.Counters, policy.Ingress))
	}
	t.Logf("%d deny events of the backend through the upgrade, %d of them the stranger's", len(evs), strangerDenied)
	if ct := c.globalMapID(t, pinpath.MapCTv4); ct != ctBefore {
		t.Errorf("the IPv4 conntrack map changed (%d, was %d): established flows depend on it", ct, ctBefore)
	}

	want := fmt.Sprintf("v%d", bpf.LayoutVersion+1)
	if m := readMarker(t, pinpath.Root(c.pinRoot).Global()); m != want {
		t.Errorf("global layout marker %q, want %q", m, want)
	}
	for _, id := range ids {
		if m := readMarker(t, c.identifierDir(string(id))); !strings.HasPrefix(m, want+" object=") || strings.HasSuffix(m, " moving") {
			t.Errorf("%s: layout marker %q, want %q and the object, its members moved", id, m, want)
		}
		trie, err := ebpf.LoadPinnedMap(filepath.Join(c.identifierDir(string(id)), pinpath.MapPolInV4), &ebpf.LoadPinOptions{ReadOnly: true})
		if err != nil {
			t.Fatal(err)
		}
		if trie.MaxEntries() != builds.NextTrieCapacity {
			t.Errorf("%s: trie of %d entries, want the next layout's %d", id, trie.MaxEntries(), builds.NextTrieCapacity)
		}
		trie.Close()
	}
	out, err := c.sweeper(t, "ls", "--json", "--pin-root", c.pinRoot)
	if err != nil {
		t.Fatal(err)
	}
	var views []struct{ Identifier, Layout string }
	if err := json.Unmarshal(out, &views); err != nil {
		t.Fatal(err)
	}
	for _, v := range views {
		if !strings.HasPrefix(v.Layout, want+" object=") {
			t.Errorf("ls shows %s at layout %q, want %q and the object", v.Identifier, v.Layout, want)
		}
	}
	members := map[podid.ID][]*pod{webID: {web, web2, web3}, clientID: {client}, strangerID: {stranger}}
	for id, pods := range members {
		in, eg, err := bpf.PinnedProgramIDs(c.identifierDir(string(id)))
		if err != nil {
			t.Fatal(err)
		}
		if slices.Contains(old.progs, in) || slices.Contains(old.progs, eg) {
			t.Errorf("%s: the old build's programs are still pinned", id)
		}
		for _, p := range pods {
			ifindex := lcIfindex(t, c, p.hostVeth)
			for hook, prog := range map[attach.Hook]ebpf.ProgramID{attach.HookIngress: eg, attach.HookEgress: in} {
				got, err := c.attached(ifindex, hook)
				if err != nil {
					t.Fatal(err)
				}
				if !slices.Equal(got, []ebpf.ProgramID{prog}) {
					t.Errorf("%s %s: programs %v attached, want the new %d alone", p.name, hook, got, prog)
				}
			}
		}
	}
	// What no pin names any more is released: the old programs and tries.
	var replaced kernelObjects
	var now kernelObjects
	for _, id := range ids {
		now.add(c.pinnedObjects(id))
	}
	replaced.progs = old.progs
	for _, m := range old.maps {
		if !slices.Contains(now.maps, m) {
			replaced.maps = append(replaced.maps, m)
		}
	}
	// The next layout doubles the capacity of the policy tries of both sides.
	if len(replaced.maps) != 8*len(ids) {
		t.Errorf("%d maps replaced, want the %d policy tries of %d identifiers", len(replaced.maps), 8, len(ids))
	}
	waitFreed(t, "after the upgrade", replaced)

	// A policy change reaches the moved members: the stranger is let in.
	if c.connects(stranger, web, backendPort) {
		t.Fatal("the stranger reached the backend before the policy let it")
	}
	c.renamePolicy(t, "web", backendPolicy(client.ip, backendPort)+"\n---\n"+endpointDoc{
		name: "web-stranger", pods: []string{webReplicas[0]}, isolate: []string{"Ingress", "Egress"},
		ingress: []docRule{tcpRule(stranger.ip.String()+"/32", backendPort)},
	}.String())
	deadline := time.Now().Add(5 * time.Second)
	for !c.connects(stranger, web, backendPort) {
		if time.Now().After(deadline) {
			t.Fatal("the policy change did not reach the moved backend within 5 s")
		}
	}
	if err := sweeper.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	if err := sweeper.Wait(); err != nil {
		t.Fatalf("sweeper: %v", err)
	}

	// This build is now the older one: it refuses, and changes nothing.
	c.useBuild(binDir)
	out, err = c.sweeper(t, "upgrade", "--pin-root", c.pinRoot)
	if err == nil || !strings.Contains(err.Error(), "newer layout") {
		t.Errorf("the older sweeper's upgrade: %v, %s; want a refusal of the newer layout", err, out)
	}
	if _, err := c.tryAddPod("late", "default"); err == nil || !strings.Contains(err.Error(), fmt.Sprintf("layout %d", bpf.LayoutVersion+1)) {
		t.Errorf("the older plugin's ADD: %v; want a refusal naming layout %d", err, bpf.LayoutVersion+1)
	}
	if m := readMarker(t, pinpath.Root(c.pinRoot).Global()); m != want {
		t.Errorf("after the refusals, global layout marker %q, want %q", m, want)
	}
	for _, p := range []*pod{client, stranger} {
		conn, err := dialEcho(p.netns)
		if err == nil {
			err = conn.roundTrip("after the refusals")
			conn.Close()
		}
		if err != nil {
			t.Errorf("after the refusals, %s through the VIP: %v", p.name, err)
		}
	}
	c.useBuild(next) // the pods' DELs
}

// traceRun is `podfence-sweeper trace --json` running in the node.
type traceRun struct {
	cmd *exec.Cmd
	out *syncBuffer
}

// startTrace streams the deny events of identifier until stop.
func (c *cluster) startTrace(t *testing.T, identifier string) *traceRun {
	t.Helper()
	r := &traceRun{out: &syncBuffer{}}
	r.cmd = exec.Command(c.sweeperBin, "trace", "--json", "--pin-root", c.pinRoot, "--policy-dir", c.policyDir, "--pod", identifier)
	r.cmd.Stdout = r.out
	var stderr bytes.Buffer
	r.cmd.Stderr = &stderr
	if err := c.inNode(r.cmd.Start); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if r.cmd.ProcessState == nil {
			r.cmd.Process.Kill()
			r.cmd.Wait()
		}
	})
	// trace prints nothing until an event: give it time to open the ring.
	time.Sleep(300 * time.Millisecond)
	return r
}

type traceEvent struct{ Direction, Reason, Protocol, Src, Dst string }

// stop interrupts the trace and returns its events; its summary must say
// that every denied packet was reported, or an absent event proves nothing.
func (r *traceRun) stop(t *testing.T) []traceEvent {
	t.Helper()
	if err := r.cmd.Process.Signal(os.Interrupt); err != nil {
		t.Fatal(err)
	}
	if err := r.cmd.Wait(); err != nil {
		t.Fatalf("trace: %v", err)
	}
	var evs []traceEvent
	var sum struct {
		Summary *struct {
			Events                     int
			NotReported, DroppedEvents uint64
		} `json:"summary"`
	}
	for _, line := range jsonLines(t, []byte(r.out.String())) {
		if json.Unmarshal(line, &sum) == nil && sum.Summary != nil {
			continue
		}
		var ev traceEvent
		if err := json.Unmarshal(line, &ev); err != nil {
			t.Fatalf("trace line %q: %v", line, err)
		}
		evs = append(evs, ev)
	}
	if sum.Summary == nil {
		t.Fatalf("trace printed no summary:\n%s", r.out.String())
	}
	if sum.Summary.NotReported != 0 || sum.Summary.DroppedEvents != 0 || sum.Summary.Events != len(evs) {
		t.Fatalf("trace summary %+v for %d events: denied packets went unreported", *sum.Summary, len(evs))
	}
	return evs
}

// denied is the packets dropped in one direction.
func denied(c bpf.Counters, d policy.Direction) (n uint64) {
	for r, v := range c[d] {
		if bpf.Reason(r).Verdict() == bpf.VerdictDrop {
			n += v
		}
	}
	return n
}

// reasons lists the nonzero counters of one direction.
func reasons(c bpf.Counters, d policy.Direction) string {
	var out []string
	for r, v := range c[d] {
		if v != 0 {
			out = append(out, fmt.Sprintf("%s=%d", bpf.Reason(r), v))
		}
	}
	return strings.Join(out, " ")
}

func readMarker(t *testing.T, dir string) string {
	t.Helper()
	m, err := os.Readlink(filepath.Join(dir, pinpath.Layout))
	if err != nil {
		t.Fatal(err)
	}
	return m
}

func (c *cluster) globalMapID(t *testing.T, name string) ebpf.MapID {
	t.Helper()
	m, err := ebpf.LoadPinnedMap(filepath.Join(pinpath.Root(c.pinRoot).Global(), name), &ebpf.LoadPinOptions{ReadOnly: true})
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	id, err := objinfo.MapID(m)
	if err != nil {
		t.Fatal(err)
	}
	return id
}
