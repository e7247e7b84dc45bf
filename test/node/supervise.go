package node

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log"
	"net"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// supervisor is the process that owns the node's namespaces.
type supervisor struct {
	opts  Options
	pki   *pki
	log   *log.Logger
	cgmu  sync.Mutex
	procs []*component // in start order
	// cgroupRoot is the kubelet's cgroup root, relative to each hierarchy.
	cgroupRoot string
	// cgroupsMade are the cgroup directories the node made, parents first.
	cgroupsMade []string
	inner       string // the kubeconfig for the node's own processes
}

// component is one started process.
type component struct {
	name string
	bin  string
	args []string
	cmd  *exec.Cmd
	done chan struct{}
}

// supervise runs in the new network and mount namespaces Up made: it sets
// the node up, reports on fd 4, forwards the API server to the listener on
// fd 3, and tears the node down on SIGTERM or SIGINT.
func supervise(opts Options) int {
	listener := os.NewFile(3, "forwarder")
	ready := os.NewFile(4, "ready")
	s := &supervisor{opts: opts, log: log.New(os.Stderr, "supervisor: ", log.LstdFlags|log.Lmicroseconds)}
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGTERM, syscall.SIGINT)
	start := time.Now()
	err := s.up(listener)
	if err != nil {
		s.log.Printf("not ready: %v", err)
		fmt.Fprintf(ready, "error: %v\n", err)
		ready.Close()
		s.down()
		return 1
	}
	s.log.Printf("ready in %v", time.Since(start).Round(time.Millisecond))
	go s.control()
	fmt.Fprintln(ready, "ready")
	ready.Close()
	<-sig
	s.log.Printf("stopping")
	s.down()
	return 0
}

func (s *supervisor) path(elem ...string) string {
	return filepath.Join(append([]string{s.opts.State}, elem...)...)
}

func (s *supervisor) up(listener *os.File) error {
	steps := []struct {
		name string
		fn   func() error
	}{
		{"mounts", s.mounts},
		{"network", s.network},
		{"cgroups", s.cgroups},
		{"credentials", s.credentials},
		{"API server", s.apiServer},
		// Before the controller manager: see policyController.
		{"network-policy controller", s.policyController},
		{"controllers", s.controllers},
		{"forwarder", func() error { return s.forward(listener) }},
		{"containerd", s.containerd},
		{"images", s.images},
		{"kubelet and kube-proxy", s.nodeAgents},
		{"CoreDNS", s.coreDNS},
	}
	for _, st := range steps {
		t := time.Now()
		if err := st.fn(); err != nil {
			return fmt.Errorf("%s: %w", st.name, err)
		}
		s.log.Printf("%s: %v", st.name, time.Since(t).Round(time.Millisecond))
	}
	return nil
}

