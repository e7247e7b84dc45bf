package bpf

import (
	"net/netip"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/cilium/ebpf"

	"github.com/podfence/podfence/pkg/policy"
)

// TestApplyPolicyNeverMixesPolicies switches an identifier between
// policies over and over while packets of one new flow keep arriving, and
// requires the verdict every policy of the case gives, at every instant of
// ApplyPolicy: a packet all of them allow is never dropped, and one none of
// them allows never passes. That rules out a half-written policy: a trie
// being filled before its direction is closed or emptied after it is
// opened, an entry naming a port set not yet written, and a trie whose
// entries are partly the old policy's and partly the new one's (where a
// longest-prefix match can find an entry that gives an address neither
// policy's verdict), or layers of both (the decision moves between the
// cluster tiers and the policy tries, and a packet meets one's new entries
// and the other's old ones).
func TestApplyPolicyNeverMixesPolicies(t *testing.T) {
	admin := func(set policy.Set, action policy.Action, cidr string) policy.Set {
		set.Cluster.Admin[policy.Ingress] = policy.TierRules{{CIDR: netip.MustParsePrefix(cidr), Action: action,
			Ports: []policy.PortRange{{Last: 65535}}}}
		return set
	}
	for _, c := range []struct {
		name  string
		sets  []policy.Set
		frame []byte
		want  uint32
	}{
		{
			name: "isolation and rules change",
			sets: []policy.Set{
				isolate(rules(rule("10.1.0.0/16")), nil),
				{Mode: policy.ModeStandard}, // open
				isolate(rules(except(rule("10.0.0.0/8"), "10.2.0.0/16"), rule("10.1.2.0/24", tcpPort(80))), nil),
				isolate(rules(rule("10.1.2.3/32", tcpPort(80))), rules()),
				// More ranges than an entry holds: port sets, the old one
				// deleted once the new one is in place.
				isolate(rules(rule("10.1.0.0/16", tcpPort(80), tcpPort(443), udpPort(53))), nil),
				isolate(rules(rule("10.0.0.0/8", tcpPort(22), ports(policy.ProtocolTCP, 79, 90), tcpPort(8080))), nil),
			},
			frame: syn(tcp(peer4, pod4, 40000, 80)).Marshal(),
			want:  VerdictAllow,
		},
		{
			// The /8 changes while a /16 under it comes and goes: until
			// the /16 is in, the /8's new value would drop port 80.
			name: "longer prefix under a changed shorter one",
			sets: []policy.Set{
				isolate(rules(rule("10.0.0.0/8", tcpPort(80))), nil),
				isolate(rules(rule("10.0.0.0/8", tcpPort(443)), rule("10.1.0.0/16", tcpPort(80))), nil),
			},
			frame: syn(tcp("10.1.2.3", pod4, 40000, 80)).Marshal(),
			want:  VerdictAllow,
		},
		{
			// An except hole in a /16 that gives way to a /8 for another
			// port: without the hole, the /16 would pass port 22.
			name: "except hole under a replaced prefix",
			sets: []policy.Set{
				isolate(rules(except(rule("10.1.0.0/16", tcpPort(22)), "10.1.2.0/24")), nil),
				isolate(rules(rule("10.0.0.0/8", tcpPort(80))), nil),
			},
			frame: syn(tcp("10.1.2.3", pod4, 40000, 22)).Marshal(),
			want:  VerdictDrop,
		},
		{
			// An Admin Accept over a NetworkPolicy that allows
			// nothing, then a NetworkPolicy allow and no cluster
			// rule: the new tries with the old tiers deny.
			name: "an allow moves between the tiers and the policy tries",
			sets: []policy.Set{
				admin(isolate(rules(), nil), policy.ActionAccept, "10.1.0.0/16"),
				isolate(rules(rule("10.1.0.0/16")), nil),
			},
			frame: syn(tcp("10.1.2.3", pod4, 40000, 80)).Marshal(),
			want:  VerdictAllow,
		},
		{
			// An Admin Deny over a NetworkPolicy allow, then a
			// NetworkPolicy that allows another range: the old
			// tries' allow with the new (empty) tiers passes.
			name: "a deny moves between the tiers and the policy tries",
			sets: []policy.Set{
				admin(isolate(rules(rule("10.1.0.0/16")), nil), policy.ActionDeny, "10.1.0.0/16"),
				isolate(rules(rule("10.2.0.0/16")), nil),
			},
			frame: syn(tcp("10.1.2.3", pod4, 40000, 80)).Marshal(),
			want:  VerdictDrop,
		},
	} {
		t.Run(c.name, func(t *testing.T) {
			h := newHarness(t)
			h.apply(t, c.sets[0]) // a fresh identifier allows everything
			var stop atomic.Bool
			var wrong, runs atomic.Int64
			var wg sync.WaitGroup
			wg.Add(1)
			go func() {
				defer wg.Done()
				for !stop.Load() {
					ret, err := h.id.Ingress.Run(&ebpf.RunOptions{Data: c.frame})
					if err != nil {
						t.Error(err)
						return
					}
					runs.Add(1)
					if ret != c.want {
						wrong.Add(1)
					}
				}
			}()
			switches := 400
			if testing.Short() { // the kernel matrix, under emulation
				switches = 100
			}
			for i := 1; i <= switches; i++ {
				if err := h.id.ApplyPolicy(c.sets[i%len(c.sets)]); err != nil {
					t.Error(err)
					break
				}
			}
			stop.Store(true)
			wg.Wait()
			if runs.Load() == 0 {
				t.Fatal("no packet ran while the policies switched: the test proves nothing")
			}
			if n := wrong.Load(); n > 0 {
				t.Fatalf("%d of %d packets got another verdict than %#x, which every policy gives", n, runs.Load(), c.want)
			}
			t.Logf("%d policy switches, %d packets, all %#x", switches, runs.Load(), c.want)
		})
	}
}
