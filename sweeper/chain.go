package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/podfence/podfence/pkg/atomicfile"
	"github.com/podfence/podfence/pkg/cniconf"
	"github.com/podfence/podfence/pkg/policywatch"
)

// chainCheckEvery is how often the keeper looks at the CNI directories
// without being told of a change: inotify misses nothing in a directory it
// watches, and this is the fallback where a watch could not be set up or
// failed (the keeper tries to watch again at each look).
const chainCheckEvery = 30 * time.Second

// chainResult is what one look at the node's CNI set-up changed.
type chainResult struct {
	conflist  string
	chained   bool // podfence was put (back) last in the list
	installed bool // the plugin binary was (re)written
}

// ensureChained puts podfence last in the node's conflist, with conf as
// its entry when it is missing, and bin into the plugin directory. With
// install set (install-cni) an entry that is not last is moved to the end
// and a binary that differs is replaced by bin; without it (the keeper)
// only what is missing is put back: an entry elsewhere in the list, or
// another build's binary, is someone's choice, and fighting it would be a
// rewrite loop. A conflist it cannot parse is left as it is: ErrMalformed
// is returned and nothing is written.
func ensureChained(cf cniFlags, conf map[string]any, bin []byte, install bool) (chainResult, error) {
	var res chainResult
	path, data, err := cf.read()
	if err != nil {
		return res, err
	}
	res.conflist = path
	out, changed, err := cniconf.Chain(data, conf)
	if err != nil {
		return res, fmt.Errorf("%s: %w (left as it is)", path, err)
	}
	if !install {
		if entry, err := cniconf.Entry(data); err == nil && entry != nil {
			changed = false
		}
	}
	// The binary first: a runtime that reads the list and finds podfence
	// in it must find the binary too.
	dst := filepath.Join(cf.binDir, cniconf.PluginType)
	old, err := os.ReadFile(dst)
	if err != nil || len(old) == 0 || (install && !bytes.Equal(old, bin)) {
		if err := atomicfile.Write(dst, bin, atomicfile.Options{Perm: 0o755, KeepMode: true, Sync: true}); err != nil {
			return res, fmt.Errorf("install %s: %w", dst, err)
		}
		res.installed = true
	}
	if changed {
		// The primary CNI may have written the list again since it was
		// read: its newer version is not overwritten with the older one
		// (the change it makes calls the keeper again).
		if again, err := os.ReadFile(path); err != nil || !bytes.Equal(again, data) {
			return res, fmt.Errorf("%s changed while podfence was being chained into it: %w", path, errChangedMeanwhile)
		}
		if err := atomicfile.Write(path, out, atomicfile.Options{Perm: 0o644, KeepMode: true, Sync: true}); err != nil {
			return res, fmt.Errorf("write %s: %w", path, err)
		}
		res.chained = true
	}
	return res, nil
}

// errChangedMeanwhile: the conflist changed between its read and its write.
var errChangedMeanwhile = errors.New("changed meanwhile")

// pluginBinary reads the podfence binary to install: path, or podfence
// beside this binary (the image holds both).
func pluginBinary(path string) ([]byte, error) {
	if path == "" {
		self, err := os.Executable()
		if err != nil {
			return nil, fmt.Errorf("find the podfence binary: %w", err)
		}
		path = filepath.Join(filepath.Dir(self), cniconf.PluginType)
	}
	bin, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("read the podfence binary: %w", err)
	}
	if len(bin) == 0 {
		return nil, fmt.Errorf("the podfence binary %s is empty", path)
	}
	return bin, nil
}

// chainKeeper keeps podfence in the node's CNI chain while the sweeper
// runs. A primary CNI rewrites its conflist from its own template when it
// starts (aws-node does at every start, upgrade or restart) and may clean
// the plugin directory when it upgrades; without the keeper every pod
// created afterwards would be left open, or fail its ADD, with nothing to
// show for it.
type chainKeeper struct {
	cf  cniFlags
	bin []byte
	// conf is podfence's entry: the one found in the list (an operator
	// may have edited it), else the one the sweeper's flags describe.
	conf map[string]any
	log  *slog.Logger
	// repaired, when set, is called after podfence was chained again:
	// pods created in the gap are adopted.
	repaired func()

	repairs *prometheus.CounterVec // by part: conflist, binary
	intact  prometheus.Gauge
}

