package bpf

import (
	"math/rand/v2"
	"testing"

	"github.com/podfence/podfence/pkg/policy"
)

// TestTrialMatchesReference: a trial run answers what the reference says
// for random policies and packets (as TestDifferential holds the attached
// programs to it), and leaves the live conntrack tables and counters as they
// were: a trial is free of side effects.
func TestTrialMatchesReference(t *testing.T) {
	h := newHarness(t)
	seed := *diffSeed
	if seed == 0 {
		seed = rand.Uint64()
	}
	t.Logf("seed %d (replay with -run TestTrialMatchesReference -seed=%d)", seed, seed)
	rng := rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))
	cases, sets := 0, 20
	if testing.Short() { // the kernel matrix, under emulation
		sets = 8
	}
	for s := 0; s < sets; s++ {
		set := randomSet(rng)
		h.apply(t, set)
		for p := 0; p < 4; p++ {
			d := policy.Direction(rng.IntN(2))
			pkt, remote, port := randomPacket(rng, uint16(p+1), d)
			// ifindex 1: the loopback device, what a test run of the
			// attached programs also reports.
			ret, reason, err := h.id.Trial(d, pkt.Marshal(), 1)
			if err != nil {
				t.Fatal(err)
			}
			want := policy.Decide(&set, &set.Cluster, d, remote, pkt.Proto, port).Allowed
			if got := ret == VerdictAllow; got != want || reason.Verdict() != ret {
				t.Errorf("seed %d set %d packet %d: %s %s->%s proto %d port %d: trial %#x (%s), reference allows=%v\npolicy: %s",
					seed, s, p, d, pkt.Src, pkt.Dst, pkt.Proto, port, ret, reason, want, describe(set))
			}
			cases++
		}
	}
	c, err := h.id.ReadCounters()
	if err != nil {
		t.Fatal(err)
	}
	if c != (Counters{}) {
		t.Errorf("trials moved the live counters: %v", c)
	}
	entries := 0
	if err := h.g.ScanConntrack(func(b []CTEntry) error { entries += len(b); return nil }); err != nil {
		t.Fatal(err)
	}
	if entries != 0 {
		t.Errorf("trials left %d live conntrack entries", entries)
	}
	t.Logf("%d trials agree with the reference", cases)
}

// TestTrialSeesEstablishedFlows: the trial's conntrack copy holds the pod's
// live flows, so a packet of an established flow that the current policy
// still allows is answered from conntrack, as the datapath would.
func TestTrialSeesEstablishedFlows(t *testing.T) {
	h := newHarness(t)
	h.apply(t, isolate(rules(rule("10.1.0.0/16", tcpPort(80))), nil))
	if ret := h.run(t, policy.Ingress, syn(tcp(peer4, pod4, 40000, 80)).Marshal()); ret != VerdictAllow {
		t.Fatalf("opening segment: %#x", ret)
	}
	before, err := h.id.ReadCounters()
	if err != nil {
		t.Fatal(err)
	}
	ret, reason, err := h.id.Trial(policy.Ingress, tcp(peer4, pod4, 40000, 80).Marshal(), 1)
	if err != nil {
		t.Fatal(err)
	}
	if ret != VerdictAllow || reason != ReasonCTEstablished {
		t.Errorf("trial of an established flow: %#x (%s), want allow (ct-established)", ret, reason)
	}
	if after, _ := h.id.ReadCounters(); after != before {
		t.Errorf("the trial moved the live counters: %v -> %v", before, after)
	}
}
