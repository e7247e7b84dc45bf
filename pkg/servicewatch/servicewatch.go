// Package servicewatch follows the cluster's Services and keeps the node's
// services map (bpf.Global.SetServices) to the frontends kube-proxy
// translates on this node: each port of a Service's ClusterIPs, external
// IPs and load-balancer IPs, and its NodePorts on each of the node's
// addresses. A pod's new flow to one of them is judged on the backend it
// is translated to (bpf/service.h); a flow to anything else on its
// destination, as before.
package servicewatch

import (
	"context"
	"fmt"
	"log/slog"
	"net/netip"
	"slices"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/tools/cache"

	"github.com/podfence/podfence/bpf"
	"github.com/podfence/podfence/pkg/kubeinformer"
)

var servicesGVR = schema.GroupVersionResource{Version: "v1", Resource: "services"}

// Options configure a Watcher.
type Options struct {
	// NodeAddrs lists the node's addresses, where NodePorts are translated.
	NodeAddrs func() ([]netip.Addr, error)
	// Apply writes the frontends: the node's services map in production.
	Apply func([]bpf.Frontend) (added, removed int, err error)
	Log   *slog.Logger
	// Settle is how long a burst of changes is waited out before the
	// frontends are written (0: 50 ms).
	Settle time.Duration
}

// Watcher keeps the services map to the cluster's Services.
type Watcher struct {
	opts     Options
	informer cache.SharedIndexInformer
	kick     chan struct{}
	synced   chan struct{}
}

// New prepares a Watcher of every Service; Run runs it.
func New(client dynamic.Interface, opts Options) (*Watcher, error) {
	if opts.Settle == 0 {
		opts.Settle = 50 * time.Millisecond
	}
	inf := kubeinformer.New(client, servicesGVR)
	w := &Watcher{opts: opts, informer: inf, kick: make(chan struct{}, 1), synced: make(chan struct{})}
	if _, err := inf.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    func(any) { w.Kick() },
		UpdateFunc: func(_, _ any) { w.Kick() },
		DeleteFunc: func(any) { w.Kick() },
	}); err != nil {
		return nil, err
	}
	if err := inf.SetWatchErrorHandlerWithContext(func(_ context.Context, _ *cache.Reflector, err error) {
		if apierrors.IsResourceExpired(err) || apierrors.IsGone(err) {
			return // listed again
		}
		opts.Log.Warn("watching Services failed; the last frontends stay and the watch is retried", "error", err)
	}); err != nil {
		return nil, err
	}
	return w, nil
}

// Kick asks for the frontends to be written again: the informer calls it
// on every event, the sweeper when the node's addresses change.
func (w *Watcher) Kick() {
	select {
	case w.kick <- struct{}{}:
	default:
	}
}

// Synced is closed once the frontends of the first full list are written.
func (w *Watcher) Synced() <-chan struct{} { return w.synced }

// Run follows the Services until ctx ends. Until the first list is in,
// nothing is written: an empty store is not an empty cluster.
func (w *Watcher) Run(ctx context.Context) error {
	go w.informer.RunWithContext(ctx)
	if !cache.WaitForCacheSync(ctx.Done(), w.informer.HasSynced) {
		return ctx.Err()
	}
	first := true
	for {
		if err := w.write(); err != nil {
			w.opts.Log.Error("write the Service frontends; retried at the next change", "error", err)
		} else if first {
			close(w.synced)
			first = false
		}
		select {
		case <-ctx.Done():
			return nil
		case <-w.kick:
		}
		select { // a burst is written once
		case <-ctx.Done():
			return nil
		case <-time.After(w.opts.Settle):
		}
	}
}

func (w *Watcher) write() error {
	addrs, err := w.opts.NodeAddrs()
	if err != nil {
		return fmt.Errorf("node addresses: %w", err)
	}
	var all []bpf.Frontend
	for _, o := range w.informer.GetStore().List() {
		if u, ok := o.(*unstructured.Unstructured); ok {
			all = append(all, Frontends(u, addrs)...)
		}
	}
	added, removed, err := w.opts.Apply(all)
	if err == nil && (added > 0 || removed > 0) {
		w.opts.Log.Info("Service frontends updated", "frontends", len(all), "added", added, "removed", removed)
	}
	return err
}

