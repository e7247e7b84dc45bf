// Package policymirror keeps the policy directory in step with the
// PolicyEndpoints in the Kubernetes API that select pods on this node.
//
// The CNI plugin cannot reach the API at ADD (it runs for a few milliseconds,
// often before the node has a route to it), so the sweeper is the only
// client: it watches PolicyEndpoints with an informer and writes one file per
// object into the directory the plugin reads, with an atomic rename. The
// sweeper then programs the live maps from that same directory, so that the
// files stay the single source of truth on the node.
//
// From the moment a Mirror starts until its first full sync is written, the
// directory carries policy.MarkUnsynced's marker: what it holds is what an
// earlier run saw. Strict pods open nothing on its word, and the sweeper
// changes no live policy until the sync.
//
// ClusterPolicyEndpoints (the controller's cluster-wide tiers) are mirrored
// the same way into the subdirectory ClusterDir, where a plugin of an older
// build, which would refuse the kind, never looks. A cluster whose API does
// not serve them (a controller without cluster policies, or a manifest
// without the permission) has none: the Mirror says so once, asks again
// every minute, and syncs without them.
//
// The informer's reflector resumes its watch from the last resourceVersion
// and lists again when the server answers 410 Gone (its watch cache has moved
// on, after a restart for instance); a list replaces the informer's whole
// store, so every reconcile after it converges the directory on what the API
// holds, deletions while the watch was down included.
package policymirror

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/tools/cache"

	"github.com/podfence/podfence/pkg/atomicfile"
	"github.com/podfence/podfence/pkg/kubeinformer"
	"github.com/podfence/podfence/pkg/policy"
)

// Resource and ClusterResource are the API resources the upstream
// network-policy controller writes.
var (
	Resource        = schema.GroupVersionResource{Group: "networking.k8s.aws", Version: "v1alpha1", Resource: "policyendpoints"}
	ClusterResource = schema.GroupVersionResource{Group: "networking.k8s.aws", Version: "v1alpha1", Resource: "clusterpolicyendpoints"}
)

// filePrefix and clusterFilePrefix mark the files a Mirror owns: it never
// touches others.
const (
	filePrefix        = "pe_"
	clusterFilePrefix = "cpe_"
)

// ClusterDir is the subdirectory of the policy directory that holds the
// mirrored ClusterPolicyEndpoints, where policy.LoadCluster reads them.
const ClusterDir = policy.ClusterDir

// probeEvery is how often a Mirror asks again whether the API serves
// ClusterPolicyEndpoints, while it does not.
var probeEvery = time.Minute

// retryAfter is how long a failed reconcile (a full disk, say) waits before
// it is tried again, when no event comes first.
const retryAfter = time.Second

// Options configure a Mirror.
type Options struct {
	// Dir is the plugin's policyDir. It is created if missing.
	Dir string
	// NodeAddrs returns the node's addresses: a PolicyEndpoint is mirrored
	// when one of its podSelectorEndpoints has one as hostIP.
	NodeAddrs func() ([]netip.Addr, error)
	// OnReconcile, if set, is called after every reconcile, from the
	// Mirror's goroutine.
	OnReconcile func(Report, error)
	Log         *slog.Logger
}

// Report is what one reconcile did.
type Report struct {
	Objects  int // PolicyEndpoints in the informer's store
	Selected int // of those, the ones that select a pod on this node
	// ClusterObjects and ClusterSelected count ClusterPolicyEndpoints the
	// same way.
	ClusterObjects, ClusterSelected int
	// Written, Removed and Invalid count files and objects of both kinds.
	Written  int // files written (new or changed)
	Removed  int // files removed (object deleted, or no longer on this node)
	Invalid  int // objects podfence cannot parse: their last good file stays
	Duration time.Duration
}

// Mirror writes the PolicyEndpoints and ClusterPolicyEndpoints of this node
// into Dir.
type Mirror struct {
	opts    Options
	client  dynamic.Interface
	kinds   []*kind // PolicyEndpoints, then ClusterPolicyEndpoints
	kick    chan struct{}
	changed chan struct{}
	synced  chan struct{}
	// forbiddenLogged: the API refused ClusterPolicyEndpoints (403) and
	// the log said so; Run's goroutine alone reads and sets it.
	forbiddenLogged bool
}

