package main

import (
	"context"
	"errors"
	"log/slog"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/podfence/podfence/pkg/adopt"
)

// adopter fences, while the sweeper runs, the pods whose ADD podfence
// never saw (package adopt): at start, after each repair of the chain, and
// every interval (a pod created while the chain was broken).
type adopter struct {
	opts     adopt.Options
	interval time.Duration
	kick     chan struct{} // a pass is wanted now
	log      *slog.Logger

	adopted  prometheus.Counter
	failures prometheus.Counter
}

func newAdopter(opts adopt.Options, interval time.Duration, log *slog.Logger, reg prometheus.Registerer) *adopter {
	a := &adopter{opts: opts, interval: interval, kick: make(chan struct{}, 1), log: log,
		adopted: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "podfence_adopted_pods_total",
			Help: "Pods fenced by adoption: running pods whose ADD podfence never saw (installed after them, or out of the chain when they were created)."}),
		failures: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "podfence_adoption_failures_total",
			Help: "Pods that adoption could not fence (each is tried again at the next pass)."}),
	}
	reg.MustRegister(a.adopted, a.failures)
	return a
}

// wake asks for a pass now.
func (a *adopter) wake() {
	select {
	case a.kick <- struct{}{}:
	default:
	}
}

// repairSettle is when a second pass follows one woken by a repair of the
// chain: a pod whose ADD ran in the gap is not ready at the repair, and
// adoption leaves a sandbox that is not ready alone.
const repairSettle = 5 * time.Second

func (a *adopter) run(ctx context.Context) {
	tick := time.NewTicker(a.interval)
	defer tick.Stop()
	var settle <-chan time.Time // nil: no second pass due
	why := "start"
	for {
		a.pass(ctx, why)
		select {
		case <-ctx.Done():
			return
		case <-a.kick:
			why = "chain repaired"
			settle = time.After(repairSettle)
		case <-settle:
			why = "chain repaired, pods created in the gap now ready"
			settle = nil
		case <-tick.C:
			why = "periodic"
		}
	}
}

func (a *adopter) pass(ctx context.Context, why string) {
	start := time.Now()
	r, err := adopt.Pass(ctx, a.opts)
	if errors.Is(err, adopt.ErrNotChained) {
		a.log.Debug("no pod adopted: podfence is not in the CNI chain", "why", why)
		return
	}
	if err != nil {
		a.log.Error("adoption: cannot list the node's pods", "why", why, "error", err)
		return
	}
	for _, p := range r.Adopted {
		a.log.Info("adopted a running pod podfence's ADD never saw", "pod", p, "why", why)
	}
	for _, e := range r.Failed {
		a.log.Warn("adoption failed; tried again at the next pass", "error", e)
	}
	a.adopted.Add(float64(len(r.Adopted)))
	a.failures.Add(float64(len(r.Failed)))
	if len(r.Adopted) > 0 || len(r.Failed) > 0 {
		a.log.Info("adoption pass", "why", why, "sandboxes", r.Sandboxes, "fenced_already", r.Fenced,
			"adopted", len(r.Adopted), "failed", len(r.Failed), "flows_seeded_allowed", r.Seeded.Allowed,
			"flows_seeded_denied", r.Seeded.Denied, "duration_ms", time.Since(start).Milliseconds())
	}
}
