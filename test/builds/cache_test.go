package builds

import (
	"os"
	"path/filepath"
	"testing"
	"time"
)

func TestCachedBuildsOnce(t *testing.T) {
	t.Setenv("PODFENCE_CACHE", t.TempDir())
	stale := filepath.Join(cacheDir(t), "previous-0000000000000000")
	if err := os.Mkdir(stale, 0o755); err != nil {
		t.Fatal(err)
	}
	old := time.Now().Add(-cacheAge - time.Hour)
	if err := os.Chtimes(stale, old, old); err != nil {
		t.Fatal(err)
	}
	builds := 0
	build := func(out string) {
		builds++
		if err := os.WriteFile(filepath.Join(out, "podfence"), []byte("binary"), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	key := newKey(t, "test")
	key.add("source")
	first := cached(t, key.String(), build)
	second := cached(t, key.String(), build)
	if builds != 1 || first != second {
		t.Fatalf("built %d times into %s and %s, want once into one directory", builds, first, second)
	}
	if b, err := os.ReadFile(filepath.Join(first, "podfence")); err != nil || string(b) != "binary" {
		t.Fatalf("the entry holds %q (%v), want the build's binary", b, err)
	}
	if _, err := os.Stat(stale); !os.IsNotExist(err) {
		t.Errorf("an entry unused for longer than %v is still there (%v)", cacheAge, err)
	}
	other := newKey(t, "test")
	other.add("other source")
	if other.String() == key.String() {
		t.Errorf("two sources have one key, %s", key)
	}
	entries, _ := os.ReadDir(cacheDir(t))
	for _, e := range entries {
		if e.Name() != key.String() {
			t.Errorf("the cache holds %s besides the entry", e.Name())
		}
	}
}