// kind is one resource the Mirror writes, each into a directory of its own.
type kind struct {
	name   string // "PolicyEndpoint", for logs
	gvr    schema.GroupVersionResource
	dir    string
	prefix string
	// check is the parser's verdict on a rendered object (nil: parses).
	check func(data []byte, file string) error
	// informer is nil while the API does not serve the resource (only
	// ClusterPolicyEndpoints may be missing); such a kind holds nothing.
	informer cache.SharedIndexInformer
	started  bool // informer runs (Mirror.start)
	// written is what dir holds, by file name; it starts from what an
	// earlier run left, so a restart rewrites only what changed meanwhile.
	written map[string][]byte
	// rendered is each selected object's document at the resourceVersion
	// it was rendered and parsed at: every event reconciles the whole
	// store, and only the objects that changed pay for a render again.
	rendered map[string]rendering
}

type rendering struct {
	resourceVersion string
	data            []byte
	err             error // Render's: nothing to write
	invalid         error // the parser's: written, enforced as policy.ReadDir says
	logged          bool  // invalid was logged
}

// New prepares a Mirror of client's PolicyEndpoints and
// ClusterPolicyEndpoints into opts.Dir and marks the directory unsynced.
// Nothing is watched until Run.
func New(client dynamic.Interface, opts Options) (*Mirror, error) {
	if opts.Dir == "" || opts.NodeAddrs == nil {
		return nil, errors.New("policymirror: Dir and NodeAddrs are required")
	}
	if opts.Log == nil {
		opts.Log = slog.New(slog.DiscardHandler)
	}
	clusterDir := filepath.Join(opts.Dir, ClusterDir)
	if err := os.MkdirAll(clusterDir, 0o755); err != nil {
		return nil, fmt.Errorf("policy directory: %w", err)
	}
	if err := policy.MarkUnsynced(opts.Dir); err != nil {
		return nil, err
	}
	m := &Mirror{
		opts:    opts,
		client:  client,
		kick:    make(chan struct{}, 1),
		changed: make(chan struct{}, 1),
		synced:  make(chan struct{}),
	}
	for _, k := range []*kind{
		{name: "PolicyEndpoint", gvr: Resource, dir: opts.Dir, prefix: filePrefix, check: func(data []byte, file string) error {
			docs, _ := policy.Parse(bytes.NewReader(data), file)
			return policy.Strict(docs)
		}},
		{name: "ClusterPolicyEndpoint", gvr: ClusterResource, dir: clusterDir, prefix: clusterFilePrefix, check: func(data []byte, file string) error {
			_, err := policy.ParseCluster(bytes.NewReader(data), file)
			return err
		}},
	} {
		var err error
		if k.written, err = readOwned(k.dir, k.prefix); err != nil {
			return nil, err
		}
		k.rendered = make(map[string]rendering)
		m.kinds = append(m.kinds, k)
	}
	// PolicyEndpoints are served wherever the controller runs: waiting
	// for their sync is how the Mirror waits for the API.
	if err := m.watch(m.kinds[0]); err != nil {
		return nil, err
	}
	return m, nil
}

// watch prepares k's informer; start runs it.
func (m *Mirror) watch(k *kind) error {
	inf := kubeinformer.New(m.client, k.gvr)
	kick := func(any) { m.Kick() }
	if _, err := inf.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    kick,
		UpdateFunc: func(_, obj any) { kick(obj) },
		DeleteFunc: func(obj any) {
			// A tombstone: the object was missing from a relist, its
			// delete event lost with the watch that was down.
			if t, ok := obj.(cache.DeletedFinalStateUnknown); ok {
				m.opts.Log.Info(k.name+" found deleted at a relist; the watch missed its delete", "object", t.Key)
			}
			m.Kick()
		},
	}); err != nil {
		return err
	}
	if err := inf.SetWatchErrorHandlerWithContext(func(_ context.Context, _ *cache.Reflector, err error) {
		if apierrors.IsResourceExpired(err) || apierrors.IsGone(err) {
			// The server no longer has the history since our last
			// resourceVersion (compacted, or a restarted watch cache).
			m.opts.Log.Info("watch expired (410 Gone); listing "+k.name+"s again", "error", err)
			return
		}
		m.opts.Log.Warn("watching "+k.name+"s failed; enforcing the last policy and retrying", "error", err)
	}); err != nil {
		return err
	}
	k.informer = inf
	return nil
}

