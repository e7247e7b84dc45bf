package bpf

import (
	"errors"
	"maps"
	"net/netip"
	"reflect"
	"runtime"
	"testing"

	"github.com/podfence/podfence/pkg/policy"
)

var errStopped = errors.New("stopped by the test")

// TestApplyPolicyRepairsStoppedChange stops a policy change after each of
// its steps, as a killed process would stop, and retries it as a runtime
// retries a failed ADD. Where it stops, the old policy is in force until
// the switch and the new one from then on, whole. Whatever the step, the
// retry must leave the new policy in force: a tracked flow it revokes is
// dropped on its next packet, a flow it allows still passes, both sides
// hold it, and no port set is left that no entry names.
func TestApplyPolicyRepairsStoppedChange(t *testing.T) {
	three := []policy.PortRange{tcpPort(80), tcpPort(443), tcpPort(8443)}
	old := isolate(rules(rule("10.1.0.0/16", three...), rule("10.3.0.0/16", three...)), nil)
	// Revokes 10.1/16, keeps 10.3/16 under another port set.
	next := isolate(rules(rule("10.3.0.0/16", tcpPort(80), tcpPort(443), tcpPort(9000))), nil)
	// Opens ingress: the step that clears an isolation bit first.
	open := policy.Set{Mode: policy.ModeStandard}

	for _, c := range []struct {
		to   policy.Set
		step string
	}{
		{next, "flagged"}, {next, "sets written"}, {next, "side written"}, {next, "switched"},
		{open, "flagged"}, {open, "side written"}, {open, "switched"},
	} {
		switched := c.step == "switched"
		name := "revoke/" + c.step
		if !c.to.Ingress.Isolated {
			name = "open/" + c.step
		}
		t.Run(name, func(t *testing.T) {
			h := newHarness(t)
			h.apply(t, old)
			revoked := tcp("10.1.2.3", pod4, 40000, 80)
			kept := tcp("10.3.2.3", pod4, 40001, 80)
			// Run while the change is stopped: tracked from 10.1/16
			// (which next revokes), or new from 10.9/16 (which only
			// open allows).
			mid, midSyn := tcp("10.1.2.4", pod4, 40002, 80), false
			if !c.to.Ingress.Isolated {
				mid, midSyn = syn(tcp("10.9.2.3", pod4, 40002, 80)), true
			}
			opening := []string{string(syn(revoked).Marshal()), string(syn(kept).Marshal())}
			if !midSyn {
				opening = append(opening, string(syn(mid).Marshal()))
			}
			for _, p := range opening {
				if ret := h.run(t, policy.Ingress, []byte(p)); ret != VerdictAllow {
					t.Fatalf("opening a flow under the old policy: %#x", ret)
				}
			}

			stopped := false
			t.Cleanup(func() { testStop = nil })
			testStop = func(step string) error {
				if step == c.step {
					stopped = true
					return errStopped
				}
				return nil
			}
			err := h.id.ApplyPolicy(c.to)
			testStop = nil
			if !stopped || !errors.Is(err, errStopped) {
				t.Fatalf("the change never reached step %q (error %v)", c.step, err)
			}
			// Before the switch only the old policy judges; from it,
			// only the new one.
			wantMid := VerdictAllow
			if switched == c.to.Ingress.Isolated {
				wantMid = VerdictDrop
			}
			if ret, reason := h.runReason(t, policy.Ingress, mid.Marshal()); ret != wantMid {
				t.Errorf("flow from %s while stopped: %#x (%s), want %#x", mid.Src, ret, reason, wantMid)
			}
			h.apply(t, c.to) // the retry

			wantRevoked, wantReason := VerdictDrop, ReasonRevoked
			if !c.to.Ingress.Isolated {
				wantRevoked, wantReason = VerdictAllow, ReasonCTEstablished
			}
			if ret, reason := h.runReason(t, policy.Ingress, revoked.Marshal()); ret != wantRevoked || reason != wantReason {
				t.Errorf("flow from 10.1.2.3 after the retry: %#x (%s), want %#x (%s)", ret, reason, wantRevoked, wantReason)
			}
			if ret, reason := h.runReason(t, policy.Ingress, kept.Marshal()); ret != VerdictAllow || reason != ReasonCTEstablished {
				t.Errorf("flow from 10.3.2.3 after the retry: %#x (%s), want it allowed as tracked", ret, reason)
			}
			if st := h.state(t); st.Applying != 0 || st.Enforced != st.Enforced1 {
				t.Errorf("state after the retry: %+v, want no flag and both sides' bits alike", st)
			}
			if a, b := readSide(t, h, 0), readSide(t, h, 1); !reflect.DeepEqual(a, b) {
				t.Error("the sides differ after the retry")
			}
			if named, held := namedKeys(t, h), setKeys(t, h); !maps.Equal(named, held) {
				t.Errorf("port_sets holds %v, the entries name %v", held, named)
			}
		})
	}
}

// readSide reads side s of the harness's identifier.
func readSide(t *testing.T, h *harness, s int) sideEntries {
	t.Helper()
	e, err := h.id.Sides[s].entries()
	if err != nil {
		t.Fatal(err)
	}
	return e
}

func (h *harness) state(t *testing.T) podfenceIdState {
	t.Helper()
	var st podfenceIdState
	if err := h.id.State.Lookup(uint32(0), &st); err != nil {
		t.Fatal(err)
	}
	return st
}

