package bpf

import (
	"fmt"
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

// ApplyPolicy programs the identifier with set and bumps the policy
// generation, so that tracked flows are re-checked against the new rules on
// their next packet. The policy has two sides (struct id_state): the side
// not in force is written whole, tries, tiers and enforced bits, and the
// generation bump that makes it the one in force is a single write. A
// packet is therefore judged by the old policy or the new one, never by
// layers of both; the port sets the new side names are written before it.
// Once no program run that read the old generation is left
// (WaitForPrograms), the side left behind is made equal to the new one,
// ready for the next change, and port sets neither side names are deleted.
// A policy the side in force already holds changes nothing, and its
// tracked flows keep their generation. Callers serialise ApplyPolicy per
// identifier.
//
// A policy that the maps cannot hold (errors wrapping
// policy.ErrTooManyEntries or ErrTooManyPortSets) fails before anything
// changes. Killed at any point, ApplyPolicy leaves what the next call
// repairs: the state's applying flag, set before the first write, says the
// side not in force may differ from the one in force and may still be read
// by programs, so the next call waits for them before writing it; a policy
// already in force then only has its other side brought level.
//
// The node's addresses (Global.SetNodeAddrs) become entries of the ingress
// tries that allow everything, so that kubelet probes pass whatever the
// policy says; after the node's addresses change, apply again.
func (i *Datapath) ApplyPolicy(set policy.Set) error {
	lv, err := i.SwitchPolicy(set)
	if err != nil || lv == nil {
		return err
	}
	if err := WaitForPrograms(); err != nil {
		return fmt.Errorf("apply policy of %q: %w", i.ID, err)
	}
	return lv.Level()
}

// Leveling is what a policy change has left to do once it is in force:
// make the side it left behind level with the new one, and delete the
// port sets neither names, which must wait until no program run that read
// the old generation is left.
type Leveling struct {
	i    *Datapath
	st   podfenceIdState // as the switch left it
	want sideWant
	have sideEntries // what the side left behind holds
	sets *portSets
}

// SwitchPolicy is ApplyPolicy without its wait: it puts set in force and
// returns what is left (nil when nothing is), which the caller completes
// with Level once WaitForPrograms has returned, still holding the
// identifier. A caller that changes many identifiers (node.ReapplyPolicies)
// switches them all and waits once. Left undone, by a process killed in
// between, the identifier's next change does it, waiting for itself.
func (i *Datapath) SwitchPolicy(set policy.Set) (*Leveling, error) {
	lv, err := i.switchPolicy(set)
	if err != nil {
		return nil, fmt.Errorf("apply policy of %q: %w", i.ID, err)
	}
	return lv, nil
}

// Level completes the change SwitchPolicy made, after WaitForPrograms.
func (lv *Leveling) Level() error {
	if err := lv.i.level(lv.st, lv.want, lv.have); err != nil {
		return fmt.Errorf("apply policy of %q: %w", lv.i.ID, err)
	}
	if err := lv.sets.removeUnused(lv.i.PortSets, false); err != nil {
		return fmt.Errorf("apply policy of %q: remove port sets: %w", lv.i.ID, err)
	}
	return nil
}

func (i *Datapath) switchPolicy(set policy.Set) (*Leveling, error) {
	nodes, err := i.global.NodeAddresses()
	if err != nil {
		return nil, err
	}
	var st podfenceIdState
	if err := i.State.Lookup(uint32(0), &st); err != nil {
		return nil, fmt.Errorf("read state: %w", err)
	}
	sets, err := readPortSets(i.PortSets)
	if err != nil {
		return nil, err
	}
	inForce := sideOf(st.Generation)
	// Reached through a pointer, not declared as an array: Go 1.26 and
	// 1.27 keep a pointer to have[inForce], taken once, live across the
	// calls below, yet mark the array itself dead, so that a collection
	// during change freed the maps that the Leveling then reads
	// (TestApplyPolicyKeepsWhatItReadAcrossCollections). It still lives
	// on the stack, but as an object whose address is taken, which the
	// collector scans while any pointer to it is live. make lint's
	// livecheck looks for the pattern elsewhere.
	have := new([2]sideEntries)
	if have[inForce], err = i.Sides[inForce].entries(); err != nil {
		return nil, fmt.Errorf("read side %d: %w", inForce, err)
	}
	have[inForce].reserve(sets)
	// Without the flag the sides are level: whatever writes a side
	// flags the state first.
	have[1-inForce] = have[inForce]
	if st.Applying != 0 {
		// A change was stopped, or a take-over just made side 1: this
		// build's programs may still read the side not in force (if it
		// was in force a moment ago), and an earlier build's read side 0.
		// Once they are done, the side not in force is only ever
		// rewritten before it is in force again, so the port sets that
		// it alone names can go; not while members may still run an
		// earlier build's programs, which read side 0 whatever the
		// generation.
		if err := WaitForPrograms(); err != nil {
			return nil, err
		}
		if have[1-inForce], err = i.Sides[1-inForce].entries(); err != nil {
			return nil, fmt.Errorf("read side %d: %w", 1-inForce, err)
		}
		if i.moving {
			have[1-inForce].reserve(sets)
		}
	}
	if err := sets.removeUnnamed(i.PortSets); err != nil {
		return nil, fmt.Errorf("remove port sets: %w", err)
	}

	want, err := desiredEntries(&set, nodes, sets)
	if err != nil {
		return nil, err
	}
	want.use(sets)
	if err := want.fits(*have, sets); err != nil {
		return nil, err
	}
	mode := stateModeStandard
	if set.Mode == policy.ModeStrict {
		mode = stateModeStrict
	}

	// Every replica's ADD applies the identifier's policy; only a change
	// makes the tracked flows of all replicas pay for a re-check.
	current := st.Mode == mode && enforcedOn(st, inForce) == want.enforced && i.Sides[inForce].diff(have[inForce], want).empty()
	level := enforcedOn(st, 1-inForce) == want.enforced && i.Sides[1-inForce].diff(have[1-inForce], want).empty()
	switch {
	case !current:
		if st, err = i.change(st, mode, want, *have, sets); err != nil {
			return nil, err
		}
		return &Leveling{i: i, st: st, want: want, have: have[inForce], sets: sets}, nil
	case !level || st.Applying != 0:
		// A change stopped after its switch: the policy is in force, its
		// other side is not level yet.
		return &Leveling{i: i, st: st, want: want, have: have[1-inForce], sets: sets}, nil
	}
	// Both sides hold the policy: a set that neither names was deleted
	// above already.
	return nil, nil
}

// sideOf is the side that generation gen puts in force.
func sideOf(gen uint32) int { return int(gen & 1) }

// enforcedOn is the enforced bits of side s in st.
func enforcedOn(st podfenceIdState, s int) uint8 {
	if s == 1 {
		return st.Enforced1
	}
	return st.Enforced
}

// setEnforced sets the enforced bits of side s in st.
func setEnforced(st *podfenceIdState, s int, bits uint8) {
	if s == 1 {
		st.Enforced1 = bits
	} else {
		st.Enforced = bits
	}
}

// change writes want to the side not in force and puts it in force, and
// returns the state it left, flagged until the side it left is level.
func (i *Datapath) change(st podfenceIdState, mode uint8, want sideWant, have [2]sideEntries, sets *portSets) (podfenceIdState, error) {
	next := 1 - sideOf(st.Generation)
	st.Applying = 1
	if err := i.writeState(st); err != nil {
		return st, err
	}
	if err := stopAt("flagged"); err != nil {
		return st, err
	}
	if err := sets.writeNew(i.PortSets); err != nil {
		return st, err
	}
	if err := stopAt("sets written"); err != nil {
		return st, err
	}
	if err := i.Sides[next].diff(have[next], want).apply(); err != nil {
		return st, fmt.Errorf("write side %d: %w", next, err)
	}
	st.Mode = mode
	setEnforced(&st, next, want.enforced)
	if err := i.writeState(st); err != nil {
		return st, err
	}
	if err := stopAt("side written"); err != nil {
		return st, err
	}
	// The switch: every layer of the new policy at once.
	st.Generation++
	if err := i.writeState(st); err != nil {
		return st, err
	}
	return st, stopAt("switched")
}

// level makes the side not in force hold want, as the side in force does,
// and clears the applying flag; have is what that side holds. The caller
// has waited for the programs that may read it (WaitForPrograms).
//
// An earlier build's programs, still attached to members a take-over could
// not move, read side 0 whatever the generation, and stamp the flows they
// judge with the current one: after side 0 was levelled (or written as the
// side to come), its flows judged meanwhile by its old entries would pass
// as current. While such members may exist, level bumps the generation
// once more, which both sides now allow, so that those flows are checked
// again against the policy in force.
func (i *Datapath) level(st podfenceIdState, want sideWant, have sideEntries) error {
	other := 1 - sideOf(st.Generation)
	if err := i.Sides[other].diff(have, want).apply(); err != nil {
		return fmt.Errorf("level side %d: %w", other, err)
	}
	setEnforced(&st, other, want.enforced)
	st.Applying = 0
	if i.moving {
		st.Generation++
	}
	return i.writeState(st)
}

func (i *Datapath) writeState(st podfenceIdState) error {
	if err := i.State.Update(uint32(0), &st, ebpf.UpdateExist); err != nil {
		return fmt.Errorf("write state: %w", err)
	}
	return nil
}

// syncSides copies side 0, with its enforced bits, into side 1: what a
// take-over of a layout before sides does before any program of this build
// runs, so that either parity of the generation finds the policy. A change
// that the earlier build stopped (its applying flag) meant, to that build,
// that the generation was still to be bumped, even if its tries held the
// policy: syncSides bumps it, as that build's next change would have, and
// leaves the flag set (see below).
func (i *Datapath) syncSides() error {
	var st podfenceIdState
	if err := i.State.Lookup(uint32(0), &st); err != nil {
		return fmt.Errorf("read state: %w", err)
	}
	stopped := st.Applying != 0
	st.Applying = 1
	if err := i.writeState(st); err != nil {
		return err
	}
	var have [2]sideEntries
	for s := range i.Sides {
		var err error
		if have[s], err = i.Sides[s].entries(); err != nil {
			return fmt.Errorf("read side %d: %w", s, err)
		}
	}
	want := have[0].want(st.Enforced)
	if err := i.Sides[1].diff(have[1], want).apply(); err != nil {
		return fmt.Errorf("copy side 0 to side 1: %w", err)
	}
	st.Enforced1 = st.Enforced
	if stopped {
		st.Generation++
	}
	// The flag stays: the first change waits for the earlier build's
	// programs, still running on a member that was just moved, before it
	// rewrites side 0.
	return i.writeState(st)
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
func (i *Datapath) Generation() (uint32, error) {
	var st podfenceIdState
	if err := i.State.Lookup(uint32(0), &st); err != nil {
		return 0, fmt.Errorf("read state of %q: %w", i.ID, err)
	}
	return st.Generation, nil
}

// Mode returns the enforcing mode the identifier's state records (the one
// its first ADD set).
func (i *Datapath) Mode() (policy.Mode, error) {
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

// WaitForPrograms returns once every run of a BPF program that started
// before the call has ended. TC programs run inside RCU read-side critical
// sections with preemption off (softirq, or bottom halves disabled), and
// membarrier's MEMBARRIER_CMD_GLOBAL waits for a grace period
// (synchronize_rcu from Linux 5.0, synchronize_sched before, which waits
// for the same non-preemptible sections; kernel/sched/membarrier.c). With
// one CPU online it returns at once, which is right there: while this
// process runs, no such section is open. It costs one grace period (tens
// of microseconds on an idle machine, milliseconds on a busy one with many
// CPUs), which every policy change pays once, and a node-wide push once
// per batch of identifiers (SwitchPolicy). The command is refused on
// nohz_full kernels; a sleep far longer than any program run stands in.
func WaitForPrograms() error {
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