// start runs the informers watch prepared and that do not run yet, until
// ctx ends.
func (m *Mirror) start(ctx context.Context) {
	for _, k := range m.kinds {
		if k.informer != nil && !k.started {
			k.started = true
			go k.informer.RunWithContext(ctx)
		}
	}
}

// Changed receives after a reconcile that changed the directory, and after
// the first sync: the directory is worth programming again.
func (m *Mirror) Changed() <-chan struct{} { return m.changed }

// Synced is closed once the first full sync is in the directory.
func (m *Mirror) Synced() <-chan struct{} { return m.synced }

// Kick asks for a reconcile: the informer calls it on every event, the
// sweeper when the node's addresses change.
func (m *Mirror) Kick() {
	select {
	case m.kick <- struct{}{}:
	default:
	}
}

// served asks the API whether it serves gvr: true or false once the API
// answers either way (a 404: no such resource; a 403: the manifest does not
// grant it), retrying anything else (the API not reachable yet) until ctx
// ends.
func (m *Mirror) served(ctx context.Context, gvr schema.GroupVersionResource, name string) (bool, error) {
	wait := 100 * time.Millisecond
	for {
		_, err := m.client.Resource(gvr).List(ctx, metav1.ListOptions{Limit: 1})
		switch {
		case err == nil:
			return true, nil
		case apierrors.IsNotFound(err):
			return false, nil
		case apierrors.IsForbidden(err):
			if !m.forbiddenLogged { // once, not at every probe
				m.opts.Log.Warn(name+"s are not readable: the sweeper's ClusterRole lacks them (an older manifest?); none are mirrored", "error", err)
				m.forbiddenLogged = true
			}
			return false, nil
		}
		select {
		case <-ctx.Done():
			return false, context.Cause(ctx)
		case <-time.After(wait):
		}
		wait = min(2*wait, 5*time.Second)
	}
}

// Run watches until ctx ends. Events that arrive during a reconcile are
// folded into the next one, so a burst costs one or two writes of the set.
func (m *Mirror) Run(ctx context.Context) error {
	start := time.Now()
	cluster := m.kinds[1]
	var probe <-chan time.Time
	served, err := m.served(ctx, cluster.gvr, cluster.name)
	if err != nil {
		return err
	}
	if served {
		if err := m.watch(cluster); err != nil {
			return err
		}
	} else {
		m.opts.Log.Info("the API serves no ClusterPolicyEndpoints (no cluster policies here); asking again every "+probeEvery.String(), "resource", cluster.gvr.Resource)
		probe = time.After(probeEvery)
	}
	m.start(ctx)
	for _, k := range m.kinds {
		if k.informer != nil && !cache.WaitForCacheSync(ctx.Done(), k.informer.HasSynced) {
			return context.Cause(ctx)
		}
		if k.informer != nil {
			m.opts.Log.Info(k.name+"s listed", "objects", len(k.informer.GetStore().ListKeys()), "duration_ms", time.Since(start).Milliseconds())
		}
	}
	first := true
	retry := time.NewTimer(0)
	retry.Stop()
	for {
		rep, err := m.reconcile()
		if m.opts.OnReconcile != nil {
			m.opts.OnReconcile(rep, err)
		}
		if err != nil {
			m.opts.Log.Error("write the mirrored policy objects into the policy directory; retrying", "dir", m.opts.Dir, "error", err)
			retry.Reset(retryAfter)
		} else if first {
			if err := policy.MarkSynced(m.opts.Dir); err != nil {
				m.opts.Log.Error("first sync written, but the directory stays marked unsynced; retrying", "error", err)
				retry.Reset(retryAfter)
			} else {
				first = false
				close(m.synced)
				m.signal()
				m.opts.Log.Info("policy directory synced with the API", "selected", rep.Selected, "written", rep.Written,
					"removed", rep.Removed, "duration_ms", time.Since(start).Milliseconds())
			}
		} else if rep.Written+rep.Removed > 0 {
			m.signal()
		}
		select {
		case <-ctx.Done():
			retry.Stop()
			return nil
		case <-m.kick:
		case <-retry.C:
		case <-probe:
			probe = nil
			if ok, err := m.served(ctx, cluster.gvr, cluster.name); err != nil {
				return nil // ctx ended
			} else if !ok {
				probe = time.After(probeEvery)
				continue
			}
			if err := m.watch(cluster); err != nil {
				return err
			}
			m.opts.Log.Info("the API now serves ClusterPolicyEndpoints; mirroring them")
			m.start(ctx)
			// Its first list kicks as it goes; this reconciles once it is whole.
			go func() {
				if cache.WaitForCacheSync(ctx.Done(), cluster.informer.HasSynced) {
					m.Kick()
				}
			}()
		}
	}
}

