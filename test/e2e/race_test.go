package e2e

import (
	"fmt"
	"math/rand/v2"
	"net/netip"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/podfence/podfence/pkg/membership"
	"github.com/podfence/podfence/pkg/podid"
)

const raceReplicas = 32

// raceRounds: four cycles of roundKinds; two under the race detector (make
// test's race stage), where every call is a race-built plugin or sweeper
// and takes several times as long. Two cycles run every code path the
// detector can check twice; the interleavings come from the full run.
var raceRounds = map[bool]int{false: 20, true: 10}[raceDetector]

// TestConcurrentAddDel runs ADDs and DELs of 32 replicas of one identifier
// concurrently, in random interleavings, as a node does when a ReplicaSet is
// scaled up and down in bursts. It catches whatever breaks when plugin
// processes overlap on shared pins: two lock holders (e.g. a waiter that
// keeps using the lock of a directory that the last member's DEL removed
// meanwhile, which "burst" rounds provoke on purpose), the last member's DEL
// removing pins that a concurrent ADD is about to use, an ADD that loads
// fresh programs beside pinned ones so that replicas run different
// programs, a lost member record, a veth left with one program or two, a
// DEL that leaves a record or an attachment behind, programs or maps left
// loaded once the identifier is gone, and any call that fails under
// contention. Every round ends with all calls returned and the pins,
// records and veth hooks compared with what the calls did.
//
// The calls are planned from a logged seed; PODFENCE_E2E_SEED replays a
// plan (the interleaving itself is up to the scheduler).
func TestConcurrentAddDel(t *testing.T) {
	seed := testSeed(t)
	for _, mode := range attachModes(t) {
		t.Run(mode, func(t *testing.T) { concurrentAddDel(t, mode, seed) })
	}
}

// raceReplica is one replica: a sandbox, and the container that is a
// member now ("" when none).
type raceReplica struct {
	name    string
	slot    *slot
	current string
	last    string // the container deleted last
	gen     int
}

type raceOp struct {
	inv   invocation
	pause time.Duration // before the call
}

