// Package policywatch tells when a policy directory has changed and every
// file in it is whole: written and closed by its writer, or renamed into
// place. It follows the directory with inotify (Linux), so that a file
// being written, however slowly, is not read until its writer closes it,
// and a ConfigMap volume's "..data" symlink swap counts as one change.
// The sweeper follows the CNI directories the same way (NewMatching).
package policywatch

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/podfence/podfence/pkg/policy"
)

// DefaultQuiet is how long the directory must stay unchanged before a
// change is reported: an editor's rename-write or a `kubectl cp` is a burst
// of events, and the policy is loaded once for it.
const DefaultQuiet = 50 * time.Millisecond

// Watcher reports changes of one directory on C.
type Watcher struct {
	// C receives a value after each settled change (coalesced: one value
	// may stand for several changes).
	C <-chan struct{}

	f         *os.File
	c         chan struct{}
	quiet     time.Duration
	match     func(name string) bool
	done      chan struct{}
	wg        sync.WaitGroup
	closeOnce sync.Once

	// Failed is closed when the watcher stops before Close; Err says why.
	Failed <-chan struct{}
	failed chan struct{}
	mu     sync.Mutex
	err    error
}

// The events that change what LoadDir reads. IN_MODIFY marks a file as
// being written; IN_CLOSE_WRITE ends that.
const watchMask = unix.IN_CLOSE_WRITE | unix.IN_MODIFY | unix.IN_MOVED_TO | unix.IN_MOVED_FROM |
	unix.IN_CREATE | unix.IN_DELETE | unix.IN_DELETE_SELF | unix.IN_MOVE_SELF | unix.IN_ATTRIB

// New watches dir, which must exist. quiet of 0 is DefaultQuiet.
func New(dir string, quiet time.Duration) (*Watcher, error) {
	return NewMatching(dir, quiet, policy.IsDocumentFile)
}

// NewMatching watches dir, where the files match accepts are the ones
// read after a change: a change is held back while one of them is being
// written. Any other event in dir (a temporary file renamed away, a
// ConfigMap's "..data" swap) is a change too.
func NewMatching(dir string, quiet time.Duration, match func(name string) bool) (*Watcher, error) {
	if quiet == 0 {
		quiet = DefaultQuiet
	}
	fd, err := unix.InotifyInit1(unix.IN_CLOEXEC | unix.IN_NONBLOCK)
	if err != nil {
		return nil, fmt.Errorf("watch %s: %w", dir, err)
	}
	if _, err := unix.InotifyAddWatch(fd, dir, watchMask); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("watch %s: %w", dir, err)
	}
	c := make(chan struct{}, 1)
	failed := make(chan struct{})
	w := &Watcher{C: c, c: c, f: os.NewFile(uintptr(fd), "inotify"), quiet: quiet, match: match, done: make(chan struct{}),
		Failed: failed, failed: failed}
	w.wg.Add(1)
	go w.run()
	return w, nil
}

// Close stops the watcher; C receives nothing after it returns. Closing
// again does nothing.
func (w *Watcher) Close() error {
	var err error
	w.closeOnce.Do(func() {
		close(w.done)
		err = w.f.Close() // ends the blocked read
		w.wg.Wait()
	})
	return err
}

// Err is why the watcher stopped before Close, if it did (the directory
// was removed or moved, or inotify failed).
func (w *Watcher) Err() error {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.err
}

func (w *Watcher) fail(err error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.err == nil {
		w.err = err
		close(w.failed)
	}
}

type event struct {
	name string
	mask uint32
}

func (w *Watcher) run() {
	defer w.wg.Done()
	events := make(chan event, 64)
	go w.read(events)

	writing := map[string]bool{} // files modified and not yet closed
	changed := false
	timer := time.NewTimer(time.Hour)
	timer.Stop()
	for {
		select {
		case <-w.done:
			return
		case ev, ok := <-events:
			if !ok {
				return
			}
			switch {
			case !w.match(ev.name):
				// Editors' temporary files, a ConfigMap's "..data"
				// swap: a change, but only the files the reader reads
				// can hold one back.
			case ev.mask&unix.IN_MODIFY != 0:
				writing[ev.name] = true
			case ev.mask&unix.IN_CLOSE_WRITE != 0:
				delete(writing, ev.name)
			case ev.mask&(unix.IN_DELETE|unix.IN_MOVED_FROM) != 0:
				delete(writing, ev.name) // gone: its writer's result no longer counts
			}
			changed = true
			timer.Reset(w.quiet)
		case <-timer.C:
			if changed && len(writing) == 0 {
				changed = false
				select {
				case w.c <- struct{}{}:
				default:
				}
			}
		}
	}
}

// read decodes inotify events until the descriptor is closed.
func (w *Watcher) read(out chan<- event) {
	defer close(out)
	rc, err := w.f.SyscallConn()
	if err != nil {
		w.fail(err)
		return
	}
	buf := make([]byte, 64<<10)
	for {
		var n int
		var rerr error
		err := rc.Read(func(fd uintptr) bool {
			n, rerr = unix.Read(int(fd), buf)
			return rerr != unix.EAGAIN
		})
		if err != nil {
			return // closed
		}
		if rerr != nil {
			w.fail(fmt.Errorf("read inotify events: %w", rerr))
			return
		}
		for b := buf[:n]; len(b) >= unix.SizeofInotifyEvent; {
			raw := (*unix.InotifyEvent)(unsafe.Pointer(&b[0]))
			end := unix.SizeofInotifyEvent + int(raw.Len)
			if end > len(b) {
				break
			}
			name := string(trimNul(b[unix.SizeofInotifyEvent:end]))
			b = b[end:]
			if raw.Mask&(unix.IN_DELETE_SELF|unix.IN_MOVE_SELF|unix.IN_IGNORED) != 0 {
				w.fail(errors.New("the directory was removed or moved"))
				return
			}
			select {
			case out <- event{filepath.Base(name), raw.Mask}:
			case <-w.done:
				return
			}
		}
	}
}

func trimNul(b []byte) []byte {
	for i, c := range b {
		if c == 0 {
			return b[:i]
		}
	}
	return b
}
