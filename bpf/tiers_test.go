package bpf

import (
	"net/netip"
	"testing"

	"github.com/podfence/podfence/pkg/policy"
)

// TestEnforced: which layers the state tells the datapath to consult, per
// direction, for the sets ForIdentifier and WithCluster make.
func TestEnforced(t *testing.T) {
	rules := policy.TierRules{{CIDR: netip.MustParsePrefix("10.0.0.0/8"), Action: policy.ActionDeny}}
	in, eg := func(b uint8) uint8 { return b << policy.Ingress }, func(b uint8) uint8 { return b << policy.Egress }
	withCluster := func(s policy.Set, admin, baseline bool) policy.Set {
		if admin {
			s.Cluster.Admin[policy.Ingress] = rules
		}
		if baseline {
			s.Cluster.Baseline[policy.Ingress] = rules
		}
		return s
	}
	standard := policy.Set{Mode: policy.ModeStandard}
	strict := policy.Set{Mode: policy.ModeStrict, Ingress: policy.DirectionPolicy{Isolated: true}, Egress: policy.DirectionPolicy{Isolated: true}}
	selected := policy.Set{Mode: policy.ModeStandard, Selected: true, Ingress: policy.DirectionPolicy{Isolated: true}}
	for _, c := range []struct {
		name string
		set  policy.Set
		want uint8
	}{
		{"nothing", standard, 0},
		{"strict, unselected: as before tiers", strict, in(enforcePolicy) | eg(enforcePolicy)},
		{"isolated ingress", selected, in(enforcePolicy)},
		{"admin only", withCluster(standard, true, false), in(enforceAdmin)},
		{"admin before the networkpolicy", withCluster(selected, true, false), in(enforceAdmin | enforcePolicy)},
		{"baseline, no networkpolicy", withCluster(standard, false, true), in(enforceBaseline)},
		{"baseline under an isolating networkpolicy: never reached", withCluster(selected, false, true), in(enforcePolicy)},
		{"strict behind a baseline", withCluster(strict, false, true), in(enforceBaseline|enforceDefaultDeny) | eg(enforcePolicy)},
	} {
		if got := enforced(&c.set); got != c.want {
			t.Errorf("%s: %#08b, want %#08b", c.name, got, c.want)
		}
	}
}