// mounts makes the mount namespace the node's: private from the host, with
// overlays over the directories the node's processes write outside their
// configured places, its own bpffs, and files in place of the machine-wide
// sysctls the kubelet writes. Then everything is made shared again within
// the namespace, as on a systemd host, so that pods can ask for
// HostToContainer propagation.
func (s *supervisor) mounts() error {
	if err := unix.Mount("", "/", "", unix.MS_REC|unix.MS_PRIVATE, ""); err != nil {
		return fmt.Errorf("make / private: %w", err)
	}
	for _, dir := range []string{"/var", "/run", "/etc", "/opt"} {
		base := s.path("overlay", strings.Trim(dir, "/"))
		upper, work := filepath.Join(base, "upper"), filepath.Join(base, "work")
		for _, d := range []string{upper, work} {
			if err := os.MkdirAll(d, 0o755); err != nil {
				return err
			}
		}
		data := "lowerdir=" + dir + ",upperdir=" + upper + ",workdir=" + work
		if err := unix.Mount("overlay", dir, "overlay", 0, data); err != nil {
			return fmt.Errorf("overlay %s: %w", dir, err)
		}
	}
	// containerd's snapshots are overlays themselves, which an overlay
	// cannot be the upper layer of: its root is a directory of the state.
	for _, b := range []struct{ src, dst string }{
		{s.path("containerd"), "/var/lib/containerd"},
		{s.path("kubelet"), "/var/lib/kubelet"},
	} {
		for _, d := range []string{b.src, b.dst} {
			if err := os.MkdirAll(d, 0o755); err != nil {
				return err
			}
		}
		if err := unix.Mount(b.src, b.dst, "", unix.MS_BIND, ""); err != nil {
			return fmt.Errorf("bind %s: %w", b.dst, err)
		}
	}
	// containerd's state directory as containerd makes it (0711): one a
	// containerd shim of another test left on the host is 0600 (the shim
	// makes its socket directory's parents so), which containerd keeps,
	// and which denies its socket to a root without CAP_DAC_OVERRIDE,
	// such as the sweeper's container. The change stays in the overlay.
	if err := os.MkdirAll("/run/containerd", 0o711); err != nil {
		return err
	}
	if err := os.Chmod("/run/containerd", 0o711); err != nil {
		return err
	}
	if err := unix.Mount("bpf", "/sys/fs/bpf", "bpf", 0, "mode=0700"); err != nil {
		return fmt.Errorf("bpffs: %w", err)
	}
	// The values the kubelet wants; the host keeps its own.
	for path, value := range map[string]string{
		"/proc/sys/vm/overcommit_memory":      "1",
		"/proc/sys/kernel/panic":              "10",
		"/proc/sys/kernel/panic_on_oops":      "1",
		"/proc/sys/kernel/keys/root_maxkeys":  "1000000",
		"/proc/sys/kernel/keys/root_maxbytes": "25000000",
	} {
		f := s.path("sysctl", strings.ReplaceAll(strings.TrimPrefix(path, "/proc/sys/"), "/", "."))
		if err := os.MkdirAll(filepath.Dir(f), 0o755); err != nil {
			return err
		}
		if err := os.WriteFile(f, []byte(value+"\n"), 0o644); err != nil {
			return err
		}
		if err := unix.Mount(f, path, "", unix.MS_BIND, ""); err != nil {
			return fmt.Errorf("bind over %s: %w", path, err)
		}
	}
	if err := unix.Mount("", "/", "", unix.MS_REC|unix.MS_SHARED, ""); err != nil {
		return fmt.Errorf("make / shared: %w", err)
	}
	return nil
}

// network gives the namespace the node's address on a link of its own (a
// veth pair whose both ends stay here: there is no dummy link type on this
// kernel), a default route, and forwarding, which are this namespace's.
func (s *supervisor) network() error {
	lo, err := netlink.LinkByName("lo")
	if err != nil {
		return err
	}
	if err := netlink.LinkSetUp(lo); err != nil {
		return err
	}
	veth := &netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: "eth0"}, PeerName: "uplink"}
	if err := netlink.LinkAdd(veth); err != nil {
		return fmt.Errorf("the node's link: %w", err)
	}
	for _, l := range []struct {
		name string
		addr string
	}{{"eth0", NodeIP.String() + "/24"}, {"uplink", nodePeerIP.String() + "/24"}} {
		link, err := netlink.LinkByName(l.name)
		if err != nil {
			return err
		}
		a, err := netlink.ParseAddr(l.addr)
		if err != nil {
			return err
		}
		if err := netlink.AddrAdd(link, a); err != nil {
			return err
		}
		if err := netlink.LinkSetUp(link); err != nil {
			return err
		}
	}
	eth0, err := netlink.LinkByName("eth0")
	if err != nil {
		return err
	}
	if err := netlink.RouteAdd(&netlink.Route{LinkIndex: eth0.Attrs().Index, Gw: nodePeerIP.AsSlice()}); err != nil {
		return fmt.Errorf("default route: %w", err)
	}
	for path, v := range map[string]string{
		"/proc/sys/net/ipv4/ip_forward":             "1",
		"/proc/sys/net/ipv4/conf/all/rp_filter":     "0",
		"/proc/sys/net/ipv4/conf/default/rp_filter": "0",
	} {
		if err := os.WriteFile(path, []byte(v), 0o644); err != nil {
			return fmt.Errorf("%s: %w", path, err)
		}
	}
	return os.WriteFile(s.path("resolv.conf"), []byte("nameserver "+DNSServiceIP.String()+"\n"), 0o644)
}

