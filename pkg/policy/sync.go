package policy

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
)

// unsyncedMarker is the file a mirror (the sweeper's Kubernetes source)
// keeps in the policy directory from the moment it starts until its first
// full sync with the API is written. The documents are then what an earlier
// run saw, and may have been revoked since. The name is hidden, so LoadDir
// and the directory watcher ignore it.
const unsyncedMarker = ".podfence-unsynced"

// ErrUnsynced is returned by Synced's callers when the directory's mirror
// has not finished its first sync since it started.
var ErrUnsynced = errors.New("policy directory not synced with its source yet")

// MarkUnsynced records in dir that its documents may be stale. It is written
// before anything else, so that a crash at any later point leaves it behind.
func MarkUnsynced(dir string) error {
	if err := os.WriteFile(filepath.Join(dir, unsyncedMarker), nil, 0o644); err != nil {
		return fmt.Errorf("mark policy directory unsynced: %w", err)
	}
	return nil
}

// MarkSynced removes the mark MarkUnsynced left: dir now holds what the
// source holds.
func MarkSynced(dir string) error {
	err := os.Remove(filepath.Join(dir, unsyncedMarker))
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("mark policy directory synced: %w", err)
	}
	return nil
}

// Synced reports whether dir's documents can be trusted: true for a plain
// directory of files, false while a mirror has not finished its first sync.
func Synced(dir string) (bool, error) {
	_, err := os.Lstat(filepath.Join(dir, unsyncedMarker))
	switch {
	case err == nil:
		return false, nil
	case errors.Is(err, fs.ErrNotExist):
		return true, nil
	}
	return false, fmt.Errorf("policy directory: %w", err)
}
