package main

import (
	"context"
	"time"

	"github.com/podfence/podfence/pkg/policywatch"
	"github.com/podfence/podfence/pkg/sweep"
)

// schedule is the order of run's work on its inputs, one thing at a time:
// the policy directory programmed at the start and at each change, a full
// pass at once and then at the adaptive interval or when one is asked for
// (wake), the node's addresses written as they change. A pass is never
// interrupted: a change that comes during one waits for it.
type schedule struct {
	interval sweep.Interval
	wake     <-chan struct{}          // a full pass is wanted now (lost events)
	addrs    <-chan struct{}          // the node's addresses changed
	policy   <-chan policywatch.Event // the policy directory changed
	mirrored <-chan struct{}          // the mirror wrote (nil without one)
	links    <-chan struct{}          // the kernel added a link (nil when uplinks are not hooked)
}

// work is what a schedule has done (the runner's).
type work interface {
	applyPolicies(push)
	policyChanged(policywatch.Event)
	mirrorWrote()
	syncNodeAddrs()
	syncUplinks()
	// pass runs a full pass after waited, and returns when the next is due.
	pass(waited time.Duration) time.Duration
}

// run does w's work until ctx is done.
func (s schedule) run(ctx context.Context, w work) {
	w.applyPolicies(pushStart)
	wait := s.interval.Min
	timer := time.NewTimer(0)
	defer timer.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-s.addrs:
			w.syncNodeAddrs()
			continue
		case e := <-s.policy:
			// Also what the mirror's own writes look like: programmed
			// once, by whichever of the two comes first.
			w.policyChanged(e)
			continue
		case <-s.mirrored:
			w.mirrorWrote()
			continue
		case <-s.links:
			w.syncUplinks()
			continue
		case <-s.wake:
		case <-timer.C:
		}
		wait = w.pass(wait)
		if !timer.Stop() {
			select {
			case <-timer.C:
			default:
			}
		}
		timer.Reset(wait)
	}
}