// cgroups makes the kubelet's cgroup root below this process's own cgroup
// of each v1 hierarchy (the kubelet wants the same path in all of them),
// and moves the supervisor into a system cgroup below it, so that every
// process of the node, containerd's shims included, is below the root.
func (s *supervisor) cgroups() error {
	own, err := os.ReadFile("/proc/self/cgroup")
	if err != nil {
		return err
	}
	// The deepest of this process's v1 paths (a session's memory cgroup,
	// say): the root goes below it in every hierarchy.
	base := "/"
	for _, line := range strings.Split(strings.TrimSpace(string(own)), "\n") {
		parts := strings.SplitN(line, ":", 3)
		if len(parts) == 3 && parts[0] != "0" && len(parts[2]) > len(base) {
			base = parts[2]
		}
	}
	// One per node: two nodes may run at once (a test run beside make
	// cluster), and a cgroup root is the kubelet's alone.
	s.cgroupRoot = filepath.Join(base, podfenceCgroup+"-"+strconv.Itoa(os.Getpid()))
	hs, err := hierarchies()
	if err != nil {
		return err
	}
	if err := s.recordState(); err != nil { // Down removes the cgroups if this process dies
		return err
	}
	for _, h := range hs {
		// Every directory made on the way is recorded first, so that
		// Down removes exactly what the node added.
		var made []string
		for d := filepath.Join(h, s.cgroupRoot, "system"); d != h; d = filepath.Dir(d) {
			if _, err := os.Stat(d); errors.Is(err, os.ErrNotExist) {
				made = append([]string{d}, made...)
			}
		}
		s.cgroupsMade = append(s.cgroupsMade, made...)
		if err := s.recordState(); err != nil {
			return err
		}
		for _, dir := range made {
			if err := os.Mkdir(dir, 0o755); err != nil {
				return err
			}
			if filepath.Base(h) == "cpuset" {
				// A cpuset cgroup starts empty: no task may join it.
				if err := inheritCpuset(h, dir); err != nil {
					return err
				}
			}
		}
		if err := os.WriteFile(filepath.Join(h, s.cgroupRoot, "system", "cgroup.procs"), []byte(strconv.Itoa(os.Getpid())), 0o644); err != nil {
			return fmt.Errorf("join %s: %w", filepath.Join(h, s.cgroupRoot, "system"), err)
		}
	}
	return nil
}

// hierarchies are the cgroup mount points below /sys/fs/cgroup: the v1
// hierarchies, and the v2 one a hybrid host mounts beside them (the
// kubelet makes its cgroups there too).
func hierarchies() ([]string, error) {
	entries, err := os.ReadDir("/sys/fs/cgroup")
	if err != nil {
		return nil, err
	}
	var out []string
	v1 := 0
	for _, e := range entries {
		p := filepath.Join("/sys/fs/cgroup", e.Name())
		var st unix.Statfs_t
		if !e.IsDir() || unix.Statfs(p, &st) != nil {
			continue
		}
		switch st.Type {
		case unix.CGROUP_SUPER_MAGIC:
			v1++
			out = append(out, p)
		case unix.CGROUP2_SUPER_MAGIC:
			out = append(out, p)
		}
	}
	if v1 == 0 {
		return nil, errors.New("no cgroup v1 hierarchy under /sys/fs/cgroup")
	}
	return out, nil
}

func inheritCpuset(hierarchy, dir string) error {
	for _, f := range []string{"cpuset.cpus", "cpuset.mems"} {
		parent := filepath.Dir(dir)
		for {
			b, err := os.ReadFile(filepath.Join(parent, f))
			if err != nil {
				return err
			}
			if strings.TrimSpace(string(b)) != "" || parent == hierarchy {
				if err := os.WriteFile(filepath.Join(dir, f), b, 0o644); err != nil {
					return fmt.Errorf("%s: %w", filepath.Join(dir, f), err)
				}
				break
			}
			parent = filepath.Dir(parent)
		}
	}
	return nil
}

