package membership

import (
	"bufio"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/podfence/podfence/bpf"
	"github.com/podfence/podfence/pkg/pinpath"
	"github.com/podfence/podfence/pkg/podid"
	"github.com/podfence/podfence/test/kernel"
)

const testID podid.ID = "web-7f65cc6544@default"

func member(container string) Member {
	return Member{
		ContainerID: container, IfName: "eth0", HostVeth: "veth-" + container, HostIfindex: 7,
		AttachMode: "tcx", IPs: prefixes("10.88.0.5/32", "fd00::5/128"),
	}
}

func lock(t *testing.T, s *Store, id podid.ID) *Lock {
	t.Helper()
	l, err := s.LockOrCreate(id)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Unlock() })
	return l
}

func inode(t *testing.T, path string) uint64 {
	t.Helper()
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		t.Fatal(err)
	}
	return st.Ino
}

func TestLockWithoutCreate(t *testing.T) {
	s := New(kernel.PinRoot(t))
	_, err := s.Lock(testID)
	if !errors.Is(err, ErrNoIdentifier) || !strings.Contains(err.Error(), string(testID)) {
		t.Fatalf("Lock without create on a missing identifier: %v, want ErrNoIdentifier naming it", err)
	}
	if _, err := os.Lstat(pinpath.Root(s.Root()).Identifier(testID)); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("Lock without create made the directory: %v", err)
	}

	l, err := s.LockOrCreate(testID)
	if err != nil {
		t.Fatal(err)
	}
	if l.Dir() != pinpath.Root(s.Root()).Identifier(testID) || l.ID != testID {
		t.Errorf("lock of %q in %s", l.ID, l.Dir())
	}
	if fi, err := os.Stat(l.Dir()); err != nil || !fi.IsDir() {
		t.Errorf("Lock with create: %v", err)
	}
	l.Unlock()
	l, err = s.Lock(testID)
	if err != nil {
		t.Fatalf("Lock without create on an existing identifier: %v", err)
	}
	l.Unlock()

	for _, bad := range []podid.ID{"", "../x@y", "a/b@c", "a.b@c", "no-at-sign"} {
		if _, err := s.LockOrCreate(bad); !errors.Is(err, podid.ErrInvalid) {
			t.Errorf("Lock(%q): %v, want podid.ErrInvalid", bad, err)
		}
	}
	if ids, _ := s.Identifiers(); len(ids) != 1 {
		t.Errorf("identifiers %v, want only %s", ids, testID)
	}
}

// waitBlocked waits until some process waits in flock for the inode (a
// "->" line of /proc/locks), so that a test knows a waiter is in place.
func waitBlocked(t *testing.T, ino uint64) {
	t.Helper()
	suffix := ":" + strconv.FormatUint(ino, 10)
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		f, err := os.Open("/proc/locks")
		if err != nil {
			t.Fatal(err)
		}
		sc := bufio.NewScanner(f)
		for sc.Scan() {
			fields := strings.Fields(sc.Text())
			// 1: -> FLOCK  ADVISORY  WRITE 1234 00:25:5678 0 EOF
			if len(fields) >= 7 && fields[1] == "->" && fields[2] == "FLOCK" && strings.HasSuffix(fields[6], suffix) {
				f.Close()
				return
			}
		}
		f.Close()
		time.Sleep(time.Millisecond)
	}
	t.Fatalf("no flock waiter on inode %d appeared", ino)
}

type lockResult struct {
	l   *Lock
	err error
}

func lockAsync(s *Store, id podid.ID, create bool) <-chan lockResult {
	ch := make(chan lockResult, 1)
	go func() {
		l, err := s.lock(id, create)
		ch <- lockResult{l, err}
	}()
	return ch
}

