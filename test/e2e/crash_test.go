package e2e

import (
	"fmt"
	"math/rand/v2"
	"net/netip"
	"slices"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/podfence/podfence/pkg/podid"
	"github.com/podfence/podfence/test/netnsutil"
)

// TestKilledMidway kills at least crashKills calls, all modes together, and
// at least crashKillsPerMode in each mode: a random kill hits a given step
// of a call (say, between attaching and recording) only a few times in a
// hundred.
const (
	crashKills        = 50
	crashKillsPerMode = 60
)

// TestKilledMidway sends SIGKILL to podfence at uniformly random instants of
// ADD and DEL calls (a node losing power, the runtime's timeout, the OOM
// killer), on identifiers of 1 to 3 replicas, and then converges the way a
// runtime does: DEL after the failed ADD, retried until it succeeds, and/or
// GC with the list of valid attachments; sometimes the runtime retries the
// ADD instead, which must then succeed and attach both programs. It catches
// a write order that a kill can leave unrepairable: pins without members
// that no later call removes, a member whose record was lost while its
// programs stay attached (or the reverse), a program attached to a veth that
// no record names, a half-renamed temporary pin (*~new), link pins or member
// directories of containers that are gone, a DEL that fails on what a kill
// left, and programs or maps still loaded in the kernel after their
// identifier was removed.
//
// The calls and kill delays are planned from a logged seed;
// PODFENCE_E2E_SEED replays them (where a kill lands within a call still
// varies with the machine's load).
func TestKilledMidway(t *testing.T) {
	seed := testSeed(t)
	modes := attachModes(t)
	perMode := max(crashKillsPerMode, (crashKills+len(modes)-1)/len(modes))
	total := 0
	for _, mode := range modes {
		t.Run(mode, func(t *testing.T) { total += killedMidway(t, mode, seed, perMode) })
	}
	if !t.Failed() && total < crashKills {
		t.Errorf("only %d calls were killed, want %d", total, crashKills)
	}
}

// crashRun is one attach mode's run of TestKilledMidway.
type crashRun struct {
	t     *testing.T
	c     *cluster
	rng   *rand.Rand
	slots []*slot
	exp   *expected

	// windows are the durations of normal calls, by kind; kills are
	// delayed uniformly within them.
	windows map[string]time.Duration
	tried   int
	kills   int
	byKind  map[string]int
	maxKill time.Duration

	// objects are the kernel objects seen pinned for the current
	// episode's identifier; all must be freed once it is gone.
	objects kernelObjects
}

// Kinds of calls, whose normal durations differ: the first ADD of an
// identifier loads its programs, the last DEL removes its pins.
const (
	kindAddFirst = "ADD of the first member"
	kindAdd      = "ADD"
	kindDel      = "DEL"
	kindDelLast  = "DEL of the last member"
)

// crashReplica is one replica in an episode: the container that runs in a
// sandbox, and whether it is a member now.
type crashReplica struct {
	name string
	ctr  string
	slot *slot
	live bool
}

func killedMidway(t *testing.T, mode string, seed uint64, wantKills int) int {
	start := time.Now()
	r := &crashRun{
		t:      t,
		c:      newCluster(t, mode),
		rng:    rand.New(rand.NewPCG(seed, modeStream(mode))),
		byKind: map[string]int{},
	}
	r.slots = r.c.newSlots(3)
	r.exp = newExpected(r.slots)
	r.calibrate()

	for e := 0; r.kills < wantKills; e++ {
		if e == 200 {
			t.Fatalf("%d of %d kills after %d episodes and %v (seed %d): calls end before the kill too often", r.kills, wantKills, e, time.Since(start).Round(time.Millisecond), seed)
		}
		r.episode(e)
		if t.Failed() {
			t.Fatalf("episode %d failed (seed %d)", e, seed)
		}
	}
	var kinds []string
	for k, n := range r.byKind {
		kinds = append(kinds, fmt.Sprintf("%s %d", k, n))
	}
	sort.Strings(kinds)
	t.Logf("%d of %d calls killed (%s), latest kill %v into a call; %v", r.kills, r.tried, strings.Join(kinds, ", "), r.maxKill.Round(time.Microsecond), time.Since(start).Round(time.Millisecond))
	return r.kills
}

// calibrate times normal calls of each kind (median of three) on an
// identifier of three replicas.
func (r *crashRun) calibrate() {
	r.t.Helper()
	samples := map[string][]time.Duration{}
	for round := range 3 {
		reps := r.replicas(fmt.Sprintf("calib%d", round), 3)
		for i, rep := range reps {
			kind := kindAdd
			if i == 0 {
				kind = kindAddFirst
			}
			d, err := r.c.timedExec(r.addInv(rep))
			if err != nil {
				r.t.Fatal(err)
			}
			samples[kind] = append(samples[kind], d)
		}
		for i, rep := range reps {
			kind := kindDel
			if i == len(reps)-1 {
				kind = kindDelLast
			}
			d, err := r.c.timedExec(r.delInv(rep, i%2 == 0))
			if err != nil {
				r.t.Fatal(err)
			}
			samples[kind] = append(samples[kind], d)
		}
	}
	r.windows = map[string]time.Duration{}
	var desc []string
	for kind, ds := range samples {
		slices.Sort(ds)
		r.windows[kind] = ds[len(ds)/2]
		desc = append(desc, fmt.Sprintf("%s %v", kind, r.windows[kind].Round(time.Microsecond)))
	}
	sort.Strings(desc)
	r.t.Logf("normal calls take: %s", strings.Join(desc, ", "))
}

