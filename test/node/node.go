// Package node runs a real Kubernetes node on this machine, for podfence's
// tests and `make cluster`: etcd, kube-apiserver, kube-controller-manager,
// kube-scheduler, containerd (Debian's) and its pods, the kubelet,
// kube-proxy, CoreDNS behind the kube-dns Service, and the upstream
// network-policy controller, all built from their Go modules by
// hack/k8s-tools.sh.
//
// Everything runs in one network namespace and one private mount namespace
// of its own, so that the host is left as it was found:
//
//   - overlays on /var, /run, /etc and /opt, with their upper layers in the
//     state directory, catch what the kubelet, containerd and the CNI
//     plugins write outside their configured directories;
//   - the three machine-wide sysctls the kubelet writes at start
//     (vm.overcommit_memory, kernel.panic, kernel.panic_on_oops) are files
//     of the state directory bind-mounted over their /proc/sys entries;
//   - a bpffs of its own is mounted at /sys/fs/bpf, so podfence's pins on
//     the node are the node's;
//   - the kubelet's cgroup root is a directory podfence-node below this
//     process's own cgroups, removed at Down with whatever ran in it.
//
// The namespaces belong to a supervisor process (this binary run again,
// see MaybeSupervise) that starts the components as its children and tears
// them down on SIGTERM. A kubeconfig that works from the root namespace
// talks to the API server through a forwarder on a loopback port, whose
// listening socket the supervisor inherits from the root namespace.
package node

import (
	"bufio"
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/podfence/podfence/pkg/ociimage"
)

// The node's addresses and names.
var (
	NodeName       = "podfence-node"
	NodeIP         = netip.MustParseAddr("192.168.50.2")
	nodePeerIP     = netip.MustParseAddr("192.168.50.1") // the other end of the node's link: its default gateway
	PodCIDR        = netip.MustParsePrefix("10.244.0.0/24")
	ClusterCIDR    = netip.MustParsePrefix("10.244.0.0/16")
	ServiceCIDR    = netip.MustParsePrefix("10.96.0.0/16")
	APIServiceIP   = netip.MustParseAddr("10.96.0.1")
	DNSServiceIP   = netip.MustParseAddr("10.96.0.10")
	apiServerPort  = 6443
	ClusterDomain  = "cluster.local"
	podfenceCgroup = "podfence-node"
)

// Images the node has: built here, imported into containerd, under the
// names the kubelet and Kubernetes' e2e suite ask for.
const (
	PauseImage   = "registry.k8s.io/pause:3.10.2"
	AgnhostImage = "registry.k8s.io/e2e-test-images/agnhost:2.66.1"
	CoreDNSImage = "registry.k8s.io/coredns/coredns:v1.15.0"
)

// Options configure Up.
type Options struct {
	// State is the node's directory: everything it writes is below it.
	// Up refuses one that holds a running node.
	State string
	// Tools is hack/k8s-tools.sh's directory.
	Tools string
	// CNIBin holds the CNI plugins the node's conflist uses: ptp,
	// host-local, portmap and loopback.
	CNIBin string
	// Images are more image archives to import into containerd (podfence's).
	Images []string
	// ForwardPort is the root namespace's loopback port of the API server
	// (0: any free one).
	ForwardPort int
	// ProxyMode is kube-proxy's mode: iptables (the default, "") or
	// nftables. (IPVS needs CONFIG_IP_VS, which the test machine's kernel
	// lacks.)
	ProxyMode string
}

// Node is a running node.
type Node struct {
	State string
	// Kubeconfig is an admin kubeconfig that works from the root
	// namespace, through the forwarder on 127.0.0.1.
	Kubeconfig string
	// InnerKubeconfig is the same for processes inside the node's
	// namespaces (Exec), which reach the API server at the node's address.
	InnerKubeconfig string
	// PID is the supervisor's: /proc/PID/ns/{net,mnt} are the node's.
	PID int
	// Tools is the directory of the node's binaries.
	Tools string
	// ProxyMode is kube-proxy's (Options.ProxyMode).
	ProxyMode string
	// CgroupRoot is the kubelet's cgroup root, relative to each hierarchy:
	// every process of the node, pods and containerd included, is below it.
	CgroupRoot string
}

