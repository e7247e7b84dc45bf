package main

import (
	"context"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/podfence/podfence/pkg/policywatch"
	"github.com/podfence/podfence/pkg/sweep"
)

// recorder is a schedule's work that records what it was asked to do.
type recorder struct {
	mu     sync.Mutex
	did    []string
	waited []time.Duration // what each pass was told it waited
	next   time.Duration   // what each pass says the next wait is
	done   chan string     // each call, as it happens
}

func (r *recorder) record(s string) {
	r.mu.Lock()
	r.did = append(r.did, s)
	r.mu.Unlock()
	r.done <- s
}

func (r *recorder) applyPolicies(p push)              { r.record("push " + p.String()) }
func (r *recorder) policyChanged(e policywatch.Event) { r.record("changed " + e.Change.String()) }
func (r *recorder) mirrorWrote()                      { r.record("mirror") }
func (r *recorder) syncNodeAddrs()                    { r.record("addrs") }
func (r *recorder) syncUplinks()                      { r.record("uplinks") }
func (r *recorder) pass(waited time.Duration) time.Duration {
	r.mu.Lock()
	r.waited = append(r.waited, waited)
	r.mu.Unlock()
	r.record("pass")
	return r.next
}

// TestSchedule: run programs the policy first and passes at once; each
// input reaches its work, one at a time; a wake runs a pass out of turn;
// the interval a pass returns is the next wait, and what the next pass is
// told it waited; cancelling ends it.
func TestSchedule(t *testing.T) {
	wake, addrs, mirrored := make(chan struct{}), make(chan struct{}), make(chan struct{})
	policy := make(chan policywatch.Event)
	rec := &recorder{next: time.Hour, done: make(chan string, 16)}
	s := schedule{interval: sweep.Interval{Min: time.Hour, Max: 2 * time.Hour}, wake: wake, addrs: addrs, policy: policy, mirrored: mirrored}
	ctx, cancel := context.WithCancel(context.Background())
	ended := make(chan struct{})
	go func() {
		s.run(ctx, rec)
		close(ended)
	}()
	expect := func(want string) {
		t.Helper()
		select {
		case got := <-rec.done:
			if got != want {
				t.Fatalf("did %q, want %q (so far %v)", got, want, rec.did)
			}
		case <-time.After(5 * time.Second):
			t.Fatalf("did nothing; want %q (so far %v)", want, rec.did)
		}
	}
	expect("push start")
	expect("pass")
	policy <- policywatch.Event{Change: policywatch.ClusterChanged}
	expect("changed " + policywatch.ClusterChanged.String())
	mirrored <- struct{}{}
	expect("mirror")
	addrs <- struct{}{}
	expect("addrs")
	wake <- struct{}{}
	expect("pass")
	cancel()
	select {
	case <-ended:
	case <-time.After(5 * time.Second):
		t.Fatal("run did not end when its context did")
	}
	if want := []time.Duration{time.Hour, time.Hour}; !slices.Equal(rec.waited, want) {
		t.Errorf("passes were told they waited %v, want %v (the minimum, then what the first returned)", rec.waited, want)
	}
	if n := len(rec.did); n != 6 {
		t.Errorf("did %d things, want 6: %v", n, rec.did)
	}
}

// TestScheduleInterval: a pass is due when the last one said.
func TestScheduleInterval(t *testing.T) {
	rec := &recorder{next: 20 * time.Millisecond, done: make(chan string, 64)}
	s := schedule{interval: sweep.Interval{Min: time.Millisecond, Max: time.Second}}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go s.run(ctx, rec)
	start := time.Now()
	passes := 0
	for passes < 4 {
		if got := <-rec.done; got == "pass" {
			passes++
		}
	}
	// At once, then three waits of 20 ms.
	if took := time.Since(start); took < 60*time.Millisecond {
		t.Errorf("four passes in %v: they did not wait the interval the last one returned", took)
	}
}
