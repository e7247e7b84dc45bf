package attach

import (
	"errors"
	"net/netip"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/cilium/ebpf/link"
	"github.com/containernetworking/plugins/pkg/ns"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/podfence/podfence/bpf"
	"github.com/podfence/podfence/pkg/objinfo"
	"github.com/podfence/podfence/pkg/pinfs"
	"github.com/podfence/podfence/pkg/pinpath"
	"github.com/podfence/podfence/pkg/podid"
	"github.com/podfence/podfence/pkg/policy"
	"github.com/podfence/podfence/test/kernel"
	"github.com/podfence/podfence/test/netnsutil"
)

// Kernel tests (root): real programs on a real veth between a "node" and a
// "pod" namespace, judged by real TCP connections.

const (
	dialTimeout = 300 * time.Millisecond
	// A connection that should work gets this many tries (a first SYN can
	// race the veth coming up); one that should be dropped gets one.
	dialAttempts = 10

	nodePort = 8080 // listener in the node namespace, for the pod's egress
)

var modes = []Mode{ModeTCX, ModeTC}

// requireMode skips a test of mode m on a kernel that cannot do it.
func requireMode(t testing.TB, m Mode) {
	t.Helper()
	kernel.RequireRoot(t)
	if m != ModeTCX {
		return
	}
	if err := TCXSupported(); err != nil {
		if errors.Is(err, ErrTCXUnsupported) {
			t.Skipf("skip tcx: %v", err)
		}
		t.Fatal(err)
	}
}

func forEachMode(t *testing.T, fn func(t *testing.T, m Mode)) {
	for _, m := range modes {
		t.Run(string(m), func(t *testing.T) {
			requireMode(t, m)
			fn(t, m)
		})
	}
}

// env is one identifier's datapath and a node/pod pair with listeners: pod
// ports 80 and 81, node port 8080.
type env struct {
	*netnsutil.Pair
	t    *testing.T
	mode Mode
	root string
	g    *bpf.Global
	id   *bpf.Datapath
}

func newEnv(t *testing.T, m Mode) *env {
	t.Helper()
	e := &env{t: t, mode: m, root: kernel.PinRoot(t)}
	var err error
	if e.g, err = bpf.OpenGlobal(pinpath.Root(e.root).Global(), bpf.GlobalOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { e.g.Close() })
	e.id = e.identifier("web-7f65cc6544@default")
	e.Pair = netnsutil.NewPair(t)
	netnsutil.Listen(t, e.Pod, 80)
	netnsutil.Listen(t, e.Pod, 81)
	netnsutil.Listen(t, e.Node, nodePort)
	return e
}

func (e *env) identifier(name podid.ID) *bpf.Datapath {
	e.t.Helper()
	id, err := bpf.OpenIdentifier(e.g, pinpath.Root(e.root).Identifier(name), name)
	if err != nil {
		e.t.Fatal(err)
	}
	e.t.Cleanup(func() { id.Close() })
	return id
}

// opts attaches prog to the host veth's hook h, with a link pin per hook.
func (e *env) opts(h Hook, prog *ebpf.Program) Options {
	return Options{
		Ifindex: e.HostIndex,
		Hook:    h,
		Program: prog,
		Mode:    e.mode,
		LinkPin: filepath.Join(e.root, "links", "veth0_"+h.String()),
	}
}

// attachBoth puts the identifier's ingress program on the host veth's
// egress hook and its egress program on the ingress hook, after recording
// the pod's addresses as what it may send from.
func (e *env) attachBoth() {
	e.t.Helper()
	src := bpf.Sources{Addrs: []netip.Addr{netnsutil.PodV4.Addr(), netnsutil.PodV6.Addr()}}
	if err := e.id.SetSources(uint32(e.HostIndex), src); err != nil {
		e.t.Fatal(err)
	}
	e.attach(e.opts(HookEgress, e.id.Ingress))
	e.attach(e.opts(HookIngress, e.id.Egress))
}

