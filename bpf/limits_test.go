package bpf

import (
	"testing"

	"github.com/podfence/podfence/pkg/policy"
)

// TestLimitsAreTheDatapaths: the policy compiler's limits are the sizes of
// the C arrays that hold what it compiles (bpf/types.h, through bpf2go's
// types), so that a change of one without the other fails here instead of
// writing entries the datapath reads short.
func TestLimitsAreTheDatapaths(t *testing.T) {
	for _, c := range []struct {
		name          string
		limit, arrays int
	}{
		{"policy.MaxPortRanges: struct port_set ranges[MAX_PORT_RANGES]", policy.MaxPortRanges, len(podfencePortSet{}.Ranges)},
		{"policy.InlinePortRanges: struct policy_value ranges", policy.InlinePortRanges, len(podfencePolicyValue{}.Ranges)},
		{"policy.MaxTierRules: struct tier_value slots[MAX_TIER_SLOTS]", policy.MaxTierRules, len(podfenceTierValue{}.Slots)},
	} {
		if c.limit != c.arrays {
			t.Errorf("%s: the limit is %d, the datapath holds %d", c.name, c.limit, c.arrays)
		}
	}
}
