package node

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
)

// Host is what a node must leave as it found on this machine: the
// machine-wide sysctls the kubelet writes, the root namespace's mounts and
// network, and the host paths the node's processes are known to write.
type Host map[string]string

// hostSysctls are machine-wide (not per network namespace).
var hostSysctls = []string{"vm/overcommit_memory", "vm/panic_on_oom", "kernel/panic", "kernel/panic_on_oops",
	"kernel/keys/root_maxkeys", "kernel/keys/root_maxbytes", "net/ipv4/ip_forward", "net/netfilter/nf_conntrack_max"}

// hostPaths are where the kubelet, containerd, CNI plugins, kubectl and
// podfence write by default: each is listed (names only) to its depth.
var hostPaths = []string{"/var/lib/kubelet", "/var/lib/containerd", "/var/lib/cni", "/var/log/containers",
	"/var/log/pods", "/var/log/podfence", "/run/containerd", "/run/netns", "/etc/cni", "/opt/cni",
	"/etc/podfence", "/usr/libexec/kubernetes", "/sys/fs/bpf", "/root/.kube", "/etc/kubernetes", "/var/run/aws-node"}

// nodeCgroup matches the cgroups the node, the kubelet, containerd and runc
// make (kubepods, pod and container cgroups, containerd's k8s.io namespace).
var nodeCgroup = regexp.MustCompile(`/(podfence-node-|kubepods|pod[0-9a-f-]{36}|k8s\.io|containerd|kubelet|system\.slice|runtime)`)

// SnapshotHost reads the host's state.
func SnapshotHost() (Host, error) {
	h := Host{}
	for _, k := range hostSysctls {
		b, err := os.ReadFile("/proc/sys/" + k)
		if err == nil {
			h["sysctl "+k] = strings.TrimSpace(string(b))
		}
	}
	mounts, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		return nil, err
	}
	var points []string
	for _, line := range strings.Split(string(mounts), "\n") {
		if f := strings.Fields(line); len(f) > 4 {
			points = append(points, f[4])
		}
	}
	slices.Sort(points)
	h["mounts"] = strings.Join(points, "\n")
	for _, c := range [][]string{{"ip", "-d", "link"}, {"ip", "addr"}, {"ip", "route", "show", "table", "all"},
		{"ip", "-6", "route", "show", "table", "all"}, {"ip", "netns", "list"}, {"nft", "list", "ruleset"}, {"iptables-save"}} {
		out, err := exec.Command(c[0], c[1:]...).Output()
		if err != nil {
			return nil, fmt.Errorf("%s: %w", strings.Join(c, " "), err)
		}
		h[strings.Join(c, " ")] = stripCounters(string(out))
	}
	for _, p := range hostPaths {
		var names []string
		filepath.WalkDir(p, func(path string, d os.DirEntry, err error) error {
			if err == nil {
				names = append(names, path)
			}
			return nil
		})
		h["files "+p] = strings.Join(names, "\n")
	}
	// Only the cgroups a node's processes make: other processes of this
	// machine make and remove their own meanwhile.
	var dirs []string
	filepath.WalkDir("/sys/fs/cgroup", func(path string, d os.DirEntry, err error) error {
		if err == nil && d.IsDir() && nodeCgroup.MatchString(path) {
			dirs = append(dirs, path)
		}
		return nil
	})
	h["cgroups"] = strings.Join(dirs, "\n")
	return h, nil
}

// stripCounters drops what changes without anyone changing the host:
// packet counters, and link statistics.
func stripCounters(s string) string {
	var out []string
	for _, line := range strings.Split(s, "\n") {
		if strings.HasPrefix(line, "# ") || strings.HasPrefix(line, ":") && strings.Contains(line, "[") {
			continue // iptables-save's comments and chain counters
		}
		out = append(out, line)
	}
	return strings.Join(out, "\n")
}

// Diff says what differs between h (before) and after, empty when nothing.
func (h Host) Diff(after Host) string {
	var b strings.Builder
	keys := make([]string, 0, len(h))
	for k := range h {
		keys = append(keys, k)
	}
	for k := range after {
		if _, ok := h[k]; !ok {
			keys = append(keys, k)
		}
	}
	slices.Sort(keys)
	for _, k := range keys {
		if h[k] != after[k] {
			fmt.Fprintf(&b, "%s:\n  before: %q\n  after:  %q\n", k, h[k], after[k])
		}
	}
	return b.String()
}
