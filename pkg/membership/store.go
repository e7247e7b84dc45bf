package membership

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"

	"golang.org/x/sys/unix"

	"github.com/podfence/podfence/pkg/pinfs"
	"github.com/podfence/podfence/pkg/pinpath"
	"github.com/podfence/podfence/pkg/podid"
)

var (
	// ErrNoIdentifier is returned by Lock without create when the
	// identifier has no directory: it has no pins and no members.
	ErrNoIdentifier = errors.New("identifier has no state")
	// ErrNotMember is returned when a container interface has no record.
	ErrNotMember = errors.New("not a member")
	// ErrCorruptRecord is wrapped when a member record cannot be decoded.
	ErrCorruptRecord = errors.New("corrupt member record")
)

// Store keeps membership below a pin root, beside the identifiers' pins,
// where package pinpath says: a member's record is a symlink in its
// directory, beside the member's TCX link pins.
type Store struct {
	root string
}

// New returns the store of a pin root.
func New(pinRoot string) *Store { return &Store{root: pinRoot} }

// Root is the pin root.
func (s *Store) Root() string { return s.root }

// Identifiers lists the identifiers that have a directory (pins, members or both).
func (s *Store) Identifiers() ([]podid.ID, error) {
	entries, err := os.ReadDir(pinpath.Root(s.root).Identifiers())
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("list identifiers: %w", err)
	}
	var ids []podid.ID
	for _, e := range entries {
		if e.IsDir() && podid.Valid(e.Name()) {
			ids = append(ids, podid.ID(e.Name()))
		}
	}
	return ids, nil
}

// Lock is an exclusive hold on one identifier: its pins and members change
// only under it, across processes (flock on the identifier's directory).
type Lock struct {
	ID   podid.ID
	root string // the pin root
	dir  string
	f    *os.File
}

// Lock takes the lock of an identifier that exists, waiting for another
// holder; a missing identifier is ErrNoIdentifier. Everything but an ADD
// locks this way: it must not bring back an identifier that was removed.
func (s *Store) Lock(id podid.ID) (*Lock, error) { return s.lock(id, false) }

// LockOrCreate takes the identifier's lock, making its directory when it is
// missing: an ADD's.
func (s *Store) LockOrCreate(id podid.ID) (*Lock, error) { return s.lock(id, true) }

// lock waits for the identifier's flock. The last member's removal deletes
// the directory while its remover holds the lock, so a waiter may wake up
// holding the lock of a directory that is gone. lock therefore checks, once
// it holds the flock, that the path still names the directory it locked,
// and starts again otherwise: two processes never both hold an identifier.
func (s *Store) lock(id podid.ID, create bool) (*Lock, error) {
	if !podid.Valid(string(id)) {
		return nil, fmt.Errorf("lock identifier %q: %w", id, podid.ErrInvalid)
	}
	dir := pinpath.Root(s.root).Identifier(id)
	for {
		if create {
			if err := os.MkdirAll(dir, 0o700); err != nil {
				return nil, fmt.Errorf("lock identifier %q: %w", id, err)
			}
		}
		f, err := os.Open(dir)
		if errors.Is(err, fs.ErrNotExist) {
			if create {
				continue // removed between MkdirAll and Open
			}
			return nil, fmt.Errorf("lock identifier %q: %w", id, ErrNoIdentifier)
		}
		if err != nil {
			return nil, fmt.Errorf("lock identifier %q: %w", id, err)
		}
		if err := pinfs.Flock(f, unix.LOCK_EX); err != nil {
			f.Close()
			return nil, fmt.Errorf("lock identifier %q: %w", id, err)
		}
		same, err := sameFile(f, dir)
		if err != nil {
			f.Close()
			return nil, fmt.Errorf("lock identifier %q: %w", id, err)
		}
		if same {
			return &Lock{ID: id, root: s.root, dir: dir, f: f}, nil
		}
		f.Close() // the directory was removed (and maybe recreated) meanwhile
	}
}

// sameFile reports whether path still names the directory open as f.
func sameFile(f *os.File, path string) (bool, error) {
	var held, now unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &held); err != nil {
		return false, err
	}
	if err := unix.Stat(path, &now); err != nil {
		if errors.Is(err, unix.ENOENT) {
			return false, nil
		}
		return false, err
	}
	return held.Dev == now.Dev && held.Ino == now.Ino, nil
}

// Unlock releases the lock. Closing the descriptor releases the flock, also
// when the process dies.
func (l *Lock) Unlock() error {
	return l.f.Close()
}

// Dir is the identifier's pin directory.
func (l *Lock) Dir() string { return l.dir }

// MemberDir is where a member's record and link pins live.
func (l *Lock) MemberDir(key string) string {
	return filepath.Join(l.dir, pinpath.MembersDir, key)
}

