package atomicfile

import (
	"errors"
	"io"
	"os"
	"path/filepath"
	"testing"
)

func TestWrite(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "f.conflist")
	for _, c := range []struct {
		name     string
		before   os.FileMode // 0: no file before
		opts     Options
		wantMode os.FileMode
	}{
		{"new, default mode", 0, Options{}, 0o644},
		{"new, given mode", 0, Options{Perm: 0o755, Sync: true}, 0o755},
		{"existing, mode kept", 0o600, Options{Perm: 0o644, KeepMode: true}, 0o600},
		{"existing, mode replaced", 0o600, Options{Perm: 0o640}, 0o640},
	} {
		t.Run(c.name, func(t *testing.T) {
			os.Remove(path)
			if c.before != 0 {
				if err := os.WriteFile(path, []byte("old"), c.before); err != nil {
					t.Fatal(err)
				}
				os.Chmod(path, c.before) // past the umask
			}
			if err := Write(path, []byte("new"), c.opts); err != nil {
				t.Fatal(err)
			}
			data, err := os.ReadFile(path)
			fi, serr := os.Stat(path)
			if err != nil || serr != nil || string(data) != "new" || fi.Mode().Perm() != c.wantMode {
				t.Errorf("%q %v, mode %v %v; want \"new\" with mode %v", data, err, fi.Mode().Perm(), serr, c.wantMode)
			}
			assertOnly(t, dir, "f.conflist")
		})
	}
}

// TestWriteFailure: a failed write leaves the old file and no temporary.
func TestWriteFailure(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "f")
	if err := os.WriteFile(path, []byte("old"), 0o644); err != nil {
		t.Fatal(err)
	}
	boom := errors.New("boom")
	err := WriteFunc(path, Options{}, func(w io.Writer) error {
		w.Write([]byte("half"))
		return boom
	})
	if !errors.Is(err, boom) {
		t.Fatalf("error %v, want boom", err)
	}
	if data, _ := os.ReadFile(path); string(data) != "old" {
		t.Errorf("file now %q, want the old content", data)
	}
	assertOnly(t, dir, "f")
	// A directory that does not exist: an error naming the path.
	if err := Write(filepath.Join(dir, "no", "f"), nil, Options{}); err == nil {
		t.Error("write into a missing directory succeeded")
	}
}

func assertOnly(t *testing.T, dir, name string) {
	t.Helper()
	entries, err := os.ReadDir(dir)
	if err != nil || len(entries) != 1 || entries[0].Name() != name {
		t.Errorf("directory holds %v (%v), want only %s", entries, err, name)
	}
}