// hostRules allows port 80 from n hosts of 10.0.0.0/8 from the i-th on,
// each with its own list of three ports when lists is set (a port set each).
func hostRules(first, n int, lists bool) []policy.Rule {
	var rs []policy.Rule
	for i := first; i < first+n; i++ {
		r := rule(netip.AddrFrom4([4]byte{10, byte(i >> 16), byte(i >> 8), byte(i)}).String()+"/32", tcpPort(80))
		if lists {
			p := uint16(6*i) % 60000
			r.Ports = []policy.PortRange{tcpPort(p + 1), tcpPort(p + 3), tcpPort(p + 5)}
		}
		rs = append(rs, r)
	}
	return rs
}

// TestApplyPolicyRefusesWhatCannotFit: a policy that a side's tries cannot
// hold, or whose port sets port_sets cannot hold next to those of the
// policy it replaces, which Set.Check would
// have refused but which reached ApplyPolicy anyway (read again after the
// check), fails before anything changes, with the policy error the plugin
// reports as such.
func TestApplyPolicyRefusesWhatCannotFit(t *testing.T) {
	for _, c := range []struct {
		name      string
		old, next []policy.Rule
		want      error
	}{
		{"prefixes", hostRules(0, policy.MaxEntries, false), hostRules(policy.MaxEntries, int(trieCapacity)+1, false), policy.ErrTooManyEntries},
		{"port sets", hostRules(0, 8, true), hostRules(100, policy.MaxPortSets+1, true), policy.ErrTooManyPortSets},
	} {
		t.Run(c.name, func(t *testing.T) {
			h := newHarness(t)
			h.apply(t, isolate(c.old, nil))
			before, sets := h.state(t), setKeys(t, h)
			entries, err := trieEntries(h.id.Sides[0].Policy[policy.Ingress][0])
			if err != nil {
				t.Fatal(err)
			}
			err = h.id.ApplyPolicy(isolate(c.next, nil))
			if !errors.Is(err, c.want) {
				t.Fatalf("error %v, want %v", err, c.want)
			}
			after, err := trieEntries(h.id.Sides[0].Policy[policy.Ingress][0])
			if err != nil {
				t.Fatal(err)
			}
			if st := h.state(t); st != before || !maps.Equal(after, entries) || !maps.Equal(setKeys(t, h), sets) {
				t.Fatalf("the refused policy changed something: state %+v (was %+v), %d entries (were %d)", st, before, len(after), len(entries))
			}
		})
	}
}

// TestApplyPolicyAfterStopClearsUnnamedSets: a change stopped after writing
// its port sets leaves them named by no entry in force, and one stopped
// later by a side that is not level. The next ApplyPolicy, of any policy,
// deletes those first, or a policy and its successor of
// policy.MaxPortSets sets each would not find room.
func TestApplyPolicyAfterStopClearsUnnamedSets(t *testing.T) {
	for _, step := range []string{"sets written", "side written", "switched"} {
		t.Run(step, func(t *testing.T) {
			h := newHarness(t)
			h.apply(t, isolate(hostRules(0, policy.MaxPortSets, true), nil))
			t.Cleanup(func() { testStop = nil })
			testStop = func(s string) error {
				if s == step {
					return errStopped
				}
				return nil
			}
			if err := h.id.ApplyPolicy(isolate(hostRules(1000, policy.MaxPortSets, true), nil)); !errors.Is(err, errStopped) {
				t.Fatalf("the change was not stopped: %v", err)
			}
			testStop = nil
			if n := len(setKeys(t, h)); n != 2*policy.MaxPortSets {
				t.Fatalf("%d port sets after the stop, want both policies' %d", n, 2*policy.MaxPortSets)
			}
			third := isolate(hostRules(2000, policy.MaxPortSets, true), nil)
			if err := h.id.ApplyPolicy(third); err != nil {
				t.Fatalf("a third policy of %d port sets: %v", policy.MaxPortSets, err)
			}
			if named, held := namedKeys(t, h), setKeys(t, h); len(named) != policy.MaxPortSets || !maps.Equal(named, held) {
				t.Fatalf("port_sets holds %d sets, the entries name %d", len(held), len(named))
			}
		})
	}
}

// TestApplyPolicyKeepsWhatItReadAcrossCollections runs garbage collections
// during a policy change, after its switch, and fills the heap with maps
// of keys no trie can hold. What the change read of the side it leaves
// behind must survive them: it is how the change makes that side level.
// (Go 1.26 and 1.27 compile a pointer into a local array, taken with a
// variable index and kept across calls, without keeping the array live;
// switchPolicy's reads were freed that way, and their memory reused.)
func TestApplyPolicyKeepsWhatItReadAcrossCollections(t *testing.T) {
	h := newHarness(t)
	h.apply(t, isolate(hostRules(0, 300, false), nil))
	var junk []map[string]podfencePolicyValue
	t.Cleanup(func() { testStop = nil })
	testStop = func(step string) error {
		if step != "switched" {
			return nil
		}
		for range 2 {
			runtime.GC()
		}
		for range 200 {
			m := make(map[string]podfencePolicyValue, 300)
			for k := range 300 {
				// A prefix length of 255: never a key of a trie.
				m[string([]byte{255, 0, 0, 0, 10, 9, byte(k >> 8), byte(k)})] = podfencePolicyValue{Count: 9}
			}
			junk = append(junk, m)
		}
		return nil
	}
	h.apply(t, isolate(hostRules(1000, 300, false), nil))
	testStop = nil
	runtime.KeepAlive(junk)
	a, b := readSide(t, h, 0), readSide(t, h, 1)
	if !reflect.DeepEqual(a, b) {
		t.Fatal("the sides differ after the change")
	}
	if n := len(a.policy[policy.Ingress][0]); n < 300 || n > 310 {
		t.Fatalf("side 0 holds %d IPv4 ingress entries, want the policy's 300 and the node's", n)
	}
}
