// Package builds builds podfence's binaries as other versions than this
// checkout's, for the tests that take a node over from one build to
// another: the build of the previous layout, from this clone's history,
// and the next layout's, from a copy of this module with edits.
package builds

import (
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/podfence/podfence/bpf"
)

// nextLayoutEdits turn this module's datapath into the next layout's: the
// policy tries get twice the capacity, so every identifier's tries are maps
// of another size and its programs another build's, and the layout version
// goes up by one.
var nextLayoutEdits = []struct{ file, old, new string }{
	{"bpf/maps.h", "#define POLICY_TRIE_ENTRIES 16384", "#define POLICY_TRIE_ENTRIES 32768"},
	{"bpf/layout.go", "trieCapacity = uint32(16384)", "trieCapacity = uint32(32768)"},
	{"bpf/version.go", fmt.Sprintf("const LayoutVersion = %d\n", bpf.LayoutVersion), fmt.Sprintf("const LayoutVersion = %d\n", bpf.LayoutVersion+1)},
}

// NextTrieCapacity is the next layout's trie capacity.
const NextTrieCapacity = 32768

// NextLayout builds podfence and podfence-sweeper from a copy of this
// module with nextLayoutEdits, regenerating the datapath object with clang
// the way make generate does, and returns the directory that holds them
// (cached: see cached).
func NextLayout(t testing.TB) string {
	t.Helper()
	clang, err := exec.Command("clang", "--version").Output()
	if err != nil {
		t.Fatal("clang is needed to build the next layout's datapath (hack/deps.sh installs it)")
	}
	root := moduleRoot(t)
	key := newKey(t, "next-layout")
	key.add(string(clang))
	// The headers clang reads, where dpkg knows them (Debian).
	headers, _ := exec.Command("dpkg-query", "-W", "linux-libc-dev", "libbpf-dev").Output()
	key.add(string(headers))
	for _, p := range nextLayoutSources {
		key.addTree(t, root, p)
	}
	for _, e := range nextLayoutEdits {
		key.add(e.file + e.old + e.new)
	}
	return cached(t, key.String(), func(out string) { buildNextLayout(t, root, out) })
}

// nextLayoutSources are what NextLayout copies of this module.
var nextLayoutSources = []string{"go.mod", "go.sum", "bpf", "pkg", "plugins", "sweeper", "hack/bpf2go.sh"}

func buildNextLayout(t testing.TB, root, out string) {
	t.Helper()
	src := t.TempDir()
	if err := os.MkdirAll(filepath.Join(src, "hack"), 0o755); err != nil {
		t.Fatal(err)
	}
	for _, p := range nextLayoutSources {
		if b, err := exec.Command("cp", "-a", filepath.Join(root, p), filepath.Join(src, p)).CombinedOutput(); err != nil {
			t.Fatalf("copy %s: %v: %s", p, err, b)
		}
	}
	for _, e := range nextLayoutEdits {
		path := filepath.Join(src, e.file)
		b, err := os.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		if n := strings.Count(string(b), e.old); n != 1 {
			t.Fatalf("%s has %q %d times, not once: nextLayoutEdits no longer fit the source", e.file, e.old, n)
		}
		if err := os.WriteFile(path, []byte(strings.Replace(string(b), e.old, e.new, 1)), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	for _, args := range [][]string{
		{"generate", "./bpf"},
		{"build", "-o", filepath.Join(out, "podfence"), "./plugins/podfence"},
		{"build", "-o", filepath.Join(out, "podfence-sweeper"), "./sweeper"},
	} {
		cmd := exec.Command("go", args...)
		cmd.Dir = src
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
		if b, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("go %v in the next layout's copy: %v: %s", args, err, b)
		}
	}
}

// PreviousBuild is the last commit of layout 3, the build before the
// policy had two sides: the build every node ran until this layout.
// (Layout 2, before the cluster tiers, ended at c704f0e, and layout 1,
// before the source check, at f9c911c; this build still takes their pins
// over, which bpf's TestRenewLayout1 checks for the oldest.)
const (
	PreviousBuild       = "7ee03b579497ce6c327f5f62cac8ef3f1e6dfb6e"
	PreviousLayout      = 3
	PreviousReasonCount = 16
)

// Previous builds podfence and podfence-sweeper of previousBuild from
// this clone's history (its generated datapath is committed, so no clang),
// and returns the directory that holds them (cached: see cached).
func Previous(t testing.TB) string {
	t.Helper()
	root := moduleRoot(t)
	key := newKey(t, "previous")
	key.add(PreviousBuild)
	return cached(t, key.String(), func(out string) { buildPrevious(t, root, out) })
}

func buildPrevious(t testing.TB, root, out string) {
	t.Helper()
	src := t.TempDir()
	archive := exec.Command("git", "-C", root, "archive", "--format=tar", PreviousBuild)
	var tarball, stderr bytes.Buffer
	archive.Stdout, archive.Stderr = &tarball, &stderr
	if err := archive.Run(); err != nil {
		t.Fatalf("git archive %s: %v: %s (the take-over test needs a clone with the history of layout %d's last build)",
			PreviousBuild, err, stderr.Bytes(), PreviousLayout)
	}
	untar := exec.Command("tar", "-x", "-C", src)
	untar.Stdin = &tarball
	if b, err := untar.CombinedOutput(); err != nil {
		t.Fatalf("untar %s: %v: %s", PreviousBuild, err, b)
	}
	for _, args := range [][]string{
		{"build", "-o", filepath.Join(out, "podfence"), "./plugins/podfence"},
		{"build", "-o", filepath.Join(out, "podfence-sweeper"), "./sweeper"},
	} {
		cmd := exec.Command("go", args...)
		cmd.Dir = src
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
		if b, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("go %v of %s: %v: %s", args, PreviousBuild, err, b)
		}
	}
}

// moduleRoot is the directory of podfence's go.mod.
func moduleRoot(t testing.TB) string {
	t.Helper()
	out, err := exec.Command("go", "env", "GOMOD").Output()
	if err != nil || !strings.HasSuffix(strings.TrimSpace(string(out)), "go.mod") {
		t.Fatalf("find podfence's module: %v (%s)", err, out)
	}
	return filepath.Dir(strings.TrimSpace(string(out)))
}
