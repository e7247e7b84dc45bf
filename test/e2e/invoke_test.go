package e2e

// Helpers for the tests that exec the podfence binary directly, without
// ptp in front of it, the way a runtime runs a chained plugin: pod sandboxes
// made once and reused, CNI environments and configs built by hand, calls
// killed at chosen instants, and the store's invariants checked on disk and
// in the kernel.

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"math/rand/v2"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/containernetworking/cni/pkg/types"
	"github.com/containernetworking/plugins/pkg/ns"

	"github.com/podfence/podfence/bpf"
	"github.com/podfence/podfence/pkg/attach"
	"github.com/podfence/podfence/pkg/membership"
	"github.com/podfence/podfence/pkg/objinfo"
	"github.com/podfence/podfence/pkg/pinpath"
	"github.com/podfence/podfence/pkg/podid"
	"github.com/podfence/podfence/test/netnsutil"
)

// execTimeout bounds one plugin call. A normal call takes tens of
// milliseconds; the bound only stops a hung plugin from hanging the test
// on a loaded machine.
const execTimeout = 60 * time.Second

// seedEnv replays a run of the randomised tests: the tests log the seed they
// used; PODFENCE_E2E_SEED=<seed> makes them plan the same calls again.
const seedEnv = "PODFENCE_E2E_SEED"

// testSeed returns the seed of a randomised test and logs how to replay it.
func testSeed(t *testing.T) uint64 {
	t.Helper()
	seed := rand.Uint64()
	if s := os.Getenv(seedEnv); s != "" {
		var err error
		if seed, err = strconv.ParseUint(s, 10, 64); err != nil {
			t.Fatalf("%s=%q: %v", seedEnv, s, err)
		}
	}
	t.Logf("seed %d (replay: %s=%d go test -run '^%s$' ./test/e2e/)", seed, seedEnv, seed, t.Name())
	return seed
}

// modeStream gives each attach mode its own random stream of one seed.
func modeStream(mode string) uint64 {
	var h uint64 = 14695981039346656037
	for _, b := range []byte(mode) {
		h = (h ^ uint64(b)) * 1099511628211
	}
	return h
}

// generatedSuffix is a Kubernetes-generated pod name suffix.
func generatedSuffix(rng *rand.Rand) string {
	const alphabet = "bcdfghjklmnpqrstvwxz2456789"
	b := make([]byte, 5)
	for i := range b {
		b[i] = alphabet[rng.IntN(len(alphabet))]
	}
	return string(b)
}

// replicaNames are n distinct pod names of one ReplicaSet.
func replicaNames(rng *rand.Rand, workload string, n int) []string {
	seen := map[string]bool{}
	var names []string
	for len(names) < n {
		name := workload + "-" + generatedSuffix(rng)
		if !seen[name] {
			seen[name] = true
			names = append(names, name)
		}
	}
	return names
}

// slot is a pod sandbox made once and used by many containers in turn: a
// network namespace with eth0, joined by a veth to the node namespace.
type slot struct {
	netns ns.NetNS
	veth  netnsutil.Veth
	addr  netip.Prefix // eth0's
}

// newSlots makes n sandboxes; eth0 of sandbox i has 10.77.<i>.2/24.
func (c *cluster) newSlots(n int) []*slot {
	c.t.Helper()
	slots := make([]*slot, n)
	for i := range slots {
		s := &slot{netns: netnsutil.New(c.t), addr: netip.MustParsePrefix(fmt.Sprintf("10.77.%d.2/24", i))}
		host := netip.MustParsePrefix(fmt.Sprintf("10.77.%d.1/24", i))
		s.veth = netnsutil.AddVeth(c.t, c.node, s.netns, fmt.Sprintf("vpf%02d", i), host, s.addr)
		slots[i] = s
	}
	return slots
}

// prevResult is what ptp would have reported for the sandbox.
func (s *slot) prevResult() map[string]any {
	return map[string]any{
		"cniVersion": "1.0.0",
		"interfaces": []any{
			map[string]any{"name": s.veth.HostName, "mac": s.veth.HostMAC.String()},
			map[string]any{"name": "eth0", "mac": s.veth.PodMAC.String(), "sandbox": s.netns.Path()},
		},
		"ips": []any{map[string]any{"address": s.addr.String(), "interface": 1}},
	}
}

// invocation is one plugin call.
type invocation struct {
	command     string // ADD, DEL, CHECK or GC
	containerID string
	pod         string // K8S_POD_NAME, namespace default
	slot        *slot
	// bare is DEL's shape at container removal: empty CNI_NETNS and no
	// prevResult (otherwise DEL gets both, as at sandbox stop).
	bare  bool
	valid []types.GCAttachment // GC's valid attachments
}