// Members returns the identifier's members sorted by key. A record that
// cannot be read is returned as an error naming it, never skipped: callers
// must not remove the pins of an identifier whose members they cannot see.
func (l *Lock) Members() ([]Member, error) {
	sc, err := l.Scan()
	if err != nil {
		return nil, err
	}
	if len(sc.Unreadable) > 0 {
		_, err := l.Member(sc.Unreadable[0])
		return nil, err
	}
	return sc.Members, nil
}

// Scan is one reading of an identifier's member directories.
type Scan struct {
	Members []Member // the readable records, sorted by key
	// Incomplete are the keys, sorted, of directories without a record: a
	// plugin died while adding the member, before its record was in place,
	// so nothing was attached for it (invariant 1) and Remove may take the
	// directory.
	Incomplete []string
	Unreadable []string // keys of directories whose record is corrupt, sorted
}

// InUse reports whether the identifier has a member, readable or not: its
// pins must stay while it does. A record this version cannot decode (one
// written by another version, say) still belongs to a pod.
func (sc Scan) InUse() bool { return len(sc.Members) > 0 || len(sc.Unreadable) > 0 }

// Scan reads every member directory. A corrupt record is listed in
// Unreadable; any other failure to read one is an error.
func (l *Lock) Scan() (Scan, error) {
	var sc Scan
	entries, err := os.ReadDir(filepath.Join(l.dir, pinpath.MembersDir))
	if errors.Is(err, fs.ErrNotExist) {
		return sc, nil
	}
	if err != nil {
		return sc, fmt.Errorf("list members of %q: %w", l.ID, err)
	}
	for _, e := range entries { // ReadDir sorts by name, which is the key
		m, err := l.Member(e.Name())
		switch {
		case err == nil:
			sc.Members = append(sc.Members, m)
		case errors.Is(err, ErrNotMember):
			sc.Incomplete = append(sc.Incomplete, e.Name())
		case errors.Is(err, ErrCorruptRecord):
			sc.Unreadable = append(sc.Unreadable, e.Name())
		default:
			return Scan{}, err
		}
	}
	return sc, nil
}

// ScanIdentifier is Scan under the identifier's lock, released before it
// returns: for readers that only look. An identifier gone meanwhile (its
// last member left) is ErrNoIdentifier.
func (s *Store) ScanIdentifier(id podid.ID) (Scan, error) {
	lock, err := s.Lock(id)
	if err != nil {
		return Scan{}, err
	}
	defer lock.Unlock()
	return lock.Scan()
}

// Member reads one member's record.
func (l *Lock) Member(key string) (Member, error) {
	target, err := os.Readlink(filepath.Join(l.MemberDir(key), pinpath.Record))
	if errors.Is(err, fs.ErrNotExist) {
		return Member{}, fmt.Errorf("member %s of %q: %w", key, l.ID, ErrNotMember)
	}
	if err != nil {
		return Member{}, fmt.Errorf("member %s of %q: %w", key, l.ID, err)
	}
	var m Member
	if err := m.UnmarshalText([]byte(target)); err != nil {
		return Member{}, fmt.Errorf("member %s of %q: %w", key, l.ID, err)
	}
	return m, nil
}

// Put records m, replacing a previous record of the same key. The record is
// written under a temporary name and renamed, so a reader (or a plugin
// killed midway) never sees half of one.
func (l *Lock) Put(m Member) error {
	dir := l.MemberDir(m.Key())
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return fmt.Errorf("record member %s of %q: %w", m.Key(), l.ID, err)
	}
	text, err := m.MarshalText()
	if err != nil {
		return err
	}
	if err := pinfs.WriteRecord(filepath.Join(dir, pinpath.Record), string(text)); err != nil {
		return fmt.Errorf("record member %s of %q: %w", m.Key(), l.ID, err)
	}
	return nil
}

// Remove deletes a member's record and whatever else is in its directory
// (link pins). The caller detaches first: a record is the only trace of
// where a member's programs are attached. Removing a missing member is not
// an error.
func (l *Lock) Remove(key string) error {
	if err := os.RemoveAll(l.MemberDir(key)); err != nil {
		return fmt.Errorf("remove member %s of %q: %w", key, l.ID, err)
	}
	return nil
}

// FindContainer looks through every identifier for a container interface's
// record. DEL uses it when the identifier cannot be derived from its
// arguments (a runtime that passes Kubernetes arguments to ADD only).
func (s *Store) FindContainer(containerID, ifname string) (podid.ID, error) {
	ids, err := s.Identifiers()
	if err != nil {
		return "", err
	}
	key := Key(containerID, ifname)
	for _, id := range ids {
		path := pinpath.Root(s.root).Member(id, key)
		_, err := os.Lstat(path)
		if err == nil {
			return id, nil
		}
		if !errors.Is(err, fs.ErrNotExist) {
			// Not "no record": the caller must not take it for one.
			return "", fmt.Errorf("container %s interface %s: %w", containerID, ifname, err)
		}
	}
	return "", fmt.Errorf("container %s interface %s: %w", containerID, ifname, ErrNotMember)
}
