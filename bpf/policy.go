package bpf

import (
	"fmt"
	"net/netip"
	"time"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/podfence/podfence/pkg/policy"
)

// policyNode marks a trie entry of one of the node's addresses (POLICY_NODE).
const policyNode uint16 = 1

// Mode values stored in id_state.mode.
const (
	stateModeStandard uint8 = 0
	stateModeStrict   uint8 = 1
)

// ApplyPolicy programs the identifier's tries with set and then bumps the
// policy generation, so that tracked flows are re-checked against the new
// rules on their next packet. A direction that becomes isolated is closed
// only once its entries are written, and one that becomes open is opened
// before its entries are deleted, so no packet meets a half-written policy
// that denies what both the old and the new one allow; likewise a port set
// is written before the entries naming it, and deleted only after them.
// A policy the tries already hold changes nothing, and its tracked flows
// keep their generation. Callers serialise ApplyPolicy per identifier.
//
// Within a trie, entries are written longest prefix first and stale ones
// deleted shortest first, so that every address is judged by its old entry
// or its new one, never by an entry that gives it neither policy's verdict.
//
// A policy that the maps cannot hold next to the one it replaces fails
// (errors wrapping policy.ErrTooManyEntries or ErrTooManyPortSets) before
// anything changes. Killed at any point, ApplyPolicy leaves what the next
// call repairs: the state's applying flag, set before the first change,
// makes that call bump the generation even when the tries already hold its
// policy, and it first deletes port sets that no entry names.
//
// The node's addresses (Global.SetNodeAddrs) become entries of the ingress
// tries that allow everything, so that kubelet probes pass whatever the
// policy says; after the node's addresses change, apply again.
func (i *Identifier) ApplyPolicy(set policy.Set) error {
	nodes, err := i.global.NodeAddresses()
	if err != nil {
		return fmt.Errorf("apply policy of %q: %w", i.ID, err)
	}
	var st podfenceIdState
	if err := i.State.Lookup(uint32(0), &st); err != nil {
		return fmt.Errorf("read state of %q: %w", i.ID, err)
	}
	sets, err := readPortSets(i.PortSets)
	if err != nil {
		return fmt.Errorf("apply policy of %q: %w", i.ID, err)
	}
	var have [2][2]map[string]podfencePolicyValue
	for d := range i.Policy {
		for f := range i.Policy[d] {
			if have[d][f], err = trieEntries(i.Policy[d][f]); err != nil {
				return fmt.Errorf("read %s policy of %q: %w", policy.Direction(d), i.ID, err)
			}
			sets.reserve(have[d][f])
		}
	}
	haveTiers, err := tierEntries(i)
	if err != nil {
		return fmt.Errorf("read cluster tiers of %q: %w", i.ID, err)
	}
	sets.reserveTiers(haveTiers)
	if err := sets.removeUnnamed(i.PortSets); err != nil {
		return fmt.Errorf("remove port sets of %q: %w", i.ID, err)
	}

	var desired [2][2]map[string]*podfencePolicyValue
	for _, d := range []policy.Direction{policy.Ingress, policy.Egress} {
		v4, v6, err := set.Direction(d).Compile()
		if err != nil {
			return fmt.Errorf("compile %s policy of %q: %w", d, i.ID, err)
		}
		for f, entries := range [][]policy.Entry{v4, v6} {
			if desired[d][f], err = sets.encode(entries); err != nil {
				return fmt.Errorf("encode %s policy of %q: %w", d, i.ID, err)
			}
		}
	}
	for _, a := range nodes {
		f := 0
		if a.Is6() {
			f = 1
		}
		// A host prefix is the longest there is, so the node's entry never
		// hides a rule from any other address.
		desired[policy.Ingress][f][string(lpmKey(netip.PrefixFrom(a, a.BitLen())))] = &podfencePolicyValue{Flags: policyNode}
	}
	for d := range desired {
		for f := range desired[d] {
			sets.use(desired[d][f])
		}
	}
	bits := enforced(&set)
	desiredTiers, err := sets.encodeTiers(&set, bits, nodes)
	if err != nil {
		return fmt.Errorf("encode cluster tiers of %q: %w", i.ID, err)
	}
	sets.useTiers(desiredTiers)
	if err := fits(have, desired, sets); err != nil {
		return fmt.Errorf("apply policy of %q: %w", i.ID, err)
	}
	if n := len(haveTiers) + newKeys(haveTiers, desiredTiers); n > int(tierCapacity) {
		return fmt.Errorf("apply policy of %q: cluster tiers: %d entries with those of the rules they replace, the trie holds %d: %w",
			i.ID, n, tierCapacity, policy.ErrTooManyEntries)
	}

	want := st
	want.Mode = stateModeStandard
	if set.Mode == policy.ModeStrict {
		want.Mode = stateModeStrict
	}
	want.Enforced = bits
	want.Applying = 0
	var diffs []trieChange
	for d := range desired {
		for f := range desired[d] {
			if df := diffTrie(i.Policy[d][f], have[d][f], desired[d][f]); !df.empty() {
				diffs = append(diffs, df)
			}
		}
	}
	// The tiers trie changes after the policy tries: a change that moves
	// a decision from one layer to another can, for the moment between
	// the two, judge a new flow by the new policy tries and the old tiers.
	if df := diffTrie(i.Tiers, haveTiers, desiredTiers); !df.empty() {
		diffs = append(diffs, df)
	}
	// Every replica's ADD applies the identifier's policy; only a change
	// makes the tracked flows of all replicas pay for a re-check.
	if len(diffs) > 0 || want != st {
		if err := i.change(st, want, sets, diffs); err != nil {
			return fmt.Errorf("apply policy of %q: %w", i.ID, err)
		}
	}
	if err := sets.removeUnused(i.PortSets); err != nil {
		return fmt.Errorf("remove port sets of %q: %w", i.ID, err)
	}
	return nil
}