// removeCgroups kills every process in the cgroups the node made and
// removes them, deepest first.
func removeCgroups(made []string) error {
	var errs []error
	for attempt := 0; attempt < 50; attempt++ {
		var dirs []string
		for _, top := range made {
			filepath.WalkDir(top, func(p string, d os.DirEntry, err error) error {
				if err == nil && d.IsDir() {
					dirs = append(dirs, p)
				}
				return nil
			})
		}
		// Deepest first: children before their parents.
		slices.SortFunc(dirs, func(a, b string) int { return strings.Count(b, "/") - strings.Count(a, "/") })
		left := 0
		for _, d := range slices.Compact(dirs) {
			b, _ := os.ReadFile(filepath.Join(d, "cgroup.procs"))
			for _, pid := range strings.Fields(string(b)) {
				if n, err := strconv.Atoi(pid); err == nil {
					syscall.Kill(n, syscall.SIGKILL)
					left++
				}
			}
			if err := os.Remove(d); err != nil && !errors.Is(err, os.ErrNotExist) {
				left++
			}
		}
		if left == 0 {
			return nil
		}
		time.Sleep(100 * time.Millisecond)
	}
	for _, d := range made {
		if _, err := os.Stat(d); err == nil {
			errs = append(errs, fmt.Errorf("cgroup %s could not be removed", d))
		}
	}
	return errors.Join(errs...)
}

func (s *supervisor) recordState() error {
	st := state{PID: os.Getpid(), Tools: s.opts.Tools, ProxyMode: s.opts.ProxyMode, CgroupRoot: s.cgroupRoot, CgroupsMade: s.cgroupsMade,
		Kubeconfig: s.path("kubeconfig"), InnerKubeconfig: s.path("kubeconfig-inner")}
	b, err := json.MarshalIndent(st, "", "  ")
	if err != nil {
		return err
	}
	tmp := s.path(stateFile + ".tmp")
	if err := os.WriteFile(tmp, b, 0o644); err != nil {
		return err
	}
	return os.Rename(tmp, s.path(stateFile))
}

func (s *supervisor) credentials() error {
	var err error
	if s.pki, err = newPKI(s.path("pki")); err != nil {
		return err
	}
	s.inner = s.path("kubeconfig-inner")
	apiURL := "https://" + net.JoinHostPort(NodeIP.String(), strconv.Itoa(apiServerPort))
	if err := s.pki.writeKubeconfig(s.inner, apiURL); err != nil {
		return err
	}
	outer := "https://127.0.0.1:" + strconv.Itoa(s.opts.ForwardPort)
	return s.pki.writeKubeconfig(s.path("kubeconfig"), outer)
}

// forward accepts on the root namespace's listener and connects each
// client to the API server in this namespace.
func (s *supervisor) forward(listener *os.File) error {
	ln, err := net.FileListener(listener)
	if err != nil {
		return err
	}
	listener.Close()
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				up, err := net.DialTimeout("tcp", net.JoinHostPort(NodeIP.String(), strconv.Itoa(apiServerPort)), 5*time.Second)
				if err != nil {
					return
				}
				defer up.Close()
				go func() { io.Copy(up, c); up.(*net.TCPConn).CloseWrite() }()
				io.Copy(c, up)
			}()
		}
	}()
	return nil
}

