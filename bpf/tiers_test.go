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

// TestWhileChanging: the state while the tries change leaves no direction
// open that the old and the new policy both enforce, and consults the
// layers of both there.
func TestWhileChanging(t *testing.T) {
	for _, c := range []struct {
		name           string
		old, want, mid uint8
	}{
		{"unchanged", enforcePolicy, enforcePolicy, enforcePolicy},
		{"opened: at once", enforcePolicy, 0, 0},
		{"closed: at the end", 0, enforcePolicy, 0},
		{"admin added", enforcePolicy, enforceAdmin | enforcePolicy, enforceAdmin | enforcePolicy},
		{"admin removed", enforceAdmin | enforcePolicy, enforcePolicy, enforceAdmin | enforcePolicy},
		{"admin appears on an open direction: at the end", 0, enforceAdmin, 0},
		{"strict gains a baseline", enforcePolicy, enforceBaseline | enforceDefaultDeny, enforcePolicy | enforceBaseline | enforceDefaultDeny},
		{"strict loses its baseline", enforceBaseline | enforceDefaultDeny, enforcePolicy, enforcePolicy | enforceBaseline | enforceDefaultDeny},
		{"networkpolicy replaced by a baseline", enforcePolicy, enforceBaseline, enforcePolicy | enforceBaseline},
		{"admin replaced by a networkpolicy", enforceAdmin, enforcePolicy, enforceAdmin | enforcePolicy},
		{"egress alone", enforcePolicy << 1, enforceBaseline << 1, (enforcePolicy | enforceBaseline) << 1},
		{"one direction each", enforcePolicy, enforceBaseline << 1, 0},
	} {
		if got := whileChanging(c.old, c.want); got != c.mid {
			t.Errorf("%s: %#08b -> %#08b: %#08b meanwhile, want %#08b", c.name, c.old, c.want, got, c.mid)
		}
	}
}
