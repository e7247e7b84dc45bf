package realnode

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"

	"github.com/podfence/podfence/pkg/attach"
	"github.com/podfence/podfence/pkg/cniconf"
	"github.com/podfence/podfence/test/node"
)

// raceSweeper builds podfence-sweeper with the race detector, for a test
// that runs it on the node.
func raceSweeper(t *testing.T) string {
	t.Helper()
	bin := filepath.Join(t.TempDir(), "podfence-sweeper")
	cmd := exec.Command("go", "build", "-race", "-o", bin, "../../sweeper")
	cmd.Env = append(os.Environ(), "CGO_ENABLED=1") // the race detector's runtime is C
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("go build -race: %v: %s", err, out)
	}
	return bin
}

// adoptLoop runs the race-built sweeper's adopt command on the node, one
// pass after another, until stop is called; stop returns what the passes
// did. A data race the detector reports, or an exit that is neither
// success nor "some sandboxes not adopted", fails the test; every failure a
// pass reports is logged.
type adoptLoop struct {
	stopc chan struct{}
	done  chan struct{}
	mu    sync.Mutex
	adoptTotals
}

// adoptTotals add up the passes' reports.
type adoptTotals struct {
	passes, adopted int
	gone            int // pods the runtime deleted while a pass adopted them
	failed          []string
}

// adoptJSON is what podfence-sweeper adopt --json prints.
type adoptJSON struct {
	Adopted []json.RawMessage `json:"adopted"`
	Gone    []struct {
		Pod, Sandbox, How string
	} `json:"deleted_meanwhile"`
	Failed []string `json:"failed"`
}

func startAdoptLoop(t *testing.T, n *node.Node, bin string) *adoptLoop {
	l := &adoptLoop{stopc: make(chan struct{}), done: make(chan struct{})}
	go func() {
		defer close(l.done)
		for {
			select {
			case <-l.stopc:
				return
			default:
			}
			var out, errOut bytes.Buffer
			cmd := n.Exec(bin, "adopt", "--json")
			cmd.Stdout, cmd.Stderr = &out, &errOut
			err := cmd.Run()
			var exit *exec.ExitError
			switch {
			case bytes.Contains(errOut.Bytes(), []byte("WARNING: DATA RACE")):
				t.Errorf("the race detector in an adoption pass:\n%s", errOut.Bytes())
			case err != nil && !(errors.As(err, &exit) && exit.ExitCode() == 1 && bytes.Contains(errOut.Bytes(), []byte("sandboxes not adopted"))):
				t.Errorf("adopt: %v:\n%s%s", err, out.Bytes(), errOut.Bytes())
			}
			var r adoptJSON
			if jerr := json.Unmarshal(out.Bytes(), &r); jerr != nil && err == nil {
				t.Errorf("adopt --json: %v:\n%s", jerr, out.Bytes())
			}
			for _, g := range r.Gone {
				t.Logf("adoption pass: %s (sandbox %.12s) deleted meanwhile: %s", g.Pod, g.Sandbox, g.How)
			}
			for _, f := range r.Failed {
				t.Logf("adoption pass: failed: %s", f)
			}
			l.mu.Lock()
			l.passes++
			l.adopted += len(r.Adopted)
			l.gone += len(r.Gone)
			l.failed = append(l.failed, r.Failed...)
			l.mu.Unlock()
		}
	}()
	return l
}

func (l *adoptLoop) stop() adoptTotals {
	close(l.stopc)
	<-l.done
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.adoptTotals
}

// memberView is what podfence-sweeper ls --json says of a member.
type memberView struct {
	ContainerID string   `json:"container_id"`
	HostVeth    string   `json:"host_veth"`
	HostIfindex int      `json:"host_ifindex"`
	IPs         []string `json:"ips"`
	VethPresent bool     `json:"veth_present"`
	Attached    bool     `json:"attached"`
}

// members lists the members of the identifiers of namespace ns.
func members(n *node.Node, bin, ns string) ([]memberView, error) {
	out, err := n.Exec(bin, "ls", "--json").Output()
	if err != nil {
		return nil, fmt.Errorf("ls: %w", err)
	}
	var ids []struct {
		ID      string       `json:"identifier"`
		Members []memberView `json:"members"`
	}
	if err := json.Unmarshal(out, &ids); err != nil {
		return nil, err
	}
	var all []memberView
	for _, id := range ids {
		if strings.HasSuffix(id.ID, "@"+ns) {
			all = append(all, id.Members...)
		}
	}
	return all, nil
}