// TestLockWaiterRelocksRemovedDirectory: the holder removes the identifier
// (its last member went) while another caller waits for its lock; the
// waiter must not come back holding the removed directory, which a third
// caller would lock independently.
func TestLockWaiterRelocksRemovedDirectory(t *testing.T) {
	s := New(kernel.PinRoot(t))
	holder, err := s.LockOrCreate(testID)
	if err != nil {
		t.Fatal(err)
	}
	old := inode(t, holder.Dir())
	waiter := lockAsync(s, testID, true)
	waitBlocked(t, old)

	if err := bpf.RemoveIdentifier(pinpath.Root(s.Root()).Identifier(testID)); err != nil {
		t.Fatal(err)
	}
	holder.Unlock()
	var r lockResult
	select {
	case r = <-waiter:
	case <-time.After(10 * time.Second):
		t.Fatal("the waiter did not get the lock")
	}
	if r.err != nil {
		t.Fatal(r.err)
	}
	defer r.l.Unlock()
	if fi, err := os.Stat(r.l.Dir()); err != nil || !fi.IsDir() {
		t.Fatalf("the waiter holds %s, which does not exist: %v", r.l.Dir(), err)
	}
	var held unix.Stat_t
	if err := unix.Fstat(int(r.l.f.Fd()), &held); err != nil {
		t.Fatal(err)
	}
	if now := inode(t, r.l.Dir()); held.Ino != now || now == old {
		t.Fatalf("the waiter holds inode %d; the directory is inode %d, the removed one was %d", held.Ino, now, old)
	}

	// It holds the lock that counts: a third caller waits for it.
	third := lockAsync(s, testID, true)
	waitBlocked(t, held.Ino)
	select {
	case r := <-third:
		t.Fatalf("a second holder of the recreated identifier: %v", r.err)
	default:
	}
	r.l.Unlock()
	select {
	case r := <-third:
		if r.err != nil {
			t.Fatal(r.err)
		}
		r.l.Unlock()
	case <-time.After(10 * time.Second):
		t.Fatal("the third caller did not get the lock")
	}
}