func (e *env) attach(o Options) {
	e.t.Helper()
	netnsutil.Do(e.t, e.Node, func() error {
		got, err := Attach(o)
		if err == nil && got != e.mode {
			e.t.Errorf("Attach used mode %s, want %s", got, e.mode)
		}
		return err
	})
}

func (e *env) detach(o Options) {
	e.t.Helper()
	netnsutil.Do(e.t, e.Node, func() error { return Detach(o) })
}

func (e *env) attached(h Hook) []ebpf.ProgramID {
	e.t.Helper()
	var ids []ebpf.ProgramID
	netnsutil.Do(e.t, e.Node, func() error {
		var err error
		ids, err = Attached(e.HostIndex, h)
		return err
	})
	return ids
}

func (e *env) wantAttached(h Hook, progs ...*ebpf.Program) {
	e.t.Helper()
	var want []ebpf.ProgramID
	for _, p := range progs {
		want = append(want, mustID(e.t, p))
	}
	if got := e.attached(h); !slices.Equal(got, want) {
		e.t.Fatalf("programs on %s hook: %v, want %v", h, got, want)
	}
}

func (e *env) apply(set policy.Set) {
	e.t.Helper()
	if err := e.id.ApplyPolicy(set); err != nil {
		e.t.Fatal(err)
	}
}

// toPod dials the pod's port from the node over IPv4 and IPv6 and checks
// that it connects (want) or that the SYN is dropped.
func (e *env) toPod(port uint16, want bool) {
	e.t.Helper()
	for _, a := range []netip.Prefix{netnsutil.PodV4, netnsutil.PodV6} {
		e.expectDial(e.Node, netip.AddrPortFrom(a.Addr(), port), want)
	}
}

// fromPod dials the node's listener from the pod.
func (e *env) fromPod(want bool) {
	e.t.Helper()
	for _, a := range []netip.Prefix{netnsutil.NodeV4, netnsutil.NodeV6} {
		e.expectDial(e.Pod, netip.AddrPortFrom(a.Addr(), nodePort), want)
	}
}

func (e *env) expectDial(n ns.NetNS, dst netip.AddrPort, want bool) {
	e.t.Helper()
	attempts := 1
	if want {
		attempts = dialAttempts
	}
	if got := netnsutil.Connects(e.t, n, dst, dialTimeout, attempts); got != want {
		if want {
			e.t.Fatalf("connection to %s dropped, want it to connect", dst)
		}
		e.t.Fatalf("connection to %s connected, want it dropped", dst)
	}
}

func (e *env) counts() bpf.Counters {
	e.t.Helper()
	c, err := e.id.ReadCounters()
	if err != nil {
		e.t.Fatal(err)
	}
	return c
}

func mustID(tb testing.TB, p *ebpf.Program) ebpf.ProgramID {
	tb.Helper()
	id, err := objinfo.ProgramID(p)
	if err != nil {
		tb.Fatal(err)
	}
	return id
}

// Policies.

var (
	podNet4 = netip.MustParsePrefix("10.200.0.0/24")
	podNet6 = netip.MustParsePrefix("fd20::/64")
)

func tcp80Only() []policy.Rule {
	port := []policy.PortRange{{Protocol: policy.ProtocolTCP, First: 80, Last: 80}}
	return []policy.Rule{{CIDR: podNet4, Ports: port}, {CIDR: podNet6, Ports: port}}
}

func anyPort() []policy.Rule {
	all := []policy.PortRange{{Protocol: policy.ProtocolAny, First: 0, Last: 65535}}
	return []policy.Rule{{CIDR: podNet4, Ports: all}, {CIDR: podNet6, Ports: all}}
}

