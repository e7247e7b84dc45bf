package realnode

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"

	"github.com/podfence/podfence/bpf"
	"github.com/podfence/podfence/test/builds"
	"github.com/podfence/podfence/test/node"
)

// serviceTraffic runs, until stop, what a Service's clients do while the
// node changes: a client opening new connections to the Service one after
// another (each must succeed), one long-lived keep-alive connection of the
// client carrying a request every 100 ms (each must be answered), and a
// stranger whom the backends' policy refuses (it must never get in).
type serviceTraffic struct {
	n                   *node.Node
	vip                 string
	clientUID, stranger string

	stopped  atomic.Bool
	wg       sync.WaitGroup
	reported sync.Once

	allowed, longRequests, strangerTries atomic.Int64
	mu                                   sync.Mutex
	failures                             []string
}

func startServiceTraffic(t testing.TB, n *node.Node, vip, clientUID, strangerUID string) *serviceTraffic {
	st := &serviceTraffic{n: n, vip: vip, clientUID: clientUID, stranger: strangerUID}
	long := &http.Client{Timeout: 3 * time.Second, Transport: &http.Transport{
		DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
			return n.DialFromPod(ctx, clientUID, network, addr)
		},
		MaxConnsPerHost: 1,
	}}
	st.wg.Add(3)
	go func() { // new connections
		defer st.wg.Done()
		for i := 0; !st.stopped.Load(); i++ {
			if err := st.request(clientUID); err != nil {
				st.fail("client connection %d: %v", i, err)
				continue
			}
			st.allowed.Add(1)
		}
	}()
	go func() { // one long-lived connection
		defer st.wg.Done()
		for i := 0; !st.stopped.Load(); i++ {
			resp, err := long.Get("http://" + vip + "/hostname")
			if err == nil {
				_, err = io.ReadAll(resp.Body)
				resp.Body.Close()
			}
			if err != nil {
				st.fail("long-lived request %d: %v", i, err)
			} else {
				st.longRequests.Add(1)
			}
			time.Sleep(100 * time.Millisecond)
		}
	}()
	go func() { // the stranger
		defer st.wg.Done()
		for !st.stopped.Load() {
			ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
			c, err := n.DialFromPod(ctx, strangerUID, "tcp", vip)
			cancel()
			st.strangerTries.Add(1)
			if err == nil {
				c.Close()
				st.fail("the stranger connected to %s", vip)
			}
		}
	}()
	return st
}

// request makes one request on a new connection from the pod. Its error
// says how far the connection got: not connected, or connected from which
// port (for the node's conntrack table and podfence's trace) and after
// how long.
func (st *serviceTraffic) request(uid string) error {
	type dialed struct {
		local net.Addr
		after time.Duration
	}
	start := time.Now()
	var connected atomic.Pointer[dialed] // set by the transport's goroutine
	c := &http.Client{Timeout: 3 * time.Second, Transport: &http.Transport{
		DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
			conn, err := st.n.DialFromPod(ctx, uid, network, addr)
			if err == nil {
				connected.Store(&dialed{conn.LocalAddr(), time.Since(start)})
			}
			return conn, err
		},
		DisableKeepAlives: true,
	}}
	resp, err := c.Get("http://" + st.vip + "/hostname")
	if err != nil {
		if d := connected.Load(); d != nil {
			return fmt.Errorf("connected from %s in %v: %w", d.local, d.after.Round(time.Millisecond), err)
		}
		return fmt.Errorf("not connected: %w", err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("%s", resp.Status)
	}
	return nil
}

func (st *serviceTraffic) fail(format string, args ...any) {
	st.mu.Lock()
	defer st.mu.Unlock()
	st.failures = append(st.failures, time.Now().Format("15:04:05.000")+": "+fmt.Sprintf(format, args...))
}

// stop ends the traffic and fails t with every failure seen. A test
// calls it before its last checks and defers it for a t.Fatal on the way:
// the failures are reported once.
func (st *serviceTraffic) stop(t testing.TB) {
	st.stopped.Store(true)
	st.wg.Wait()
	st.reported.Do(func() {
		st.mu.Lock()
		defer st.mu.Unlock()
		for i, f := range st.failures {
			if i == 20 {
				t.Errorf("... and %d more", len(st.failures)-20)
				break
			}
			t.Error(f)
		}
	})
}

// serviceScene is two backends behind a Service, whose NetworkPolicy lets
// only the client in, the client, and a stranger.
func serviceScene(t *testing.T, n *node.Node) (vip string, client, stranger *corev1.Pod) {
	cs := clientset(t, n)
	ns := namespace(t, cs, "restarts")
	isolateIngress(t, cs, ns, "backend", "client")
	for _, name := range []string{"backend-0", "backend-1"} {
		runPod(t, cs, ns, netexecPod(name, map[string]string{"app": "backend"}))
	}
	client = runPod(t, cs, ns, netexecPod("client", map[string]string{"app": "client"}))
	stranger = runPod(t, cs, ns, netexecPod("stranger", map[string]string{"app": "stranger"}))
	vip = serviceFor(t, n, cs, ns, "backend")
	st := &serviceTraffic{n: n, vip: vip}
	waitFor(t, "the client through the Service", 30*time.Second, func() error { return st.request(string(client.UID)) })
	return vip, client, stranger
}

