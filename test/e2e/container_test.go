package e2e

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/podfence/podfence/test/kubeapi"
)

// containerd is a containerd daemon of the test's own (config, root, state
// and socket in a temporary directory), as the kubelet's runtime.
type containerd struct {
	t    *testing.T
	sock string
}

// startContainerd runs Debian's containerd (hack/deps.sh installs it). The
// CRI plugin is off: the test drives it as ctr does, with the same OCI
// options a kubelet would ask for.
func startContainerd(t *testing.T) *containerd {
	t.Helper()
	bin, err := exec.LookPath("containerd")
	if err != nil {
		if os.Getenv(kubeapi.RequireEnv) == "1" {
			t.Fatalf("containerd not installed (hack/deps.sh installs it): %v", err)
		}
		t.Skipf("containerd not installed: %v", err)
	}
	// A short directory: the socket path must fit in sun_path.
	dir, err := os.MkdirTemp("/tmp", "pfctd")
	if err != nil {
		t.Fatal(err)
	}
	d := &containerd{t: t, sock: filepath.Join(dir, "sock")}
	config := filepath.Join(dir, "config.toml")
	if err := os.WriteFile(config, []byte(fmt.Sprintf(`version = 2
root = %q
state = %q
disabled_plugins = ["io.containerd.grpc.v1.cri"]
[grpc]
  address = %q
[ttrpc]
  address = %q
`, filepath.Join(dir, "root"), filepath.Join(dir, "state"), d.sock, d.sock+".ttrpc")), 0o644); err != nil {
		t.Fatal(err)
	}
	log, err := os.Create(filepath.Join(dir, "containerd.log"))
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(bin, "--config", config)
	cmd.Stdout, cmd.Stderr = log, log
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cmd.Process.Kill()
		cmd.Wait()
		log.Close()
		if t.Failed() {
			data, _ := os.ReadFile(log.Name())
			t.Logf("containerd log:\n%s", tail(data, 3000))
		}
		os.RemoveAll(dir)
	})
	deadline := time.Now().Add(20 * time.Second)
	for {
		if _, err := d.ctr("version"); err == nil {
			return d
		} else if time.Now().After(deadline) {
			t.Fatalf("containerd not answering: %v", err)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// capSet reads one capability set ("CapEff", "CapBnd") of a
// /proc/PID/status.
func capSet(t *testing.T, status, set string) uint64 {
	t.Helper()
	for _, line := range strings.Split(status, "\n") {
		if v, ok := strings.CutPrefix(line, set+":"); ok {
			caps, err := strconv.ParseUint(strings.TrimSpace(v), 16, 64)
			if err != nil {
				t.Fatalf("%s: %v", set, err)
			}
			return caps
		}
	}
	t.Fatalf("no %s in %q", set, status)
	return 0
}

func boundingSet(t *testing.T) uint64 {
	t.Helper()
	status, err := os.ReadFile("/proc/self/status")
	if err != nil {
		t.Fatal(err)
	}
	return capSet(t, string(status), "CapBnd")
}

func tail(b []byte, n int) []byte {
	if len(b) > n {
		return b[len(b)-n:]
	}
	return b
}

func (d *containerd) ctr(args ...string) (string, error) {
	out, err := exec.Command("ctr", append([]string{"--address", d.sock}, args...)...).CombinedOutput()
	if err != nil {
		return string(out), fmt.Errorf("ctr %s: %w: %s", strings.Join(args, " "), err, out)
	}
	return string(out), nil
}

// buildImage runs hack/image on the test's binaries, as make image does.
func buildImage(t *testing.T) (tarball, ref string) {
	t.Helper()
	tarball, ref = filepath.Join(t.TempDir(), "podfence.tar"), "ghcr.io/podfence/podfence:test"
	cmd := exec.Command("go", "run", "./hack/image", "-o", tarball, "-ref", ref,
		filepath.Join(binDir, "podfence"), filepath.Join(binDir, "podfence-sweeper"))
	cmd.Dir = filepath.Join("..", "..")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("hack/image: %v: %s", err, out)
	}
	return tarball, ref
}

// TestSweeperImageInContainerd: the image make image writes imports into
// containerd and runs the sweeper as conf/podfence-sweeper.yaml has the
// kubelet run it: the node's network namespace, a read-only root, the
// runtime's default seccomp profile, exactly CAP_BPF, CAP_NET_ADMIN,
// CAP_PERFMON and CAP_SYS_RESOURCE, and bpffs, /run and the policy directory mounted from
// the host. In there it must open the pins, answer /healthz, and program a
// policy change that traffic then shows.
func TestSweeperImageInContainerd(t *testing.T) {
	c := newCluster(t, attachModes(t)[0])
	client, intruder, web := c.guardedWeb(t)

	tarball, ref := buildImage(t)
	d := startContainerd(t)
	if _, err := d.ctr("images", "import", "--snapshotter", "native", tarball); err != nil {
		t.Fatal(err)
	}
	const name = "podfence-sweeper"
	bind := func(src, dst string) string {
		return fmt.Sprintf("type=bind,src=%s,dst=%s,options=rbind:rw", src, dst)
	}
	logFile := filepath.Join(t.TempDir(), "sweeper.log")
	args := []string{"run", "-d", "--snapshotter", "native", "--log-uri", "file://" + logFile,
		"--with-ns", "network:" + c.node.Path(),
		"--read-only", "--seccomp"}
	// ctr takes no "ALL": drop its default set one by one, as the
	// manifest's drop: [ALL] has the kubelet do.
	for _, cap := range []string{"CHOWN", "DAC_OVERRIDE", "FSETID", "FOWNER", "MKNOD", "NET_RAW", "SETGID", "SETUID",
		"SETFCAP", "SETPCAP", "NET_BIND_SERVICE", "SYS_CHROOT", "KILL", "AUDIT_WRITE"} {
		args = append(args, "--cap-drop", "CAP_"+cap)
	}
	const capNetAdmin, capSysResource, capPerfmon, capBPF = 12, 24, 38, 39
	want := uint64(1)<<capNetAdmin | 1<<capBPF | 1<<capPerfmon
	args = append(args, "--cap-add", "CAP_BPF", "--cap-add", "CAP_NET_ADMIN", "--cap-add", "CAP_PERFMON")
	// Only 5.10 needs CAP_SYS_RESOURCE (memlock rlimit); a runtime cannot
	// grant what its own bounding set lacks, as in some sandboxes.
	if boundingSet(t)&(1<<capSysResource) != 0 {
		args = append(args, "--cap-add", "CAP_SYS_RESOURCE")
		want |= 1 << capSysResource
	} else {
		t.Log("CAP_SYS_RESOURCE is not in this machine's bounding set: the container runs without it")
	}
	_, err := d.ctr(append(args,
		"--mount", bind("/sys/fs/bpf", "/sys/fs/bpf"),
		"--mount", bind("/run", "/run"),
		"--mount", bind(c.policyDir, "/etc/podfence/policies"),
		ref, name,
		"/usr/local/bin/podfence-sweeper", "run", "--pin-root", c.pinRoot,
		"--policy-dir", "/etc/podfence/policies", "--metrics-addr", "127.0.0.1:9465",
		"--interval-min", "1h", "--interval-max", "1h", "--judge-local-cgroup=none")...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		d.ctr("task", "kill", "--signal", "SIGKILL", name)
		for range 50 {
			if _, err := d.ctr("task", "delete", name); err == nil {
				break
			}
			time.Sleep(100 * time.Millisecond)
		}
		d.ctr("container", "delete", name)
		if t.Failed() {
			data, _ := os.ReadFile(logFile)
			t.Logf("the containerised sweeper's log:\n%s", tail(data, 4000))
		}
	})
	c.waitHealthy(t)

	// The kubelet's view of the container: the capabilities it holds.
	out, err := d.ctr("task", "ls")
	if err != nil {
		t.Fatal(err)
	}
	pid := ""
	for _, line := range strings.Split(out, "\n") {
		if f := strings.Fields(line); len(f) >= 2 && f[0] == name {
			pid = f[1]
		}
	}
	status, err := os.ReadFile(filepath.Join("/proc", pid, "status"))
	if err != nil {
		t.Fatalf("the sweeper's task (pid %q): %v", pid, err)
	}
	if got := capSet(t, string(status), "CapEff"); got != want {
		t.Errorf("the sweeper runs with CapEff %016x, want %016x (BPF, NET_ADMIN, PERFMON, SYS_RESOURCE where possible)", got, want)
	}

	if !c.connects(client, web, backendPort) || c.connects(intruder, web, backendPort) {
		t.Fatal("the policy the pod got at ADD does not hold")
	}
	c.renamePolicy(t, "web", backendPolicy(intruder.ip, backendPort))
	changed := time.Now()
	took := waitConnects(t, intruder, web, backendPort, true, changed, 2*time.Second)
	t.Logf("the containerised sweeper enforced a policy change %v after the rename", took)
	if c.connects(client, web, backendPort) {
		t.Error("the client is still let in after the change")
	}

	// SIGTERM, as the kubelet stops a pod: a clean exit.
	if _, err := d.ctr("task", "kill", "--signal", "SIGTERM", name); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		out, err := d.ctr("task", "ls")
		if err != nil {
			t.Fatal(err)
		}
		if strings.Contains(out, "STOPPED") {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the sweeper did not stop within 30s of SIGTERM:\n%s", out)
		}
		time.Sleep(100 * time.Millisecond)
	}
	// ctr task delete fails with the task's exit code when it is not 0.
	if _, err := d.ctr("task", "delete", name); err != nil {
		t.Errorf("the sweeper's exit after SIGTERM: %v", err)
	}
}
