package policywatch

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"sync"
	"time"

	"github.com/podfence/podfence/pkg/policy"
)

// Change is what a Follower saw of a policy directory.
type Change uint8

const (
	// FilesChanged: the directory's document files changed.
	FilesChanged Change = iota + 1
	// ClusterChanged: its cluster subdirectory's files changed.
	ClusterChanged
	// WatchedAgain: the directory's watch failed (the directory was
	// removed, say) and it is followed again, made anew if missing;
	// changes meanwhile were not seen.
	WatchedAgain
	// ClusterGone: the cluster subdirectory was removed; it is followed
	// again once it is back, which a ClusterChanged then reports.
	ClusterGone
)

func (c Change) String() string {
	switch c {
	case FilesChanged:
		return "policy files changed"
	case ClusterChanged:
		return "cluster policy files changed"
	case WatchedAgain:
		return "policy directory watched again"
	case ClusterGone:
		return "cluster policy directory gone"
	}
	return fmt.Sprintf("change(%d)", uint8(c))
}

// Event is one Change, with the error that caused it, if any (why a watch
// failed), and Problem, an error the follower met and went on past (the
// cluster subdirectory cannot be followed: its files are read at the
// directory's next change).
type Event struct {
	Change  Change
	Err     error
	Problem error
}

// Follower follows a policy directory and its cluster subdirectory
// (policy.ClusterDir), each with a Watcher of its own: inotify follows one
// directory. It makes both at the start, follows the directory again when
// its watch fails, and the subdirectory again when it is back after a
// removal.
type Follower struct {
	// C receives each change as it settles.
	C <-chan Event

	dir, clusterDir string
	quiet           time.Duration
	c               chan Event
	done            chan struct{}
	wg              sync.WaitGroup
	closeOnce       sync.Once
}

// Follow makes dir and its cluster subdirectory when they are missing and
// follows them; quiet is as New's.
func Follow(dir string, quiet time.Duration) (*Follower, error) {
	f := &Follower{dir: dir, clusterDir: filepath.Join(dir, policy.ClusterDir), quiet: quiet,
		c: make(chan Event), done: make(chan struct{})}
	f.C = f.c
	if err := os.MkdirAll(f.clusterDir, 0o755); err != nil {
		return nil, fmt.Errorf("cluster policy directory: %w", err)
	}
	pw, err := f.watchDir()
	if err != nil {
		return nil, err
	}
	f.wg.Add(1)
	go f.run(pw)
	return f, nil
}

// Close stops following; C receives nothing after it returns.
func (f *Follower) Close() {
	f.closeOnce.Do(func() {
		close(f.done)
		f.wg.Wait()
	})
}

// watchDir watches the policy directory, made if it was removed (no
// documents).
func (f *Follower) watchDir() (*Watcher, error) {
	if err := os.MkdirAll(f.dir, 0o755); err != nil {
		return nil, fmt.Errorf("policy directory: %w", err)
	}
	return New(f.dir, f.quiet)
}

func (f *Follower) send(e Event) bool {
	select {
	case f.c <- e:
		return true
	case <-f.done:
		return false
	}
}

func (f *Follower) run(pw *Watcher) {
	defer f.wg.Done()
	var cw *Watcher
	defer func() {
		pw.Close()
		if cw != nil {
			cw.Close()
		}
	}()
	started := false
	for {
		if cw == nil {
			w, err := New(f.clusterDir, f.quiet)
			switch {
			case errors.Is(err, fs.ErrNotExist):
			case err != nil:
				if !f.send(Event{Problem: err}) {
					return
				}
			default:
				cw = w
				// Files written into it before the watch began are
				// read now (at the start, the caller reads them all).
				if started && !f.send(Event{Change: ClusterChanged}) {
					return
				}
			}
		}
		started = true
		var clusterChanged, clusterFailed <-chan struct{} // nil: never ready
		if cw != nil {
			clusterChanged, clusterFailed = cw.C, cw.Failed
		}
		var e Event
		select {
		case <-f.done:
			return
		case <-pw.C:
			e.Change = FilesChanged
		case <-clusterChanged:
			e.Change = ClusterChanged
		case <-pw.Failed:
			e.Change, e.Err = WatchedAgain, pw.Err()
			pw.Close()
			for {
				w, err := f.watchDir()
				if err == nil {
					pw = w
					break
				}
				// The directory cannot be made (its parent went, say):
				// tried again each second, the failure reported.
				if !f.send(Event{Problem: err}) {
					return
				}
				select {
				case <-f.done:
					return
				case <-time.After(time.Second):
				}
			}
		case <-clusterFailed:
			e.Change, e.Err = ClusterGone, cw.Err()
			cw.Close()
			cw = nil
		}
		if !f.send(e) {
			return
		}
	}
}
