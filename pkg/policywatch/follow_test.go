package policywatch

import (
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/podfence/podfence/pkg/policy"
)

// next is the follower's next event, or a failure after within.
func next(t *testing.T, f *Follower, within time.Duration) Event {
	t.Helper()
	select {
	case e := <-f.C:
		return e
	case <-time.After(within):
		t.Fatalf("no event within %v", within)
		return Event{}
	}
}

// none checks that the follower says nothing for a while.
func none(t *testing.T, f *Follower) {
	t.Helper()
	select {
	case e := <-f.C:
		t.Fatalf("unexpected %v (%v, %v)", e.Change, e.Err, e.Problem)
	case <-time.After(5 * quiet):
	}
}

func write(t *testing.T, path string) {
	t.Helper()
	if err := os.WriteFile(path, []byte("a: b\n"), 0o644); err != nil {
		t.Fatal(err)
	}
}

// TestFollow: a follower reports each settled change of the policy
// directory and of its cluster subdirectory once, as what it was; follows
// the subdirectory again once it is back after a removal (a change: files
// may have come with it), and the directory again (made anew) after its
// own removal.
func TestFollow(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "policies")
	f, err := Follow(dir, quiet)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	cluster := filepath.Join(dir, policy.ClusterDir)
	if _, err := os.Stat(cluster); err != nil {
		t.Fatalf("the cluster subdirectory is not made: %v", err)
	}

	steps := []struct {
		name string
		do   func()
		want Change
	}{
		{"a document written", func() { write(t, filepath.Join(dir, "web.yaml")) }, FilesChanged},
		{"a cluster document written", func() { write(t, filepath.Join(cluster, "admin.json")) }, ClusterChanged},
	}
	for _, s := range steps {
		s.do()
		if e := next(t, f, time.Second); e.Change != s.want || e.Problem != nil {
			t.Fatalf("%s: %v (problem %v), want %v", s.name, e.Change, e.Problem, s.want)
		}
	}
	// cluster/ removed: its watch ends, and the directory sees it go, in
	// either order.
	if err := os.RemoveAll(cluster); err != nil {
		t.Fatal(err)
	}
	seen := map[Change]int{}
	for range 2 {
		seen[next(t, f, time.Second).Change]++
	}
	if seen[ClusterGone] != 1 || seen[FilesChanged] != 1 {
		t.Fatalf("cluster/ removed: %v, want one %v and one %v", seen, ClusterGone, FilesChanged)
	}
	none(t, f)

	// Back: the directory's change is seen, then cluster/ is followed
	// again, which is a change of its own (files may be there already).
	if err := os.Mkdir(cluster, 0o755); err != nil {
		t.Fatal(err)
	}
	if e := next(t, f, time.Second); e.Change != FilesChanged {
		t.Fatalf("cluster/ made again: %v, want %v", e.Change, FilesChanged)
	}
	if e := next(t, f, time.Second); e.Change != ClusterChanged {
		t.Fatalf("cluster/ followed again: %v, want %v", e.Change, ClusterChanged)
	}
	write(t, filepath.Join(cluster, "admin.json"))
	if e := next(t, f, time.Second); e.Change != ClusterChanged {
		t.Fatalf("a cluster document after cluster/ came back: %v, want %v", e.Change, ClusterChanged)
	}

	// The directory itself removed: followed again, and made anew.
	if err := os.RemoveAll(dir); err != nil {
		t.Fatal(err)
	}
	for {
		e := next(t, f, time.Second)
		if e.Change == WatchedAgain {
			if e.Err == nil {
				t.Error("WatchedAgain without the watch's error")
			}
			break
		}
		if e.Change != ClusterGone && e.Change != FilesChanged {
			t.Fatalf("while the directory went: %v", e.Change)
		}
	}
	if _, err := os.Stat(dir); err != nil {
		t.Fatalf("the directory is not made anew: %v", err)
	}
	write(t, filepath.Join(dir, "web.yaml"))
	for {
		if e := next(t, f, time.Second); e.Change == FilesChanged {
			break
		}
	}
}
