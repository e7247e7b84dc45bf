// Package kernel holds helpers for tests that need a real kernel: root,
// bpffs and a private pin root that is removed when the test ends.
package kernel

import (
	"crypto/rand"
	"encoding/hex"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

// BPFFS is where tests expect bpffs to be mounted.
const BPFFS = "/sys/fs/bpf"

// RequireRoot skips the test when it cannot load eBPF programs.
func RequireRoot(tb testing.TB) {
	tb.Helper()
	if os.Geteuid() != 0 {
		tb.Skip("needs root (loads eBPF programs); CI runs it as root")
	}
}

// PinRoot returns a fresh directory on bpffs for one test and removes it,
// with everything pinned below it, when the test ends (also when it fails).
func PinRoot(tb testing.TB) string {
	tb.Helper()
	RequireRoot(tb)
	var st unix.Statfs_t
	if err := unix.Statfs(BPFFS, &st); err != nil || st.Type != unix.BPF_FS_MAGIC {
		tb.Fatalf("bpffs is not mounted at %s (mount -t bpf bpf %s)", BPFFS, BPFFS)
	}
	var b [4]byte
	_, _ = rand.Read(b[:])
	name := strings.NewReplacer("/", "-", ".", "-").Replace(tb.Name())
	if len(name) > 60 {
		name = name[:60]
	}
	dir := filepath.Join(BPFFS, "podfence-test-"+name+"-"+hex.EncodeToString(b[:]))
	if err := os.MkdirAll(dir, 0o700); err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() {
		if err := os.RemoveAll(dir); err != nil {
			tb.Errorf("remove pin root: %v", err)
		}
	})
	return dir
}

// Cgroup returns a fresh cgroup v2 directory below the root of the
// hierarchy (as localhook.Root finds it) for one test, removed when the
// test ends; a test that moves processes in moves them out first. It skips
// the test where no cgroup v2 hierarchy is mounted.
func Cgroup(tb testing.TB) string {
	tb.Helper()
	RequireRoot(tb)
	var root string
	for _, c := range []string{"/sys/fs/cgroup", "/sys/fs/cgroup/unified"} {
		var st unix.Statfs_t
		if unix.Statfs(c, &st) == nil && st.Type == unix.CGROUP2_SUPER_MAGIC {
			root = c
			break
		}
	}
	if root == "" {
		tb.Skip("no cgroup v2 hierarchy is mounted")
	}
	dir, err := os.MkdirTemp(root, "podfence-test-")
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() {
		if err := os.Remove(dir); err != nil {
			tb.Errorf("remove cgroup %s: %v", dir, err)
		}
	})
	return dir
}
