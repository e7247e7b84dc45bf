package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"slices"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/podfence/podfence/pkg/adopt"
	"github.com/podfence/podfence/pkg/ctnetlink"
	"github.com/podfence/podfence/pkg/localhook"
	"github.com/podfence/podfence/pkg/nodeaddr"
	"github.com/podfence/podfence/pkg/pinpath"
	"github.com/podfence/podfence/pkg/pinroot"
	"github.com/podfence/podfence/pkg/policy"
	"github.com/podfence/podfence/pkg/policymirror"
	"github.com/podfence/podfence/pkg/policywatch"
	"github.com/podfence/podfence/pkg/servicewatch"
	"github.com/podfence/podfence/pkg/sweep"
	"github.com/podfence/podfence/pkg/uplink"
)

// fillWarn is the occupancy past which an LRU map starts evicting live flows.
const fillWarn = 0.9

func discardLog() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }

func cmdRun(args []string, stdout, stderr io.Writer) error {
	var c common
	fs := newFlags("run", stderr, &c, true)
	metricsAddr := fs.String("metrics-addr", ":9465", "address of /metrics and /healthz (empty: none)")
	minInterval := fs.Duration("interval-min", sweep.DefaultInterval.Min, "shortest time between full passes")
	maxInterval := fs.Duration("interval-max", sweep.DefaultInterval.Max, "longest time between full passes")
	policyDir := fs.String("policy-dir", defaultPolicyDir, "the plugin's policyDir: followed, and programmed into every identifier as it changes")
	source := fs.String("policy-source", sourceFiles, "where policy comes from: files (policyDir, written by hand or a config tool) or kubernetes (PolicyEndpoints selecting this node's pods, mirrored into policyDir)")
	kubeconfig := fs.String("kubeconfig", "", "with --policy-source=kubernetes: kubeconfig file (empty: the pod's in-cluster ServiceAccount)")
	logLevel := fs.String("log-level", "info", "debug, info, warn or error")
	eventBuffer := fs.Int("event-buffer", ctnetlink.DefaultEventsReadBuffer, "receive buffer for conntrack destroy events, in bytes; events past it are lost and cause a full pass")
	keepChained := fs.Bool("keep-chained", false, "keep podfence in the node's CNI chain: put its conflist entry and its binary back when the primary CNI rewrites its conflist or cleans the plugin directory (needs the CNI directories in the container)")
	var cf cniFlags
	cf.register(fs)
	plugin := fs.String("plugin", "", "with --keep-chained: the podfence binary to put back (default: podfence beside this binary)")
	mode := fs.String("enforcing-mode", "", "with --keep-chained: enforcingMode of podfence's entry when the conflist has none to keep (empty: the plugin's default, standard)")
	adoptPods := fs.Bool("adopt", false, "fence the running pods podfence's ADD never saw (installed after them, or out of the chain when they were created): asks the container runtime (--cri-socket) and runs the plugin's ADD for each; in strict mode this closes every adopted pod no policy opens")
	criSocket := fs.String("cri-socket", adopt.DefaultCRISocket, "with --adopt: the container runtime's CRI endpoint")
	adoptInterval := fs.Duration("adopt-interval", 30*time.Second, "with --adopt: how often to look for pods to adopt besides the start and each repair of the chain")
	judgeUplinks := fs.Bool("judge-uplinks", true, "hook the judge of pods' Service flows on the TC egress of the node's interfaces other than loopback and veths, as they appear: a flow translated to a backend off the node is judged there on the backend (false: such flows leave unjudged; only for a node where another component does it)")
	localCgroup := fs.String("judge-local-cgroup", "auto", "hook the judge of pods' Service flows delivered to the node's own sockets (host-network pods, the node itself) at the inet ingress of this cgroup v2 directory: auto is the root of the node's cgroup v2 hierarchy, which holds every socket; none takes an earlier run's hook off and leaves such flows judged only at their first reply (a refused UDP datagram then reaches the socket); where auto finds no cgroup v2 hierarchy the sweeper runs without the hook")
	if err := parse(fs, args); err != nil {
		return err
	}
	if *source != sourceFiles && *source != sourceKubernetes {
		return usageError{fmt.Errorf("--policy-source %q: want %s or %s", *source, sourceFiles, sourceKubernetes)}
	}
	if *kubeconfig != "" && *source != sourceKubernetes {
		return usageError{fmt.Errorf("--kubeconfig needs --policy-source=%s", sourceKubernetes)}
	}
	if *eventBuffer <= 0 {
		return usageError{fmt.Errorf("--event-buffer %d: need a positive size", *eventBuffer)}
	}
	var level slog.Level
	if err := level.UnmarshalText([]byte(*logLevel)); err != nil {
		return usageError{fmt.Errorf("--log-level: %w", err)}
	}
	if *adoptInterval <= 0 {
		return usageError{fmt.Errorf("--adopt-interval %v: need a positive interval", *adoptInterval)}
	}
	if *minInterval <= 0 || *maxInterval < *minInterval {
		return usageError{fmt.Errorf("--interval-min %v and --interval-max %v: need 0 < min <= max", *minInterval, *maxInterval)}
	}
	log := slog.New(slog.NewJSONHandler(stderr, &slog.HandlerOptions{Level: level}))
	var keeperConf map[string]any
	var keeperBin []byte
	if *keepChained {
		var err error
		if keeperConf, err = podfenceEntry(c.pinRoot, *policyDir, *mode); err != nil {
			return err
		}
		if keeperBin, err = pluginBinary(*plugin); err != nil {
			return err
		}
	}
	if c.grace == 0 {
		log.Warn("--grace 0: a new flow's entry may be deleted before netfilter creates its kernel flow; its next packet is then judged again by policy")
	}

	root, err := openRoot(&c, serve)
	if err != nil {
		return err
	}
	defer root.Close()
	// Before anything programs the identifiers: pins and pods of an
	// earlier build move onto this one's datapath (the plugin does the
	// same for each identifier it adds a pod to).
	start := time.Now()
	rep, err := upgradeNode(root)
	logUpgrade(log, rep, time.Since(start), err)
	warnAWSAgent(log)
	s, err := sweep.New(root, sweep.Options{Grace: c.grace, OrphanGrace: c.orphanGrace, Log: log})
	if err != nil {
		return err
	}
	defer s.Close()

	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	r := &runner{
		s: s, pins: root, log: log, policyDir: *policyDir,
		interval: sweep.Interval{Min: *minInterval, Max: *maxInterval},
		wake:     make(chan struct{}, 1),
		events:   ctnetlink.EventsOptions{ReadBuffer: *eventBuffer},
	}
	reg := prometheus.NewRegistry()
	r.m = newMetrics(reg, root)
	registerDroppedEvents(reg, root)
	if *keepChained {
		r.chain = newChainKeeper(cf, keeperConf, keeperBin, log, reg)
	}
	if *adoptPods {
		cri, err := adopt.DialCRI(*criSocket)
		if err != nil {
			return usageError{fmt.Errorf("--cri-socket: %w", err)}
		}
		defer cri.Close()
		r.adopt = newAdopter(adopt.Options{Runtime: cri, Conflist: cf.read, BinDir: cf.binDir, Root: root, Seed: true}, *adoptInterval, log, reg)
		if r.chain != nil {
			r.chain.repaired = r.adopt.wake
		}
	}
	if *judgeUplinks {
		r.uplinksDir = pinpath.Root(c.pinRoot).Uplinks()
	}
	switch *localCgroup {
	case "none":
		// An earlier run's hook would go on judging with the programs
		// of its build.
		if err := localhook.Release(pinpath.Root(c.pinRoot).LocalLink()); err != nil {
			return err
		}
	case "auto":
		if r.localCgroup, err = localhook.Root(); err != nil {
			log.Warn("the judge of Service flows delivered to the node's sockets is not hooked: such a flow is judged at its first reply, and what it sends before reaches the socket (--judge-local-cgroup names a directory)", "error", err)
		}
	default:
		r.localCgroup = *localCgroup
	}
	if *source == sourceKubernetes {
		cfg, err := apiConfig(*kubeconfig)
		if err != nil {
			return err
		}
		if r.mirror, err = newMirror(cfg, *policyDir, r.m, log); err != nil {
			return err
		}
		if r.services, err = newServiceWatch(cfg, root, log); err != nil {
			return err
		}
	} else if synced, err := policy.Synced(*policyDir); err == nil && !synced {
		// A run with --policy-source=kubernetes stopped before its first
		// sync. With files as the source, the files are the truth.
		if err := policy.MarkSynced(*policyDir); err != nil {
			return err
		}
		log.Warn("removed the unsynced mark a Kubernetes-source run left; the policy files are the source now", "dir", *policyDir)
	}
	if *metricsAddr != "" {
		srv, err := r.serve(*metricsAddr, reg)
		if err != nil {
			return err
		}
		defer srv.Shutdown(context.Background()) //nolint:errcheck // exiting
	}
	return r.loop(ctx)
}