func (inv invocation) String() string {
	s := inv.command + " " + inv.containerID
	if inv.pod != "" {
		s += " (" + inv.pod + ")"
	}
	if inv.command == "DEL" && inv.bare {
		s += " without netns"
	}
	return s
}

// command builds the plugin's process for inv; it still has to be started
// in the node namespace.
func (c *cluster) command(ctx context.Context, inv invocation) (*exec.Cmd, *bytes.Buffer) {
	conf := map[string]any{
		"cniVersion": "1.0.0",
		"name":       "podfence-e2e",
		"type":       "podfence",
		"pinRoot":    c.pinRoot,
		"policyDir":  c.policyDir,
		"attachMode": c.attachMode,
		"logFile":    c.logFile,
	}
	env := []string{"CNI_COMMAND=" + inv.command, "CNI_PATH=" + binDir}
	switch inv.command {
	case "GC":
		conf["cniVersion"] = "1.1.0"
		valid := inv.valid
		if valid == nil {
			valid = []types.GCAttachment{}
		}
		conf["cni.dev/valid-attachments"] = valid
	default:
		env = append(env,
			"CNI_CONTAINERID="+inv.containerID,
			"CNI_IFNAME=eth0",
			"CNI_ARGS=IgnoreUnknown=1;K8S_POD_NAMESPACE=default;K8S_POD_NAME="+inv.pod,
		)
		if inv.command == "DEL" && inv.bare {
			env = append(env, "CNI_NETNS=")
		} else {
			env = append(env, "CNI_NETNS="+inv.slot.netns.Path())
			conf["prevResult"] = inv.slot.prevResult()
		}
	}
	stdin, err := json.Marshal(conf)
	if err != nil {
		panic(err) // maps of strings
	}
	cmd := exec.CommandContext(ctx, filepath.Join(binDir, "podfence"))
	cmd.Env = env
	cmd.Stdin = bytes.NewReader(stdin)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	return cmd, &out
}

// exec runs inv to its end in the node namespace (the child inherits the
// network namespace of the locked thread that forks it).
func (c *cluster) exec(inv invocation) error {
	ctx, cancel := context.WithTimeout(context.Background(), execTimeout)
	defer cancel()
	cmd, out := c.command(ctx, inv)
	if err := c.inNode(cmd.Run); err != nil {
		return fmt.Errorf("%s: %w: %s", inv, err, bytes.TrimSpace(out.Bytes()))
	}
	return nil
}

// timedExec is exec that also returns how long the call took.
func (c *cluster) timedExec(inv invocation) (time.Duration, error) {
	start := time.Now()
	err := c.exec(inv)
	return time.Since(start), err
}

// execKilled starts inv and sends it SIGKILL after delay. It reports whether
// the signal ended the call; when the call ended first, its error is
// returned as exec would.
func (c *cluster) execKilled(inv invocation, delay time.Duration) (bool, error) {
	ctx, cancel := context.WithTimeout(context.Background(), execTimeout)
	defer cancel()
	cmd, out := c.command(ctx, inv)
	if err := c.inNode(cmd.Start); err != nil {
		return false, fmt.Errorf("%s: start: %w", inv, err)
	}
	time.Sleep(delay)
	_ = cmd.Process.Signal(syscall.SIGKILL) // fails only once it has exited
	err := cmd.Wait()
	if ws, ok := cmd.ProcessState.Sys().(syscall.WaitStatus); ok && ws.Signaled() && ws.Signal() == syscall.SIGKILL {
		return true, nil
	}
	if err != nil {
		return false, fmt.Errorf("%s: %w: %s", inv, err, bytes.TrimSpace(out.Bytes()))
	}
	return false, nil
}

// attached lists the programs on a hook of a host veth.
func (c *cluster) attached(ifindex int, hook attach.Hook) ([]ebpf.ProgramID, error) {
	var ids []ebpf.ProgramID
	err := c.inNode(func() error {
		var err error
		ids, err = attach.Attached(ifindex, hook)
		return err
	})
	return ids, err
}

// kernelObjects are the programs and maps pinned for an identifier; once
// its last member is gone, nothing may hold them any more.
type kernelObjects struct {
	progs []ebpf.ProgramID
	maps  []ebpf.MapID
}

// identifierMaps are the maps pinned per identifier; with the program pins
// and the members directory they are all an identifier's directory holds.
var identifierMaps = pinpath.IdentifierMaps()

