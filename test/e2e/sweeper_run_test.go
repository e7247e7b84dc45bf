package e2e

import (
	"bytes"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os/exec"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	mdnetlink "github.com/mdlayher/netlink"
	"github.com/ti-mo/conntrack"
	"github.com/vishvananda/netlink"

	"github.com/podfence/podfence/bpf"
)

// runSweeper starts `podfence-sweeper run` in the node namespace. Its
// metrics listen on the node namespace's loopback.
func (c *cluster) runSweeper(t testing.TB, args ...string) (*exec.Cmd, *syncBuffer) {
	t.Helper()
	all := append([]string{"run", "--pin-root", c.pinRoot, "--policy-dir", c.policyDir, "--metrics-addr", "127.0.0.1:9465"}, args...)
	// The default hooks the machine's cgroup root: a test names its own.
	if !slices.ContainsFunc(args, func(a string) bool { return strings.HasPrefix(a, "--judge-local-cgroup") }) {
		all = append(all, "--judge-local-cgroup=none")
	}
	cmd := exec.Command(c.sweeperBin, all...)
	logs := &syncBuffer{}
	cmd.Stdout, cmd.Stderr = logs, logs
	if err := c.inNode(cmd.Start); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if cmd.ProcessState == nil {
			cmd.Process.Kill()
			cmd.Wait()
		}
		if t.Failed() {
			t.Logf("sweeper log:\n%s", logs.String())
		}
	})
	return cmd, logs
}

// syncBuffer is the sweeper's log, read while exec's goroutine writes it.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