// runner is the DaemonSet loop's state.
type runner struct {
	s          *sweep.Sweeper
	pins       *pinroot.Root
	m          *metrics
	log        *slog.Logger
	policyDir  string
	mirror     *policymirror.Mirror  // nil with --policy-source=files
	chain      *chainKeeper          // nil without --keep-chained
	adopt      *adopter              // nil without --adopt
	services   *servicewatch.Watcher // nil with --policy-source=files
	uplinks    *uplink.Hooks         // nil with --judge-uplinks=false, or no kfuncs
	uplinksDir string                // where the uplinks' link pins go; empty: --judge-uplinks=false
	// uplinksHooked is how many interfaces the last syncUplinks hooked;
	// uplinksWarned, that the kernel cannot judge after the translation.
	uplinksHooked int
	uplinksWarned bool
	// localCgroup is the cgroup the local judge hooks (empty:
	// --judge-local-cgroup=none); localHooked, that it is hooked.
	localCgroup string
	localHooked bool
	// problems and keepErr are what the last policy load reported, logged
	// again only when they change.
	problems []string
	keepErr  error
	// applied is the digest of the policy directory the last apply
	// programmed into every identifier without an error (zero: none).
	applied policy.Digest
	// programmed is, by document, the controller's change time last seen
	// programmed: each change is observed once.
	programmed map[string]time.Time
	interval   sweep.Interval
	healthy    atomic.Bool
	wake       chan struct{} // a full pass is wanted now (lost events)
	events     ctnetlink.EventsOptions
}