// pinnedObjects collects the IDs of whatever an identifier has pinned now
// (any of it may be missing after a kill).
func (c *cluster) pinnedObjects(id podid.ID) kernelObjects {
	var o kernelObjects
	dir := c.identifierDir(string(id))
	for _, name := range []string{pinpath.ProgIngress, pinpath.ProgEgress} {
		p, err := ebpf.LoadPinnedProgram(filepath.Join(dir, name), &ebpf.LoadPinOptions{ReadOnly: true})
		if err != nil {
			continue
		}
		if pid, err := objinfo.ProgramID(p); err == nil {
			o.progs = append(o.progs, pid)
		}
		p.Close()
	}
	for _, name := range identifierMaps {
		m, err := ebpf.LoadPinnedMap(filepath.Join(dir, name), &ebpf.LoadPinOptions{ReadOnly: true})
		if err != nil {
			continue
		}
		if mid, err := objinfo.MapID(m); err == nil {
			o.maps = append(o.maps, mid)
		}
		m.Close()
	}
	return o
}

func (o *kernelObjects) add(more kernelObjects) {
	for _, p := range more.progs {
		if !slices.Contains(o.progs, p) {
			o.progs = append(o.progs, p)
		}
	}
	for _, m := range more.maps {
		if !slices.Contains(o.maps, m) {
			o.maps = append(o.maps, m)
		}
	}
}

// waitFreed fails the test when one of the objects can still be opened by
// ID after a grace period: the kernel frees a program detached from a
// cls_bpf filter or a TCX link after an RCU period, not at once.
func waitFreed(t *testing.T, what string, o kernelObjects) {
	t.Helper()
	deadline := time.Now().Add(15 * time.Second)
	for {
		var alive []string
		for _, id := range o.progs {
			p, err := ebpf.NewProgramFromID(id)
			if err == nil {
				p.Close()
				alive = append(alive, fmt.Sprintf("program %d", id))
			} else if !errors.Is(err, os.ErrNotExist) {
				t.Errorf("%s: program %d: %v", what, id, err)
			}
		}
		for _, id := range o.maps {
			m, err := ebpf.NewMapFromID(id)
			if err == nil {
				m.Close()
				alive = append(alive, fmt.Sprintf("map %d", id))
			} else if !errors.Is(err, os.ErrNotExist) {
				t.Errorf("%s: map %d: %v", what, id, err)
			}
		}
		if len(alive) == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Errorf("%s: kernel objects leaked, still loaded 15 s after the identifier went: %s", what, strings.Join(alive, ", "))
			return
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// expected is what the test has done, and so what the store must say.
type expected struct {
	// live are the containers that are members, by identifier.
	live map[podid.ID]map[string]*slot
	// gone are containers whose last call was a DEL, or whose killed ADD
	// was cleaned up: none may have a record.
	gone map[string]bool
	// slots are all sandboxes; those no live container uses must carry no
	// program at all.
	slots []*slot
	// unsure are containers that may or may not be members (a DEL was
	// killed): their records and veths are not checked, and their
	// identifier may keep its pins without another member.
	unsure map[podid.ID]map[string]*slot
}

func newExpected(slots []*slot) *expected {
	return &expected{live: map[podid.ID]map[string]*slot{}, gone: map[string]bool{}, slots: slots}
}

func (e *expected) join(id podid.ID, containerID string, s *slot) {
	if e.live[id] == nil {
		e.live[id] = map[string]*slot{}
	}
	e.live[id][containerID] = s
	delete(e.gone, containerID)
}

func (e *expected) leave(id podid.ID, containerID string) {
	delete(e.live[id], containerID)
	if len(e.live[id]) == 0 {
		delete(e.live, id)
	}
	e.gone[containerID] = true
}

// validAttachments is GC's list: every live container.
func (e *expected) validAttachments() []types.GCAttachment {
	var out []types.GCAttachment
	for _, ms := range e.live {
		for ctr := range ms {
			out = append(out, types.GCAttachment{ContainerID: ctr, IfName: "eth0"})
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].ContainerID < out[j].ContainerID })
	return out
}

// check compares the pin root and the veths' hooks with e and reports every
// difference with t.Errorf, prefixed with when. It returns the kernel
// objects of each live identifier.
func (c *cluster) check(t *testing.T, when string, e *expected) map[podid.ID]kernelObjects {
	t.Helper()
	errorf := func(format string, args ...any) {
		t.Helper()
		t.Errorf("%s: %s", when, fmt.Sprintf(format, args...))
	}
	objs := map[podid.ID]kernelObjects{}

	// Nothing half-written anywhere: no "~new" temporaries, no other
	// names than the layout's.
	_ = filepath.WalkDir(c.pinRoot, func(path string, d fs.DirEntry, err error) error {
		t.Helper()
		if err != nil {
			errorf("walk pin root: %v", err)
			return nil
		}
		if strings.Contains(d.Name(), "~") {
			errorf("stray temporary pin %s", strings.TrimPrefix(path, c.pinRoot+"/"))
		}
		return nil
	})
	if entries, err := os.ReadDir(pinpath.Root(c.pinRoot).Global()); err == nil {
		for _, en := range entries {
			if !slices.Contains(pinpath.GlobalMaps(), en.Name()) && !slices.Contains([]string{pinpath.Layout, pinpath.SlotsDir, pinpath.UplinksDir, pinpath.LocalLink}, en.Name()) {
				errorf("unexpected global pin %s", en.Name())
			}
		}
	}

	// Pins exist if and only if members do.
	entries, err := os.ReadDir(pinpath.Root(c.pinRoot).Identifiers())
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		errorf("list identifiers: %v", err)
	}
	onDisk := map[podid.ID]bool{}
	for _, en := range entries {
		id := podid.ID(en.Name())
		onDisk[id] = true
		if len(e.live[id]) == 0 && len(e.unsure[id]) == 0 {
			errorf("identifier %s has no member, but its directory is still there: %s", id, listDir(pinpath.Root(c.pinRoot).Identifier(podid.ID(en.Name()))))
		}
	}
	// A slot is reserved for an identifier that has pins, never leaked.
	slots, err := os.ReadDir(pinpath.Root(c.pinRoot).Slots())
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		errorf("list slots: %v", err)
	}
	for _, en := range slots {
		owner, err := os.Readlink(filepath.Join(pinpath.Root(c.pinRoot).Slots(), en.Name()))
		if err != nil {
			errorf("slot %s: %v", en.Name(), err)
			continue
		}
		if id := podid.ID(filepath.Base(owner)); !onDisk[id] {
			errorf("slot %s is reserved for %s, which has no pins", en.Name(), id)
		}
	}
	vethUsed := map[int]bool{}
	for _, ms := range e.unsure {
		for _, s := range ms {
			vethUsed[s.veth.HostIndex] = true
		}
	}
	for id, ms := range e.live {
		for _, s := range ms {
			vethUsed[s.veth.HostIndex] = true
		}
		if !onDisk[id] {
			errorf("identifier %s has %d members but no pins", id, len(ms))
			continue
		}
		objs[id] = c.checkIdentifier(t, errorf, id, ms, e.unsure[id])
	}

	// No record of a container that is gone, under any identifier.
	for ctr := range e.gone {
		key := membership.Key(ctr, "eth0")
		for id := range onDisk {
			if p := pinpath.Root(c.pinRoot).Member(id, key); exists(p) {
				errorf("container %s is gone, but %s has its member directory: %s", ctr, id, listDir(p))
			}
		}
	}

	// A veth no live container uses carries nothing.
	for _, s := range e.slots {
		if vethUsed[s.veth.HostIndex] {
			continue
		}
		for _, hook := range []attach.Hook{attach.HookIngress, attach.HookEgress} {
			ids, err := c.attached(s.veth.HostIndex, hook)
			if err != nil {
				errorf("%s %s: %v", s.veth.HostName, hook, err)
			} else if len(ids) > 0 {
				errorf("%s %s: no live container uses it, but programs %v are attached", s.veth.HostName, hook, ids)
			}
		}
	}
	return objs
}

