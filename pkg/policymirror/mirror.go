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
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/dynamic/dynamicinformer"
	"k8s.io/client-go/tools/cache"

	"github.com/podfence/podfence/pkg/atomicfile"
	"github.com/podfence/podfence/pkg/policy"
)

// Resource is the API resource the upstream network-policy controller writes.
var Resource = schema.GroupVersionResource{Group: "networking.k8s.aws", Version: "v1alpha1", Resource: "policyendpoints"}

// filePrefix marks the files a Mirror owns: it never touches others.
const filePrefix = "pe_"

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
	Written  int // files written (new or changed)
	Removed  int // files removed (object deleted, or no longer on this node)
	Invalid  int // objects podfence cannot parse: their last good file stays
	Duration time.Duration
}

// Mirror writes the PolicyEndpoints of this node into Dir.
type Mirror struct {
	opts     Options
	informer cache.SharedIndexInformer
	kick     chan struct{}
	changed  chan struct{}
	synced   chan struct{}
	// written is what Dir holds, by file name; it starts from what an
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

// New prepares a Mirror of client's PolicyEndpoints into opts.Dir and marks
// the directory unsynced. Nothing is watched until Run.
func New(client dynamic.Interface, opts Options) (*Mirror, error) {
	if opts.Dir == "" || opts.NodeAddrs == nil {
		return nil, errors.New("policymirror: Dir and NodeAddrs are required")
	}
	if opts.Log == nil {
		opts.Log = slog.New(slog.DiscardHandler)
	}
	if err := os.MkdirAll(opts.Dir, 0o755); err != nil {
		return nil, fmt.Errorf("policy directory: %w", err)
	}
	if err := policy.MarkUnsynced(opts.Dir); err != nil {
		return nil, err
	}
	written, err := readOwned(opts.Dir)
	if err != nil {
		return nil, err
	}
	// No resync period: the reflector's relists and the watch are the
	// source of changes; a periodic resync would only replay the store.
	factory := dynamicinformer.NewDynamicSharedInformerFactory(client, 0)
	m := &Mirror{
		opts:     opts,
		informer: factory.ForResource(Resource).Informer(),
		kick:     make(chan struct{}, 1),
		changed:  make(chan struct{}, 1),
		synced:   make(chan struct{}),
		written:  written,
		rendered: make(map[string]rendering),
	}
	kick := func(any) { m.Kick() }
	if _, err := m.informer.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    kick,
		UpdateFunc: func(_, obj any) { kick(obj) },
		DeleteFunc: func(obj any) {
			// A tombstone: the object was missing from a relist, its
			// delete event lost with the watch that was down.
			if t, ok := obj.(cache.DeletedFinalStateUnknown); ok {
				opts.Log.Info("PolicyEndpoint found deleted at a relist; the watch missed its delete", "object", t.Key)
			}
			m.Kick()
		},
	}); err != nil {
		return nil, err
	}
	if err := m.informer.SetWatchErrorHandlerWithContext(func(_ context.Context, _ *cache.Reflector, err error) {
		if apierrors.IsResourceExpired(err) || apierrors.IsGone(err) {
			// The server no longer has the history since our last
			// resourceVersion (compacted, or a restarted watch cache).
			opts.Log.Info("watch expired (410 Gone); listing PolicyEndpoints again", "error", err)
			return
		}
		opts.Log.Warn("watching PolicyEndpoints failed; enforcing the last policy and retrying", "error", err)
	}); err != nil {
		return nil, err
	}
	return m, nil
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

// Run watches until ctx ends. Events that arrive during a reconcile are
// folded into the next one, so a burst costs one or two writes of the set.
func (m *Mirror) Run(ctx context.Context) error {
	go m.informer.RunWithContext(ctx)
	start := time.Now()
	if !cache.WaitForCacheSync(ctx.Done(), m.informer.HasSynced) {
		return context.Cause(ctx)
	}
	m.opts.Log.Info("PolicyEndpoints listed", "objects", len(m.informer.GetStore().ListKeys()), "duration_ms", time.Since(start).Milliseconds())
	first := true
	retry := time.NewTimer(0)
	retry.Stop()
	for {
		rep, err := m.reconcile()
		if m.opts.OnReconcile != nil {
			m.opts.OnReconcile(rep, err)
		}
		if err != nil {
			m.opts.Log.Error("write PolicyEndpoints into the policy directory; retrying", "dir", m.opts.Dir, "error", err)
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
		}
	}
}