// TestLockWaiterWithoutCreate: a waiter that does not create (DEL, GC)
// finds the identifier gone once the holder removed it.
func TestLockWaiterWithoutCreate(t *testing.T) {
	s := New(kernel.PinRoot(t))
	holder, err := s.LockOrCreate(testID)
	if err != nil {
		t.Fatal(err)
	}
	waiter := lockAsync(s, testID, false)
	waitBlocked(t, inode(t, holder.Dir()))
	if err := bpf.RemoveIdentifier(pinpath.Root(s.Root()).Identifier(testID)); err != nil {
		t.Fatal(err)
	}
	holder.Unlock()
	select {
	case r := <-waiter:
		if !errors.Is(r.err, ErrNoIdentifier) {
			if r.l != nil {
				r.l.Unlock()
			}
			t.Fatalf("waiter: %v, want ErrNoIdentifier", r.err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the waiter did not return")
	}
	if _, err := os.Lstat(pinpath.Root(s.Root()).Identifier(testID)); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("a waiter without create recreated the identifier: %v", err)
	}
}

// holdAndCheck is one lock holder's critical section: it claims a marker
// outside the identifier's directory (so that holders of different
// incarnations of the directory would collide too), and sometimes plays the
// last member's DEL and removes the identifier.
//
// Removing the identifier's directory releases its lock (the next Lock makes
// a new one), so it is the last thing a holder does, as in the CNI plugin;
// the marker goes before it.
func holdAndCheck(s *Store, id podid.ID, rng *rand.Rand, container string) error {
	l, err := s.LockOrCreate(id)
	if err != nil {
		return err
	}
	defer l.Unlock()
	marker := filepath.Join(s.Root(), "holder")
	if err := os.Mkdir(marker, 0o700); err != nil {
		return fmt.Errorf("two holders of %s at once: %w", id, err)
	}
	var held, now unix.Stat_t
	if err := unix.Fstat(int(l.f.Fd()), &held); err != nil {
		return err
	}
	if err := unix.Stat(l.Dir(), &now); err != nil || now.Ino != held.Ino {
		return fmt.Errorf("holding inode %d, not the directory %s (inode %d, %v)", held.Ino, l.Dir(), now.Ino, err)
	}
	m := member(container)
	if err := l.Put(m); err != nil {
		return err
	}
	time.Sleep(time.Duration(rng.IntN(200)) * time.Microsecond)
	if rng.IntN(3) == 0 {
		if err := os.Remove(marker); err != nil {
			return err
		}
		return bpf.RemoveIdentifier(pinpath.Root(s.Root()).Identifier(id))
	}
	if err := l.Remove(m.Key()); err != nil {
		return err
	}
	return os.Remove(marker)
}

const (
	helperEnvRoot = "PODFENCE_LOCK_HELPER_ROOT"
	helperEnvN    = "PODFENCE_LOCK_HELPER_N"
)

// TestLockHelperProcess is not a test: TestLockExclusiveAcrossProcesses
// runs the test binary with it to get more processes contending for a lock.
func TestLockHelperProcess(t *testing.T) {
	root := os.Getenv(helperEnvRoot)
	if root == "" {
		return
	}
	n, _ := strconv.Atoi(os.Getenv(helperEnvN))
	s := New(root)
	rng := rand.New(rand.NewPCG(uint64(os.Getpid()), uint64(time.Now().UnixNano())))
	for i := 0; i < n; i++ {
		if err := holdAndCheck(s, testID, rng, fmt.Sprintf("p%d", os.Getpid())); err != nil {
			fmt.Fprintf(os.Stderr, "iteration %d: %v\n", i, err)
			os.Exit(3)
		}
	}
}

func TestLockExclusiveAcrossProcesses(t *testing.T) {
	root := kernel.PinRoot(t)
	const procs, iterations = 4, 150
	var wg sync.WaitGroup
	errs := make([]error, procs)
	outs := make([][]byte, procs)
	for i := range procs {
		cmd := exec.Command(os.Args[0], "-test.run=^TestLockHelperProcess$", "-test.count=1")
		cmd.Env = append(os.Environ(), helperEnvRoot+"="+root, helperEnvN+"="+strconv.Itoa(iterations))
		wg.Add(1)
		go func() {
			defer wg.Done()
			outs[i], errs[i] = cmd.CombinedOutput()
		}()
	}
	// This process contends too, from goroutines with their own
	// descriptors (flock conflicts between open files, not processes).
	var failed atomic.Pointer[error]
	for g := range 2 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			s := New(root)
			rng := rand.New(rand.NewPCG(uint64(g), 1))
			for range iterations {
				if err := holdAndCheck(s, testID, rng, fmt.Sprintf("g%d", g)); err != nil {
					failed.Store(&err)
					return
				}
			}
		}()
	}
	wg.Wait()
	for i := range procs {
		if errs[i] != nil {
			t.Errorf("helper %d: %v\n%s", i, errs[i], outs[i])
		}
	}
	if err := failed.Load(); err != nil {
		t.Error(*err)
	}
}

