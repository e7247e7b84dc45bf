package membership

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"time"

	"github.com/podfence/podfence/pkg/pinpath"
)

// A tombstone says that the runtime's DEL of a container interface ran. An
// adoption (package adopt) lists the runtime's ready sandboxes, then runs
// the plugin's ADD for each that has no record; a DEL that runs between the
// two finds nothing to remove, and the ADD would then fence a pod that is
// being torn down, leaving a member whose veth goes a moment later. A DEL
// therefore leaves a tombstone of its key before it takes the identifier's
// lock, and an adoption's ADD looks for one after it has taken it: either
// the ADD holds the lock first, and the DEL then finds and removes its
// member, or the tombstone is there when the ADD looks, and it adds
// nothing. A runtime's own ADD is not an adoption: it removes the
// tombstone instead (a runtime that adds a container again knows it is
// alive).
//
// Keys are container IDs, which a runtime never reuses, so a tombstone is
// needed only as long as an adoption pass may hold a listing made before
// it: the sweeper removes those older than TombstoneTTL, and adoption lists
// the sandboxes again when its listing is older than half of that.

// TombstoneTTL is how long a tombstone is kept.
const TombstoneTTL = 10 * time.Minute

// PutTombstone records that the DEL of key ran at now. A tombstone that is
// there already is kept, with its time. A pin root that does not exist is
// left alone: nothing of podfence's runs on the node, and an adoption
// needs the sweeper, which makes it.
func (s *Store) PutTombstone(key string, now time.Time) error {
	dir := pinpath.Root(s.root).Tombstones()
	if err := os.Mkdir(dir, 0o700); err != nil && !errors.Is(err, fs.ErrExist) {
		if errors.Is(err, fs.ErrNotExist) {
			return nil // no pin root
		}
		return fmt.Errorf("tombstone of %s: %w", key, err)
	}
	// A symlink is created whole or not at all: no temporary name, and
	// two DELs of one key (containerd's stop and removal) agree.
	err := os.Symlink(strconv.FormatInt(now.Unix(), 10), filepath.Join(dir, key))
	if err != nil && !errors.Is(err, fs.ErrExist) {
		return fmt.Errorf("tombstone of %s: %w", key, err)
	}
	return nil
}

// HasTombstone reports whether a DEL of key ran. The caller holds the
// lock of the identifier it would add key to.
func (l *Lock) HasTombstone(key string) (bool, error) {
	_, err := os.Lstat(filepath.Join(pinpath.Root(l.root).Tombstones(), key))
	if errors.Is(err, fs.ErrNotExist) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("tombstone of %s: %w", key, err)
	}
	return true, nil
}

// RemoveTombstone removes key's tombstone, if any: a runtime's ADD of key.
func (l *Lock) RemoveTombstone(key string) error {
	err := os.Remove(filepath.Join(pinpath.Root(l.root).Tombstones(), key))
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("tombstone of %s: %w", key, err)
	}
	return nil
}

// ExpireTombstones removes the tombstones made before before, and those
// whose time cannot be read, and returns how many it removed.
func (s *Store) ExpireTombstones(before time.Time) (int, error) {
	dir := pinpath.Root(s.root).Tombstones()
	entries, err := os.ReadDir(dir)
	if errors.Is(err, fs.ErrNotExist) {
		return 0, nil
	}
	if err != nil {
		return 0, fmt.Errorf("list tombstones: %w", err)
	}
	removed := 0
	var errs []error
	for _, e := range entries {
		path := filepath.Join(dir, e.Name())
		target, err := os.Readlink(path)
		if errors.Is(err, fs.ErrNotExist) {
			continue
		}
		if sec, perr := strconv.ParseInt(target, 10, 64); err == nil && perr == nil && !time.Unix(sec, 0).Before(before) {
			continue
		}
		if err := os.Remove(path); err != nil && !errors.Is(err, fs.ErrNotExist) {
			errs = append(errs, fmt.Errorf("remove tombstone %s: %w", e.Name(), err))
			continue
		}
		removed++
	}
	return removed, errors.Join(errs...)
}
