// Package atomicfile replaces regular files so that a reader sees the old
// content or the new, never a part of either: the data goes to a hidden
// temporary file in the target's directory, which is then renamed over it.
// It is how podfence writes every file others read while it runs: the CNI
// configuration and binary the runtime execs, the mirrored policy files, the
// policy's last good copies, the image archive. (Records and pins in bpffs
// have their own writer, pinfs: bpffs has no regular files to rename.)
package atomicfile

import (
	"fmt"
	"io"
	"os"
	"path/filepath"
)

// tempPattern names the temporary file: hidden, so that directory readers
// that skip dot files (the policy loader, the runtime's conflist scan)
// never take it for a real one.
func tempPattern(path string) string { return "." + filepath.Base(path) + ".tmp-*" }

// Options say how Write leaves the file.
type Options struct {
	// Perm is the mode of a new file (0o644 when zero).
	Perm os.FileMode
	// KeepMode keeps an existing file's mode instead of Perm.
	KeepMode bool
	// Sync flushes the data to disk before the rename, for files that
	// must survive a crash whole (the CNI configuration). Without it a
	// crash may leave the file empty; use it where a later start rewrites
	// the file anyway.
	Sync bool
}

// Write replaces path with data.
func Write(path string, data []byte, opts Options) error {
	return WriteFunc(path, opts, func(w io.Writer) error {
		_, err := w.Write(data)
		return err
	})
}

// WriteFunc replaces path with what write writes. On any error the
// temporary file is removed and path is as it was.
func WriteFunc(path string, opts Options, write func(io.Writer) error) (err error) {
	perm := opts.Perm
	if perm == 0 {
		perm = 0o644
	}
	if opts.KeepMode {
		if fi, err := os.Stat(path); err == nil {
			perm = fi.Mode().Perm()
		}
	}
	f, err := os.CreateTemp(filepath.Dir(path), tempPattern(path))
	if err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	defer func() {
		if err != nil {
			f.Close()
			os.Remove(f.Name())
			err = fmt.Errorf("write %s: %w", path, err)
		}
	}()
	if err := write(f); err != nil {
		return err
	}
	if err := f.Chmod(perm); err != nil {
		return err
	}
	if opts.Sync {
		if err := f.Sync(); err != nil {
			return err
		}
	}
	if err := f.Close(); err != nil {
		return err
	}
	return os.Rename(f.Name(), path)
}