func TestPutReplacesAtomically(t *testing.T) {
	s := New(kernel.PinRoot(t))
	l := lock(t, s, testID)
	m := member("c1")
	if _, err := l.Member(m.Key()); !errors.Is(err, ErrNotMember) {
		t.Fatalf("Member before Put: %v, want ErrNotMember", err)
	}
	if err := l.Put(m); err != nil {
		t.Fatal(err)
	}
	// A plugin killed between writing and renaming left a temporary.
	if err := os.Symlink("v=1&junk", filepath.Join(l.MemberDir(m.Key()), pinpath.RecordTemp)); err != nil {
		t.Fatal(err)
	}
	m2 := m
	m2.HostVeth, m2.HostIfindex, m2.AttachMode = "veth-other", 9, "tc"
	if err := l.Put(m2); err != nil {
		t.Fatal(err)
	}
	got, err := l.Member(m.Key())
	if err != nil {
		t.Fatal(err)
	}
	if got.HostVeth != "veth-other" || got.HostIfindex != 9 || got.AttachMode != "tc" || len(got.IPs) != 2 {
		t.Errorf("record not replaced: %+v", got)
	}
	entries, err := os.ReadDir(l.MemberDir(m.Key()))
	if err != nil {
		t.Fatal(err)
	}
	if len(entries) != 1 || entries[0].Name() != pinpath.Record {
		var names []string
		for _, e := range entries {
			names = append(names, e.Name())
		}
		t.Errorf("member directory holds %v, want only %s", names, pinpath.Record)
	}

	// Readers never see the record missing or half-written while it is
	// replaced.
	stop := make(chan struct{})
	var readErr atomic.Pointer[error]
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			select {
			case <-stop:
				return
			default:
			}
			if _, err := l.Member(m.Key()); err != nil {
				readErr.Store(&err)
				return
			}
		}
	}()
	for i := range 500 {
		m2.HostIfindex = i + 1
		if err := l.Put(m2); err != nil {
			t.Error(err)
			break
		}
	}
	close(stop)
	wg.Wait()
	if err := readErr.Load(); err != nil {
		t.Errorf("a reader saw: %v", *err)
	}
}

// TestPutDottedContainerID: the CNI spec allows '.' in container IDs, and
// bpffs refuses it in names.
func TestPutDottedContainerID(t *testing.T) {
	s := New(kernel.PinRoot(t))
	l := lock(t, s, testID)
	for _, m := range []Member{member("pod.1"), {ContainerID: "c2", IfName: "eth0.100"}, {ContainerID: "c3", IfName: "a%b"}} {
		if err := l.Put(m); err != nil {
			t.Errorf("Put %s/%s: %v", m.ContainerID, m.IfName, err)
			continue
		}
		got, err := l.Member(Key(m.ContainerID, m.IfName))
		if err != nil || got.ContainerID != m.ContainerID || got.IfName != m.IfName {
			t.Errorf("Member %s/%s: %+v, %v", m.ContainerID, m.IfName, got, err)
		}
		if id, err := s.FindContainer(m.ContainerID, m.IfName); err != nil || id != testID {
			t.Errorf("FindContainer %s/%s: %q, %v", m.ContainerID, m.IfName, id, err)
		}
	}
}

func TestMembers(t *testing.T) {
	s := New(kernel.PinRoot(t))
	l := lock(t, s, testID)
	if ms, err := l.Members(); err != nil || len(ms) != 0 {
		t.Fatalf("members of a fresh identifier: %v, %v", ms, err)
	}
	for _, c := range []string{"c3", "c1", "c2"} {
		if err := l.Put(member(c)); err != nil {
			t.Fatal(err)
		}
	}
	// A plugin died after making a member's directory, before its record.
	if err := os.MkdirAll(l.MemberDir(Key("c0", "eth0")), 0o700); err != nil {
		t.Fatal(err)
	}
	ms, err := l.Members()
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, m := range ms {
		got = append(got, m.ContainerID)
	}
	if strings.Join(got, ",") != "c1,c2,c3" {
		t.Errorf("members %v, want c1,c2,c3 (sorted, without the record-less c0)", got)
	}
	if ms[0].HostVeth != "veth-c1" || len(ms[0].IPs) != 2 {
		t.Errorf("member c1 read back as %+v", ms[0])
	}

	if err := l.Remove(Key("c2", "eth0")); err != nil {
		t.Fatal(err)
	}
	if err := l.Remove(Key("c2", "eth0")); err != nil {
		t.Errorf("removing a missing member: %v", err)
	}
	// Remove takes the member's link pins with it.
	if err := os.Mkdir(filepath.Join(l.MemberDir(Key("c3", "eth0")), pinpath.LinkIngress), 0o700); err != nil {
		t.Fatal(err)
	}
	if err := l.Remove(Key("c3", "eth0")); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Lstat(l.MemberDir(Key("c3", "eth0"))); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("member directory left: %v", err)
	}

	// A record that cannot be read is an error naming it, never skipped.
	bad := Key("c9", "eth0")
	if err := os.MkdirAll(l.MemberDir(bad), 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink("v=7&container=c9", filepath.Join(l.MemberDir(bad), pinpath.Record)); err != nil {
		t.Fatal(err)
	}
	if _, err := l.Members(); !errors.Is(err, ErrCorruptRecord) || !strings.Contains(err.Error(), bad) {
		t.Errorf("Members with a corrupt record: %v, want ErrCorruptRecord naming %s", err, bad)
	}
	if _, err := l.Member(bad); !errors.Is(err, ErrCorruptRecord) {
		t.Errorf("Member of a corrupt record: %v", err)
	}
	// Scan lists it apart, and it keeps the identifier in use.
	if sc, err := l.Scan(); err != nil || !slices.Equal(sc.Unreadable, []string{bad}) || !sc.InUse() {
		t.Errorf("Scan with a corrupt record: %+v, %v; want it unreadable and in use", sc, err)
	}
	// A record that is not a symlink is not readable either.
	if err := os.Remove(filepath.Join(l.MemberDir(bad), pinpath.Record)); err != nil {
		t.Fatal(err)
	}
	if err := os.Mkdir(filepath.Join(l.MemberDir(bad), pinpath.Record), 0o700); err != nil {
		t.Fatal(err)
	}
	if _, err := l.Members(); err == nil || errors.Is(err, ErrNotMember) {
		t.Errorf("Members with a directory as a record: %v, want an error", err)
	}
}