// isolate builds a policy; nil leaves a direction open.
func isolate(ingress, egress []policy.Rule) policy.Set {
	return policy.Set{
		Mode:     policy.ModeStandard,
		Selected: true,
		Ingress:  policy.DirectionPolicy{Isolated: ingress != nil, Rules: ingress},
		Egress:   policy.DirectionPolicy{Isolated: egress != nil, Rules: egress},
	}
}

// TestEnforce attaches both programs and checks with real connections that
// the policy is enforced in both directions, and no longer after Detach.
func TestEnforce(t *testing.T) {
	forEachMode(t, func(t *testing.T, m Mode) {
		e := newEnv(t, m)
		e.attachBoth()
		e.wantAttached(HookEgress, e.id.Ingress)
		e.wantAttached(HookIngress, e.id.Egress)

		// A fresh identifier isolates nothing.
		e.toPod(80, true)
		e.toPod(81, true)
		e.fromPod(true)

		e.apply(isolate(tcp80Only(), nil))
		e.toPod(80, true)
		e.toPod(81, false)
		e.fromPod(true)

		e.apply(isolate(tcp80Only(), []policy.Rule{}))
		e.fromPod(false)
		e.apply(isolate(tcp80Only(), anyPort()))
		e.fromPod(true)
		e.apply(isolate(tcp80Only(), []policy.Rule{}))

		e.detach(e.opts(HookEgress, e.id.Ingress))
		e.detach(e.opts(HookIngress, e.id.Egress))
		e.wantAttached(HookEgress)
		e.wantAttached(HookIngress)
		e.toPod(81, true)
		e.fromPod(true)
	})
}

// TestNeighbourDiscoveryUnderIsolation: with the pod's egress closed and
// its ingress open to TCP port 80 only, IPv6 still works because neighbour
// discovery passes both programs: the node's solicitation for the pod goes
// through the ingress program, the pod's advertisement (and its own
// solicitation for the node) through the egress program.
func TestNeighbourDiscoveryUnderIsolation(t *testing.T) {
	forEachMode(t, func(t *testing.T, m Mode) {
		e := newEnv(t, m)
		e.attachBoth()
		e.apply(isolate(tcp80Only(), []policy.Rule{}))
		e.FlushNeighbours(t)
		e.expectDial(e.Node, netip.AddrPortFrom(netnsutil.PodV6.Addr(), 80), true)
		if n := e.counts()[policy.Egress][bpf.ReasonND]; n == 0 {
			t.Error("the connection needed no neighbour discovery from the pod: the test proves nothing")
		}
		e.expectDial(e.Node, netip.AddrPortFrom(netnsutil.PodV6.Addr(), 81), false)
	})
}

// TestReattach: attaching again is a no-op, another program replaces the
// first, and Detach can be repeated.
func TestReattach(t *testing.T) {
	forEachMode(t, func(t *testing.T, m Mode) {
		e := newEnv(t, m)
		other := e.identifier("other@default") // allows everything
		e.apply(isolate(tcp80Only(), nil))

		o := e.opts(HookEgress, e.id.Ingress)
		e.attach(o)
		e.attach(o)
		e.wantAttached(HookEgress, e.id.Ingress)
		e.toPod(81, false)

		e.attach(e.opts(HookEgress, other.Ingress))
		e.wantAttached(HookEgress, other.Ingress)
		e.toPod(81, true)

		e.attach(o)
		e.wantAttached(HookEgress, e.id.Ingress)
		e.toPod(81, false)

		e.detach(o)
		e.detach(o)
		e.wantAttached(HookEgress)
		e.toPod(81, true)
		if _, err := os.Stat(o.LinkPin); !errors.Is(err, os.ErrNotExist) {
			t.Fatalf("link pin after detach: %v", err)
		}
	})
}