// replicas makes the replicas of a new workload, one per sandbox, and a
// policy that selects it.
func (r *crashRun) replicas(workload string, n int) []*crashReplica {
	names := replicaNames(r.rng, workload+"-"+generatedSuffix(r.rng)+generatedSuffix(r.rng), n)
	r.c.writePolicy("crash", selectPolicy(names[0]))
	reps := make([]*crashReplica, n)
	for i := range reps {
		reps[i] = &crashReplica{name: names[i], ctr: fmt.Sprintf("%s-%s", r.c.attachMode, names[i]), slot: r.slots[i]}
	}
	return reps
}

func (r *crashRun) id(rep *crashReplica) podid.ID {
	id, err := podid.FromPod(rep.name, "default")
	if err != nil {
		r.t.Fatal(err)
	}
	return id
}

func (r *crashRun) addInv(rep *crashReplica) invocation {
	return invocation{command: "ADD", containerID: rep.ctr, pod: rep.name, slot: rep.slot}
}

func (r *crashRun) delInv(rep *crashReplica, bare bool) invocation {
	return invocation{command: "DEL", containerID: rep.ctr, pod: rep.name, slot: rep.slot, bare: bare}
}

// add runs a normal ADD, which must succeed.
func (r *crashRun) add(rep *crashReplica) {
	r.t.Helper()
	if err := r.c.exec(r.addInv(rep)); err != nil {
		r.t.Fatal(err)
	}
	rep.live = true
	r.exp.join(r.id(rep), rep.ctr, rep.slot)
}

// del runs a DEL the way a runtime does, again until it succeeds; after a
// kill it must succeed the first time, so every failure is reported.
func (r *crashRun) del(rep *crashReplica, bare bool) {
	r.t.Helper()
	for attempt := 0; ; attempt++ {
		err := r.c.exec(r.delInv(rep, bare))
		if err == nil {
			break
		}
		r.t.Errorf("attempt %d: %v", attempt, err)
		if attempt == 2 {
			r.t.FailNow()
		}
	}
	rep.live = false
	r.exp.leave(r.id(rep), rep.ctr)
}

// gc runs a GC whose valid attachments are the live containers.
func (r *crashRun) gc() {
	r.t.Helper()
	if err := r.c.exec(invocation{command: "GC", valid: r.exp.validAttachments()}); err != nil {
		r.t.Fatal(err)
	}
}

// kill runs inv and kills it at a uniformly random instant of a normal
// call of its kind (every tenth attempt at once). It reports whether the
// kill landed; a call that ended first must have succeeded.
func (r *crashRun) kill(inv invocation, kind string, id podid.ID) bool {
	r.t.Helper()
	var delay time.Duration
	if r.tried%10 != 0 {
		delay = time.Duration(r.rng.Int64N(int64(r.windows[kind]) + 1))
	}
	r.tried++
	killed, err := r.c.execKilled(inv, delay)
	if err != nil {
		r.t.Fatalf("%s, not killed %v in: %v", kind, delay, err)
	}
	if !killed {
		return false
	}
	r.kills++
	r.byKind[kind]++
	r.maxKill = max(r.maxKill, delay)
	r.objects.add(r.c.pinnedObjects(id))
	r.c.checkReachable(r.t, fmt.Sprintf("after killing %s %v in", inv, delay), r.slots)
	return true
}

// addKind is the kind of the next ADD among reps.
func (r *crashRun) addKind(reps []*crashReplica) string {
	if r.liveCount(reps) == 0 {
		return kindAddFirst
	}
	return kindAdd
}

// addOrRetry adds a replica; one time in three, the first ADD is killed
// and the runtime's retry must succeed.
func (r *crashRun) addOrRetry(rep *crashReplica, id podid.ID, reps []*crashReplica) {
	r.t.Helper()
	if r.rng.IntN(3) != 0 {
		r.add(rep)
		return
	}
	if r.kill(r.addInv(rep), r.addKind(reps), id) {
		r.add(rep) // the runtime's retry
		return
	}
	rep.live = true // it finished first
	r.exp.join(id, rep.ctr, rep.slot)
}

func (r *crashRun) liveCount(reps []*crashReplica) int {
	n := 0
	for _, rep := range reps {
		if rep.live {
			n++
		}
	}
	return n
}