// hooks counts, on each hook of a host veth of the node, the programs
// attached (by any mechanism) that are podfence's.
func hooks(n *node.Node, ifindex int) (map[attach.Hook]int, error) {
	count := map[attach.Hook]int{}
	err := n.InNetns(func() error {
		for _, h := range []attach.Hook{attach.HookIngress, attach.HookEgress} {
			ids, err := attach.Attached(ifindex, h)
			if err != nil {
				return err
			}
			for _, id := range ids {
				p, err := ebpf.NewProgramFromID(id)
				if err != nil {
					return err
				}
				info, err := p.Info()
				p.Close()
				if err != nil {
					return err
				}
				if info.Name == "pod_ingress" || info.Name == "pod_egress" {
					count[h]++
				}
			}
		}
		return nil
	})
	return count, err
}

// TestAdoptionRacesRuntime runs adoption (the sweeper's adopt command,
// built with the race detector, one pass after another) against the
// kubelet's ADDs and DELs of the same pods: pods created while podfence
// was out of the chain are deleted while they are being adopted, and
// their replacements are added while the passes list the node. Afterwards
// every pod has exactly one member and one set of hooks, and a deleted pod
// none. The DaemonSet's sweeper is off the node meanwhile, so neither its
// adoption nor its orphan sweep tidies up after the race.
func TestAdoptionRacesRuntime(t *testing.T) {
	n := needNode(t)
	cs := clientset(t, n)
	ns := namespace(t, cs, "adoptrace")
	ctx := context.Background()
	bin := raceSweeper(t)
	isolateIngress(t, cs, ns, "race")
	createDeployment(t, cs, ns, "race")
	// The plugin's log, for what a failure's member went through.
	const pluginLog = "/var/log/podfence-adoptrace.log"
	setPluginLog(t, n, pluginLog)
	chained := keepChain(t, n)
	pauseSweeper(t, n)
	t.Cleanup(func() { resumeSweeper(t, n) })

	const pods, rounds = 10, 2
	var adoptedTotal, passesTotal int
	for round := range rounds {
		// Pods podfence's ADD never sees: the primary CNI's template
		// rewrote the conflist.
		useConflist(t, n, node.PrimaryConflist(), false)
		scale(t, cs, ns, "race", pods)
		useConflist(t, n, chained, true)

		// The kubelet's DELs (podfence's own, the chain is whole again)
		// race the passes adopting these pods, then its ADDs of their
		// replacements race the passes listing the node.
		// The passes start once the kubelet has begun deleting.
		setReplicas(t, cs, ns, "race", 0)
		waitFor(t, "a pod being deleted", 30*time.Second, func() error {
			list, err := cs.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{LabelSelector: "app=race"})
			if err != nil {
				return err
			}
			if len(list.Items) < pods {
				return nil // deleted already, between two looks
			}
			for _, p := range list.Items {
				if p.DeletionTimestamp != nil {
					return nil
				}
			}
			return errors.New("none yet")
		})
		loop := startAdoptLoop(t, n, bin)
		scale(t, cs, ns, "race", 0)
		scale(t, cs, ns, "race", pods)
		r := loop.stop()
		t.Logf("round %d: %d passes adopted %d pods; %d adoptions met the pod's DEL (refused or undone); %d failures", round, r.passes, r.adopted, r.gone, len(r.failed))
		adoptedTotal += r.adopted
		passesTotal += r.passes
		if round < rounds-1 {
			scale(t, cs, ns, "race", 0)
			waitTornDown(t, n, ns)
		}
	}
	if adoptedTotal == 0 {
		t.Fatalf("%d passes adopted no pod: nothing raced", passesTotal)
	}

	list, err := cs.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{LabelSelector: "app=race"})
	if err != nil {
		t.Fatal(err)
	}
	live := map[string]string{} // pod address -> name
	for _, p := range list.Items {
		live[p.Status.PodIP] = p.Name
	}
	// A DEL the kubelet has in flight when its pod leaves the API
	// finishes within seconds: only then is "none once deleted" due.
	var ms []memberView
	defer func() {
		if t.Failed() {
			explainMembers(t, n, ms, pluginLog)
		}
	}()
	waitFor(t, "a member for each live pod and none for a deleted one", 30*time.Second, func() error {
		var err error
		if ms, err = members(n, bin, ns); err != nil {
			return err
		}
		seen := map[string]int{}
		for _, m := range ms {
			if !m.VethPresent {
				return fmt.Errorf("member %.12s (%v) outlived its veth %s", m.ContainerID, m.IPs, m.HostVeth)
			}
			for _, ip := range m.IPs {
				p, err := netip.ParsePrefix(ip) // the record's: 10.244.0.9/24
				if err != nil {
					return fmt.Errorf("member %.12s: address %q: %v", m.ContainerID, ip, err)
				}
				seen[p.Addr().String()]++
			}
		}
		if len(ms) != len(live) {
			return fmt.Errorf("%d members for %d pods", len(ms), len(live))
		}
		for ip, name := range live {
			if seen[ip] != 1 {
				return fmt.Errorf("pod %s (%s) has %d members", name, ip, seen[ip])
			}
		}
		return nil
	})
	for _, m := range ms {
		h, err := hooks(n, m.HostIfindex)
		if err != nil {
			t.Fatal(err)
		}
		if !m.Attached || h[attach.HookIngress] != 1 || h[attach.HookEgress] != 1 {
			t.Errorf("pod %s (veth %s): attached %v, hooks %v, want one of each", live[m.IPs[0]], m.HostVeth, m.Attached, h)
		}
	}
}

