package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"syscall"
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
	openFor  prometheus.Histogram
}

func newAdopter(opts adopt.Options, interval time.Duration, log *slog.Logger, reg prometheus.Registerer) *adopter {
	a := &adopter{opts: opts, interval: interval, kick: make(chan struct{}, 1), log: log,
		adopted: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "podfence_adopted_pods_total",
			Help: "Pods fenced by adoption: running pods whose ADD podfence never saw (installed after them, or out of the chain when they were created)."}),
		failures: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "podfence_adoption_failures_total",
			Help: "Pods that adoption could not fence (each is tried again at the next pass)."}),
		openFor: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "podfence_adoption_unfenced_seconds",
			Help: "How long each adopted pod ran unfenced: from its sandbox's creation to its adoption. Pods that predate podfence count their age.",
			// From a pass right after a repair of the chain (seconds) to
			// pods that predate the install (days).
			Buckets: prometheus.ExponentialBuckets(0.5, 4, 10)}),
	}
	reg.MustRegister(a.adopted, a.failures, a.openFor)
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
		a.log.Info("adopted a running pod podfence's ADD never saw", "pod", p.Pod, "sandbox", p.Sandbox,
			"unfenced_for", p.OpenFor.Round(time.Millisecond).String(), "why", why)
		if p.OpenFor > 0 {
			a.openFor.Observe(p.OpenFor.Seconds())
		}
	}
	for _, g := range r.Gone {
		a.log.Info("not adopted: the runtime deleted the pod meanwhile", "pod", g.Pod, "sandbox", g.Sandbox, "how", g.How, "why", why)
	}
	for _, e := range r.Failed {
		a.log.Warn("adoption failed; tried again at the next pass", "error", e)
	}
	a.adopted.Add(float64(len(r.Adopted)))
	a.failures.Add(float64(len(r.Failed)))
	if len(r.Adopted) > 0 || len(r.Failed) > 0 || len(r.Gone) > 0 || r.Deferred > 0 {
		a.log.Info("adoption pass", "why", why, "sandboxes", r.Sandboxes, "fenced_already", r.Fenced,
			"adopted", len(r.Adopted), "gone", len(r.Gone), "deferred", r.Deferred, "failed", len(r.Failed), "flows_seeded_allowed", r.Seeded.Allowed,
			"flows_seeded_denied", r.Seeded.Denied, "duration_ms", time.Since(start).Milliseconds())
	}
}

// cmdAdopt runs one adoption pass, the one run --adopt makes at its start,
// and prints what it did: for an operator who runs the sweeper without
// --adopt, or wants the node's pods fenced now.
func cmdAdopt(args []string, stdout, stderr io.Writer) error {
	var c common
	fs := newFlags("adopt", stderr, &c, false)
	var cf cniFlags
	cf.register(fs)
	criSocket := fs.String("cri-socket", adopt.DefaultCRISocket, "the container runtime's CRI endpoint")
	if err := parse(fs, args); err != nil {
		return err
	}
	cri, err := adopt.DialCRI(*criSocket)
	if err != nil {
		return usageError{fmt.Errorf("--cri-socket: %w", err)}
	}
	defer cri.Close()
	// Made if missing, as run makes them: the first adopted pod's flows
	// are seeded into them.
	root, err := openRoot(&c, serve)
	if err != nil {
		return err
	}
	defer root.Close()
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	start := time.Now()
	r, err := adopt.Pass(ctx, adopt.Options{Runtime: cri, Conflist: cf.read, BinDir: cf.binDir, Root: root, Seed: true})
	if err != nil {
		return err
	}
	v := adoptView{Sandboxes: r.Sandboxes, Fenced: r.Fenced, Adopted: []adoptedView{}, Gone: []goneView{}, Deferred: r.Deferred, Failed: []string{},
		SeededAllowed: r.Seeded.Allowed, SeededDenied: r.Seeded.Denied, DurationMS: time.Since(start).Milliseconds()}
	for _, a := range r.Adopted {
		v.Adopted = append(v.Adopted, adoptedView{Pod: a.Pod, Sandbox: a.Sandbox, UnfencedSeconds: a.OpenFor.Seconds()})
	}
	for _, g := range r.Gone {
		v.Gone = append(v.Gone, goneView{Pod: g.Pod, Sandbox: g.Sandbox, How: g.How})
	}
	for _, e := range r.Failed {
		v.Failed = append(v.Failed, e.Error())
	}
	if c.json {
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		if err := enc.Encode(v); err != nil {
			return err
		}
	} else {
		fmt.Fprintf(stdout, "%d ready sandboxes: %d fenced already, %d adopted, %d deleted meanwhile, %d left for the next pass, %d failed (%d ms); flows seeded: %d allowed, %d denied\n",
			v.Sandboxes, v.Fenced, len(v.Adopted), len(v.Gone), v.Deferred, len(v.Failed), v.DurationMS, v.SeededAllowed, v.SeededDenied)
		for _, a := range v.Adopted {
			fmt.Fprintf(stdout, "adopted %s (sandbox %.12s), unfenced for %.1f s\n", a.Pod, a.Sandbox, a.UnfencedSeconds)
		}
		for _, g := range v.Gone {
			fmt.Fprintf(stdout, "deleted meanwhile: %s (sandbox %.12s): %s\n", g.Pod, g.Sandbox, g.How)
		}
		for _, e := range v.Failed {
			fmt.Fprintf(stdout, "failed: %s\n", e)
		}
	}
	if len(r.Failed) > 0 {
		return fmt.Errorf("%d sandboxes not adopted", len(r.Failed))
	}
	return nil
}

type adoptView struct {
	Sandboxes     int           `json:"sandboxes"`
	Fenced        int           `json:"fenced_already"`
	Adopted       []adoptedView `json:"adopted"`
	Gone          []goneView    `json:"deleted_meanwhile"`
	Deferred      int           `json:"left_for_next_pass"`
	Failed        []string      `json:"failed"`
	SeededAllowed int           `json:"flows_seeded_allowed"`
	SeededDenied  int           `json:"flows_seeded_denied"`
	DurationMS    int64         `json:"duration_ms"`
}

type adoptedView struct {
	Pod             string  `json:"pod"`
	Sandbox         string  `json:"sandbox"`
	UnfencedSeconds float64 `json:"unfenced_seconds"`
}

type goneView struct {
	Pod     string `json:"pod"`
	Sandbox string `json:"sandbox"`
	How     string `json:"how"`
}