// TestRestartsUnderTraffic: traffic through a Service goes on while the
// node's parts restart one after another: the sweeper's pod is killed (the
// DaemonSet starts another), the kubelet restarts, containerd restarts
// (PODFENCE_RESTART_ROUNDS times, make restarts: 5),
// and the DaemonSet rolls to the next layout's image (as TestUpgrade
// builds it), whose plugin and sweeper take the node's pins over. Not one
// allowed connection or request fails, and the stranger never gets in.
func TestRestartsUnderTraffic(t *testing.T) {
	n := needNode(t)
	vip, client, stranger := serviceScene(t, n)
	traffic := startServiceTraffic(t, n, vip, string(client.UID), string(stranger.UID))
	defer traffic.stop(t)
	settle := func(what string) {
		time.Sleep(3 * time.Second)
		t.Logf("%s: %d client connections, %d long-lived requests, %d stranger attempts so far",
			what, traffic.allowed.Load(), traffic.longRequests.Load(), traffic.strangerTries.Load())
	}
	settle("before")

	if _, err := n.Kubectl("-n", "kube-system", "delete", "pod", "-l", "app.kubernetes.io/name=podfence-sweeper", "--wait=false"); err != nil {
		t.Fatal(err)
	}
	time.Sleep(time.Second)
	if err := n.WaitPodfence(2 * time.Minute); err != nil {
		t.Fatal(err)
	}
	settle("sweeper pod killed")

	rounds := 1
	if v, err := strconv.Atoi(os.Getenv("PODFENCE_RESTART_ROUNDS")); err == nil && v > 0 {
		rounds = v
	}
	for r := range rounds {
		for _, c := range []string{"kubelet", "containerd"} {
			if err := n.Restart(c); err != nil {
				t.Fatal(err)
			}
			waitFor(t, "the node Ready after "+c+" restarted", time.Minute, func() error {
				out, err := n.Kubectl("get", "node", node.NodeName, "-o", `jsonpath={.status.conditions[?(@.type=="Ready")].status}`)
				if err == nil && string(out) != "True" {
					err = fmt.Errorf("Ready %q", out)
				}
				return err
			})
			settle(fmt.Sprintf("%s restarted (round %d)", c, r+1))
		}
	}

	rollToNextLayout(t, n)
	settle("rolled to the next layout")
	traffic.stop(t)
	if traffic.allowed.Load() == 0 || traffic.longRequests.Load() == 0 || traffic.strangerTries.Load() == 0 {
		t.Error("some traffic never ran")
	}
}

// rollToNextLayout builds the next layout's image, imports it into the
// node's containerd, and rolls the DaemonSet to it as an operator would.
func rollToNextLayout(t *testing.T, n *node.Node) {
	t.Helper()
	bins := builds.NextLayout(t)
	root, err := filepath.Abs("../..")
	if err != nil {
		t.Fatal(err)
	}
	const ref = "ghcr.io/podfence/podfence:next"
	image := filepath.Join(t.TempDir(), "next.tar")
	cmd := exec.Command("go", "run", "./hack/image", "-o", image, "-ref", ref,
		filepath.Join(bins, "podfence"), filepath.Join(bins, "podfence-sweeper"))
	cmd.Dir = root
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("hack/image: %v: %s", err, out)
	}
	if out, err := n.Exec("ctr", "--address", "/run/containerd/containerd.sock", "-n", "k8s.io", "images", "import", image).CombinedOutput(); err != nil {
		t.Fatalf("import the next image: %v: %s", err, out)
	}
	if _, err := n.Kubectl("-n", "kube-system", "set", "image", "daemonset/podfence-sweeper", "install-cni="+ref, "sweeper="+ref); err != nil {
		t.Fatal(err)
	}
	time.Sleep(time.Second)
	if err := n.WaitPodfence(3 * time.Minute); err != nil {
		t.Fatal(err)
	}
	// The new plugin is in place: its binary is the next build's.
	plugin, err := os.ReadFile(filepath.Join(bins, "podfence"))
	if err != nil {
		t.Fatal(err)
	}
	got, err := n.Exec("cat", "/opt/cni/bin/podfence").Output()
	if err != nil || string(got) != string(plugin) {
		t.Errorf("/opt/cni/bin/podfence is not the next build's (%v)", err)
	}
	want := fmt.Sprintf("v%d", bpf.LayoutVersion+1)
	if out, err := n.Exec("readlink", "/sys/fs/bpf/podfence/global/layout").Output(); err != nil || !strings.HasPrefix(string(out), want) {
		t.Errorf("the node's global layout after the roll: %q, %v; want %s", out, err, want)
	}
	// The new sweeper took every identifier over (it loads programs with
	// the DaemonSet's capabilities), and moved their members.
	out, err := n.Exec("sh", "-c", "for d in /sys/fs/bpf/podfence/ids/*; do echo $d $(readlink $d/layout); done").Output()
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		// "<dir> v6 object=... [slot=N]": moving is the only other word.
		if f := strings.Fields(line); len(f) < 3 || f[1] != want || !strings.HasPrefix(f[2], "object=") || slices.Contains(f, "moving") {
			t.Errorf("identifier after the roll: %q, want layout %s with its object, not moving", line, want)
		}
	}
}