// state is what the supervisor records in the state directory.
type state struct {
	PID             int    `json:"pid"`
	Kubeconfig      string `json:"kubeconfig"`
	InnerKubeconfig string `json:"inner_kubeconfig"`
	Tools           string `json:"tools"`
	ProxyMode       string `json:"proxy_mode"`
	// CgroupRoot is the kubelet's cgroup root, relative to each hierarchy;
	// CgroupsMade the directories the node made for it, parents first.
	CgroupRoot  string   `json:"cgroup_root"`
	CgroupsMade []string `json:"cgroups_made"`
}

const (
	superviseEnv  = "PODFENCE_NODE_SUPERVISE"
	stateFile     = "node.json"
	controlSocket = "control.sock"
)

// MaybeSupervise runs the supervisor when this process was started as one
// by Up, and never returns then. Every binary that calls Up calls it first
// thing in main (or TestMain).
func MaybeSupervise() {
	if os.Getenv(superviseEnv) == "" {
		return
	}
	var opts Options
	if err := json.Unmarshal([]byte(os.Getenv(superviseEnv)), &opts); err != nil {
		fmt.Fprintln(os.Stderr, "node supervisor:", err)
		os.Exit(2)
	}
	os.Exit(supervise(opts))
}

// Up starts a node and waits until it is ready: the node Ready, CoreDNS
// answering, the images imported. A failed start tears down what it made.
func Up(opts Options) (*Node, error) {
	switch opts.ProxyMode {
	case "":
		opts.ProxyMode = "iptables"
	case "iptables", "nftables":
	default:
		return nil, fmt.Errorf("node: kube-proxy mode %q: want iptables or nftables", opts.ProxyMode)
	}
	if opts.State == "" || opts.Tools == "" || opts.CNIBin == "" {
		return nil, errors.New("node: State, Tools and CNIBin are required")
	}
	var err error
	if opts.State, err = filepath.Abs(opts.State); err != nil {
		return nil, err
	}
	if n, err := Attach(opts.State); err == nil && n.running() {
		return nil, fmt.Errorf("node: a node runs in %s already (pid %d)", opts.State, n.PID)
	}
	// What a node left behind that died without its Down.
	if err := cleanup(opts.State); err != nil {
		return nil, err
	}
	if err := os.MkdirAll(filepath.Join(opts.State, "logs"), 0o755); err != nil {
		return nil, err
	}
	if err := buildImages(opts); err != nil {
		return nil, err
	}
	ln, err := net.Listen("tcp", "127.0.0.1:"+strconv.Itoa(opts.ForwardPort))
	if err != nil {
		return nil, fmt.Errorf("node: the API server's forwarder: %w", err)
	}
	defer ln.Close()
	lf, err := ln.(*net.TCPListener).File()
	if err != nil {
		return nil, err
	}
	defer lf.Close()
	opts.ForwardPort = ln.Addr().(*net.TCPAddr).Port
	ready, readyW, err := os.Pipe()
	if err != nil {
		return nil, err
	}
	defer ready.Close()
	exe, err := os.Executable()
	if err != nil {
		return nil, err
	}
	env, err := json.Marshal(opts)
	if err != nil {
		return nil, err
	}
	logf, err := os.Create(filepath.Join(opts.State, "logs", "supervisor.log"))
	if err != nil {
		return nil, err
	}
	defer logf.Close()
	cmd := exec.Command(exe)
	cmd.Env = append(os.Environ(), superviseEnv+"="+string(env))
	cmd.Stdout, cmd.Stderr = logf, logf
	// fd 3 is the forwarder's listening socket (it stays in the root
	// namespace), fd 4 the readiness pipe.
	cmd.ExtraFiles = []*os.File{lf, readyW}
	cmd.SysProcAttr = &syscall.SysProcAttr{
		Cloneflags: syscall.CLONE_NEWNET | syscall.CLONE_NEWNS,
		Setsid:     true, // it outlives `make cluster`
	}
	if err := cmd.Start(); err != nil {
		readyW.Close()
		return nil, fmt.Errorf("node: start the supervisor: %w", err)
	}
	readyW.Close()
	go cmd.Wait() //nolint:errcheck // reaped here when this process is its parent; Down watches /proc
	line, _ := bufio.NewReader(ready).ReadString('\n')
	if strings.TrimSpace(line) != "ready" {
		n := &Node{State: opts.State, PID: cmd.Process.Pid}
		derr := n.Down()
		return nil, errors.Join(fmt.Errorf("node: not ready: %s(log: %s)", strings.TrimPrefix(line, "error: "),
			filepath.Join(opts.State, "logs")), derr)
	}
	return Attach(opts.State)
}