func (r *runner) serve(addr string, reg *prometheus.Registry) (*http.Server, error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("--metrics-addr: %w", err)
	}
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	mux.HandleFunc("/healthz", func(w http.ResponseWriter, _ *http.Request) {
		if !r.healthy.Load() {
			http.Error(w, "not ready: the last pass failed or none has run", http.StatusServiceUnavailable)
			return
		}
		fmt.Fprintln(w, "ok")
	})
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	go srv.Serve(ln) //nolint:errcheck // ends with Shutdown
	r.log.Info("serving metrics", "addr", ln.Addr().String())
	return srv, nil
}

func (r *runner) loop(ctx context.Context) error {
	var wg sync.WaitGroup
	defer wg.Wait()
	ctx, cancel := context.WithCancel(ctx)
	defer cancel() // before wg.Wait: ends the goroutines on every return

	ev, err := ctnetlink.OpenEventsWith(r.events)
	if err != nil {
		return fmt.Errorf("follow conntrack events: %w", err)
	}
	wg.Add(1)
	go func() {
		defer wg.Done()
		err := r.s.Follow(ev, func(er sweep.EventReport) {
			r.m.events.Add(float64(er.Events))
			r.m.eventDeletes.Add(float64(er.Deleted))
			if er.Lost {
				r.m.eventsLost.Inc()
				r.log.Warn("conntrack destroy events lost: running a full pass")
				select {
				case r.wake <- struct{}{}:
				default:
				}
			}
		})
		if err != nil && ctx.Err() == nil {
			r.log.Error("following conntrack events stopped; passes continue", "error", err)
		}
	}()
	defer ev.Close() // before wg.Wait: unblocks Follow

	// A member whose veth the kernel deletes goes at once: its pod is
	// gone, whatever its DEL did (an adoption that raced it, a runtime
	// that never called it). The passes' orphan collection remains for
	// deletions this misses.
	wg.Add(1)
	go func() {
		defer wg.Done()
		subscriptions := 0
		err := sweep.FollowLinkRemovals(ctx.Done(), func(links sweep.Removed) {
			if links == nil {
				if subscriptions++; subscriptions > 1 {
					r.log.Warn("link removal events lost: looking at every member's veth")
				}
			}
			orphans, err := r.s.RemoveVethless(links)
			r.m.orphans.Add(float64(len(orphans)))
			if err != nil {
				r.log.Error("remove the members of deleted veths; the next pass tries again", "error", err)
			}
		})
		if err != nil {
			r.log.Error("cannot follow link removals: members of deleted veths go at the passes' orphan collection", "error", err)
		}
	}()

	if r.chain != nil {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r.chain.run(ctx)
		}()
	}
	if r.adopt != nil {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r.adopt.run(ctx)
		}()
	}

	done := make(chan struct{})
	defer close(done)
	addrs, err := nodeaddr.Watch(done)
	if err != nil {
		return err
	}
	r.syncNodeAddrs()

	// Policy changes are programmed as they settle; the directory is read
	// once at the start, for changes made while no sweeper ran.
	follow, err := policywatch.Follow(r.policyDir, 0)
	if err != nil {
		return err
	}
	defer follow.Close()

	// The mirror writes into the directory followed, and also says when
	// it wrote and when its first sync is complete.
	var mirrored <-chan struct{}
	if r.mirror != nil {
		mirrored = r.mirror.Changed()
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := r.mirror.Run(ctx); err != nil && ctx.Err() == nil {
				r.log.Error("following PolicyEndpoints stopped", "error", err)
			}
		}()
	}
	if r.services != nil {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := r.services.Run(ctx); err != nil && ctx.Err() == nil {
				r.log.Error("following Services stopped", "error", err)
			}
		}()
	}
	var links chan struct{}
	if r.uplinksDir != "" {
		links = make(chan struct{}, 1)
		wg.Add(1)
		go func() {
			defer wg.Done()
			followLinks(ctx, links, r.log)
		}()
		r.syncUplinks()
	}
	r.syncLocal()
	sc := schedule{interval: r.interval, wake: r.wake, addrs: addrs, policy: follow.C, mirrored: mirrored, links: links}
	sc.run(ctx, r)
	r.log.Info("stopping", "reason", context.Cause(ctx))
	return nil
}