// TestDetachAfterVethDeleted: the pod's veth went away first (the runtime
// deleted the netns); Detach succeeds and leaves no pin behind.
func TestDetachAfterVethDeleted(t *testing.T) {
	forEachMode(t, func(t *testing.T, m Mode) {
		e := newEnv(t, m)
		e.attachBoth()
		if m == ModeTCX {
			for _, h := range []Hook{HookIngress, HookEgress} {
				if _, err := os.Stat(e.opts(h, nil).LinkPin); err != nil {
					t.Fatalf("link pin: %v", err)
				}
			}
		}
		e.DeleteHostVeth(t)
		for range 2 {
			e.detach(e.opts(HookEgress, e.id.Ingress))
			e.detach(e.opts(HookIngress, nil))
		}
		for _, h := range []Hook{HookIngress, HookEgress} {
			if _, err := os.Stat(e.opts(h, nil).LinkPin); !errors.Is(err, os.ErrNotExist) {
				t.Errorf("link pin of %s hook after detach: %v", h, err)
			}
		}
		netnsutil.Do(t, e.Node, func() error {
			if ids, err := Attached(e.HostIndex, HookEgress); err == nil {
				t.Errorf("Attached on a deleted veth: %v, want an error", ids)
			}
			if _, err := Attach(e.opts(HookEgress, e.id.Ingress)); err == nil {
				t.Error("Attach to a deleted veth succeeded")
			}
			return nil
		})
	})
}

// TestTCXSeveredPin: a pin left by a veth that is gone is replaced by a new
// link when the same pin path is attached to a new veth.
func TestTCXSeveredPin(t *testing.T) {
	requireMode(t, ModeTCX)
	e := newEnv(t, ModeTCX)
	e.apply(isolate(tcp80Only(), nil))
	o := e.opts(HookEgress, e.id.Ingress)
	e.attach(o)
	e.DeleteHostVeth(t)

	l, err := link.LoadPinnedLink(o.LinkPin, nil)
	if err != nil {
		t.Fatalf("severed link pin: %v", err)
	}
	err = l.Update(e.id.Egress)
	l.Close()
	if !errors.Is(err, unix.ENOLINK) {
		t.Fatalf("update severed link: %v, want ENOLINK", err)
	}

	// A new pod veth, and the same pin path: same program and then
	// another one (both paths of a stale pin).
	e.Pair = netnsutil.NewPair(t)
	netnsutil.Listen(t, e.Pod, 80)
	netnsutil.Listen(t, e.Pod, 81)
	o.Ifindex = e.HostIndex
	e.attach(o)
	e.wantAttached(HookEgress, e.id.Ingress)
	e.toPod(80, true)
	e.toPod(81, false)

	e.DeleteHostVeth(t)
	e.Pair = netnsutil.NewPair(t)
	o.Ifindex = e.HostIndex
	o.Program = e.identifier("other@default").Ingress
	e.attach(o)
	e.wantAttached(HookEgress, o.Program)
}

// TestTCXPinOutlivesProcess: once Attach returns, only the link pin keeps
// the program attached (the CNI plugin exits right after ADD). Closing
// every file descriptor and removing the identifier's own pins changes
// nothing; Detach through the pin alone still works.
func TestTCXPinOutlivesProcess(t *testing.T) {
	requireMode(t, ModeTCX)
	e := newEnv(t, ModeTCX)
	e.apply(isolate(tcp80Only(), nil))
	o := e.opts(HookEgress, e.id.Ingress)
	e.attach(o)
	want := mustID(t, e.id.Ingress)

	e.id.Close()
	e.g.Close()
	if err := bpf.RemoveIdentifier(e.id.Dir); err != nil {
		t.Fatal(err)
	}
	runtime.GC()

	if got := e.attached(HookEgress); !slices.Equal(got, []ebpf.ProgramID{want}) {
		t.Fatalf("programs on egress hook: %v, want [%d]", got, want)
	}
	e.toPod(80, true)
	e.toPod(81, false)

	l, err := link.LoadPinnedLink(o.LinkPin, nil)
	if err != nil {
		t.Fatal(err)
	}
	info, err := l.Info()
	l.Close()
	if err != nil || info.Program != want {
		t.Fatalf("pinned link runs program %v (%v), want %d", info, err, want)
	}

	o.Program = nil
	e.detach(o)
	e.wantAttached(HookEgress)
	e.toPod(81, true)
}