// Attach finds the node running in state (make cluster-down, tools).
func Attach(stateDir string) (*Node, error) {
	b, err := os.ReadFile(filepath.Join(stateDir, stateFile))
	if err != nil {
		return nil, fmt.Errorf("node: no node in %s: %w", stateDir, err)
	}
	var s state
	if err := json.Unmarshal(b, &s); err != nil {
		return nil, fmt.Errorf("node: %s: %w", filepath.Join(stateDir, stateFile), err)
	}
	return &Node{State: stateDir, Kubeconfig: s.Kubeconfig, InnerKubeconfig: s.InnerKubeconfig, PID: s.PID, Tools: s.Tools,
		ProxyMode: cmp.Or(s.ProxyMode, "iptables"), CgroupRoot: s.CgroupRoot}, nil
}

func (n *Node) running() bool {
	return n.PID > 0 && syscall.Kill(n.PID, 0) == nil
}

// Down stops the node and removes its state: the supervisor tears the
// components down on SIGTERM; whatever still runs in the node's cgroups
// is killed, and the cgroups are removed. Down of a node that is not
// running cleans up after it.
func (n *Node) Down() error {
	if n.running() {
		syscall.Kill(n.PID, syscall.SIGTERM)
		deadline := time.Now().Add(60 * time.Second)
		for n.running() && time.Now().Before(deadline) {
			time.Sleep(100 * time.Millisecond)
		}
		if n.running() {
			syscall.Kill(n.PID, syscall.SIGKILL)
		}
		for n.running() {
			time.Sleep(50 * time.Millisecond)
		}
	}
	return cleanup(n.State)
}

