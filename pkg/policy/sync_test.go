package policy

import (
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"testing"
)

func TestSyncMarker(t *testing.T) {
	dir := t.TempDir()
	check := func(want bool) {
		t.Helper()
		if got, err := Synced(dir); err != nil || got != want {
			t.Fatalf("Synced = %v, %v; want %v", got, err, want)
		}
	}
	check(true) // a plain directory of files
	if err := MarkUnsynced(dir); err != nil {
		t.Fatal(err)
	}
	check(false)
	// The marker is no document: loading the directory ignores it.
	if docs, err := LoadDir(dir); err != nil || len(docs) != 0 {
		t.Fatalf("LoadDir with the marker = %v, %v", docs, err)
	}
	for range 2 { // idempotent
		if err := MarkSynced(dir); err != nil {
			t.Fatal(err)
		}
		check(true)
	}

	if _, err := Synced(filepath.Join(dir, "missing", "deeper")); err != nil {
		t.Errorf("Synced of a missing directory: %v (no marker means synced)", err)
	}
	if err := MarkUnsynced(filepath.Join(dir, "missing")); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("MarkUnsynced of a missing directory = %v, want ErrNotExist", err)
	}
	file := filepath.Join(dir, "file")
	if err := os.WriteFile(file, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := Synced(file); err == nil {
		t.Error("Synced of a regular file: no error")
	}
}
