package bpf

import (
	"testing"

	"github.com/cilium/ebpf"

	"github.com/podfence/podfence/pkg/policy"
)

// TestApplyPolicyRepairsKilledChange: an ApplyPolicy killed after writing
// the tries but before bumping the generation leaves tracked flows of the
// old policy passing as current. The applying flag it set first makes the
// next ApplyPolicy of the same policy (a retried ADD) bump the generation
// although the tries already hold that policy, so the revoked flow is
// dropped on its next packet.
func TestApplyPolicyRepairsKilledChange(t *testing.T) {
	h := newHarness(t)
	h.apply(t, isolate(rules(rule("10.1.0.0/16")), nil))
	ack := tcp("10.1.2.3", pod4, 40000, 80)
	if ret := h.run(t, policy.Ingress, syn(ack).Marshal()); ret != VerdictAllow {
		t.Fatalf("SYN: verdict %#x", ret)
	}

	// The state a kill leaves after the tries hold the revoking policy:
	// the old generation, and the flag.
	before := h.state(t)
	revoke := isolate(rules(rule("10.2.0.0/16")), nil)
	h.apply(t, revoke)
	killed := h.state(t)
	if killed.Applying != 0 || killed.Generation == before.Generation {
		t.Fatalf("after ApplyPolicy: state %+v (before %+v), want a new generation and no flag", killed, before)
	}
	killed.Generation, killed.Applying = before.Generation, 1
	if err := h.id.State.Update(uint32(0), &killed, ebpf.UpdateExist); err != nil {
		t.Fatal(err)
	}
	if ret, reason := h.runReason(t, policy.Ingress, ack.Marshal()); ret != VerdictAllow || reason != ReasonCTEstablished {
		t.Fatalf("before the repair: %#x (%s), want the stale pass the kill leaves", ret, reason)
	}

	h.apply(t, revoke)
	if st := h.state(t); st.Applying != 0 || st.Generation == before.Generation {
		t.Fatalf("after the repeated ApplyPolicy: state %+v, want a new generation and no flag", st)
	}
	if ret, reason := h.runReason(t, policy.Ingress, ack.Marshal()); ret != VerdictDrop || reason != ReasonRevoked {
		t.Fatalf("after the repair: %#x (%s), want the flow revoked", ret, reason)
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