// cleanup kills what is left in a node's cgroups and removes them, then
// the state directory's contents but its logs.
func cleanup(stateDir string) error {
	var errs []error
	if b, err := os.ReadFile(filepath.Join(stateDir, stateFile)); err == nil {
		var s state
		if json.Unmarshal(b, &s) == nil {
			errs = append(errs, removeCgroups(s.CgroupsMade))
		}
	}
	entries, err := os.ReadDir(stateDir)
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	for _, e := range entries {
		if e.Name() == "logs" {
			continue
		}
		if err := os.RemoveAll(filepath.Join(stateDir, e.Name())); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// Exec is a command that runs inside the node's network and mount
// namespaces (nsenter), as a process of the node's host would.
func (n *Node) Exec(name string, args ...string) *exec.Cmd {
	all := append([]string{"--net=/proc/" + strconv.Itoa(n.PID) + "/ns/net", "--mount=/proc/" + strconv.Itoa(n.PID) + "/ns/mnt", "--", name}, args...)
	cmd := exec.Command("nsenter", all...)
	// HOME too: clients cache discovery below it (kubectl, e2e.test), and
	// the node's mount namespace does not cover the host's home.
	cmd.Env = append(os.Environ(), "KUBECONFIG="+n.InnerKubeconfig, "HOME="+filepath.Join(n.State, "home"),
		"KUBECACHEDIR="+filepath.Join(n.State, "home", "kube-cache"))
	return cmd
}

// Kubectl runs the node's kubectl inside its namespaces and returns its
// output.
func (n *Node) Kubectl(args ...string) ([]byte, error) {
	cmd := n.Exec(filepath.Join(n.Tools, "kubectl"), args...)
	out, err := cmd.CombinedOutput()
	if err != nil {
		return out, fmt.Errorf("kubectl %s: %w: %s", strings.Join(args, " "), err, out)
	}
	return out, nil
}

// buildImages writes the image archives the node imports at start: the
// sandbox image, agnhost (Kubernetes' e2e suite's), and CoreDNS.
func buildImages(opts Options) error {
	dir := filepath.Join(opts.State, "images")
	for _, img := range []struct {
		file, ref, bin, path string
	}{
		{"pause.tar", PauseImage, "pause", "/pause"},
		{"agnhost.tar", AgnhostImage, "agnhost", "/agnhost"},
		{"coredns.tar", CoreDNSImage, "coredns", "/coredns"},
	} {
		if _, err := ociimage.Write(filepath.Join(dir, img.file), ociimage.Spec{
			Ref: img.ref, Arch: runtime.GOARCH,
			Files:      map[string]string{img.path: filepath.Join(opts.Tools, img.bin)},
			Entrypoint: []string{img.path},
		}); err != nil {
			return fmt.Errorf("node: image %s: %w", img.ref, err)
		}
	}
	return nil
}

// SweeperManifestChange is what the node changes in
// conf/podfence-sweeper.yaml before applying it: this VM's capability
// bounding set lacks CAP_SYS_RESOURCE, which the manifest asks for (5.10
// nodes need it to lift the memlock limit), so a container that asks for
// it cannot start here; and the local judge is hooked at the node's
// cgroup root rather than the machine's, which the default would hook
// (the host's cgroup hierarchy is the machine's here).
const SweeperManifestChange = "CAP_SYS_RESOURCE removed from the sweeper container's capabilities (this machine's bounding set lacks it); --judge-local-cgroup set to the node's cgroup root (the default is the machine's)"

// InstallPodfence deploys podfence on the node as the README's "Deploy on
// a cluster" says: the image is containerd's already (Options.Images),
// the manifest is applied in kube-system with SweeperManifestChange, and
// the DaemonSet's pod runs its install-cni init container, which chains
// the plugin into the node's conflist. It returns once the pod is Ready
// and the conflist names podfence.
func (n *Node) InstallPodfence(manifest []byte) error {
	const capLine = "                - SYS_RESOURCE\n"
	if strings.Count(string(manifest), capLine) != 1 {
		return fmt.Errorf("node: the sweeper manifest no longer asks for SYS_RESOURCE the way this change expects: update SweeperManifestChange")
	}
	changed := strings.Replace(string(manifest), capLine, "", 1)
	const sourceLine = "            - --policy-source=kubernetes\n"
	if strings.Count(changed, sourceLine) != 1 {
		return fmt.Errorf("node: the sweeper manifest no longer passes --policy-source=kubernetes the way this change expects: update SweeperManifestChange")
	}
	changed = strings.Replace(changed, sourceLine, sourceLine+"            - --judge-local-cgroup="+n.localCgroup()+"\n", 1)
	f := filepath.Join(n.State, "podfence-sweeper.yaml")
	if err := os.WriteFile(f, []byte(changed), 0o644); err != nil {
		return err
	}
	if _, err := n.Kubectl("apply", "-n", "kube-system", "-f", f); err != nil {
		return err
	}
	return n.WaitPodfence(3 * time.Minute)
}

// localCgroup is the node's cgroup root in the v2 hierarchy, as the
// sweeper's container sees the host's (mounted at /host/sys/fs/cgroup), or
// none where the host has no v2 hierarchy.
func (n *Node) localCgroup() string {
	hs, err := hierarchies()
	if err != nil || n.CgroupRoot == "" {
		return "none"
	}
	for _, h := range hs {
		var st unix.Statfs_t
		if unix.Statfs(h, &st) == nil && st.Type == unix.CGROUP2_SUPER_MAGIC {
			return filepath.Join("/host", h, n.CgroupRoot)
		}
	}
	return "none"
}

// WaitPodfence waits until the sweeper DaemonSet's pod on the node is
// Ready and podfence is chained in the node's conflist.
func (n *Node) WaitPodfence(timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	var last error
	for time.Now().Before(deadline) {
		out, err := n.Kubectl("-n", "kube-system", "get", "ds", "podfence-sweeper", "-o",
			"jsonpath={.status.numberReady}/{.status.desiredNumberScheduled}/{.status.updatedNumberScheduled}")
		switch {
		case err != nil:
			last = err
		case string(out) != "1/1/1":
			last = fmt.Errorf("DaemonSet ready/desired/updated %s", out)
		default:
			conf, err := n.Exec("cat", "/etc/cni/net.d/10-aws.conflist").Output()
			if err == nil && strings.Contains(string(conf), `"type": "podfence"`) {
				return nil
			}
			last = fmt.Errorf("podfence not chained in 10-aws.conflist: %v %s", err, conf)
		}
		time.Sleep(time.Second)
	}
	return fmt.Errorf("node: podfence not running: %w", last)
}

// DialContext connects from inside the node's network namespace (to a
// pod's or a Service's address).
func (n *Node) DialContext(ctx context.Context, network, addr string) (net.Conn, error) {
	return dialIn("/proc/"+strconv.Itoa(n.PID)+"/ns/net", ctx, network, addr)
}

// DialFromPod connects from inside the network namespace of the pod whose
// UID is uid, as the pod itself would: its source is the pod's address.
func (n *Node) DialFromPod(ctx context.Context, uid, network, addr string) (net.Conn, error) {
	pid, err := podProcess(uid)
	if err != nil {
		return nil, err
	}
	return dialIn("/proc/"+strconv.Itoa(pid)+"/ns/net", ctx, network, addr)
}

// ListenInPod listens inside the network namespace of the pod whose UID
// is uid: connections to the pod's address and port reach the listener,
// as they would reach a server of the pod's own.
func (n *Node) ListenInPod(uid, network, addr string) (net.Listener, error) {
	pid, err := podProcess(uid)
	if err != nil {
		return nil, err
	}
	var l net.Listener
	err = inNetns("/proc/"+strconv.Itoa(pid)+"/ns/net", func() error {
		var err error
		l, err = net.Listen(network, addr)
		return err
	})
	return l, err
}

// podProcess finds a process of the pod with uid by its cgroup (the
// kubelet's cgroupfs driver names it pod<uid>).
func podProcess(uid string) (int, error) {
	procs, err := filepath.Glob("/proc/[0-9]*/cgroup")
	if err != nil {
		return 0, err
	}
	for _, p := range procs {
		b, err := os.ReadFile(p)
		if err != nil || !strings.Contains(string(b), "/pod"+uid+"/") {
			continue
		}
		return strconv.Atoi(filepath.Base(filepath.Dir(p)))
	}
	return 0, fmt.Errorf("no process of pod %s", uid)
}

// dialIn connects from inside the network namespace at nsPath: a socket
// keeps the namespace it was made in, so only the connect runs there.
func dialIn(nsPath string, ctx context.Context, network, addr string) (net.Conn, error) {
	var c net.Conn
	err := inNetns(nsPath, func() error {
		var d net.Dialer
		var err error
		c, err = d.DialContext(ctx, network, addr)
		return err
	})
	return c, err
}

// InNetns runs fn in the node's network namespace, on a thread of its own
// (see inNetns): for a test that asks the kernel about the node's links.
func (n *Node) InNetns(fn func() error) error {
	return inNetns("/proc/"+strconv.Itoa(n.PID)+"/ns/net", fn)
}

// inNetns runs fn in the network namespace at nsPath, on a thread that is
// thrown away afterwards (it never returns to the root namespace). The
// sockets fn makes keep that namespace.
func inNetns(nsPath string, fn func() error) error {
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread() // never unlocked: the thread leaves the root namespace
		f, err := os.Open(nsPath)
		if err != nil {
			errc <- err
			return
		}
		defer f.Close()
		if err := unix.Setns(int(f.Fd()), unix.CLONE_NEWNET); err != nil {
			errc <- fmt.Errorf("enter %s: %w", nsPath, err)
			return
		}
		errc <- fn()
	}()
	return <-errc
}

// Apply applies a manifest with the node's kubectl.
func (n *Node) Apply(manifest string) error {
	cmd := n.Exec(filepath.Join(n.Tools, "kubectl"), "apply", "-f", "-")
	cmd.Stdin = strings.NewReader(manifest)
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("kubectl apply: %w: %s", err, out)
	}
	return nil
}

// Restart restarts one of the node's components (kubelet, containerd,
// kube-proxy, ...) as a service manager would: stopped with SIGTERM, then
// started again with the same arguments. Its pods keep running.
func (n *Node) Restart(component string) error {
	c, err := net.Dial("unix", filepath.Join(n.State, controlSocket))
	if err != nil {
		return fmt.Errorf("node: %w", err)
	}
	defer c.Close()
	fmt.Fprintf(c, "restart %s\n", component)
	line, _ := bufio.NewReader(c).ReadString('\n')
	if strings.TrimSpace(line) != "ok" {
		return fmt.Errorf("node: restart %s: %s", component, strings.TrimSpace(line))
	}
	return nil
}
