// Package pinfs writes and locks in bpffs the one way every part of
// podfence does. bpffs holds pins, directories and symlinks, no regular
// files: a record is a symlink whose target is its text. A record or a pin
// is replaced through a temporary name and a rename, so a reader sees the
// old one or the new one, never none; and the directories are locked with
// flock, which every build running on a node at the same time takes in the
// same places and modes.
package pinfs

import (
	"errors"
	"fmt"
	"os"

	"golang.org/x/sys/unix"
)

// TempSuffix ends the temporary name a record or pin is written under
// before the rename that makes it visible. Removers of an identifier's or
// a member's pins remove such names too: a writer killed halfway leaves one.
const TempSuffix = "~new"

// TempName is the temporary name of path.
func TempName(path string) string { return path + TempSuffix }

// Replace makes path name what write puts at path's temporary name, through
// a rename. Writers of path hold its directory's lock exclusively, so one
// temporary name does, and one a killed writer left is removed first; on
// failure the temporary name is removed again.
func Replace(path string, write func(tmp string) error) error {
	tmp := TempName(path)
	_ = os.Remove(tmp)
	if err := write(tmp); err != nil {
		_ = os.Remove(tmp)
		return err
	}
	if err := os.Rename(tmp, path); err != nil {
		_ = os.Remove(tmp)
		return err
	}
	return nil
}

// WriteRecord replaces the record at path with text.
func WriteRecord(path, text string) error {
	return Replace(path, func(tmp string) error { return os.Symlink(text, tmp) })
}

// ReadRecord reads the record at path; ok is false when there is none.
func ReadRecord(path string) (text string, ok bool, err error) {
	text, err = os.Readlink(path)
	if errors.Is(err, os.ErrNotExist) {
		return "", false, nil
	}
	if err != nil {
		return "", false, err
	}
	return text, true, nil
}

// ReplacePin pins p at path in place of what is pinned there. Programs
// attached from the old pin keep their own reference.
func ReplacePin(path string, p interface{ Pin(string) error }) error {
	return Replace(path, p.Pin)
}

// Flock takes how (unix.LOCK_SH or unix.LOCK_EX) on f, waiting for other
// holders; a signal that interrupts the wait does not end it.
func Flock(f *os.File, how int) error {
	for {
		err := unix.Flock(int(f.Fd()), how)
		if !errors.Is(err, unix.EINTR) {
			return err
		}
	}
}

// LockDir opens dir and takes how on it; closing the file releases it.
func LockDir(dir string, how int) (*os.File, error) {
	f, err := os.Open(dir)
	if err != nil {
		return nil, fmt.Errorf("lock %s: %w", dir, err)
	}
	if err := Flock(f, how); err != nil {
		f.Close()
		return nil, fmt.Errorf("lock %s: %w", dir, err)
	}
	return f, nil
}