// checkIdentifier checks a live identifier: its pins, its member records
// and that each member's veth runs exactly its two programs.
func (c *cluster) checkIdentifier(t *testing.T, errorf func(string, ...any), id podid.ID, ms, unsure map[string]*slot) kernelObjects {
	t.Helper()
	dir := c.identifierDir(string(id))
	ingress, egress, err := bpf.PinnedProgramIDs(c.identifierDir(string(id)))
	if err != nil {
		errorf("identifier %s has %d members but its programs: %v (%s)", id, len(ms), err, listDir(dir))
	}
	allowed := append([]string{pinpath.ProgIngress, pinpath.ProgEgress, pinpath.MembersDir, pinpath.Layout}, identifierMaps...)
	if bpf.AfterNATSupported() { // the judge of its Service flows
		allowed = append(allowed, pinpath.ProgAfterNAT, pinpath.ProgLocal)
	}
	entries, _ := os.ReadDir(dir)
	for _, en := range entries {
		if !slices.Contains(allowed, en.Name()) {
			errorf("identifier %s: unexpected pin %s", id, en.Name())
		}
	}
	for _, name := range allowed {
		if !exists(filepath.Join(dir, name)) {
			errorf("identifier %s has members but lacks %s", id, name)
		}
	}

	want := map[string]string{} // member key -> container
	for ctr := range ms {
		want[membership.Key(ctr, "eth0")] = ctr
	}
	memberFiles := []string{pinpath.Record}
	if c.attachMode == string(attach.ModeTCX) {
		memberFiles = []string{pinpath.LinkEgress, pinpath.LinkIngress, pinpath.Record}
	}
	maybe := map[string]bool{}
	for ctr := range unsure {
		maybe[membership.Key(ctr, "eth0")] = true
	}
	members, _ := os.ReadDir(filepath.Join(dir, pinpath.MembersDir))
	for _, en := range members {
		if _, ok := want[en.Name()]; !ok && !maybe[en.Name()] {
			errorf("identifier %s: member directory %s of no live container: %s", id, en.Name(), listDir(filepath.Join(dir, pinpath.MembersDir, en.Name())))
		}
	}
	for key, ctr := range want {
		mdir := filepath.Join(dir, pinpath.MembersDir, key)
		var names []string
		files, _ := os.ReadDir(mdir)
		for _, f := range files {
			names = append(names, f.Name())
		}
		if !slices.Equal(names, memberFiles) {
			errorf("identifier %s: member %s holds %v, want %v", id, key, names, memberFiles)
		}
		target, err := os.Readlink(filepath.Join(mdir, pinpath.Record))
		if err != nil {
			errorf("identifier %s: live container %s has no record: %v", id, ctr, err)
			continue
		}
		var m membership.Member
		if err := m.UnmarshalText([]byte(target)); err != nil {
			errorf("identifier %s: record of %s: %v", id, ctr, err)
			continue
		}
		s := ms[ctr]
		if m.ContainerID != ctr || m.HostVeth != s.veth.HostName || m.HostIfindex != s.veth.HostIndex || m.AttachMode != c.attachMode {
			errorf("identifier %s: record of %s is %+v, want veth %s (%d), mode %s", id, ctr, m, s.veth.HostName, s.veth.HostIndex, c.attachMode)
		}
		if ingress == 0 || egress == 0 {
			continue
		}
		// The pod's egress program runs at the veth's ingress and the
		// other way round; one podfence program per hook, nothing else.
		for _, h := range []struct {
			hook attach.Hook
			want ebpf.ProgramID
		}{{attach.HookIngress, egress}, {attach.HookEgress, ingress}} {
			ids, err := c.attached(s.veth.HostIndex, h.hook)
			if err != nil {
				errorf("%s %s: %v", s.veth.HostName, h.hook, err)
			} else if !slices.Equal(ids, []ebpf.ProgramID{h.want}) {
				errorf("%s %s (container %s of %s) runs programs %v, want exactly [%d]", s.veth.HostName, h.hook, ctr, id, ids, h.want)
			}
		}
	}
	return c.pinnedObjects(id)
}