// newKeys counts the keys of want that have does not hold.
func newKeys[V any](have map[string]V, want map[string]*V) int {
	n := 0
	for k := range want {
		if _, ok := have[k]; !ok {
			n++
		}
	}
	return n
}

// fits checks, before anything changes, that the tries and the port sets
// can hold the desired policy next to the one it replaces, as they must
// while it does. Set.Check refuses a policy too large on its own; this also
// covers one read again after the check.
func fits(have [2][2]map[string]podfencePolicyValue, desired [2][2]map[string]*podfencePolicyValue, sets *portSets) error {
	for d := range desired {
		for f := range desired[d] {
			n := len(have[d][f]) + newKeys(have[d][f], desired[d][f])
			if n > int(trieCapacity) {
				return fmt.Errorf("%s policy of IPv%d: %d entries with those of the policy it replaces, a trie holds %d: %w",
					policy.Direction(d), 4+2*f, n, trieCapacity, policy.ErrTooManyEntries)
			}
		}
	}
	if n := len(sets.used); n > policy.MaxPortSets {
		return fmt.Errorf("%d distinct port sets, at most %d: %w", n, policy.MaxPortSets, policy.ErrTooManyPortSets)
	}
	return nil
}

// change takes the identifier from state st to want (mode and isolation)
// with the tries changed by diffs, and bumps the generation.
func (i *Identifier) change(st, want podfenceIdState, sets *portSets, diffs []trieChange) error {
	st.Applying = 1
	if err := i.State.Update(uint32(0), &st, ebpf.UpdateExist); err != nil {
		return fmt.Errorf("write state: %w", err)
	}
	if err := stopAt("flagged"); err != nil {
		return err
	}
	if err := sets.writeNew(i.PortSets); err != nil {
		return err
	}
	if err := stopAt("sets written"); err != nil {
		return err
	}
	// A direction being opened is opened before its trie is emptied, and
	// (below) one being closed is closed after its trie is filled: at no
	// instant is a direction enforced against a trie that is neither the
	// old policy's nor the new one's. One that stays enforced by other
	// layers is judged by both policies' layers meanwhile (whileChanging).
	mid := st
	mid.Enforced = whileChanging(st.Enforced, want.Enforced)
	if mid.Enforced != st.Enforced {
		if err := i.State.Update(uint32(0), &mid, ebpf.UpdateExist); err != nil {
			return fmt.Errorf("write state: %w", err)
		}
		// A packet that read an old bit may still be on its way to
		// that layer's trie; let it finish before entries go.
		if st.Enforced&^mid.Enforced != 0 {
			if err := waitForPrograms(); err != nil {
				return err
			}
		}
		if err := stopAt("opened"); err != nil {
			return err
		}
	}
	for _, df := range diffs {
		if err := df.apply(); err != nil {
			return err
		}
	}
	if err := stopAt("tries written"); err != nil {
		return err
	}
	want.Generation = st.Generation + 1
	want.Applying = 0
	if err := i.State.Update(uint32(0), &want, ebpf.UpdateExist); err != nil {
		return fmt.Errorf("write state: %w", err)
	}
	return nil
}