func concurrentAddDel(t *testing.T, mode string, seed uint64) {
	start := time.Now()
	rng := rand.New(rand.NewPCG(seed, modeStream(mode)))
	c := newCluster(t, mode)
	names := replicaNames(rng, "web-7f65cc6544", raceReplicas)
	c.writePolicy("web", selectPolicy(names[0]))
	id, err := podid.FromPod(names[0], "default")
	if err != nil {
		t.Fatal(err)
	}
	all := c.newSlots(raceReplicas + 1)
	slots, bystander := all[:raceReplicas], all[raceReplicas]
	t.Logf("%d sandboxes ready after %v", len(slots), time.Since(start).Round(time.Millisecond))

	replicas := make([]*raceReplica, raceReplicas)
	for i := range replicas {
		replicas[i] = &raceReplica{name: names[i], slot: slots[i]}
	}
	exp := newExpected(slots)
	// A bystander with a live connection: no sweep may delete its entry.
	if err := c.exec(invocation{command: "ADD", containerID: "bystander", pod: "db-0", slot: bystander}); err != nil {
		t.Fatal(err)
	}
	exp.join("db-0@default", "bystander", bystander)
	bystanderFlow := [2]netip.AddrPort{netip.AddrPortFrom(bystander.addr.Addr(), 40000), netip.MustParseAddrPort("10.99.0.1:443")}
	bystanderEntry := c.writeEntry(t, bystanderFlow[0], bystanderFlow[1], bystander.veth.HostIndex)
	c.conntrackInsert(t, bystanderFlow[0], bystanderFlow[1])
	sweeps := 0
	var seen kernelObjects // of the identifier's pins since it was last empty
	calls := 0
	perKind := map[roundKind]int{}
	kindTime := map[roundKind]time.Duration{}
	for round := range raceRounds {
		kind := roundKinds[round%len(roundKinds)]
		if round == raceRounds-1 {
			kind = roundDrain
		}
		before, roundStart := calls, time.Now()
		plans := make([][]raceOp, len(replicas))
		var first *raceReplica
		if kind == roundBurst {
			first = replicas[rng.IntN(len(replicas))]
			ctr := first.next(mode)
			if err := c.exec(invocation{command: "ADD", containerID: ctr, pod: first.name, slot: first.slot}); err != nil {
				t.Fatalf("round %d: %v", round, err)
			}
			exp.join(id, ctr, first.slot)
			calls++
		}
		// Removal-time DELs of earlier containers, which come whenever
		// the runtime gets to them; they find no member, and must not
		// take the identifier from ADDs that have not recorded theirs.
		var stragglers []raceOp
		if kind == roundBurst {
			for _, r := range replicas {
				if r.last != "" && rng.IntN(2) == 0 {
					stragglers = append(stragglers, raceOp{
						inv:   invocation{command: "DEL", containerID: r.last, pod: r.name, slot: r.slot, bare: true},
						pause: time.Duration(rng.Int64N(int64(150 * time.Millisecond))),
					})
				}
			}
			calls += len(stragglers)
		}
		for i, r := range replicas {
			plans[i] = planReplica(rng, mode, r, kind)
			calls += len(plans[i])
		}

		var wg sync.WaitGroup
		var mu sync.Mutex
		var failed []error
		// The sweeper passes in a loop meanwhile, removing orphans at
		// once: it takes the identifier's lock like the plugin.
		stopSweeps := make(chan struct{})
		sweepsDone := make(chan struct{})
		go func() {
			defer close(sweepsDone)
			for {
				select {
				case <-stopSweeps:
					return
				default:
				}
				_, err := c.sweeper(t, "sweep", "--json", "--pin-root", c.pinRoot, "--grace", "1ms", "--orphan-grace", "0")
				mu.Lock()
				sweeps++
				if err != nil {
					failed = append(failed, err)
				}
				mu.Unlock()
			}
		}()
		run := func(ops []raceOp) {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for _, op := range ops {
					time.Sleep(op.pause)
					if err := c.exec(op.inv); err != nil {
						mu.Lock()
						failed = append(failed, err)
						mu.Unlock()
					}
				}
			}()
		}
		if kind == roundBurst {
			// The one member leaves while every other replica joins.
			// The test holds the identifier's lock (as the sweeper
			// may) until the DEL and then all ADDs wait for it, so
			// that the DEL, woken first, empties the identifier and
			// removes its directory under 31 queued ADDs.
			c.barrier(t, id, func(waitFor func(n int)) {
				for i, r := range replicas {
					if r == first {
						run(plans[i])
					}
				}
				waitFor(1)
				for i, r := range replicas {
					if r != first {
						run(plans[i])
					}
				}
				waitFor(len(replicas))
			})
			for _, op := range stragglers {
				run([]raceOp{op})
			}
		} else {
			for i := range plans {
				run(plans[i])
			}
		}
		wg.Wait()
		close(stopSweeps)
		<-sweepsDone
		if !c.hasEntry(t, bystanderEntry) {
			t.Errorf("round %d: a sweep deleted the live entry of a bystander", round)
		}
		perKind[kind] += calls - before
		kindTime[kind] += time.Since(roundStart)
		for _, err := range failed {
			t.Errorf("round %d (%s): %v", round, kind, err)
		}

		// What the plans did.
		for _, op := range stragglers {
			exp.leave(id, op.inv.containerID)
		}
		for i, r := range replicas {
			for _, op := range plans[i] {
				switch op.inv.command {
				case "ADD":
					exp.join(id, op.inv.containerID, r.slot)
				case "DEL":
					exp.leave(id, op.inv.containerID)
				}
			}
		}
		objs := c.check(t, fmt.Sprintf("round %d (%s, %d members)", round, kind, len(exp.live[id])), exp)
		seen.add(objs[id])
		if len(exp.live[id]) == 0 {
			waitFreed(t, fmt.Sprintf("round %d (%s)", round, kind), seen)
			seen = kernelObjects{}
		}
		if t.Failed() {
			t.Fatalf("round %d (%s) failed (seed %d)", round, kind, seed)
		}
	}
	var kinds []string
	for _, k := range []roundKind{roundBurst, roundChurn, roundFlap, roundDrain} {
		kinds = append(kinds, fmt.Sprintf("%s %d in %v", k, perKind[k], kindTime[k].Round(time.Millisecond)))
	}
	t.Logf("%d calls in %d rounds (%s), %d sweeps meanwhile, %v", calls, raceRounds, strings.Join(kinds, ", "), sweeps, time.Since(start).Round(time.Millisecond))
}

// roundKind is the shape of a round's calls.
type roundKind string

const (
	// roundBurst starts from an empty identifier: one replica joins,
	// then leaves while every other one joins (and half of them leave
	// again).
	roundBurst roundKind = "burst"
	// roundChurn replaces a random share of the members and keeps or
	// drops others.
	roundChurn roundKind = "churn"
	// roundFlap deletes every member and adds and deletes a container of
	// half of the replicas, so that the identifier is emptied and
	// recreated while calls wait for it.
	roundFlap roundKind = "flap"
	// roundDrain deletes every member.
	roundDrain roundKind = "drain"
)

