package bpf

import (
	"sync"
	"sync/atomic"
	"testing"

	"github.com/cilium/ebpf"

	"github.com/podfence/podfence/pkg/policy"
)

// TestApplyPolicyHasNoDenyWindow switches a direction between open and
// isolated with differently shaped rules allowing the peer, over and over,
// while new flows from that peer keep arriving. Every policy allows every
// one of them, so no packet may be dropped at any instant of ApplyPolicy:
// not while a trie is being filled before its direction is closed, nor
// while it is being emptied after its direction is opened, nor while one
// policy's entries (and port sets) give way to another's.
func TestApplyPolicyHasNoDenyWindow(t *testing.T) {
	h := newHarness(t)
	sets := []policy.Set{
		isolate(rules(rule("10.1.0.0/16")), nil),
		{Mode: policy.ModeStandard}, // open
		isolate(rules(except(rule("10.0.0.0/8"), "10.2.0.0/16"), rule("10.1.2.0/24", tcpPort(80))), nil),
		isolate(rules(rule("10.1.2.3/32", tcpPort(80))), rules()),
		// More ranges than an entry holds: port sets, the old one deleted
		// once the new one is in place.
		isolate(rules(rule("10.1.0.0/16", tcpPort(80), tcpPort(443), udpPort(53))), nil),
		isolate(rules(rule("10.0.0.0/8", tcpPort(22), ports(policy.ProtocolTCP, 79, 90), tcpPort(8080))), nil),
	}
	frame := syn(tcp(peer4, pod4, 40000, 80)).Marshal()

	var stop atomic.Bool
	var dropped, runs atomic.Int64
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for !stop.Load() {
			ret, err := h.id.Ingress.Run(&ebpf.RunOptions{Data: frame})
			if err != nil {
				t.Error(err)
				return
			}
			runs.Add(1)
			if ret != VerdictAllow {
				dropped.Add(1)
			}
		}
	}()
	const switches = 400
	for i := 0; i < switches; i++ {
		if err := h.id.ApplyPolicy(sets[i%len(sets)]); err != nil {
			t.Error(err)
			break
		}
	}
	stop.Store(true)
	wg.Wait()
	if runs.Load() == 0 {
		t.Fatal("no packet ran while the policies switched: the test proves nothing")
	}
	if n := dropped.Load(); n > 0 {
		t.Fatalf("%d of %d packets dropped while switching between policies that all allow them", n, runs.Load())
	}
	t.Logf("%d policy switches, %d packets, none dropped", switches, runs.Load())
}
