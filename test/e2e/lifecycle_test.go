package e2e

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"net/netip"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"github.com/containernetworking/cni/libcni"
	"github.com/containernetworking/cni/pkg/invoke"
	"github.com/containernetworking/cni/pkg/types"
	current "github.com/containernetworking/cni/pkg/types/100"
	"github.com/containernetworking/plugins/pkg/ns"
	"github.com/containernetworking/plugins/pkg/testutils"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/podfence/podfence/bpf"
	"github.com/podfence/podfence/pkg/attach"
	"github.com/podfence/podfence/pkg/cniconf"
	"github.com/podfence/podfence/pkg/membership"
	"github.com/podfence/podfence/pkg/pinpath"
	"github.com/podfence/podfence/pkg/podid"
	"github.com/podfence/podfence/test/netnsutil"
)

// Helpers of the lifecycle and bad-input tests carry an "lc" prefix: other
// files of this package add helpers of their own.

// lcCluster is newCluster with a libcni cache of its own: the default one,
// /var/lib/cni, is shared by every test process on the machine, and
// container IDs are unique only within one.
func lcCluster(t *testing.T, mode string) *cluster {
	t.Helper()
	c := newCluster(t, mode)
	c.cni = libcni.NewCNIConfigWithCacheDir([]string{binDir}, t.TempDir(), nil)
	return c
}

// lcList is c's conflist at another CNI version, with podfence's
// configuration changed by edit (when not nil). keep "ptp" drops podfence,
// keep "podfence" drops ptp.
func lcList(t *testing.T, c *cluster, version string, edit func(pf map[string]any), keep string) *libcni.NetworkConfigList {
	t.Helper()
	var conf map[string]any
	if err := json.Unmarshal(c.confBytes, &conf); err != nil {
		t.Fatal(err)
	}
	conf["cniVersion"] = version
	plugins := conf["plugins"].([]any)
	if edit != nil {
		edit(plugins[1].(map[string]any))
	}
	switch keep {
	case "ptp":
		conf["plugins"] = plugins[:1]
	case "podfence":
		conf["plugins"] = plugins[1:]
	}
	b, err := json.Marshal(conf)
	if err != nil {
		t.Fatal(err)
	}
	list, err := libcni.ConfListFromBytes(b)
	if err != nil {
		t.Fatal(err)
	}
	return list
}

// lcArgs is CNI_ARGS as kubelet's runtimes pass it.
func lcArgs(name, namespace string) string {
	return "IgnoreUnknown=1;K8S_POD_NAMESPACE=" + namespace + ";K8S_POD_NAME=" + name
}

// lcConf is podfence's configuration as a runtime passes it to the plugin
// (without prevResult).
func lcConf(c *cluster, version string) map[string]any {
	return map[string]any{
		"cniVersion": version,
		"name":       "podfence-e2e",
		"type":       "podfence",
		"pinRoot":    c.pinRoot,
		"policyDir":  c.policyDir,
		"attachMode": c.attachMode,
		"logFile":    c.logFile,
	}
}

// lcCall is one direct invocation of the podfence binary.
type lcCall struct {
	cmd         string
	containerID string
	netns       string
	ifname      string
	args        string
	conf        map[string]any
	env         []string // more environment, after the CNI variables
	plugin      string   // the executable to run, when not bin/podfence
}

// lcExec runs podfence the way a runtime does, in the node namespace, and
// returns its stdout; a plugin error is the *types.Error it printed.
func lcExec(t *testing.T, c *cluster, call lcCall) ([]byte, error) {
	t.Helper()
	stdin, err := json.Marshal(call.conf)
	if err != nil {
		t.Fatal(err)
	}
	env := []string{
		"CNI_COMMAND=" + call.cmd,
		"CNI_CONTAINERID=" + call.containerID,
		"CNI_NETNS=" + call.netns,
		"CNI_IFNAME=" + call.ifname,
		"CNI_ARGS=" + call.args,
		"CNI_PATH=" + binDir,
	}
	env = append(env, call.env...)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	plugin := call.plugin
	if plugin == "" {
		plugin = filepath.Join(binDir, "podfence")
	}
	var out []byte
	var stderr bytes.Buffer
	err = c.inNode(func() error {
		var err error
		out, err = (&invoke.RawExec{Stderr: &stderr}).ExecPlugin(ctx, plugin, stdin, env)
		return err
	})
	if stderr.Len() > 0 {
		t.Logf("podfence %s stderr: %s", call.cmd, stderr.Bytes())
	}
	return out, err
}

// podCall is a call for a pod added through the harness.
func (p *pod) lcCall(c *cluster, cmd string) lcCall {
	return lcCall{cmd: cmd, containerID: p.containerID, netns: p.netns.Path(), ifname: "eth0", args: lcArgs(p.name, p.namespace), conf: lcConf(c, "1.0.0")}
}

// lcPrevResult is the result the runtime cached for p: what DEL and CHECK
// receive as prevResult.
func lcPrevResult(t *testing.T, c *cluster, list *libcni.NetworkConfigList, p *pod) map[string]any {
	t.Helper()
	r, err := c.cni.GetNetworkListCachedResult(list, c.runtimeConf(p))
	if err != nil || r == nil {
		t.Fatalf("cached result of %s: %v", p.containerID, err)
	}
	return lcJSONMap(t, r)
}

func lcJSONMap(t *testing.T, v any) map[string]any {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	var m map[string]any
	if err := json.Unmarshal(b, &m); err != nil {
		t.Fatal(err)
	}
	return m
}