// explainMembers logs, for each member whose veth is gone, what the
// plugin's log and containerd's log say of its container.
func explainMembers(t *testing.T, n *node.Node, ms []memberView, pluginLog string) {
	plugin, _ := n.Exec("cat", pluginLog).Output()
	containerd, _ := os.ReadFile(filepath.Join(n.State, "logs", "containerd.log"))
	for _, m := range ms {
		if m.VethPresent {
			continue
		}
		var lines []string
		for _, src := range [][]byte{plugin, containerd} {
			for _, l := range strings.Split(string(src), "\n") {
				if strings.Contains(l, m.ContainerID[:12]) {
					lines = append(lines, l)
				}
			}
		}
		t.Logf("member %.12s (veth %s): what the plugin and containerd logged of it:\n%s", m.ContainerID, m.HostVeth, strings.Join(lines, "\n"))
	}
}

// useConflist writes the node's conflist and waits until containerd has
// loaded it, which it does on the directory's inotify events, in its own
// time: pods started or stopped right after a rewrite otherwise meet the
// list before (seen under load: ADDs through podfence a second after the
// test took it out of the chain, DELs without it seconds after it was put
// back, which left members no DEL of podfence's ever saw). chained says
// whether the list has podfence; containerd's verbose CRI status holds the
// lists it loaded ("cniconfig").
func useConflist(t *testing.T, n *node.Node, conf string, chained bool) {
	t.Helper()
	writeConflist(t, n, conf)
	rs := criClient(t, n)
	waitFor(t, fmt.Sprintf("containerd to load the conflist (podfence chained: %v)", chained), 30*time.Second, func() error {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		st, err := rs.Status(ctx, &runtimeapi.StatusRequest{Verbose: true})
		if err != nil {
			return err
		}
		loaded, ok := st.GetInfo()["cniconfig"]
		if !ok {
			return errors.New("no cniconfig in containerd's status")
		}
		if strings.Contains(loaded, cniconf.PluginType) != chained {
			return errors.New("not yet")
		}
		return nil
	})
}

// waitTornDown waits until containerd has torn down the network of every
// sandbox of namespace ns (its CNI DEL run, the netns removed). A pod
// leaves the API before that: after scale reported none, the last round's
// teardowns ran seconds later, so a conflist rewritten meanwhile (the next
// round's) gave their DELs a list without podfence, and their members
// outlived their veths with the sweeper paused.
func waitTornDown(t *testing.T, n *node.Node, ns string) {
	t.Helper()
	rs := criClient(t, n)
	waitFor(t, "containerd to tear down the network of every sandbox of "+ns, 2*time.Minute, func() error {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		list, err := rs.ListPodSandbox(ctx, &runtimeapi.ListPodSandboxRequest{Filter: &runtimeapi.PodSandboxFilter{
			LabelSelector: map[string]string{"io.kubernetes.pod.namespace": ns},
		}})
		if err != nil {
			return err
		}
		for _, sb := range list.Items {
			st, err := rs.PodSandboxStatus(ctx, &runtimeapi.PodSandboxStatusRequest{PodSandboxId: sb.Id, Verbose: true})
			if err != nil {
				return err
			}
			var info struct {
				NetNSClosed bool `json:"netNamespaceClosed"`
			}
			if err := json.Unmarshal([]byte(st.GetInfo()["info"]), &info); err != nil {
				return fmt.Errorf("sandbox %.12s: containerd's status info: %w", sb.Id, err)
			}
			if sb.State == runtimeapi.PodSandboxState_SANDBOX_READY || !info.NetNSClosed {
				return fmt.Errorf("sandbox %.12s (%s): network not torn down yet", sb.Id, sb.Metadata.GetName())
			}
		}
		return nil
	})
}

// criClient is a client of the node's containerd, closed with the test.
func criClient(t *testing.T, n *node.Node) runtimeapi.RuntimeServiceClient {
	t.Helper()
	sock := "unix:///proc/" + strconv.Itoa(n.PID) + "/root/run/containerd/containerd.sock"
	conn, err := grpc.NewClient(sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return runtimeapi.NewRuntimeServiceClient(conn)
}
