package builds

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"hash"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"
)

// cacheAge is how long an entry nobody used is kept.
const cacheAge = 7 * 24 * time.Hour

// cached returns the directory holding a build's binaries, kept outside
// the clone under ~/.cache/podfence/builds (PODFENCE_CACHE, as
// hack/k8s-tools.sh), and runs build into a new directory when there is
// none for key yet. A build is keyed by everything it reads, so an entry
// never goes stale. Go's build cache cannot stand in: the source is
// copied to a new t.TempDir() each time, and the build cache keys a
// package by its directory, so every run compiled both binaries anew.
//
// A finished build is renamed into place: an interrupted one leaves
// nothing behind, and of two at once one is kept. Entries unused for a
// week are removed.
func cached(t testing.TB, key string, build func(out string)) string {
	t.Helper()
	dir := cacheDir(t)
	entry := filepath.Join(dir, key)
	if _, err := os.Stat(entry); err == nil {
		now := time.Now()
		if err := os.Chtimes(entry, now, now); err != nil {
			t.Fatal(err)
		}
		return entry
	}
	tmp, err := os.MkdirTemp(dir, ".build-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(tmp) })
	build(tmp)
	// Another build of the key finished first (ENOTEMPTY is ErrExist):
	// either is it.
	if err := os.Rename(tmp, entry); err != nil && !errors.Is(err, fs.ErrExist) {
		t.Fatal(err)
	}
	prune(t, dir, key)
	return entry
}

// cacheDir is the builds' cache directory, created if missing.
func cacheDir(t testing.TB) string {
	t.Helper()
	base := os.Getenv("PODFENCE_CACHE")
	if base == "" {
		user, err := os.UserCacheDir()
		if err != nil {
			t.Fatal(err)
		}
		base = filepath.Join(user, "podfence")
	}
	dir := filepath.Join(base, "builds")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	return dir
}

// prune removes the entries other than keep that nobody used for cacheAge.
func prune(t testing.TB, dir, keep string) {
	t.Helper()
	entries, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range entries {
		info, err := e.Info()
		if err != nil || e.Name() == keep || time.Since(info.ModTime()) < cacheAge {
			continue
		}
		os.RemoveAll(filepath.Join(dir, e.Name()))
	}
}

// keyer hashes what a build reads into its cache key.
type keyer struct {
	kind string
	h    hash.Hash
}

func newKey(t testing.TB, kind string) *keyer {
	t.Helper()
	k := &keyer{kind: kind, h: sha256.New()}
	// The toolchain and what it is told to build for.
	out, err := exec.Command("go", "env", "GOVERSION", "GOOS", "GOARCH", "GOAMD64", "GOFLAGS").Output()
	if err != nil {
		t.Fatalf("go env: %v", err)
	}
	k.add(string(out))
	return k
}

// add writes s with its length, so that no two sequences of parts hash
// alike.
func (k *keyer) add(s string) { fmt.Fprintf(k.h, "%d:%s", len(s), s) }

// addTree adds every file below path (a file or a directory), by its
// path relative to root and its content.
func (k *keyer) addTree(t testing.TB, root, path string) {
	t.Helper()
	err := filepath.WalkDir(filepath.Join(root, path), func(p string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		b, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(root, p)
		k.add(rel)
		k.add(string(b))
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

// String is the entry's name: the kind, and the hash.
func (k *keyer) String() string { return k.kind + "-" + hex.EncodeToString(k.h.Sum(nil)[:8]) }