// pass runs a full pass, and returns when the next is due after one
// waited for since the last.
func (r *runner) pass(waited time.Duration) time.Duration {
	r.syncUplinks()
	r.syncLocal()
	r.sweepSlots()
	rep, err := r.s.Pass()
	r.m.pass(rep, err)
	r.healthy.Store(err == nil)
	if err != nil {
		r.log.Error("pass failed: nothing deleted after the failure", "error", err)
	} else {
		r.logPass(rep)
	}
	fill := max(rep.Fill[0], rep.Fill[1])
	return r.interval.Next(waited, fill, rep.Deleted, rep.Scanned)
}

// policyChanged is what the follower of the policy directory saw.
func (r *runner) policyChanged(e policywatch.Event) {
	switch {
	case e.Problem != nil:
		r.log.Error("cannot follow the policy directory in full; its files are read at its next change", "error", e.Problem)
		return
	case e.Change == policywatch.WatchedAgain:
		r.log.Error("following the policy directory stopped; watching it again", "error", e.Err)
	case e.Change == policywatch.ClusterGone:
		// Removed (with the policy directory, say): its policies no
		// longer apply. It is followed again when it is back.
		r.log.Info("the cluster policy directory is gone: no cluster policy applies until it is back", "reason", e.Err)
	}
	r.applyPolicies(pushOf(e.Change))
}