// lcWantCNIError checks that err is, or wraps, a CNI error with the code and
// a message holding every substring.
func lcWantCNIError(t *testing.T, err error, code uint, msgs ...string) {
	t.Helper()
	var e *types.Error
	if !errors.As(err, &e) {
		t.Fatalf("got %v, want CNI error %d", err, code)
	}
	if e.Code != code {
		t.Errorf("CNI error code %d, want %d: %s", e.Code, code, e.Msg)
	}
	for _, m := range msgs {
		if !strings.Contains(e.Msg, m) {
			t.Errorf("message %q does not contain %q", e.Msg, m)
		}
	}
}

// lcIdentifier is the identifier of p.
func lcIdentifier(t *testing.T, p *pod) podid.ID {
	t.Helper()
	id, err := podid.FromPod(p.name, p.namespace)
	if err != nil {
		t.Fatal(err)
	}
	return id
}

// lcIfindex is the index of the node's interface name, 0 when it is gone.
func lcIfindex(t *testing.T, c *cluster, name string) int {
	t.Helper()
	var idx int
	if err := c.inNode(func() error {
		l, err := netlink.LinkByName(name)
		var nf netlink.LinkNotFoundError
		if errors.As(err, &nf) {
			return nil
		}
		if err != nil {
			return err
		}
		idx = l.Attrs().Index
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	return idx
}

// lcAttached lists the programs on both hooks of the node's interface.
func lcAttached(t *testing.T, c *cluster, ifindex int) (ingress, egress []ebpf.ProgramID) {
	t.Helper()
	var err error
	if ingress, err = c.attached(ifindex, attach.HookIngress); err != nil {
		t.Fatal(err)
	}
	if egress, err = c.attached(ifindex, attach.HookEgress); err != nil {
		t.Fatal(err)
	}
	return ingress, egress
}

// lcRequireEnforced checks that p is a member of its identifier and that
// its host veth runs the identifier's two programs.
func lcRequireEnforced(t *testing.T, c *cluster, p *pod) {
	t.Helper()
	id := lcIdentifier(t, p)
	progIn, progEg, err := bpf.PinnedProgramIDs(c.identifierDir(string(id)))
	if err != nil {
		t.Fatalf("%s: %v", p.name, err)
	}
	found, err := membership.New(c.pinRoot).FindContainer(p.containerID, "eth0")
	if err != nil || found != id {
		t.Fatalf("%s: member of %q (%v), want %q", p.name, found, err, id)
	}
	idx := lcIfindex(t, c, p.hostVeth)
	if idx == 0 {
		t.Fatalf("%s: host veth %s is gone", p.name, p.hostVeth)
	}
	in, eg := lcAttached(t, c, idx)
	if !slices.Equal(in, []ebpf.ProgramID{progEg}) || !slices.Equal(eg, []ebpf.ProgramID{progIn}) {
		t.Fatalf("%s: veth runs %v (ingress hook) and %v (egress hook), want [%d] and [%d]", p.name, in, eg, progEg, progIn)
	}
}

// lcRequireGone checks that nothing of p is left: no record (in any
// identifier), no link pin, and no program on its host veth if that still
// exists.
func lcRequireGone(t *testing.T, c *cluster, p *pod) {
	t.Helper()
	if id, err := membership.New(c.pinRoot).FindContainer(p.containerID, "eth0"); !errors.Is(err, membership.ErrNotMember) {
		t.Errorf("%s: still a member of %q (%v)", p.name, id, err)
	}
	key := membership.Key(p.containerID, "eth0")
	for _, path := range lcTree(t, c.pinRoot) {
		if strings.Contains(path, key) {
			t.Errorf("%s: %s left in the pin root", p.name, path)
		}
	}
	if p.hostVeth == "" {
		return
	}
	if idx := lcIfindex(t, c, p.hostVeth); idx != 0 {
		if in, eg := lcAttached(t, c, idx); len(in)+len(eg) > 0 {
			t.Errorf("%s: veth %s still runs %v (ingress hook) and %v (egress hook)", p.name, p.hostVeth, in, eg)
		}
	}
}

// lcTree lists every path below root, relative to it, sorted, but for
// the DELs' tombstones (lcTombstones), which every DEL leaves.
func lcTree(t *testing.T, root string) []string {
	t.Helper()
	all, err := walkTree(root)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, p := range all {
		if p != pinpath.TombstonesDir && !strings.HasPrefix(p, pinpath.TombstonesDir+"/") {
			out = append(out, p)
		}
	}
	return out
}

// lcTombstones are the keys of the DELs' tombstones below root.
func lcTombstones(t *testing.T, root string) []string {
	t.Helper()
	entries, err := os.ReadDir(pinpath.Root(root).Tombstones())
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		t.Fatal(err)
	}
	var keys []string
	for _, e := range entries {
		keys = append(keys, e.Name())
	}
	return keys
}

// lcLinkPins are the TCX link pins below root.
func lcLinkPins(t *testing.T, root string) []string {
	t.Helper()
	var out []string
	for _, p := range lcTree(t, root) {
		if strings.HasPrefix(filepath.Base(p), "link_") {
			out = append(out, p)
		}
	}
	return out
}

// lcIdentifiers are the identifiers with a directory below c's pin root.
func lcIdentifiers(t *testing.T, c *cluster) []string {
	t.Helper()
	ids, err := membership.New(c.pinRoot).Identifiers()
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, id := range ids {
		out = append(out, string(id))
	}
	slices.Sort(out)
	return out
}

// lcAddPodOwnNS adds a pod whose network namespace the test may destroy
// (the harness's namespaces are removed by its own cleanup); destroy
// removes it and waits until the kernel has deleted the pod's veth.
func lcAddPodOwnNS(t *testing.T, c *cluster, name string) (p *pod, destroy func()) {
	t.Helper()
	n, err := testutils.NewNS()
	if err != nil {
		t.Fatal(err)
	}
	gone := false
	t.Cleanup(func() {
		if !gone {
			n.Close()
			_ = testutils.UnmountNS(n)
		}
	})
	p = &pod{name: name, namespace: "default", containerID: fmt.Sprintf("lc%06d", podSeq.Add(1)), netns: n}
	t.Cleanup(func() { c.delPodQuiet(p) })
	var res *current.Result
	if err := c.inNode(func() error {
		r, err := c.cni.AddNetworkList(context.Background(), c.list, c.runtimeConf(p))
		if err != nil {
			return err
		}
		res, err = current.NewResultFromResult(r)
		return err
	}); err != nil {
		t.Fatalf("ADD %s: %v", name, err)
	}
	for _, iface := range res.Interfaces {
		if iface.Sandbox == "" {
			p.hostVeth = iface.Name
		}
	}
	for _, ipc := range res.IPs {
		if a, ok := netip.AddrFromSlice(ipc.Address.IP.To4()); ok && !p.ip.IsValid() {
			p.ip = a
		}
	}
	return p, func() {
		t.Helper()
		n.Close()
		if err := testutils.UnmountNS(n); err != nil {
			t.Fatal(err)
		}
		gone = true
		deadline := time.Now().Add(10 * time.Second)
		for lcIfindex(t, c, p.hostVeth) != 0 {
			if time.Now().After(deadline) {
				t.Fatalf("veth %s outlived its pod's namespace", p.hostVeth)
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
}

// lcDeleteHostVeth deletes p's veth (both ends) from the node.
func lcDeleteHostVeth(t *testing.T, c *cluster, p *pod) {
	t.Helper()
	if err := c.inNode(func() error {
		l, err := netlink.LinkByName(p.hostVeth)
		if err != nil {
			return err
		}
		return netlink.LinkDel(l)
	}); err != nil {
		t.Fatal(err)
	}
}

// TestDelRepeatedAndUnknown: DEL is idempotent, and a DEL for a container
// podfence never saw changes nothing, also in an identifier that others use.
func TestDelRepeatedAndUnknown(t *testing.T) {
	for _, mode := range attachModes(t) {
		t.Run(mode, func(t *testing.T) {
			c := lcCluster(t, mode)
			a := c.addPod(webReplicas[0], "default")
			b := c.addPod(webReplicas[1], "default")
			lcRequireEnforced(t, c, a)
			lcRequireEnforced(t, c, b)
			before := lcTree(t, c.pinRoot)

			// DEL of containers never added: one in b's identifier, one in
			// none, one without Kubernetes arguments.
			for _, call := range []lcCall{
				{cmd: "DEL", containerID: "never-added-1", netns: a.netns.Path(), ifname: "eth0", args: lcArgs(webReplicas[2], "default")},
				{cmd: "DEL", containerID: "never-added-2", ifname: "eth0", args: lcArgs("other", "default")},
				{cmd: "DEL", containerID: "never-added-3", ifname: "eth0"},
				// a's container with another interface name.
				{cmd: "DEL", containerID: a.containerID, ifname: "eth1", args: lcArgs(a.name, a.namespace)},
			} {
				call.conf = lcConf(c, "1.0.0")
				if _, err := lcExec(t, c, call); err != nil {
					t.Errorf("DEL of %s/%s, never added: %v", call.containerID, call.ifname, err)
				}
			}
			if after := lcTree(t, c.pinRoot); !slices.Equal(before, after) {
				t.Errorf("DEL of unknown containers changed the pin root:\nbefore %v\nafter  %v", before, after)
			}
			// But each left its tombstone, for an adoption that raced it.
			tombs := lcTombstones(t, c.pinRoot)
			for _, key := range []string{membership.Key("never-added-1", "eth0"), membership.Key("never-added-2", "eth0"),
				membership.Key("never-added-3", "eth0"), membership.Key(a.containerID, "eth1")} {
				if !slices.Contains(tombs, key) {
					t.Errorf("no tombstone of %s: %v", key, tombs)
				}
			}
			lcRequireEnforced(t, c, a)
			lcRequireEnforced(t, c, b)

			for i := 0; i < 2; i++ {
				c.delPod(a)
				lcRequireGone(t, c, a)
				lcRequireEnforced(t, c, b)
			}
			progIn, progEg, err := bpf.PinnedProgramIDs(c.identifierDir(string(lcIdentifier(t, b))))
			if err != nil {
				t.Fatal(err)
			}
			for i := 0; i < 2; i++ {
				c.delPod(b)
				lcRequireGone(t, c, b)
				if exists(c.identifierDir(webID)) {
					t.Fatal("the last member's DEL left the identifier")
				}
			}
			waitFreed(t, "identifier", kernelObjects{progs: []ebpf.ProgramID{progIn, progEg}})
			if ids := lcIdentifiers(t, c); len(ids) != 0 {
				t.Errorf("identifiers left: %v", ids)
			}
		})
	}
}

// TestAdoptionAddAfterDel: an adoption's ADD (marked with
// cniconf.AdoptionArg) of a container whose DEL has run is refused with
// code 105 and adds nothing, while the veth is still there (the DEL that
// raced it was podfence's, before the primary plugin's); the runtime's own
// ADD of it is not refused, and clears the tombstone.
func TestAdoptionAddAfterDel(t *testing.T) {
	c := lcCluster(t, attachModes(t)[0])
	p := c.addPod(webReplicas[0], "default")
	other := c.addPod(webReplicas[1], "default")
	prev := lcPrevResult(t, c, c.list, p)
	del := p.lcCall(c, "DEL")
	del.conf = withPrev(lcConf(c, "1.0.0"), prev)
	if _, err := lcExec(t, c, del); err != nil {
		t.Fatalf("podfence's DEL: %v", err)
	}
	lcRequireGone(t, c, p)
	key := membership.Key(p.containerID, "eth0")
	if !slices.Contains(lcTombstones(t, c.pinRoot), key) {
		t.Fatalf("the DEL left no tombstone: %v", lcTombstones(t, c.pinRoot))
	}
	before := lcTree(t, c.pinRoot)

	adopt := p.lcCall(c, "ADD")
	adopt.args += ";" + cniconf.AdoptionArg + "=true"
	adopt.conf = withPrev(lcConf(c, "1.0.0"), prev)
	_, err := lcExec(t, c, adopt)
	lcWantCNIError(t, err, cniconf.ErrCodeDeleted, "not adopted", key)
	if after := lcTree(t, c.pinRoot); !slices.Equal(before, after) {
		t.Errorf("the refused ADD changed the pin root:\nbefore %v\nafter  %v", before, after)
	}
	lcRequireGone(t, c, p)
	lcRequireEnforced(t, c, other)

	add := p.lcCall(c, "ADD")
	add.conf = withPrev(lcConf(c, "1.0.0"), prev)
	if _, err := lcExec(t, c, add); err != nil {
		t.Fatalf("the runtime's ADD after the tombstone: %v", err)
	}
	lcRequireEnforced(t, c, p)
	if slices.Contains(lcTombstones(t, c.pinRoot), key) {
		t.Errorf("the runtime's ADD kept the tombstone")
	}
}

// TestDelAfterPodGone: the runtime's DEL comes after the pod's namespace
// (and with it the veth) or just the veth is gone. DEL must succeed and
// remove the record, the link pins and, for the last member, the pins.
func TestDelAfterPodGone(t *testing.T) {
	for _, mode := range attachModes(t) {
		t.Run(mode, func(t *testing.T) {
			c := lcCluster(t, mode)
			// Two replicas: the first DEL must keep the shared pins.
			a, destroyA := lcAddPodOwnNS(t, c, webReplicas[0])
			b := c.addPod(webReplicas[1], "default")
			lcRequireEnforced(t, c, a)
			progIn, progEg, err := bpf.PinnedProgramIDs(c.identifierDir(string(webID)))
			if err != nil {
				t.Fatal(err)
			}
			if mode == "tcx" && len(lcLinkPins(t, c.pinRoot)) != 4 {
				t.Fatalf("link pins %v, want two per member", lcLinkPins(t, c.pinRoot))
			}

			destroyA()
			c.delPod(a) // with the path of the namespace that is gone
			lcRequireGone(t, c, a)
			lcRequireEnforced(t, c, b)
			if i2, e2, err := bpf.PinnedProgramIDs(c.identifierDir(string(webID))); err != nil || i2 != progIn || e2 != progEg {
				t.Fatalf("pins changed: %v", err)
			}

			lcDeleteHostVeth(t, c, b) // the namespace is still there
			c.delPod(b)
			lcRequireGone(t, c, b)
			if exists(c.identifierDir(webID)) {
				t.Errorf("the last member's DEL left the identifier: %v", lcTree(t, c.pinRoot))
			}
			if pins := lcLinkPins(t, c.pinRoot); len(pins) != 0 {
				t.Errorf("link pins left: %v", pins)
			}
			waitFreed(t, "identifier", kernelObjects{progs: []ebpf.ProgramID{progIn, progEg}})
		})
	}
}

// TestDelContainerdShapes: containerd calls DEL at sandbox stop (netns,
// cached prevResult) and again at removal, with an empty CNI_NETNS and no
// prevResult; either may be the only one that comes. The second shape
// works from the record alone, also when the runtime passes no Kubernetes
// arguments to it.
func TestDelContainerdShapes(t *testing.T) {
	bare := func(c *cluster, p *pod, args string) lcCall {
		return lcCall{cmd: "DEL", containerID: p.containerID, ifname: "eth0", args: args, conf: lcConf(c, "1.0.0")}
	}
	for _, mode := range attachModes(t) {
		t.Run(mode, func(t *testing.T) {
			c := lcCluster(t, mode)
			a := c.addPod(webReplicas[0], "default")
			b := c.addPod(webReplicas[1], "default")
			d := c.addPod(webReplicas[2], "default")
			client := c.addPod("client", "default")

			// Stop, then removal.
			c.delPod(a)
			if _, err := lcExec(t, c, bare(c, a, lcArgs(a.name, a.namespace))); err != nil {
				t.Fatalf("DEL without netns after a DEL: %v", err)
			}
			lcRequireGone(t, c, a)
			lcRequireEnforced(t, c, b)

			// Removal only: the veth is still there and its programs
			// must go.
			if _, err := lcExec(t, c, bare(c, b, lcArgs(b.name, b.namespace))); err != nil {
				t.Fatalf("DEL without netns instead of a DEL: %v", err)
			}
			lcRequireGone(t, c, b)
			lcRequireEnforced(t, c, d)

			// Removal only, without Kubernetes arguments: the identifier
			// is found through the record.
			progIn, progEg, err := bpf.PinnedProgramIDs(c.identifierDir(string(webID)))
			if err != nil {
				t.Fatal(err)
			}
			if _, err := lcExec(t, c, bare(c, d, "IgnoreUnknown=1")); err != nil {
				t.Fatalf("DEL without netns or arguments: %v", err)
			}
			lcRequireGone(t, c, d)
			if exists(c.identifierDir(webID)) {
				t.Errorf("the last member's DEL left the identifier")
			}
			waitFreed(t, "identifier", kernelObjects{progs: []ebpf.ProgramID{progIn, progEg}})
			lcRequireEnforced(t, c, client)

			// The runtime's regular DELs that follow change nothing.
			for _, p := range []*pod{b, d} {
				c.delPod(p)
				lcRequireGone(t, c, p)
			}
			lcRequireEnforced(t, c, client)
		})
	}
}

// TestDelAfterFailedAdd: an ADD that fails once it holds the identifier's
// lock leaves nothing, and the DEL a runtime sends after it succeeds.
func TestDelAfterFailedAdd(t *testing.T) {
	c := lcCluster(t, attachModes(t)[0])
	// A node-wide map pinned by a datapath of another layout.
	global := pinpath.Root(c.pinRoot).Global()
	if err := os.MkdirAll(global, 0o700); err != nil {
		t.Fatal(err)
	}
	m, err := ebpf.NewMap(&ebpf.MapSpec{Type: ebpf.Hash, KeySize: 4, ValueSize: 4, MaxEntries: 1})
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	if err := m.Pin(filepath.Join(global, pinpath.MapCTv4)); err != nil {
		t.Fatal(err)
	}
	before := lcTree(t, c.pinRoot)

	p, err := c.tryAddPod(webReplicas[0], "default")
	lcWantCNIError(t, err, 102, pinpath.MapCTv4, "incompatible pin")
	// The identifier's directory was made (it is the lock's) and removed;
	// the directory of all identifiers may stay.
	before = append(before, pinpath.IdentifiersDir)
	slices.Sort(before)
	if after := lcTree(t, c.pinRoot); !slices.Equal(before, after) {
		t.Errorf("failed ADD changed the pin root:\nbefore %v\nafter  %v", before, after)
	}
	p.hostVeth = lcPeerOfEth0(t, c, p.netns)
	lcRequireGone(t, c, p)

	c.delPod(p) // no cached result: no prevResult
	if after := lcTree(t, c.pinRoot); !slices.Equal(before, after) {
		t.Errorf("DEL after the failed ADD changed the pin root:\nbefore %v\nafter  %v", before, after)
	}
}

// lcPeerOfEth0 is the name of the node's end of the pod's eth0 ("" when
// eth0 is gone).
func lcPeerOfEth0(t *testing.T, c *cluster, pod ns.NetNS) string {
	t.Helper()
	var peer int
	if err := pod.Do(func(ns.NetNS) error {
		l, err := netlink.LinkByName("eth0")
		if err != nil {
			return nil
		}
		peer = l.Attrs().ParentIndex
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	if peer == 0 {
		return ""
	}
	var name string
	if err := c.inNode(func() error {
		l, err := netlink.LinkByIndex(peer)
		if err != nil {
			return err
		}
		name = l.Attrs().Name
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	return name
}

// TestGC: GC keeps the listed attachments and removes every other member,
// its programs and link pins, and every identifier left without members
// (also one whose pins a killed ADD left without any member).
func TestGC(t *testing.T) {
	gc := func(t *testing.T, c *cluster, valid ...*pod) error {
		conf := lcConf(c, "1.1.0")
		list := []types.GCAttachment{}
		for _, p := range valid {
			list = append(list, types.GCAttachment{ContainerID: p.containerID, IfName: "eth0"})
		}
		conf["cni.dev/valid-attachments"] = list
		_, err := lcExec(t, c, lcCall{cmd: "GC", conf: conf})
		return err
	}
	for _, mode := range attachModes(t) {
		t.Run(mode, func(t *testing.T) {
			c := lcCluster(t, mode)
			a := c.addPod(webReplicas[0], "default")
			b := c.addPod(webReplicas[1], "default")
			d := c.addPod("db-0", "default")
			client := c.addPod("client", "default")
			// Pins of an identifier whose ADD was killed before it
			// recorded a member.
			g, err := bpf.OpenGlobal(globalDir(c.pinRoot), bpf.GlobalOptions{})
			if err != nil {
				t.Fatal(err)
			}
			ident, err := bpf.OpenIdentifier(g, c.identifierDir(string("orphan@default")), "orphan@default")
			if err != nil {
				t.Fatal(err)
			}
			ident.Close()
			g.Close()
			if got := lcIdentifiers(t, c); len(got) != 4 {
				t.Fatalf("identifiers %v, want four", got)
			}
			webIn, webEg, err := bpf.PinnedProgramIDs(c.identifierDir(string(webID)))
			if err != nil {
				t.Fatal(err)
			}

			if err := gc(t, c, a, client); err != nil {
				t.Fatalf("GC: %v", err)
			}
			lcRequireEnforced(t, c, a)
			lcRequireEnforced(t, c, client)
			lcRequireGone(t, c, b)
			lcRequireGone(t, c, d)
			if got, want := lcIdentifiers(t, c), []string{"client@default", webID}; !slices.Equal(got, want) {
				t.Errorf("identifiers after GC %v, want %v", got, want)
			}
			if i2, e2, err := bpf.PinnedProgramIDs(c.identifierDir(string(webID))); err != nil || i2 != webIn || e2 != webEg {
				t.Errorf("GC changed the pins of an identifier in use: %v", err)
			}
			// Repeating it changes nothing.
			before := lcTree(t, c.pinRoot)
			if err := gc(t, c, a, client); err != nil {
				t.Fatalf("GC again: %v", err)
			}
			if after := lcTree(t, c.pinRoot); !slices.Equal(before, after) {
				t.Errorf("a second GC changed the pin root:\nbefore %v\nafter  %v", before, after)
			}

			if err := gc(t, c); err != nil {
				t.Fatalf("GC with no valid attachment: %v", err)
			}
			for _, p := range []*pod{a, b, d, client} {
				lcRequireGone(t, c, p)
			}
			if got := lcIdentifiers(t, c); len(got) != 0 {
				t.Errorf("identifiers after GC of everything: %v", got)
			}
			if pins := lcLinkPins(t, c.pinRoot); len(pins) != 0 {
				t.Errorf("link pins left: %v", pins)
			}
			waitFreed(t, "identifier", kernelObjects{progs: []ebpf.ProgramID{webIn, webEg}})
		})
	}
}

// TestGCThroughLibcni: libcni's GC first DELs the cached attachments that
// are not valid, then sends GC to every plugin, with the valid attachments
// under two keys.
func TestGCThroughLibcni(t *testing.T) {
	c := newCluster(t, attachModes(t)[0])
	cacheDir := t.TempDir()
	c.cni = libcni.NewCNIConfigWithCacheDir([]string{binDir}, cacheDir, nil)
	c.list = lcList(t, c, "1.1.0", nil, "")
	keep := c.addPod(webReplicas[0], "default")
	drop := c.addPod(webReplicas[1], "default")
	other := c.addPod("client", "default")
	// Leave a member podfence knows and libcni does not (its cache was
	// lost): only podfence's GC can remove it.
	if err := os.Remove(filepath.Join(cacheDir, "results", "podfence-e2e-"+other.containerID+"-eth0")); err != nil {
		t.Fatalf("forget the cached result: %v", err)
	}
	err := c.inNode(func() error {
		return c.cni.GCNetworkList(context.Background(), c.list, &libcni.GCArgs{
			ValidAttachments: []types.GCAttachment{{ContainerID: keep.containerID, IfName: "eth0"}},
		})
	})
	if err != nil {
		t.Fatalf("GC: %v", err)
	}
	lcRequireEnforced(t, c, keep)
	lcRequireGone(t, c, drop)
	lcRequireGone(t, c, other)
	if got := lcIdentifiers(t, c); !slices.Equal(got, []string{webID}) {
		t.Errorf("identifiers %v, want only %s", got, webID)
	}
}

// TestCheck: CHECK passes on a healthy pod and fails, saying what is
// wrong, when its record or its sources entry is gone or a program was
// detached from its veth behind podfence's back; DEL still cleans up after
// each.
func TestCheck(t *testing.T) {
	for _, mode := range attachModes(t) {
		t.Run(mode, func(t *testing.T) {
			c := lcCluster(t, mode)
			check := func(p *pod) error {
				return c.inNode(func() error {
					return c.cni.CheckNetworkList(context.Background(), c.list, c.runtimeConf(p))
				})
			}
			a := c.addPod(webReplicas[0], "default")
			b := c.addPod(webReplicas[1], "default")
			d := c.addPod("db-0", "default")
			for _, p := range []*pod{a, b, d} {
				if err := check(p); err != nil {
					t.Fatalf("CHECK of healthy %s: %v", p.name, err)
				}
			}

			// a's record is gone (a's programs are still attached).
			store := membership.New(c.pinRoot)
			l, err := store.Lock(webID)
			if err != nil {
				t.Fatal(err)
			}
			aKey := membership.Key(a.containerID, "eth0")
			rec := filepath.Join(l.MemberDir(aKey), pinpath.Record)
			target, err := os.Readlink(rec)
			if err != nil {
				t.Fatal(err)
			}
			if err := os.Remove(rec); err != nil {
				t.Fatal(err)
			}
			l.Unlock()
			lcWantCNIError(t, check(a), 104, aKey, "not a member")
			if err := check(b); err != nil {
				t.Errorf("CHECK of %s, whose replica lost its record: %v", b.name, err)
			}
			// Put the record back for DEL to find.
			if err := os.Symlink(target, rec); err != nil {
				t.Fatal(err)
			}
			if err := check(a); err != nil {
				t.Fatalf("CHECK with the record back: %v", err)
			}

			// a's sources entry is gone: its new flows would be dropped.
			if err := bpf.DeleteSources(c.identifierDir(webID), uint32(lcIfindex(t, c, a.hostVeth))); err != nil {
				t.Fatal(err)
			}
			lcWantCNIError(t, check(a), 102, a.hostVeth, "may send from")
			c.setSources(t, webID, a)
			if err := check(a); err != nil {
				t.Fatalf("CHECK with the sources entry back: %v", err)
			}

			// The identifier is gone altogether.
			if _, err := lcExec(t, c, lcCall{cmd: "CHECK", containerID: "none", netns: d.netns.Path(), ifname: "eth0",
				args: lcArgs("nobody", "default"), conf: withPrev(lcConf(c, "1.0.0"), lcPrevResult(t, c, c.list, d))}); err == nil {
				t.Error("CHECK of a pod podfence never added passed")
			} else {
				lcWantCNIError(t, err, 104, "none", "identifier has no state")
			}

			// Detach one program behind podfence's back: the veth's egress
			// hook (the pod's ingress program).
			idx := lcIfindex(t, c, b.hostVeth)
			if err := c.inNode(func() error {
				if mode == "tcx" {
					// Detach the link but leave its pin.
					pin := filepath.Join(l.MemberDir(membership.Key(b.containerID, "eth0")), pinpath.LinkEgress)
					ln, err := link.LoadPinnedLink(pin, nil)
					if err != nil {
						return err
					}
					defer ln.Close()
					return ln.Detach()
				}
				return attach.Detach(attach.Options{Ifindex: idx, Hook: attach.HookEgress})
			}); err != nil {
				t.Fatal(err)
			}
			lcWantCNIError(t, check(b), 103, b.hostVeth, "lacks the ingress program", "egress hook")
			if err := check(a); err != nil {
				t.Errorf("CHECK of %s after its replica's program was detached: %v", a.name, err)
			}
			// And the other hook too.
			if err := c.inNode(func() error {
				if mode == "tcx" {
					pin := filepath.Join(l.MemberDir(membership.Key(b.containerID, "eth0")), pinpath.LinkIngress)
					ln, err := link.LoadPinnedLink(pin, nil)
					if err != nil {
						return err
					}
					defer ln.Close()
					return ln.Detach()
				}
				return attach.Detach(attach.Options{Ifindex: idx, Hook: attach.HookIngress})
			}); err != nil {
				t.Fatal(err)
			}
			lcWantCNIError(t, check(b), 103, b.hostVeth, "lacks the")

			// d's veth is gone (ptp's CHECK would fail first: ask podfence).
			dPrev := lcPrevResult(t, c, c.list, d)
			lcDeleteHostVeth(t, c, d)
			call := d.lcCall(c, "CHECK")
			call.conf = withPrev(call.conf, dPrev)
			_, err = lcExec(t, c, call)
			lcWantCNIError(t, err, 103, d.hostVeth, "is gone")

			for _, p := range []*pod{a, b, d} {
				c.delPod(p)
				lcRequireGone(t, c, p)
			}
			if got := lcIdentifiers(t, c); len(got) != 0 {
				t.Errorf("identifiers left: %v", got)
			}
			if pins := lcLinkPins(t, c.pinRoot); len(pins) != 0 {
				t.Errorf("link pins left: %v", pins)
			}
		})
	}
}

func withPrev(conf, prev map[string]any) map[string]any {
	conf["prevResult"] = prev
	return conf
}

// TestStatus: STATUS (CNI 1.1.0) reports a usable node, and error 50 when
// the pin root is not on bpffs.
func TestStatus(t *testing.T) {
	c := lcCluster(t, attachModes(t)[0])
	status := func(pinRoot string) error {
		conf := lcConf(c, "1.1.0")
		conf["pinRoot"] = pinRoot
		_, err := lcExec(t, c, lcCall{cmd: "STATUS", conf: conf})
		return err
	}
	if err := status(c.pinRoot); err != nil {
		t.Fatalf("STATUS: %v", err)
	}
	if err := status(filepath.Join(c.pinRoot, "not-yet")); err != nil {
		t.Errorf("STATUS with a pin root to create on bpffs: %v", err)
	}
	notBPF := t.TempDir()
	var st unix.Statfs_t
	if err := unix.Statfs(notBPF, &st); err != nil || st.Type == unix.BPF_FS_MAGIC {
		t.Fatalf("%s is on bpffs (%v)", notBPF, err)
	}
	lcWantCNIError(t, status(notBPF), types.ErrPluginNotAvailable, notBPF, "not on bpffs")
	lcWantCNIError(t, status(filepath.Join(notBPF, "sub", "dir")), types.ErrPluginNotAvailable, "not on bpffs")
	file := filepath.Join(notBPF, "file")
	if err := os.WriteFile(file, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	lcWantCNIError(t, status(filepath.Join(file, "pins")), types.ErrPluginNotAvailable, "pin root")

	// Through libcni, as a 1.1.0 runtime asks: every plugin of the list.
	list := lcList(t, c, "1.1.0", nil, "")
	if err := c.inNode(func() error { return c.cni.GetStatusNetworkList(context.Background(), list) }); err != nil {
		t.Errorf("STATUS of the list: %v", err)
	}
	list = lcList(t, c, "1.1.0", func(pf map[string]any) { pf["pinRoot"] = notBPF }, "")
	err := c.inNode(func() error { return c.cni.GetStatusNetworkList(context.Background(), list) })
	lcWantCNIError(t, err, types.ErrPluginNotAvailable, "not on bpffs")
	// STATUS made the missing pin root it was asked about, and removed
	// its probe; what it leaves is the marker of its verified datapath.
	var left []string
	for _, p := range lcTree(t, c.pinRoot) {
		if p != "not-yet" && !strings.HasPrefix(p, pinpath.StatusDir) && !strings.HasPrefix(p, filepath.Join("not-yet", pinpath.StatusDir)) {
			left = append(left, p)
		}
	}
	if len(left) > 0 {
		t.Errorf("STATUS left %v in the pin root", left)
	}
	markers, err := os.ReadDir(pinpath.Root(c.pinRoot).Status())
	if err != nil || len(markers) != 1 || !strings.HasPrefix(markers[0].Name(), "verified-") {
		t.Fatalf("STATUS's marker: %v %v", markers, err)
	}
	// With the marker, STATUS still checks the pin root (and fails on one
	// not on bpffs) but does not load the programs again: its log says so.
	if err := status(c.pinRoot); err != nil {
		t.Fatalf("STATUS with its marker: %v", err)
	}
	if log, err := os.ReadFile(c.logFile); err != nil || !strings.Contains(string(log), "verified earlier on this kernel") {
		t.Errorf("the second STATUS did not use its marker: %v\n%s", err, log)
	}
}

// TestPrevResultPassedThrough: ADD prints the primary plugin's result
// unchanged, in the conflist's version, and the chain works end to end in
// every version podfence supports.
func TestPrevResultPassedThrough(t *testing.T) {
	for _, version := range []string{"0.4.0", "1.0.0", "1.1.0"} {
		t.Run(version, func(t *testing.T) {
			c := lcCluster(t, attachModes(t)[0])
			c.list = lcList(t, c, version, nil, "")

			// ptp alone, then podfence given ptp's result.
			ptpOnly := lcList(t, c, version, nil, "ptp")
			p := &pod{name: "solo", namespace: "default", containerID: fmt.Sprintf("lc%06d", podSeq.Add(1)), netns: netnsutil.New(t)}
			var ptpResult types.Result
			if err := c.inNode(func() error {
				var err error
				ptpResult, err = c.cni.AddNetworkList(context.Background(), ptpOnly, c.runtimeConf(p))
				return err
			}); err != nil {
				t.Fatalf("ptp ADD: %v", err)
			}
			t.Cleanup(func() {
				_ = c.inNode(func() error {
					return c.cni.DelNetworkList(context.Background(), ptpOnly, c.runtimeConf(p))
				})
			})
			if ptpResult.Version() != version {
				t.Fatalf("ptp answered in version %s", ptpResult.Version())
			}
			prev := lcJSONMap(t, ptpResult)
			call := p.lcCall(c, "ADD")
			call.conf = withPrev(lcConf(c, version), prev)
			out, err := lcExec(t, c, call)
			if err != nil {
				t.Fatalf("podfence ADD: %v", err)
			}
			var got map[string]any
			if err := json.Unmarshal(out, &got); err != nil {
				t.Fatalf("podfence printed %q: %v", out, err)
			}
			if !reflect.DeepEqual(got, prev) {
				t.Errorf("podfence changed the result:\nptp      %v\npodfence %v", prev, got)
			}
			if got["cniVersion"] != version {
				t.Errorf("result of version %v, want %s", got["cniVersion"], version)
			}
			r, _ := current.NewResultFromResult(ptpResult)
			for _, iface := range r.Interfaces {
				if iface.Sandbox == "" {
					p.hostVeth = iface.Name
				}
			}
			lcRequireEnforced(t, c, p)
			call = p.lcCall(c, "DEL")
			call.conf = withPrev(lcConf(c, version), prev)
			if _, err := lcExec(t, c, call); err != nil {
				t.Fatalf("podfence DEL: %v", err)
			}
			lcRequireGone(t, c, p)

			// The whole chain through libcni.
			q := c.addPod(webReplicas[0], "default")
			cached, err := c.cni.GetNetworkListCachedResult(c.list, c.runtimeConf(q))
			if err != nil || cached == nil || cached.Version() != version {
				t.Fatalf("cached result %v, %v; want version %s", cached, err, version)
			}
			lcRequireEnforced(t, c, q)
			if err := c.inNode(func() error {
				return c.cni.CheckNetworkList(context.Background(), c.list, c.runtimeConf(q))
			}); err != nil {
				t.Errorf("CHECK: %v", err)
			}
			c.delPod(q)
			lcRequireGone(t, c, q)
			if got := lcIdentifiers(t, c); len(got) != 0 {
				t.Errorf("identifiers left: %v", got)
			}
		})
	}
}

// TestOddContainerAndInterfaceNames: the CNI spec allows '.' in container
// IDs and interface names, which bpffs refuses in names.
func TestOddContainerAndInterfaceNames(t *testing.T) {
	c := lcCluster(t, attachModes(t)[0])
	rt := &libcni.RuntimeConf{
		ContainerID: fmt.Sprintf("pod.%06d_a-b", podSeq.Add(1)),
		NetNS:       netnsutil.New(t).Path(),
		IfName:      "net.1",
		Args:        [][2]string{{"IgnoreUnknown", "1"}, {"K8S_POD_NAMESPACE", "default"}, {"K8S_POD_NAME", "api.v2-0"}},
	}
	run := func(what string, fn func(context.Context, *libcni.NetworkConfigList, *libcni.RuntimeConf) error) {
		t.Helper()
		if err := c.inNode(func() error { return fn(context.Background(), c.list, rt) }); err != nil {
			t.Fatalf("%s: %v", what, err)
		}
	}
	t.Cleanup(func() {
		_ = c.inNode(func() error { return c.cni.DelNetworkList(context.Background(), c.list, rt) })
	})
	run("ADD", func(ctx context.Context, l *libcni.NetworkConfigList, rt *libcni.RuntimeConf) error {
		_, err := c.cni.AddNetworkList(ctx, l, rt)
		return err
	})
	store := membership.New(c.pinRoot)
	if id, err := store.FindContainer(rt.ContainerID, rt.IfName); err != nil || id != "api_v2-0@default" {
		t.Fatalf("member of %q (%v), want api_v2-0@default", id, err)
	}
	run("CHECK", c.cni.CheckNetworkList)
	run("DEL", c.cni.DelNetworkList)
	if id, err := store.FindContainer(rt.ContainerID, rt.IfName); !errors.Is(err, membership.ErrNotMember) {
		t.Errorf("still a member of %q after DEL (%v)", id, err)
	}
	if ids := lcIdentifiers(t, c); len(ids) != 0 {
		t.Errorf("identifiers left: %v", ids)
	}
}
