package pinfs

import (
	"errors"
	"os"
	"path/filepath"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// TestWriteRecord: a record replaces the one before, through a rename that
// also replaces a temporary name a killed writer left; a failed write
// leaves the record as it was and no temporary name.
func TestWriteRecord(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "record")
	if _, ok, err := ReadRecord(path); ok || err != nil {
		t.Fatalf("a record before any was written: %v %v", ok, err)
	}
	if err := os.Symlink("left by a killed writer", TempName(path)); err != nil {
		t.Fatal(err)
	}
	for _, text := range []string{"v=1&a=1", "v=1&a=2"} {
		if err := WriteRecord(path, text); err != nil {
			t.Fatal(err)
		}
		if got, ok, err := ReadRecord(path); got != text || !ok || err != nil {
			t.Errorf("read %q %v %v, want %q", got, ok, err, text)
		}
	}
	failing := errors.New("no room")
	if err := Replace(path, func(tmp string) error {
		if err := os.Symlink("half written", tmp); err != nil {
			return err
		}
		return failing
	}); !errors.Is(err, failing) {
		t.Fatalf("a failed write: %v", err)
	}
	if got, _, _ := ReadRecord(path); got != "v=1&a=2" {
		t.Errorf("a failed write changed the record to %q", got)
	}
	if _, err := os.Lstat(TempName(path)); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("a failed write left its temporary name: %v", err)
	}
}

// TestReplaceRemovesTempOnRenameFailure: a rename that fails (the target
// is a non-empty directory) leaves no temporary name behind.
func TestReplaceRemovesTempOnRenameFailure(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "record")
	if err := os.MkdirAll(filepath.Join(path, "x"), 0o700); err != nil {
		t.Fatal(err)
	}
	if err := WriteRecord(path, "v=1"); err == nil {
		t.Fatal("a record written over a directory")
	}
	if _, err := os.Lstat(TempName(path)); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the temporary name stayed: %v", err)
	}
}

// TestLockDir: an exclusive lock waits for a shared one, and is taken once
// the shared holder closes its file.
func TestLockDir(t *testing.T) {
	dir := t.TempDir()
	shared, err := LockDir(dir, unix.LOCK_SH)
	if err != nil {
		t.Fatal(err)
	}
	got := make(chan error, 1)
	go func() {
		f, err := LockDir(dir, unix.LOCK_EX)
		if err == nil {
			f.Close()
		}
		got <- err
	}()
	select {
	case err := <-got:
		t.Fatalf("the exclusive lock did not wait for the shared one: %v", err)
	case <-time.After(100 * time.Millisecond):
	}
	shared.Close()
	if err := <-got; err != nil {
		t.Fatal(err)
	}
	if _, err := LockDir(filepath.Join(dir, "missing"), unix.LOCK_EX); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("lock a missing directory: %v", err)
	}
}