func newChainKeeper(cf cniFlags, conf map[string]any, bin []byte, log *slog.Logger, reg prometheus.Registerer) *chainKeeper {
	k := &chainKeeper{cf: cf, conf: conf, bin: bin, log: log,
		repairs: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "podfence_cni_chain_repairs_total",
			Help: "Times podfence was put back into the node's CNI chain: its conflist entry (part=conflist) or its binary (part=binary)."},
			[]string{"part"}),
		intact: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "podfence_cni_chain_intact",
			Help: "1 when, at the last look, the node's conflist chained podfence last and its binary was in place; 0 when it could not be made so (a conflist podfence cannot parse, a directory it cannot write)."}),
	}
	k.repairs.WithLabelValues("conflist")
	k.repairs.WithLabelValues("binary")
	reg.MustRegister(k.repairs, k.intact)
	return k
}

// check looks at the CNI directories once and repairs what is missing.
func (k *chainKeeper) check(why string) {
	if path, data, err := k.cf.read(); err == nil {
		// Keep the entry as the node has it, so that a repair writes
		// back what the operator chose, not what the flags say.
		if conf, err := cniconf.Entry(data); err == nil && conf != nil {
			k.conf = conf
		} else if err == nil {
			k.log.Warn("podfence is missing from the CNI chain: the primary CNI rewrote its conflist", "conflist", path, "why", why)
		}
	}
	res, err := ensureChained(k.cf, k.conf, k.bin, false)
	if errors.Is(err, errChangedMeanwhile) {
		k.log.Info("the conflist changed while podfence was being chained: looking again", "error", err)
		return // its change is another event
	}
	if err != nil {
		k.intact.Set(0)
		level := slog.LevelError
		if errors.Is(err, os.ErrNotExist) || errors.Is(err, cniconf.ErrNoConflist) {
			level = slog.LevelWarn // the primary CNI has not written it yet
		}
		k.log.Log(context.Background(), level, "podfence is not in the CNI chain and cannot be put back: new pods are not fenced", "why", why, "error", err)
		return
	}
	k.intact.Set(1)
	if res.installed {
		k.repairs.WithLabelValues("binary").Inc()
		k.log.Warn("put the podfence binary back into the CNI plugin directory", "dir", k.cf.binDir, "why", why)
	}
	if res.chained {
		k.repairs.WithLabelValues("conflist").Inc()
		k.log.Warn("chained podfence last again", "conflist", res.conflist, "why", why)
		if k.repaired != nil {
			k.repaired()
		}
	}
}

// run checks at once, then whenever either directory changes, and every
// chainCheckEvery, until ctx ends.
func (k *chainKeeper) run(ctx context.Context) {
	isConf := func(name string) bool {
		return !strings.HasPrefix(name, ".") && (strings.HasSuffix(name, ".conflist") || strings.HasSuffix(name, ".conf") || strings.HasSuffix(name, ".json"))
	}
	isPlugin := func(name string) bool { return name == cniconf.PluginType }
	var confW, binW *policywatch.Watcher
	watch := func() {
		var err error
		if confW == nil {
			if confW, err = policywatch.NewMatching(k.cf.confDir, 0, isConf); err != nil {
				k.log.Warn("cannot follow the CNI configuration directory: looking every "+chainCheckEvery.String(), "error", err)
			}
		}
		if binW == nil {
			if binW, err = policywatch.NewMatching(k.cf.binDir, 0, isPlugin); err != nil {
				k.log.Warn("cannot follow the CNI plugin directory: looking every "+chainCheckEvery.String(), "error", err)
			}
		}
	}
	closeAll := func() {
		if confW != nil {
			confW.Close()
		}
		if binW != nil {
			binW.Close()
		}
	}
	defer func() { closeAll() }()
	watch()
	k.check("start")
	tick := time.NewTicker(chainCheckEvery)
	defer tick.Stop()
	for {
		// A nil watcher's channels are nil: never ready.
		var confC, binC, confFailed, binFailed <-chan struct{}
		if confW != nil {
			confC, confFailed = confW.C, confW.Failed
		}
		if binW != nil {
			binC, binFailed = binW.C, binW.Failed
		}
		select {
		case <-ctx.Done():
			return
		case <-confC:
			k.check("CNI configuration changed")
		case <-binC:
			k.check("CNI plugin directory changed")
		case <-confFailed:
			confW.Close()
			confW = nil
			watch()
			k.check("CNI configuration directory replaced")
		case <-binFailed:
			binW.Close()
			binW = nil
			watch()
			k.check("CNI plugin directory replaced")
		case <-tick.C:
			watch()
			k.check("periodic")
		}
	}
}
