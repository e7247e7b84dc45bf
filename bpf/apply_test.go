package bpf

import (
	"errors"
	"testing"

	"github.com/podfence/podfence/pkg/policy"
)

var errStopped = errors.New("stopped by the test")

// TestApplyPolicyRepairsStoppedChange stops a policy change after each of
// its steps, as a killed process would stop, and retries it as a runtime
// retries a failed ADD. Whatever the step, the retry must leave the new
// policy in force: a tracked flow it revokes is dropped on its next packet
// (which a retry that found the tries already written and so bumped no
// generation would let through), a flow it allows still passes, and no
// port set is left that no entry names.
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
		{next, "flagged"}, {next, "sets written"}, {next, "tries written"},
		{open, "flagged"}, {open, "opened"}, {open, "tries written"},
	} {
		name := "revoke/" + c.step
		if !c.to.Ingress.Isolated {
			name = "open/" + c.step
		}
		t.Run(name, func(t *testing.T) {
			h := newHarness(t)
			h.apply(t, old)
			revoked := tcp("10.1.2.3", pod4, 40000, 80)
			kept := tcp("10.3.2.3", pod4, 40001, 80)
			for _, p := range []string{string(syn(revoked).Marshal()), string(syn(kept).Marshal())} {
				if ret := h.run(t, policy.Ingress, []byte(p)); ret != VerdictAllow {
					t.Fatalf("opening a flow under the old policy: %#x", ret)
				}
			}

			stopped := false
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
			if st := h.state(t); st.Applying != 0 {
				t.Errorf("state after the retry: %+v, want no flag", st)
			}
			named := namedKeys(t, h)
			if n := countEntries(t, h.id.PortSets); n != len(named) {
				t.Errorf("%d port sets, but the entries name %v", n, named)
			}
		})
	}
}

func (h *harness) state(t *testing.T) podfenceIdState {
	t.Helper()
	var st podfenceIdState
	if err := h.id.State.Lookup(uint32(0), &st); err != nil {
		t.Fatal(err)
	}
	return st
}