// start runs a component as a child, its output in logs/<name>.log.
func (s *supervisor) start(name, bin string, args ...string) (*component, error) {
	logf, err := os.OpenFile(s.path("logs", name+".log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(bin, args...)
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.Env = append(os.Environ(), "HOME="+s.path("home"), "KUBECACHEDIR="+s.path("home", "kube-cache"))
	cmd.Env = withoutEnv(cmd.Env, superviseEnv)
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		logf.Close()
		return nil, fmt.Errorf("start %s: %w", name, err)
	}
	c := &component{name: name, bin: bin, args: args, cmd: cmd, done: make(chan struct{})}
	go func() {
		err := cmd.Wait()
		logf.Close()
		s.log.Printf("%s exited: %v", name, err)
		close(c.done)
	}()
	s.procs = append(s.procs, c)
	return c, nil
}

func withoutEnv(env []string, key string) []string {
	out := env[:0:0]
	for _, kv := range env {
		if !strings.HasPrefix(kv, key+"=") {
			out = append(out, kv)
		}
	}
	return out
}

// run runs a command to completion, inside the node.
func (s *supervisor) run(ctx context.Context, bin string, args ...string) ([]byte, error) {
	cmd := exec.CommandContext(ctx, bin, args...)
	cmd.Env = append(withoutEnv(os.Environ(), superviseEnv), "HOME="+s.path("home"), "KUBECACHEDIR="+s.path("home", "kube-cache"))
	out, err := cmd.CombinedOutput()
	if err != nil {
		return out, fmt.Errorf("%s %s: %w: %s", filepath.Base(bin), strings.Join(args, " "), err, out)
	}
	return out, nil
}

// kubectl runs the node's kubectl as admin.
func (s *supervisor) kubectl(ctx context.Context, args ...string) ([]byte, error) {
	return s.run(ctx, s.tool("kubectl"), append([]string{"--kubeconfig", s.inner}, args...)...)
}

func (s *supervisor) tool(name string) string { return filepath.Join(s.opts.Tools, name) }

// waitFor polls check until it succeeds, a component exits, or timeout.
func (s *supervisor) waitFor(what string, timeout time.Duration, check func() error) error {
	deadline := time.Now().Add(timeout)
	var last error
	for {
		if last = check(); last == nil {
			return nil
		}
		for _, c := range s.procs {
			select {
			case <-c.done:
				return fmt.Errorf("%s: %s exited (see logs/%s.log)", what, c.name, c.name)
			default:
			}
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%s: not within %v: %w", what, timeout, last)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// down stops the components in the reverse of their start, the kubelet's
// pods with them (everything below the cgroup root but this process), and
// returns once they are gone. The namespaces go with this process.
func (s *supervisor) down() {
	for i := len(s.procs) - 1; i >= 0; i-- {
		c := s.procs[i]
		if c.name == "containerd" {
			s.killPods()
		}
		c.cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-c.done:
		case <-time.After(10 * time.Second):
			c.cmd.Process.Kill()
			<-c.done
		}
	}
	s.killPods()
}

// killPods kills every process below the node's cgroup root but the
// supervisor's own cgroup: the pods, and containerd's shims.
func (s *supervisor) killPods() {
	if s.cgroupRoot == "" {
		return
	}
	hs, err := hierarchies()
	if err != nil {
		return
	}
	me := strconv.Itoa(os.Getpid())
	for _, h := range hs {
		filepath.WalkDir(filepath.Join(h, s.cgroupRoot), func(p string, d os.DirEntry, err error) error {
			if err != nil || !d.IsDir() {
				return nil
			}
			b, _ := os.ReadFile(filepath.Join(p, "cgroup.procs"))
			for _, pid := range strings.Fields(string(b)) {
				if pid == me || s.isComponent(pid) {
					continue
				}
				if n, err := strconv.Atoi(pid); err == nil {
					syscall.Kill(n, syscall.SIGKILL)
				}
			}
			return nil
		})
	}
}

func (s *supervisor) isComponent(pid string) bool {
	for _, c := range s.procs {
		if strconv.Itoa(c.cmd.Process.Pid) == pid {
			select {
			case <-c.done:
				return false
			default:
				return true
			}
		}
	}
	return false
}

// control serves Node.Restart on the state directory's control socket:
// one line "restart NAME", answered "ok" or "error: ...".
func (s *supervisor) control() {
	ln, err := net.Listen("unix", s.path(controlSocket))
	if err != nil {
		s.log.Printf("control socket: %v", err)
		return
	}
	for {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		go func() {
			defer c.Close()
			line, _ := bufio.NewReader(c).ReadString('\n')
			cmd, name, _ := strings.Cut(strings.TrimSpace(line), " ")
			err := fmt.Errorf("unknown command %q", cmd)
			if cmd == "restart" {
				err = s.restart(name)
			}
			if err != nil {
				fmt.Fprintf(c, "error: %v\n", err)
				return
			}
			fmt.Fprintln(c, "ok")
		}()
	}
}

// restart stops a component as down does and starts it again with the
// same arguments, as a node's service manager restarts a service.
func (s *supervisor) restart(name string) error {
	s.cgmu.Lock()
	defer s.cgmu.Unlock()
	for i, c := range s.procs {
		if c.name != name {
			continue
		}
		s.log.Printf("restarting %s", name)
		c.cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-c.done:
		case <-time.After(10 * time.Second):
			c.cmd.Process.Kill()
			<-c.done
		}
		n := len(s.procs)
		nc, err := s.start(c.name, c.bin, c.args...)
		if err != nil {
			return err
		}
		// start appended it: it takes the old one's place in the order.
		s.procs = append(s.procs[:n], s.procs[n+1:]...)
		s.procs[i] = nc
		return nil
	}
	return fmt.Errorf("no component %q", name)
}