func (m *Mirror) signal() {
	select {
	case m.changed <- struct{}{}:
	default:
	}
}

// reconcile makes the directory's owned files what the store says.
func (m *Mirror) reconcile() (Report, error) {
	start := time.Now()
	addrs, err := m.opts.NodeAddrs()
	if err != nil {
		return Report{}, fmt.Errorf("node addresses: %w", err)
	}
	objs := m.informer.GetStore().List()
	rep := Report{Objects: len(objs)}
	want := make(map[string][]byte, len(m.written))
	seen := make(map[string]bool, len(m.rendered))
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
		name := FileName(u.GetNamespace(), u.GetName())
		r, ok := m.rendered[name]
		if rv := u.GetResourceVersion(); !ok || rv == "" || r.resourceVersion != rv {
			r = rendering{resourceVersion: rv}
			r.data, r.err = Render(u)
			if r.err == nil {
				// Mirrored all the same: the policy directory's loader
				// enforces its last good version, or its isolation
				// alone, and reports it (policy.ReadDir).
				docs, _ := policy.Parse(bytes.NewReader(r.data), name)
				r.invalid = policy.Strict(docs)
			}
			m.rendered[name] = r
		}
		seen[name] = true
		if r.err != nil {
			rep.Invalid++
			m.opts.Log.Warn("PolicyEndpoint not mirrored: it cannot be rendered; its last file stays", "namespace", u.GetNamespace(), "name", u.GetName(), "error", r.err)
			if old, ok := m.written[name]; ok {
				want[name] = old
			}
			continue
		}
		if r.invalid != nil {
			rep.Invalid++
			if !r.logged { // once per version
				m.opts.Log.Warn("PolicyEndpoint does not parse: its last good version is enforced, or without one its isolation alone", "namespace", u.GetNamespace(), "name", u.GetName(), "error", r.invalid)
				r.logged = true
				m.rendered[name] = r
			}
		}
		want[name] = r.data
	}
	for name := range m.rendered {
		if !seen[name] {
			delete(m.rendered, name)
		}
	}
	rep.Selected = len(want)
	var errs []error
	for name, data := range want {
		if old, ok := m.written[name]; ok && bytes.Equal(old, data) {
			continue
		}
		// No fsync: after a crash the directory is marked unsynced and
		// rewritten at the next start.
		if err := atomicfile.Write(filepath.Join(m.opts.Dir, name), data, atomicfile.Options{}); err != nil {
			errs = append(errs, err)
			continue
		}
		m.written[name] = data
		rep.Written++
	}
	for name := range m.written {
		if _, ok := want[name]; ok {
			continue
		}
		if err := os.Remove(filepath.Join(m.opts.Dir, name)); err != nil && !errors.Is(err, fs.ErrNotExist) {
			errs = append(errs, err)
			continue
		}
		delete(m.written, name)
		rep.Removed++
	}
	rep.Duration = time.Since(start)
	return rep, errors.Join(errs...)
}

// FileName is the file of PolicyEndpoint namespace/name. Neither a namespace
// nor an object name can hold "_" or "/", so the mapping is one to one.
func FileName(namespace, name string) string {
	return filePrefix + namespace + "_" + name + ".json"
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
	meta := map[string]any{"name": pe.GetName(), "namespace": pe.GetNamespace()}
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
func readOwned(dir string) (map[string][]byte, error) {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return nil, fmt.Errorf("policy directory: %w", err)
	}
	owned := make(map[string][]byte)
	for _, e := range entries {
		if !strings.HasPrefix(e.Name(), filePrefix) || !e.Type().IsRegular() {
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