// TestTCLeavesForeignFilter: the legacy path shares clsact with other tools;
// it neither removes their qdisc nor their filters.
func TestTCLeavesForeignFilter(t *testing.T) {
	requireMode(t, ModeTC)
	e := newEnv(t, ModeTC)
	e.apply(isolate(tcp80Only(), nil))
	foreign := passProgram(t)
	foreignID := mustID(t, foreign)

	// Another tool got there first: clsact and a filter at priority 1.
	netnsutil.Do(t, e.Node, func() error {
		h, err := newHandle()
		if err != nil {
			return err
		}
		defer h.Close()
		qdisc := &netlink.GenericQdisc{
			QdiscAttrs: netlink.QdiscAttrs{LinkIndex: e.HostIndex, Handle: netlink.MakeHandle(0xffff, 0), Parent: netlink.HANDLE_CLSACT},
			QdiscType:  "clsact",
		}
		if err := h.QdiscAdd(qdisc); err != nil {
			return err
		}
		return h.FilterAdd(&netlink.BpfFilter{
			FilterAttrs:  netlink.FilterAttrs{LinkIndex: e.HostIndex, Parent: netlink.HANDLE_MIN_EGRESS, Handle: 1, Priority: 1, Protocol: unix.ETH_P_ALL},
			Fd:           foreign.FD(),
			Name:         "foreign",
			DirectAction: true,
		})
	})

	o := e.opts(HookEgress, e.id.Ingress)
	e.attach(o)
	e.attach(o)
	e.wantAttached(HookEgress, foreign, e.id.Ingress)
	e.toPod(81, false) // the foreign filter passes, podfence's drops

	// Detach guarded by another program leaves podfence's filter alone.
	e.detach(Options{Ifindex: e.HostIndex, Hook: HookEgress, Program: foreign, Mode: ModeTC})
	e.wantAttached(HookEgress, foreign, e.id.Ingress)

	e.detach(o)
	e.detach(o)
	e.wantAttached(HookEgress, foreign)
	e.toPod(81, true)
	netnsutil.Do(t, e.Node, func() error {
		h, err := newHandle()
		if err != nil {
			return err
		}
		defer h.Close()
		l, err := h.LinkByIndex(e.HostIndex)
		if err != nil {
			return err
		}
		typ, err := qdiscType(h, l)
		if err == nil && typ != "clsact" {
			t.Errorf("qdisc after detach: %q, want clsact", typ)
		}
		filters, err := bpfFilters(h, l, HookEgress)
		if err != nil {
			return err
		}
		if len(filters) != 1 || filters[0].Priority != 1 || filters[0].Handle != 1 || filters[0].Id != int(foreignID) {
			t.Errorf("filters after detach: %+v, want the foreign one", filters)
		}
		return nil
	})
}

// TestModeSwitch: a change of attachMode between two ADDs of one pod leaves
// exactly one podfence program on the hook.
func TestModeSwitch(t *testing.T) {
	requireMode(t, ModeTCX)
	e := newEnv(t, ModeTC)
	o := e.opts(HookEgress, e.id.Ingress)
	e.attach(o)
	e.wantAttached(HookEgress, e.id.Ingress)

	e.mode, o.Mode = ModeTCX, ModeTCX
	e.attach(o)
	e.wantAttached(HookEgress, e.id.Ingress)

	e.mode, o.Mode = ModeTC, ModeTC
	e.attach(o)
	e.wantAttached(HookEgress, e.id.Ingress)
	if _, err := os.Stat(o.LinkPin); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("link pin after switching to tc: %v", err)
	}

	// Detach in either mode removes either kind.
	e.mode, o.Mode = ModeTCX, ModeTCX
	e.attach(o)
	o.Mode = ModeTC
	e.detach(o)
	e.wantAttached(HookEgress)
	if _, err := os.Stat(o.LinkPin); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("link pin after detach: %v", err)
	}
}