func (m *Mirror) signal() {
	select {
	case m.changed <- struct{}{}:
	default:
	}
}

// reconcile makes the directories' owned files what the stores say.
func (m *Mirror) reconcile() (Report, error) {
	start := time.Now()
	addrs, err := m.opts.NodeAddrs()
	if err != nil {
		return Report{}, fmt.Errorf("node addresses: %w", err)
	}
	var rep Report
	var errs []error
	for i, k := range m.kinds {
		if k.informer != nil && !k.informer.HasSynced() {
			continue // being listed: what the directory holds stays
		}
		objects, selected, err := m.reconcileKind(k, addrs, &rep)
		if i == 0 {
			rep.Objects, rep.Selected = objects, selected
		} else {
			rep.ClusterObjects, rep.ClusterSelected = objects, selected
		}
		errs = append(errs, err)
	}
	rep.Duration = time.Since(start)
	return rep, errors.Join(errs...)
}

// reconcileKind makes k's owned files what its store says, adding what it
// wrote, removed and found invalid to rep; objects and selected are its
// store's size and the objects of this node.
func (m *Mirror) reconcileKind(k *kind, addrs []netip.Addr, rep *Report) (objects, selected int, err error) {
	var objs []any
	if k.informer != nil {
		objs = k.informer.GetStore().List()
	}
	want := make(map[string][]byte, len(k.written))
	seen := make(map[string]bool, len(k.rendered))
	// A policy's chunks select pods independently of the rules they hold:
	// every chunk of a policy that selects a pod here is this node's.
	policies := map[string]bool{}
	for _, obj := range objs {
		if u, ok := obj.(*unstructured.Unstructured); ok && SelectsNode(u, addrs) {
			if ref := policyRef(u); ref != "" {
				policies[ref] = true
			}
		}
	}
	for _, obj := range objs {
		u, ok := obj.(*unstructured.Unstructured)
		if !ok {
			continue
		}
		if ref := policyRef(u); !SelectsNode(u, addrs) && (ref == "" || !policies[ref]) {
			continue
		}
		name := k.prefix + fileStem(u.GetNamespace(), u.GetName())
		r, ok := k.rendered[name]
		if rv := u.GetResourceVersion(); !ok || rv == "" || r.resourceVersion != rv {
			r = rendering{resourceVersion: rv}
			r.data, r.err = Render(u)
			if r.err == nil {
				// Mirrored all the same: the policy directory's loader
				// enforces its last good version, or its isolation
				// alone, and reports it (policy.ReadDir).
				r.invalid = k.check(r.data, name)
			}
			k.rendered[name] = r
		}
		seen[name] = true
		if r.err != nil {
			rep.Invalid++
			m.opts.Log.Warn(k.name+" not mirrored: it cannot be rendered; its last file stays", "namespace", u.GetNamespace(), "name", u.GetName(), "error", r.err)
			if old, ok := k.written[name]; ok {
				want[name] = old
			}
			continue
		}
		if r.invalid != nil {
			rep.Invalid++
			if !r.logged { // once per version
				m.opts.Log.Warn(k.name+" does not parse: its last good version is enforced, or without one its isolation alone", "namespace", u.GetNamespace(), "name", u.GetName(), "error", r.invalid)
				r.logged = true
				k.rendered[name] = r
			}
		}
		want[name] = r.data
	}
	for name := range k.rendered {
		if !seen[name] {
			delete(k.rendered, name)
		}
	}
	var errs []error
	for name, data := range want {
		if old, ok := k.written[name]; ok && bytes.Equal(old, data) {
			continue
		}
		// No fsync: after a crash the directory is marked unsynced and
		// rewritten at the next start.
		if err := atomicfile.Write(filepath.Join(k.dir, name), data, atomicfile.Options{}); err != nil {
			errs = append(errs, err)
			continue
		}
		k.written[name] = data
		rep.Written++
	}
	for name := range k.written {
		if _, ok := want[name]; ok {
			continue
		}
		if err := os.Remove(filepath.Join(k.dir, name)); err != nil && !errors.Is(err, fs.ErrNotExist) {
			errs = append(errs, err)
			continue
		}
		delete(k.written, name)
		rep.Removed++
	}
	return len(objs), len(want), errors.Join(errs...)
}