// checkReachable checks invariant 1 of package membership at any instant,
// also right after a kill: every program on a sandbox's veth is reachable
// from a member record naming that veth.
func (c *cluster) checkReachable(t *testing.T, when string, slots []*slot) {
	t.Helper()
	recorded := map[int]bool{}
	_ = filepath.WalkDir(pinpath.Root(c.pinRoot).Identifiers(), func(path string, d fs.DirEntry, err error) error {
		if err != nil || d.Name() != pinpath.Record {
			return nil
		}
		target, err := os.Readlink(path)
		if err != nil {
			return nil
		}
		var m membership.Member
		if m.UnmarshalText([]byte(target)) == nil {
			recorded[m.HostIfindex] = true
		}
		return nil
	})
	for _, s := range slots {
		if recorded[s.veth.HostIndex] {
			continue
		}
		for _, hook := range []attach.Hook{attach.HookIngress, attach.HookEgress} {
			ids, err := c.attached(s.veth.HostIndex, hook)
			if err != nil {
				t.Errorf("%s: %s %s: %v", when, s.veth.HostName, hook, err)
			} else if len(ids) > 0 {
				t.Errorf("%s: %s %s runs programs %v, but no member record names the veth", when, s.veth.HostName, hook, ids)
			}
		}
	}
}

// listDir lists a directory tree below dir, for error messages.
func listDir(dir string) string {
	names, _ := walkTree(dir) // for messages: a directory may be gone
	return "[" + strings.Join(names, " ") + "]"
}

// walkTree lists the paths below root, relative to it, in lexical order.
func walkTree(root string) ([]string, error) {
	var out []string
	err := filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if path != root {
			rel, _ := filepath.Rel(root, path)
			out = append(out, rel)
		}
		return nil
	})
	return out, err
}