// episode runs one scenario on a new identifier, checks the invariants,
// deletes every replica (killing one of the DELs now and then) and checks
// that nothing of the identifier is left, in bpffs or in the kernel.
func (r *crashRun) episode(e int) {
	r.t.Helper()
	k := 1 + r.rng.IntN(3)
	reps := r.replicas(fmt.Sprintf("app%02d", e), k)
	id := r.id(reps[0])
	r.objects = kernelObjects{}
	j := r.rng.IntN(k) // the replica whose call is killed
	var scenario string

	switch e % 4 {
	case 0, 2, 3: // kill an ADD
		for _, rep := range reps[:j] {
			r.addOrRetry(rep, id, reps)
		}
		switch {
		case !r.kill(r.addInv(reps[j]), r.addKind(reps), id):
			scenario = "ADD finished before the kill"
			reps[j].live = true
			r.exp.join(id, reps[j].ctr, reps[j].slot)
		case e%4 == 2:
			// The runtime retries the ADD, which repairs what the
			// killed one left and attaches both programs.
			scenario = "ADD killed, ADD retried"
			r.add(reps[j])
		default:
			// containerd follows a failed ADD with a DEL; GC (with
			// the killed container not valid) must do as well.
			switch how := r.rng.IntN(3); how {
			case 0:
				scenario = "ADD killed, then DEL"
				r.del(reps[j], r.rng.IntN(2) == 0)
			case 1:
				scenario = "ADD killed, then GC"
				r.exp.leave(id, reps[j].ctr)
				r.gc()
			case 2:
				scenario = "ADD killed, then DEL and GC"
				r.del(reps[j], r.rng.IntN(2) == 0)
				r.gc()
			}
		}
		for _, rep := range reps[j+1:] {
			r.addOrRetry(rep, id, reps)
		}
	case 1: // kill a DEL
		for _, rep := range reps {
			r.add(rep)
		}
		kind := kindDel
		if k == 1 {
			kind = kindDelLast
		}
		killed := r.kill(r.delInv(reps[j], r.rng.IntN(2) == 0), kind, id)
		if killed {
			when := fmt.Sprintf("episode %d, after killing the DEL of replica %d of %d", e, j, k)
			r.objects.add(r.c.check(r.t, when, r.expectKilledDel(id, reps[j]))[id])
		}
		if !killed {
			scenario = "DEL finished before the kill"
			reps[j].live = false
			r.exp.leave(id, reps[j].ctr)
		} else if r.rng.IntN(2) == 0 {
			scenario = "DEL killed, DEL retried"
			r.del(reps[j], r.rng.IntN(2) == 0)
		} else {
			scenario = "DEL killed, then GC"
			reps[j].live = false
			r.exp.leave(id, reps[j].ctr)
			r.gc()
		}
	}
	when := fmt.Sprintf("episode %d (%d replicas, replica %d: %s)", e, k, j, scenario)
	r.objects.add(r.c.check(r.t, when, r.exp)[id])
	if r.t.Failed() {
		return
	}

	// Tear down in random order. Sometimes the sandbox is gone first
	// (its veth with it) and only the removal-time DEL comes; sometimes a
	// DEL is killed and retried.
	order := r.rng.Perm(k)
	for n, i := range order {
		rep := reps[i]
		if !rep.live {
			continue
		}
		bare := r.rng.IntN(2) == 0
		if r.rng.IntN(4) == 0 {
			r.replaceVeth(rep.slot)
			bare = true
		}
		if r.rng.IntN(3) == 0 {
			kind := kindDel
			if r.liveCount(reps) == 1 {
				kind = kindDelLast
			}
			if !r.kill(r.delInv(rep, bare), kind, id) {
				rep.live = false
				r.exp.leave(id, rep.ctr)
				continue
			}
			when := fmt.Sprintf("episode %d teardown, after killing DEL %d of %d", e, n+1, k)
			r.objects.add(r.c.check(r.t, when, r.expectKilledDel(id, rep))[id])
		}
		r.del(rep, bare)
	}
	r.c.check(r.t, fmt.Sprintf("episode %d (%s), after teardown", e, scenario), r.exp)
	waitFreed(r.t, fmt.Sprintf("episode %d (%s)", e, scenario), r.objects)
}

// expectKilledDel is what the store must say after a killed DEL: the same
// as before for everything else, while the killed container's record, its
// veth's hooks and, when it was the last member, the identifier's pins may
// each be there or gone, depending on where the kill hit.
func (r *crashRun) expectKilledDel(id podid.ID, rep *crashReplica) *expected {
	e := newExpected(r.exp.slots)
	for i, ms := range r.exp.live {
		for ctr, s := range ms {
			if ctr != rep.ctr {
				e.join(i, ctr, s)
			}
		}
	}
	for ctr := range r.exp.gone {
		e.gone[ctr] = true
	}
	e.unsure = map[podid.ID]map[string]*slot{id: {rep.ctr: rep.slot}}
	return e
}

// replaceVeth deletes a sandbox's veth, as when the pod's network namespace
// is destroyed before the runtime's last DEL, and makes a new one for the
// sandbox's next container (with another ifindex).
func (r *crashRun) replaceVeth(s *slot) {
	r.t.Helper()
	netnsutil.DeleteLink(r.t, r.c.node, s.veth.HostName)
	host := s.addr.Addr().Prev()
	s.veth = netnsutil.AddVeth(r.t, r.c.node, s.netns, s.veth.HostName, netip.PrefixFrom(host, s.addr.Bits()), s.addr)
}