// whileChanging is the enforced bits while the tries change from those of
// old to those of want. A direction one of them leaves open is open
// meanwhile, as before tiers: one being opened is opened first, one being
// closed closed last. A direction both enforce is judged by the layers of
// both, each layer's trie holding, per address, its old entry or its new
// one: never open, and a strict pod never more open than its old or its
// new policy. Across layers this is not atomic: for those moments a flow
// can meet one layer's new entries and another's old ones (the policy
// tries change before the tiers), and be denied though both policies
// allow it, or allowed though both deny it (README, "Cluster-wide tiers").
func whileChanging(old, want uint8) uint8 {
	const all = enforceAdmin | enforcePolicy | enforceBaseline | enforceDefaultDeny
	var bits uint8
	for d := range 2 {
		o, w := old&(all<<d), want&(all<<d)
		if o != 0 && w != 0 {
			bits |= o | w
		}
	}
	return bits
}

// stopAt is where a test makes change stop between two of its steps, as a
// process killed there would; it returns testStop's error for that step.
func stopAt(step string) error {
	if testStop == nil {
		return nil
	}
	return testStop(step)
}

// testStop is set by tests only.
var testStop func(step string) error

// Generation returns the identifier's current policy generation.
func (i *Identifier) Generation() (uint32, error) {
	var st podfenceIdState
	if err := i.State.Lookup(uint32(0), &st); err != nil {
		return 0, fmt.Errorf("read state of %q: %w", i.ID, err)
	}
	return st.Generation, nil
}

// Mode returns the enforcing mode the identifier's state records (the one
// its first ADD set).
func (i *Identifier) Mode() (policy.Mode, error) {
	var st podfenceIdState
	if err := i.State.Lookup(uint32(0), &st); err != nil {
		return "", fmt.Errorf("read state of %q: %w", i.ID, err)
	}
	return stateMode(st), nil
}

// stateMode is the mode a state value records.
func stateMode(st podfenceIdState) policy.Mode {
	if st.Mode == stateModeStrict {
		return policy.ModeStrict
	}
	return policy.ModeStandard
}

// waitForPrograms returns once every run of a BPF program that started
// before the call has ended. TC programs run inside RCU read-side critical
// sections with preemption off (softirq, or bottom halves disabled), and
// membarrier's MEMBARRIER_CMD_GLOBAL waits for a grace period
// (synchronize_rcu from Linux 5.0, synchronize_sched before, which waits
// for the same non-preemptible sections; kernel/sched/membarrier.c). With
// one CPU online it returns at once, which is right there: while this
// process runs, no such section is open. It costs one grace period
// (milliseconds), which ApplyPolicy pays only when it opens an isolated
// direction or drops port sets. The command is refused on nohz_full
// kernels; a sleep far longer than any program run stands in.
func waitForPrograms() error {
	const membarrierCmdGlobal = 1 // MEMBARRIER_CMD_GLOBAL, once MEMBARRIER_CMD_SHARED
	_, _, errno := unix.Syscall(unix.SYS_MEMBARRIER, membarrierCmdGlobal, 0, 0)
	switch errno {
	case 0:
		return nil
	case unix.EINVAL, unix.ENOSYS:
		time.Sleep(50 * time.Millisecond)
		return nil
	}
	return fmt.Errorf("wait for running programs: membarrier: %w", errno)
}