// Frontends are what kube-proxy translates on a node with addresses
// nodeAddrs for the Service svc (a core/v1 Service as unstructured): every
// TCP and UDP port of its ClusterIPs, external IPs and load-balancer
// ingress IPs (except those whose ipMode is Proxy, which kube-proxy leaves
// to the load balancer), and its NodePorts on every node address. A
// headless or ExternalName Service has none. SCTP ports are left out: the
// conntrack lookup the judgement needs takes TCP and UDP only, so such a
// Service is judged on its frontend, at the pod's veth.
func Frontends(svc *unstructured.Unstructured, nodeAddrs []netip.Addr) []bpf.Frontend {
	typ, _, _ := unstructured.NestedString(svc.Object, "spec", "type")
	if typ == "ExternalName" {
		return nil
	}
	var addrs []netip.Addr
	add := func(s string) {
		if a, err := netip.ParseAddr(s); err == nil {
			addrs = append(addrs, a.Unmap())
		}
	}
	ips, _, _ := unstructured.NestedStringSlice(svc.Object, "spec", "clusterIPs")
	if len(ips) == 0 {
		if ip, _, _ := unstructured.NestedString(svc.Object, "spec", "clusterIP"); ip != "" {
			ips = []string{ip}
		}
	}
	for _, ip := range ips {
		add(ip) // "None" (headless) does not parse
	}
	ext, _, _ := unstructured.NestedStringSlice(svc.Object, "spec", "externalIPs")
	for _, ip := range ext {
		add(ip)
	}
	ingress, _, _ := unstructured.NestedSlice(svc.Object, "status", "loadBalancer", "ingress")
	for _, in := range ingress {
		m, ok := in.(map[string]any)
		if !ok {
			continue
		}
		if mode, _ := m["ipMode"].(string); mode == "Proxy" {
			continue
		}
		if ip, _ := m["ip"].(string); ip != "" {
			add(ip)
		}
	}
	ports, _, _ := unstructured.NestedSlice(svc.Object, "spec", "ports")
	var out []bpf.Frontend
	for _, p := range ports {
		m, ok := p.(map[string]any)
		if !ok {
			continue
		}
		proto := protocol(m["protocol"])
		if proto == 0 {
			continue
		}
		if port := number(m["port"]); port != 0 {
			for _, a := range addrs {
				out = append(out, bpf.Frontend{Addr: a, Port: port, Proto: proto})
			}
		}
		if np := number(m["nodePort"]); np != 0 {
			for _, a := range nodeAddrs {
				out = append(out, bpf.Frontend{Addr: a.Unmap(), Port: np, Proto: proto})
			}
		}
	}
	slices.SortFunc(out, func(a, b bpf.Frontend) int {
		if c := a.Addr.Compare(b.Addr); c != 0 {
			return c
		}
		if a.Port != b.Port {
			return int(a.Port) - int(b.Port)
		}
		return int(a.Proto) - int(b.Proto)
	})
	return slices.Compact(out)
}

// protocol is the IP protocol of a ServicePort's protocol (TCP when
// unset), 0 for one not judged after the translation (SCTP).
func protocol(v any) uint8 {
	s, _ := v.(string)
	switch s {
	case "", "TCP":
		return 6
	case "UDP":
		return 17
	}
	return 0
}

// number reads a port from unstructured JSON (int64 from the API, float64
// from a decoded document).
func number(v any) uint16 {
	switch n := v.(type) {
	case int64:
		if n > 0 && n < 1<<16 {
			return uint16(n)
		}
	case float64:
		if n > 0 && n < 1<<16 && n == float64(int(n)) {
			return uint16(n)
		}
	}
	return 0
}