// FileName is the file of PolicyEndpoint namespace/name. Neither a namespace
// nor an object name can hold "_" or "/", so the mapping is one to one.
func FileName(namespace, name string) string {
	return filePrefix + fileStem(namespace, name)
}

// ClusterFileName is the file, in ClusterDir, of ClusterPolicyEndpoint name.
func ClusterFileName(name string) string {
	return clusterFilePrefix + fileStem("", name)
}

func fileStem(namespace, name string) string {
	if namespace == "" { // cluster-scoped
		return name + ".json"
	}
	return namespace + "_" + name + ".json"
}

// SelectsNode reports whether one of pe's podSelectorEndpoints runs on a node
// with one of addrs as its hostIP.
func SelectsNode(pe *unstructured.Unstructured, addrs []netip.Addr) bool {
	eps, _, _ := unstructured.NestedSlice(pe.Object, "spec", "podSelectorEndpoints")
	for _, ep := range eps {
		m, ok := ep.(map[string]any)
		if !ok {
			continue
		}
		s, _ := m["hostIP"].(string)
		ip, err := netip.ParseAddr(s)
		if err != nil {
			continue
		}
		for _, a := range addrs {
			if a == ip.Unmap() {
				return true
			}
		}
	}
	return false
}

// policyRef is the policy a PolicyEndpoint is a chunk of
// ("namespace/name"), empty when it names none.
func policyRef(pe *unstructured.Unstructured) string {
	name, _, _ := unstructured.NestedString(pe.Object, "spec", "policyRef", "name")
	ns, _, _ := unstructured.NestedString(pe.Object, "spec", "policyRef", "namespace")
	if name == "" {
		return ""
	}
	return ns + "/" + name
}

// Render is the document the mirror writes for pe: its type, name,
// namespace and spec. The rest of the metadata (resourceVersion, managed
// fields) changes without changing the policy, and would only cause writes.
func Render(pe *unstructured.Unstructured) ([]byte, error) {
	spec, ok := pe.Object["spec"]
	if !ok {
		return nil, errors.New("no spec")
	}
	meta := map[string]any{"name": pe.GetName()}
	if ns := pe.GetNamespace(); ns != "" { // cluster-scoped kinds have none
		meta["namespace"] = ns
	}
	// When the controller wrote it, for podfence_policy_programming_latency_seconds.
	if t, ok := pe.GetAnnotations()[policy.ChangeTimeAnnotation]; ok {
		meta["annotations"] = map[string]any{policy.ChangeTimeAnnotation: t}
	}
	doc := map[string]any{
		"apiVersion": pe.GetAPIVersion(),
		"kind":       pe.GetKind(),
		"metadata":   meta,
		"spec":       spec,
	}
	data, err := json.Marshal(doc) // map keys sorted: the same object gives the same bytes
	if err != nil {
		return nil, err
	}
	return append(data, '\n'), nil
}

// readOwned reads the files an earlier Mirror left in dir.
func readOwned(dir, prefix string) (map[string][]byte, error) {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return nil, fmt.Errorf("policy directory: %w", err)
	}
	owned := make(map[string][]byte)
	for _, e := range entries {
		if !strings.HasPrefix(e.Name(), prefix) || !e.Type().IsRegular() {
			continue
		}
		data, err := os.ReadFile(filepath.Join(dir, e.Name()))
		if err != nil {
			return nil, fmt.Errorf("policy directory: %w", err)
		}
		owned[e.Name()] = data
	}
	return owned, nil
}
