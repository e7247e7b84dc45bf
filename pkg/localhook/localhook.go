// Package localhook hooks the node's judge of Service flows delivered to
// its own sockets (bpf.LoadLocal, local_after_nat in bpf/podfence.c) at
// the inet ingress of a cgroup: a packet kube-proxy translates to a
// host-network backend or to the node itself is delivered to a socket and
// meets no TC egress, so the cgroup of the sockets is where it can be
// judged before the backend reads it. The hook is a BPF link pinned in the
// node's pin directory, so that it outlives the sweeper that made it and
// a new sweeper replaces its program without a moment unhooked.
package localhook

import (
	"errors"
	"fmt"
	"os"
	"slices"
	"strings"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"golang.org/x/sys/unix"

	"github.com/podfence/podfence/pkg/pinfs"
)

// Hook attaches prog at the inet ingress of the cgroup v2 directory
// cgroup, through a link pinned at pin. A pinned link on the same cgroup
// is updated to prog in place; one on another cgroup (the flag changed) is
// replaced. Idempotent.
func Hook(cgroup, pin string, prog *ebpf.Program) error {
	var st unix.Stat_t
	if err := unix.Stat(cgroup, &st); err != nil {
		return fmt.Errorf("local hook: cgroup %s: %w", cgroup, err)
	}
	if !isCgroup2(cgroup) {
		return fmt.Errorf("local hook: %s is not a cgroup v2 directory", cgroup)
	}
	if l, err := link.LoadPinnedLink(pin, nil); err == nil {
		defer l.Close()
		info, err := l.Info()
		if err == nil && info.Cgroup() != nil && info.Cgroup().CgroupId == st.Ino {
			if err := l.Update(prog); err != nil {
				return fmt.Errorf("local hook: update %s: %w", pin, err)
			}
			return nil
		}
		// Another cgroup's, or unreadable: the new link goes in first,
		// so that the sockets are never left unhooked.
	} else if !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("local hook: load %s: %w", pin, err)
	}
	l, err := link.AttachCgroup(link.CgroupOptions{Path: cgroup, Attach: ebpf.AttachCGroupInetIngress, Program: prog})
	if err != nil {
		return fmt.Errorf("local hook: attach to %s: %w", cgroup, err)
	}
	defer l.Close()
	if err := pinfs.ReplacePin(pin, l); err != nil {
		return fmt.Errorf("local hook: pin %s: %w", pin, err)
	}
	return nil
}

// Release detaches the hook pinned at pin: the link goes with its pin.
// Idempotent.
func Release(pin string) error {
	for _, p := range []string{pin, pinfs.TempName(pin)} {
		if err := os.Remove(p); err != nil && !errors.Is(err, os.ErrNotExist) {
			return fmt.Errorf("local hook: release: %w", err)
		}
	}
	return nil
}

// Hooked tells whether a hook is pinned at pin.
func Hooked(pin string) bool {
	l, err := link.LoadPinnedLink(pin, nil)
	if err != nil {
		return false
	}
	l.Close()
	return true
}

// Candidates are where Root looks for the root of the node's cgroup v2
// hierarchy, in order: the host's, as the sweeper's DaemonSet mounts it
// (unified, then hybrid); then, for a process in the host's cgroup
// namespace only, its own (unified, then hybrid). A container's own
// /sys/fs/cgroup in a cgroup namespace of its own shows only its subtree:
// hooked, it would cover the container's sockets alone.
var (
	Candidates = []string{"/host/sys/fs/cgroup", "/host/sys/fs/cgroup/unified"}
	ownRoots   = []string{"/sys/fs/cgroup", "/sys/fs/cgroup/unified"}
)

// initialCgroupNS is the inode of the host's cgroup namespace
// (PROC_CGROUP_INIT_INO in include/linux/proc_ns.h).
const initialCgroupNS = "cgroup:[4026531835]"

// Root is the first of Candidates that is a cgroup v2 directory: where the
// default hook covers every socket of the node.
func Root() (string, error) {
	cands := Candidates
	if ns, err := os.Readlink("/proc/self/ns/cgroup"); err == nil && ns == initialCgroupNS {
		cands = append(slices.Clone(cands), ownRoots...)
	}
	for _, c := range cands {
		if isCgroup2(c) {
			return c, nil
		}
	}
	return "", fmt.Errorf("no cgroup v2 hierarchy of the host at %s", strings.Join(cands, ", "))
}

func isCgroup2(dir string) bool {
	var fs unix.Statfs_t
	return unix.Statfs(dir, &fs) == nil && fs.Type == unix.CGROUP2_SUPER_MAGIC
}

// Attached lists the programs attached at the inet ingress of the cgroup
// v2 directory cgroup (this hook's among them, once hooked).
func Attached(cgroup string) ([]ebpf.ProgramID, error) {
	f, err := os.Open(cgroup)
	if err != nil {
		return nil, fmt.Errorf("local hook: %w", err)
	}
	defer f.Close()
	res, err := link.QueryPrograms(link.QueryOptions{Target: int(f.Fd()), Attach: ebpf.AttachCGroupInetIngress})
	if err != nil {
		return nil, fmt.Errorf("local hook: query %s: %w", cgroup, err)
	}
	ids := make([]ebpf.ProgramID, 0, len(res.Programs))
	for _, p := range res.Programs {
		ids = append(ids, p.ID)
	}
	return ids, nil
}