// mirrorWrote is the mirror's signal that it wrote what the API changed.
func (r *runner) mirrorWrote() {
	select {
	case <-r.mirror.Synced():
		r.m.mirrorSynced.Set(1)
	default:
	}
	r.applyPolicies(pushMirrored)
}

func (r *runner) logPass(rep sweep.Report) {
	attrs := []any{"duration_ms", rep.Duration.Milliseconds(), "kernel_flows", rep.KernelFlows,
		"scanned", rep.Scanned, "deleted", rep.Deleted, "orphans", len(rep.Orphans),
		"fill_v4", rep.Fill[0], "fill_v6", rep.Fill[1]}
	r.log.Debug("pass", attrs...)
	for fam, f := range rep.Fill {
		if f > fillWarn {
			r.log.Warn("conntrack map nearly full: the datapath evicts flows; raise ctV4Entries/ctV6Entries and --ct-v4-entries/--ct-v6-entries",
				"family", []string{"ipv4", "ipv6"}[fam], "fill", f)
		}
	}
}

// push is why the policy directory is programmed into every identifier.
type push uint8

const (
	pushStart               push = iota // the sweeper started
	pushFilesChanged                    // inotify: the policy directory's files
	pushClusterFilesChanged             // inotify: its cluster/ subdirectory's
	pushMirrored                        // the mirror wrote what the API changed
	pushWatchedAgain                    // the policy directory is followed again
	pushClusterDirGone                  // cluster/ was removed
)

// pushOf is the push of what the follower of the policy directory saw.
func pushOf(c policywatch.Change) push {
	switch c {
	case policywatch.FilesChanged:
		return pushFilesChanged
	case policywatch.ClusterChanged:
		return pushClusterFilesChanged
	case policywatch.WatchedAgain:
		return pushWatchedAgain
	default:
		return pushClusterDirGone
	}
}

func (p push) String() string {
	switch p {
	case pushStart:
		return "start"
	case pushMirrored:
		return "PolicyEndpoints changed"
	case pushFilesChanged:
		return policywatch.FilesChanged.String()
	case pushClusterFilesChanged:
		return policywatch.ClusterChanged.String()
	case pushWatchedAgain:
		return policywatch.WatchedAgain.String()
	case pushClusterDirGone:
		return policywatch.ClusterGone.String()
	}
	return fmt.Sprintf("push(%d)", uint8(p))
}

// ofChange says p reports a change of the directory's files, which reaches
// the loop once or twice (the mirror's signal, then inotify's on the
// directory or on cluster/): a directory that is programmed already is not
// programmed again. The other pushes program whatever it holds.
func (p push) ofChange() bool {
	return p == pushFilesChanged || p == pushClusterFilesChanged || p == pushMirrored
}