// waitFor polls the log until it contains text, failing the test after
// within with what the log held.
func (s *syncBuffer) waitFor(t testing.TB, text string, within time.Duration) {
	t.Helper()
	deadline := time.Now().Add(within)
	for !strings.Contains(s.String(), text) {
		if time.Now().After(deadline) {
			t.Fatalf("no %q in the sweeper's log after %v; log:\n%s", text, within, s)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// get fetches path from the sweeper's metrics server in the node namespace
// (a dial from this goroutine's locked thread, which net/http would not do).
func (c *cluster) get(path string) (string, error) {
	var body []byte
	err := c.inNode(func() error {
		conn, err := net.DialTimeout("tcp", "127.0.0.1:9465", time.Second)
		if err != nil {
			return err
		}
		defer conn.Close()
		conn.SetDeadline(time.Now().Add(5 * time.Second))
		fmt.Fprintf(conn, "GET %s HTTP/1.0\r\n\r\n", path)
		body, err = io.ReadAll(conn)
		return err
	})
	return string(body), err
}

// addNodeAddr gives the node namespace one more address (on lo).
func (c *cluster) addNodeAddr(t testing.TB, addr netip.Addr) {
	t.Helper()
	if err := c.inNode(func() error {
		lo, err := netlink.LinkByName("lo")
		if err != nil {
			return err
		}
		return netlink.AddrAdd(lo, &netlink.Addr{IPNet: prefixNet(netip.PrefixFrom(addr, 32))})
	}); err != nil {
		t.Fatal(err)
	}
}

// waitHealthy polls /healthz until it answers 200.
func (c *cluster) waitHealthy(t testing.TB) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		resp, err := c.get("/healthz")
		if err == nil && strings.HasPrefix(resp, "HTTP/1.0 200") {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("/healthz not ready after 30s: %q, %v", resp, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// metric returns the value of the series whose line starts with series.
func metric(t *testing.T, page, series string) string {
	t.Helper()
	for _, line := range strings.Split(page, "\n") {
		if v, ok := strings.CutPrefix(line, series+" "); ok {
			return v
		}
	}
	t.Fatalf("no series %s in:\n%s", series, page)
	return ""
}

// TestSweeperRunFollowsDestroyEvents: with `run` going and no pass due, a
// kernel flow's destruction deletes its entry within a second. The service
// reports ready, exports what it did, and exits cleanly on SIGTERM.
func TestSweeperRunFollowsDestroyEvents(t *testing.T) {
	c := lcCluster(t, attachModes(t)[0])
	p := c.addPod(webReplicas[0], "default")
	ifindex := lcIfindex(t, c, p.hostVeth)
	src := netip.AddrPortFrom(p.ip, 40100)
	peer := netip.MustParseAddrPort("10.99.0.1:443")
	cmd, logs := c.runSweeper(t, "--interval-min", "1h", "--interval-max", "1h", "--grace", "1ms")
	c.waitHealthy(t)
	// The kernel sends destroy events only for flows created while someone
	// listens (nf_conntrack_events=2): the flow comes after the sweeper.
	e := c.writeEntry(t, src, peer, ifindex)
	c.conntrackInsert(t, src, peer)

	c.conntrackDelete(t, "-p", "tcp", "--orig-src", p.ip.String(), "--sport", "40100")
	destroyed := time.Now()
	for c.hasEntry(t, e) {
		if time.Since(destroyed) > time.Second {
			t.Fatalf("the entry is still there %v after its kernel flow's destruction", time.Since(destroyed))
		}
		time.Sleep(5 * time.Millisecond)
	}
	t.Logf("entry deleted %v after conntrack -D returned", time.Since(destroyed))

	page, err := c.get("/metrics")
	if err != nil {
		t.Fatal(err)
	}
	if got := metric(t, page, "podfence_sweep_pass_duration_seconds_count"); got != "1" {
		t.Errorf("%s passes ran, want only the first: the event, not a pass, deleted the entry", got)
	}
	if got := metric(t, page, "podfence_conntrack_event_deletes_total"); got != "1" {
		t.Errorf("event deletes %s, want 1", got)
	}
	metric(t, page, `podfence_conntrack_fill_ratio{family="ipv4"}`)
	// The pod's identifier's packet counts, read at the scrape.
	for _, verdict := range []string{"allowed", "denied"} {
		metric(t, page, `podfence_identifier_packets_total{identifier="`+string(webID)+`",verdict="`+verdict+`"}`)
	}

	if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("exit after SIGTERM: %v\n%s", err, logs)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("no exit 10s after SIGTERM")
	}
}

// TestSweeperRunFollowsNodeAddresses: kubelet probes come from the node's
// addresses, which every pod's policy must allow. When the node gains an
// address after its pods were added, `run` writes it to the node's map
// without any ADD.
func TestSweeperRunFollowsNodeAddresses(t *testing.T) {
	c := lcCluster(t, attachModes(t)[0])
	c.addPod(webReplicas[0], "default")
	c.runSweeper(t, "--interval-min", "1h", "--interval-max", "1h")
	c.waitHealthy(t)

	added := netip.MustParseAddr("198.51.100.7")
	c.addNodeAddr(t, added)
	deadline := time.Now().Add(5 * time.Second)
	for {
		g, err := bpf.OpenGlobal(globalDir(c.pinRoot), bpf.GlobalOptions{})
		if err != nil {
			t.Fatal(err)
		}
		addrs, err := g.NodeAddresses()
		g.Close()
		if err != nil {
			t.Fatal(err)
		}
		if slices.Contains(addrs, added) {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("node addresses %v 5s after %s was added, want it among them", addrs, added)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestSweeperRunWarnsWhenFull: a node whose conntrack maps are past 90%
// full evicts live flows; `run` exports the fill ratio and warns, naming
// the settings to raise.
func TestSweeperRunWarnsWhenFull(t *testing.T) {
	c := newCluster(t, attachModes(t)[0])
	const size = 1024
	_, logs := c.runSweeper(t, "--ct-v4-entries", fmt.Sprint(size), "--interval-min", "50ms", "--interval-max", "50ms")
	c.waitHealthy(t) // the maps exist, at the size asked for
	g, err := bpf.OpenGlobal(globalDir(c.pinRoot), bpf.GlobalOptions{CTv4Entries: size})
	if err != nil {
		t.Fatal(err)
	}
	defer g.Close()
	for i := range 950 {
		k := bpf.CTKeyV4{Src: [4]byte{10, 88, byte(i >> 8), byte(i)}, Dst: [4]byte{10, 99, 0, 1}, Ifindex: 999, Sport: 1000, Dport: 80, Proto: 6}
		if err := g.CTv4.Put(&k, &bpf.CTValue{LastSeenNs: uint64(time.Hour)}); err != nil {
			t.Fatal(err)
		}
	}
	logs.waitFor(t, "conntrack map nearly full", 10*time.Second) // 950 of 1024: 93%
	page, err := c.get("/metrics")
	if err != nil {
		t.Fatal(err)
	}
	// The entries' veth is no member's: the pass that warned deleted them,
	// so the gauge says 0.93 or, one pass later, 0.
	if v := metric(t, page, `podfence_conntrack_fill_ratio{family="ipv4"}`); v != "0" && !strings.HasPrefix(v, "0.92") {
		t.Errorf("fill ratio %s, want 950/1024 or 0 after the deleting pass", v)
	}
}

// TestSweeperRunLostEventsRunPass: destroy events the kernel could not
// deliver (the socket's buffer was full) hide flows' ends; `run` counts the
// loss and runs a full pass at once rather than waiting for the interval.
func TestSweeperRunLostEventsRunPass(t *testing.T) {
	c := lcCluster(t, attachModes(t)[0])
	c.addPod(webReplicas[0], "default")
	c.runSweeper(t, "--interval-min", "1h", "--interval-max", "1h", "--event-buffer", "4096")
	c.waitHealthy(t)

	ct, err := conntrack.Dial(&mdnetlink.Config{NetNS: int(c.node.Fd())})
	if err != nil {
		t.Fatal(err)
	}
	defer ct.Close()
	for i := range 5000 {
		src := netip.AddrFrom4([4]byte{10, 77, byte(i >> 8), byte(i)})
		f := conntrack.NewFlow(17, 0, src, netip.MustParseAddr("10.99.0.1"), 1000, 53, 600, 0)
		if err := ct.Create(f); err != nil {
			t.Fatal(err)
		}
	}
	if err := ct.Flush(); err != nil { // 5,000 destroy events at once
		t.Fatal(err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		page, err := c.get("/metrics")
		if err != nil {
			t.Fatal(err)
		}
		lost := metric(t, page, "podfence_conntrack_destroy_events_lost_total")
		passes := metric(t, page, "podfence_sweep_pass_duration_seconds_count")
		if lost != "0" && passes != "1" {
			t.Logf("events lost %s times; %s passes", lost, passes)
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("10s after flushing 5,000 flows: events lost %s times, %s passes; want a loss and a pass after the first", lost, passes)
		}
		time.Sleep(50 * time.Millisecond)
	}
}
