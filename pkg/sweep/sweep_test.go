package sweep

import (
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/podfence/podfence/bpf"
	"github.com/podfence/podfence/pkg/liveness"
	"github.com/podfence/podfence/test/netnsutil"
)

// TestPassKeepsReusedTuple: a connection closes, its kernel flow goes, and
// a new connection on the same tuple starts while a pass runs, after the
// pass read the kernel table and before it reads the entry. The datapath
// rewrote the entry's last_seen for the new connection's first packet, so
// the pass keeps it although the table it read has no flow for it.
func TestPassKeepsReusedTuple(t *testing.T) {
	root, pair, g := newNode(t, bpf.GlobalOptions{})

	reused := bpf.CTKeyV4{Src: [4]byte{10, 64, 0, 1}, Dst: [4]byte{10, 200, 0, 1}, Ifindex: uint32(pair.HostIndex), Sport: 40000, Dport: 80, Proto: unix.IPPROTO_TCP}
	closed := reused
	closed.Sport = 40001
	for _, k := range []bpf.CTKeyV4{reused, closed} {
		if err := g.CTv4.Put(&k, &bpf.CTValue{LastSeenNs: 1}); err != nil {
			t.Fatal(err)
		}
	}

	var s *Sweeper
	var rep Report
	netnsutil.Do(t, pair.Node, func() (err error) {
		s, err = New(root, Options{Grace: time.Nanosecond, Record: true, afterKernelRead: func() {
			// The new connection's first packet, as the datapath writes it.
			if err := g.CTv4.Put(&reused, &bpf.CTValue{LastSeenNs: uint64(Monotonic())}); err != nil {
				t.Error(err)
			}
		}})
		if err != nil {
			return err
		}
		defer s.Close()
		rep, err = s.Pass()
		return err
	})
	want := map[uint16]liveness.Reason{40000: liveness.KeptRecent, 40001: liveness.DeletedDead}
	if len(rep.Decisions) != len(want) {
		t.Fatalf("decisions %+v, want one per entry", rep.Decisions)
	}
	for _, d := range rep.Decisions {
		if d.Reason != want[d.Entry.Key.SrcPort] {
			t.Errorf("entry %s: %s, want %s", d.Entry.Key, d.Reason, want[d.Entry.Key.SrcPort])
		}
	}
	var v bpf.CTValue
	if err := g.CTv4.Lookup(&reused, &v); err != nil {
		t.Errorf("the reused tuple's entry was deleted: %v", err)
	}
	if err := g.CTv4.Lookup(&closed, &v); err == nil {
		t.Error("the closed connection's entry is still there")
	}
}