func TestIdentifiersAndFindContainer(t *testing.T) {
	s := New(kernel.PinRoot(t))
	if ids, err := s.Identifiers(); err != nil || len(ids) != 0 {
		t.Fatalf("identifiers of an empty pin root: %v, %v", ids, err)
	}
	if _, err := s.FindContainer("c1", "eth0"); !errors.Is(err, ErrNotMember) {
		t.Fatalf("FindContainer in an empty pin root: %v", err)
	}
	other := podid.ID("db-0@prod")
	for _, x := range []struct {
		id        podid.ID
		container string
	}{{testID, "c1"}, {testID, "c2"}, {other, "c3"}} {
		l, err := s.LockOrCreate(x.id)
		if err != nil {
			t.Fatal(err)
		}
		if err := l.Put(member(x.container)); err != nil {
			t.Fatal(err)
		}
		l.Unlock()
	}
	// Not identifiers: podfence's other directories, and names that podid
	// never builds.
	for _, d := range []string{pinpath.GlobalDir, filepath.Join(pinpath.IdentifiersDir, "not-an-identifier")} {
		if err := os.MkdirAll(filepath.Join(s.Root(), d), 0o700); err != nil {
			t.Fatal(err)
		}
	}
	ids, err := s.Identifiers()
	if err != nil {
		t.Fatal(err)
	}
	if len(ids) != 2 {
		t.Errorf("identifiers %v, want %s and %s", ids, testID, other)
	}
	for _, c := range []struct {
		container, ifname string
		want              podid.ID
	}{{"c1", "eth0", testID}, {"c2", "eth0", testID}, {"c3", "eth0", other}} {
		if id, err := s.FindContainer(c.container, c.ifname); err != nil || id != c.want {
			t.Errorf("FindContainer(%s, %s) = %q, %v; want %q", c.container, c.ifname, id, err, c.want)
		}
	}
	for _, c := range [][2]string{{"c1", "eth1"}, {"c4", "eth0"}, {"c", "1@eth0"}} {
		if id, err := s.FindContainer(c[0], c[1]); !errors.Is(err, ErrNotMember) || !strings.Contains(err.Error(), c[0]) {
			t.Errorf("FindContainer(%s, %s) = %q, %v; want ErrNotMember naming the container", c[0], c[1], id, err)
		}
	}
}