// applyPolicies programs every identifier with what the policy directory
// says. A directory that cannot be read changes nothing; the refusal is
// logged and counted (ReapplyPolicies records it for ls). What documents
// say that is not enforced as written is logged when it changes, and
// counted.
func (r *runner) applyPolicies(why push) {
	start := time.Now()
	var unless policy.Digest
	if why.ofChange() {
		unless = r.applied
	}
	r.applied = policy.Digest{}
	a, err := r.pins.ReapplyPolicies(r.policyDir, unless)
	if a.Unchanged {
		r.applied = a.Digest
		r.log.Debug("policy directory unchanged: not programmed again", "why", why.String())
		return
	}
	n := a.Identifiers
	if errors.Is(err, policy.ErrUnsynced) {
		r.log.Info("policy not programmed until the first sync with the API: identifiers keep what they enforce", "why", why.String())
		return
	}
	if errors.Is(err, pinroot.ErrInvalidPolicy) {
		r.m.policyValid.Set(0)
		r.m.policyErrors.Inc()
		r.log.Error("policy directory refused: every identifier keeps its last good policy", "why", why.String(), "error", err)
		return
	}
	r.m.policyValid.Set(1)
	r.m.policyApplies.Inc()
	r.observeLatency(a.Changed, time.Now())
	r.m.documentsInvalid.Set(float64(a.Broken))
	r.m.rulesNotEnforced.Set(float64(a.NotEnforced))
	if !slices.Equal(a.Problems, r.problems) {
		for _, p := range a.Problems {
			r.log.Warn("policy not enforced as written", "problem", p)
		}
		r.problems = a.Problems
	}
	if a.KeepErr != nil && (r.keepErr == nil || a.KeepErr.Error() != r.keepErr.Error()) {
		r.log.Warn("last good versions of the policy files not recorded: a document that breaks then isolates its pods instead", "error", a.KeepErr)
	}
	r.keepErr = a.KeepErr
	if err != nil {
		r.m.policyErrors.Inc()
		r.log.Error("program identifiers with the policy", "why", why.String(), "identifiers_programmed", n, "error", err)
		return
	}
	r.applied = a.Digest
	r.log.Info("policy programmed", "why", why.String(), "identifiers", n, "duration_ms", time.Since(start).Milliseconds())
}

// syncNodeAddrs writes the node's addresses and, when they changed,
// reprograms every identifier so its tries allow the new ones.
func (r *runner) syncNodeAddrs() {
	g, err := r.pins.Global()
	if err != nil {
		r.log.Error("write the node's addresses", "error", err)
		return
	}
	before, _ := g.NodeAddresses()
	if err := g.SyncNodeAddrs(nodeaddr.List); err != nil {
		r.log.Error("write the node's addresses", "error", err)
		return
	}
	after, _ := g.NodeAddresses()
	if sameAddrs(before, after) {
		return
	}
	r.m.nodeAddrSyncs.Inc()
	if r.mirror != nil {
		r.mirror.Kick() // PolicyEndpoints select pods by the node's address
	}
	if r.services != nil {
		r.services.Kick() // NodePorts are on the node's addresses
	}
	a, err := r.pins.ReapplyPolicies(r.policyDir, policy.Digest{})
	r.log.Info("node addresses changed", "addresses", fmt.Sprint(after), "identifiers_reprogrammed", a.Identifiers)
	if err != nil && !errors.Is(err, policy.ErrUnsynced) {
		r.log.Error("reprogram identifiers for the node's addresses", "error", err)
	}
}

func sameAddrs[T comparable](a, b []T) bool {
	if len(a) != len(b) {
		return false
	}
	set := make(map[T]bool, len(a))
	for _, x := range a {
		set[x] = true
	}
	for _, x := range b {
		if !set[x] {
			return false
		}
	}
	return true
}

// observeLatency records, for each document the controller changed since
// the last apply, how long its change took to be programmed: from the
// controller's write (policy.ChangeTimeAnnotation) to now. The first
// apply after a start only notes the times, which are no new change.
func (r *runner) observeLatency(changed map[string]time.Time, now time.Time) {
	first := r.programmed == nil
	if first {
		r.programmed = map[string]time.Time{}
	}
	for doc, at := range changed {
		if seen, ok := r.programmed[doc]; !first && (!ok || at.After(seen)) {
			if d := now.Sub(at); d >= 0 {
				r.m.programmingLatency.Observe(d.Seconds())
			}
		}
		r.programmed[doc] = at
	}
	for doc := range r.programmed {
		if _, ok := changed[doc]; !ok {
			delete(r.programmed, doc)
		}
	}
}