// roundKinds repeat; a drain precedes each burst.
var roundKinds = []roundKind{roundBurst, roundChurn, roundFlap, roundChurn, roundDrain}

// next names the replica's next container.
func (r *raceReplica) next(mode string) string {
	r.gen++
	r.current = fmt.Sprintf("%s-%s-g%03d", mode, r.name, r.gen)
	return r.current
}

// planReplica plans one replica's calls in a round, in the order a runtime
// makes them for one pod: the current container's DEL (at stop, with the
// netns and prevResult, or at removal, without), a new container's ADD when
// the replica stays, and sometimes containerd's second DEL of the old
// container. A member may also be left alone.
func planReplica(rng *rand.Rand, mode string, r *raceReplica, kind roundKind) []raceOp {
	pause := func(max time.Duration) time.Duration { return time.Duration(rng.Int64N(int64(max))) }
	var ops []raceOp
	del := func(ctr string, bare bool, p time.Duration) {
		r.last = ctr
		ops = append(ops, raceOp{
			inv:   invocation{command: "DEL", containerID: ctr, pod: r.name, slot: r.slot, bare: bare},
			pause: p,
		})
	}
	add := func(p time.Duration) string {
		ctr := r.next(mode)
		ops = append(ops, raceOp{
			inv:   invocation{command: "ADD", containerID: ctr, pod: r.name, slot: r.slot},
			pause: p,
		})
		return ctr
	}
	old := r.current
	switch kind {
	case roundBurst:
		if old != "" {
			r.current = ""
			del(old, rng.IntN(2) == 0, 0)
		} else {
			ctr := add(0)
			if rng.IntN(2) == 0 {
				// Gone again while others still wait for the lock.
				r.current = ""
				del(ctr, rng.IntN(2) == 0, pause(5*time.Millisecond))
			}
		}
		return ops
	case roundChurn:
		keep := []float64{0.25, 0.5, 0.75, 1}[rng.IntN(4)]
		stays := rng.Float64() < keep
		if old != "" && stays && rng.IntN(3) == 0 {
			return nil // untouched, its pins must survive the churn
		}
		r.current = ""
		if old != "" {
			del(old, rng.IntN(2) == 0, 0)
		}
		if stays {
			add(pause(10 * time.Millisecond))
		}
	case roundFlap:
		r.current = ""
		if old != "" {
			del(old, rng.IntN(2) == 0, 0)
		}
		if rng.IntN(2) == 0 {
			ctr := add(pause(5 * time.Millisecond))
			r.current = ""
			del(ctr, rng.IntN(2) == 0, pause(5*time.Millisecond))
		}
	case roundDrain:
		r.current = ""
		if old != "" {
			del(old, rng.IntN(2) == 0, 0)
		}
	}
	if old != "" && rng.IntN(3) == 0 {
		// The removal-time DEL of the old container, after the stop-time
		// one (and maybe after the new container's ADD).
		del(old, true, pause(10*time.Millisecond))
	}
	if len(ops) > 0 {
		window := 30 * time.Millisecond
		if kind == roundFlap {
			window = 300 * time.Millisecond // spread, so members keep coming and going
		}
		ops[0].pause = pause(window)
	}
	return ops
}

// barrier holds the identifier's lock while start launches calls; start's
// waitFor(n) returns once n processes wait for the lock (or after a
// timeout, which a call that failed before locking causes). The lock is
// released when start returns.
func (c *cluster) barrier(t *testing.T, id podid.ID, start func(waitFor func(n int))) {
	t.Helper()
	lock, err := membership.New(c.pinRoot).Lock(id)
	if err != nil {
		t.Fatalf("hold the lock of %s: %v", id, err)
	}
	defer lock.Unlock()
	var st unix.Stat_t
	if err := unix.Stat(lock.Dir(), &st); err != nil {
		t.Fatal(err)
	}
	start(func(n int) {
		deadline := time.Now().Add(20 * time.Second)
		for lockWaiters(st) < n {
			if time.Now().After(deadline) {
				t.Logf("only %d of %d calls wait for the lock of %s", lockWaiters(st), n, id)
				return
			}
			time.Sleep(2 * time.Millisecond)
		}
	})
}

// lockWaiters counts the processes blocked on a lock of the file (from
// /proc/locks, whose blocked entries are marked "->").
func lockWaiters(st unix.Stat_t) int {
	b, err := os.ReadFile("/proc/locks")
	if err != nil {
		return 0
	}
	want := fmt.Sprintf("%02x:%02x:%d", unix.Major(st.Dev), unix.Minor(st.Dev), st.Ino)
	n := 0
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) > 6 && f[1] == "->" && f[6] == want {
			n++
		}
	}
	return n
}