// TestResolveAuto: auto picks TCX exactly when the probe finds it.
func TestResolveAuto(t *testing.T) {
	kernel.RequireRoot(t)
	got, err := Resolve(ModeAuto)
	if err != nil {
		t.Fatal(err)
	}
	want := ModeTCX
	if errors.Is(TCXSupported(), ErrTCXUnsupported) {
		want = ModeTC
		if _, err := Resolve(ModeTCX); !errors.Is(err, ErrTCXUnsupported) {
			t.Errorf("Resolve(tcx) without tcx: %v", err)
		}
	}
	if got != want {
		t.Fatalf("Resolve(auto) = %s, want %s", got, want)
	}
}

// TestTCXRecord: a resolution without a record probes and asks for the
// answer to be saved, writing nothing itself; Save records it; later
// resolutions take it from the record without probing (a record saying
// the opposite of the kernel is believed, which shows the probe did not
// run) and ask for no save; a record that is neither answer is ignored.
func TestTCXRecord(t *testing.T) {
	kernel.RequireRoot(t)
	r := TCXRecord(filepath.Join(t.TempDir(), "status", "tcx"))
	want, answer := ModeTCX, recordTCX
	if errors.Is(TCXSupported(), ErrTCXUnsupported) {
		want, answer = ModeTC, recordNoTCX
	}
	if got, save, err := r.Resolve(ModeAuto); err != nil || got != want || !save {
		t.Fatalf("Resolve(auto) without a record = %s, save %v, %v; want %s and a save", got, save, err, want)
	}
	if _, err := os.Lstat(string(r)); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("Resolve wrote the record (%v)", err)
	}
	if err := r.Save(); err != nil {
		t.Fatal(err)
	}
	if text, err := os.Readlink(string(r)); err != nil || text != answer {
		t.Fatalf("record %q, %v; want %q", text, err, answer)
	}
	for _, c := range []struct {
		record string
		want   Mode
	}{{recordNoTCX, ModeTC}, {recordTCX, ModeTCX}} {
		if err := pinfs.WriteRecord(string(r), c.record); err != nil {
			t.Fatal(err)
		}
		if got, save, err := r.Resolve(ModeAuto); err != nil || got != c.want || save {
			t.Errorf("with the record %q: Resolve(auto) = %s, save %v, %v; want %s, no save", c.record, got, save, err, c.want)
		}
	}
	if _, _, err := r.Resolve(ModeTCX); err != nil {
		t.Errorf("Resolve(tcx) with the record %q: %v", recordTCX, err)
	}
	if got, save, err := r.Resolve(ModeTC); err != nil || got != ModeTC || save {
		t.Errorf("Resolve(tc) = %s, save %v, %v; want tc without a probe", got, save, err)
	}
	if err := pinfs.WriteRecord(string(r), "garbage"); err != nil {
		t.Fatal(err)
	}
	if got, save, err := r.Resolve(ModeAuto); err != nil || got != want || !save {
		t.Errorf("with a garbage record: Resolve(auto) = %s, save %v, %v; want %s and a save", got, save, err, want)
	}
}

// passProgram is another tool's program: it lets every packet continue.
func passProgram(tb testing.TB) *ebpf.Program {
	tb.Helper()
	p, err := ebpf.NewProgram(&ebpf.ProgramSpec{
		Name:         "foreign",
		Type:         ebpf.SchedCLS,
		License:      "Apache-2.0",
		Instructions: asm.Instructions{asm.Mov.Imm(asm.R0, -1), asm.Return()},
	})
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { p.Close() })
	return p
}
