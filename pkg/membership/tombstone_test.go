package membership

import (
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/podfence/podfence/pkg/pinpath"
)

// TestTombstones: a DEL's tombstone is seen under any identifier's lock,
// kept with its first time when put again, removed by a runtime's ADD, and
// expired by age; a pin root that does not exist gets none. Tombstones are
// symlinks, so a plain directory serves as the pin root.
func TestTombstones(t *testing.T) {
	root := t.TempDir()
	s := New(root)
	t0 := time.Unix(1_800_000_000, 0)
	a, b, c := Key("ctr-a", "eth0"), Key("ctr-b", "eth0"), Key("ctr-c", "eth0")
	for _, k := range []struct {
		key string
		at  time.Time
	}{{a, t0}, {b, t0.Add(time.Minute)}, {a, t0.Add(time.Hour)}, {c, t0.Add(2 * time.Minute)}} {
		if err := s.PutTombstone(k.key, k.at); err != nil {
			t.Fatalf("PutTombstone(%s): %v", k.key, err)
		}
	}
	l := lock(t, s, testID)
	for key, want := range map[string]bool{a: true, b: true, c: true, Key("ctr-d", "eth0"): false} {
		if got, err := l.HasTombstone(key); err != nil || got != want {
			t.Errorf("HasTombstone(%s) = %v, %v; want %v", key, got, err, want)
		}
	}
	if err := l.RemoveTombstone(c); err != nil {
		t.Fatal(err)
	}
	if err := l.RemoveTombstone(c); err != nil {
		t.Errorf("RemoveTombstone of a missing one: %v", err)
	}
	// One whose time cannot be read goes with the expired ones.
	if err := os.Symlink("garbage", filepath.Join(pinpath.Root(root).Tombstones(), Key("ctr-e", "eth0"))); err != nil {
		t.Fatal(err)
	}
	// a was put first at t0 (the second put kept that time): it expires
	// at t0+30s, b does not.
	n, err := s.ExpireTombstones(t0.Add(30 * time.Second))
	if err != nil || n != 2 {
		t.Errorf("ExpireTombstones = %d, %v; want 2", n, err)
	}
	entries, err := os.ReadDir(pinpath.Root(root).Tombstones())
	if err != nil {
		t.Fatal(err)
	}
	var left []string
	for _, e := range entries {
		left = append(left, e.Name())
	}
	if !slices.Equal(left, []string{b}) {
		t.Errorf("tombstones left %v, want [%s]", left, b)
	}

	missing := New(filepath.Join(t.TempDir(), "no-such-root"))
	if err := missing.PutTombstone(a, t0); err != nil {
		t.Errorf("PutTombstone without a pin root: %v", err)
	}
	if _, err := os.Stat(missing.Root()); !os.IsNotExist(err) {
		t.Errorf("PutTombstone made the pin root: %v", err)
	}
}
