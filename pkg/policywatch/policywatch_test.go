package policywatch

import (
	"os"
	"path/filepath"
	"testing"
	"time"
)

const quiet = 20 * time.Millisecond

func watch(t *testing.T) (string, *Watcher) {
	t.Helper()
	dir := t.TempDir()
	w, err := New(dir, quiet)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { w.Close() })
	return dir, w
}

func changed(w *Watcher, within time.Duration) bool {
	select {
	case <-w.C:
		return true
	case <-time.After(within):
		return false
	}
}

func TestRenameIntoPlace(t *testing.T) {
	dir, w := watch(t)
	tmp := filepath.Join(dir, ".web.yaml.tmp")
	if err := os.WriteFile(tmp, []byte("a: b\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, filepath.Join(dir, "web.yaml")); err != nil {
		t.Fatal(err)
	}
	if !changed(w, time.Second) {
		t.Fatal("no change reported for a file renamed into place")
	}
	if changed(w, 10*quiet) {
		t.Fatal("one rename reported twice")
	}
}

// A writer that pauses mid-file holds the change back until it closes.
func TestSlowWriterIsWaitedFor(t *testing.T) {
	dir, w := watch(t)
	f, err := os.Create(filepath.Join(dir, "web.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.WriteString("kind: PolicyEndpoint\n"); err != nil {
		t.Fatal(err)
	}
	if changed(w, 20*quiet) {
		t.Fatal("a change reported while its file was still being written")
	}
	if _, err := f.WriteString("spec: {}\n"); err != nil {
		t.Fatal(err)
	}
	f.Close()
	if !changed(w, time.Second) {
		t.Fatal("no change reported after the writer closed the file")
	}
}

// Files LoadDir does not read (an editor's swap file left open) hold
// nothing back.
func TestOtherFilesDoNotHoldBack(t *testing.T) {
	dir, w := watch(t)
	swap, err := os.Create(filepath.Join(dir, ".web.yaml.swp"))
	if err != nil {
		t.Fatal(err)
	}
	defer swap.Close()
	if _, err := swap.WriteString("x"); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "db.json"), []byte("{}"), 0o644); err != nil {
		t.Fatal(err)
	}
	if !changed(w, time.Second) {
		t.Fatal("an open swap file held a policy change back")
	}
}

func TestRemove(t *testing.T) {
	dir, w := watch(t)
	path := filepath.Join(dir, "web.yaml")
	if err := os.WriteFile(path, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	changed(w, time.Second)
	if err := os.Remove(path); err != nil {
		t.Fatal(err)
	}
	if !changed(w, time.Second) {
		t.Fatal("no change reported for a removed file")
	}
}

func TestDirectoryRemoved(t *testing.T) {
	dir, w := watch(t)
	if err := os.Remove(dir); err != nil {
		t.Fatal(err)
	}
	select {
	case <-w.Failed:
		if w.Err() == nil {
			t.Fatal("failed without an error")
		}
	case <-time.After(time.Second):
		t.Fatal("the watcher did not notice its directory going")
	}
}

func TestMissingDirectory(t *testing.T) {
	if _, err := New(filepath.Join(t.TempDir(), "nothing"), 0); err == nil {
		t.Fatal("watching a missing directory succeeded")
	}
}
