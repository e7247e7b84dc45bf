package main

import (
	"context"
	"log/slog"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/rest"

	"github.com/podfence/podfence/bpf"
	"github.com/podfence/podfence/pkg/attach"
	"github.com/podfence/podfence/pkg/localhook"
	"github.com/podfence/podfence/pkg/nodeaddr"
	"github.com/podfence/podfence/pkg/pinpath"
	"github.com/podfence/podfence/pkg/pinroot"
	"github.com/podfence/podfence/pkg/servicewatch"
	"github.com/podfence/podfence/pkg/uplink"
)

// What the sweeper does for judging egress after Service translation
// (bpf/service.h): it writes the cluster's Service frontends into the
// node's services map (with --policy-source=kubernetes), hooks the judge on
// the node's uplinks as they appear, and frees the slots of identifiers
// that are gone.

// newUplinks loads the uplinks' judge, or returns nil where the kernel
// cannot judge after the translation (no conntrack kfuncs, or nf_conntrack
// not loaded yet: syncUplinks asks again at every pass): Services are then
// judged on their frontend at the pods' veths, which ls reports.
func newUplinks(root *pinroot.Root, dir string) (*uplink.Hooks, error) {
	if !bpf.AfterNATSupported() {
		return nil, nil
	}
	g, err := root.Global()
	if err != nil {
		return nil, err
	}
	p, err := bpf.LoadUplink(g)
	if err != nil {
		return nil, err
	}
	return &uplink.Hooks{Dir: dir, Program: p, Mode: attach.ModeAuto}, nil
}

// syncUplinks hooks the judge on every uplink, as they come and go.
func (r *runner) syncUplinks() {
	if r.uplinksDir == "" {
		return // --judge-uplinks=false
	}
	if r.uplinks == nil {
		var err error
		if r.uplinks, err = newUplinks(r.pins, r.uplinksDir); err != nil {
			r.log.Error("load the uplinks' judge of Service flows; the next pass tries again", "error", err)
			return
		}
		if r.uplinks == nil {
			if !r.uplinksWarned {
				r.uplinksWarned = true
				r.log.Warn("this kernel has no conntrack kfuncs (Linux 5.18, nf_conntrack loaded): a pod's flows to Services are judged on the Service's address, not its backend's; asked again at every pass")
			}
			return
		}
		r.log.Info("judging Services on their backends: the uplinks' judge is loaded")
	}
	rep, err := r.uplinks.Sync()
	if err != nil {
		r.log.Error("hook the uplinks' judge of Service flows; the next pass tries again", "error", err)
	}
	if rep.Released > 0 || len(rep.Hooked) != r.uplinksHooked {
		r.uplinksHooked = len(rep.Hooked)
		r.log.Info("uplinks judged for Service flows translated off the node", "interfaces", rep.Hooked, "released", rep.Released)
	}
}

// syncLocal hooks the judge of Service flows delivered to the node's own
// sockets at the ingress of --judge-local-cgroup, once the kernel can
// judge after the translation; each pass tries again until it is hooked,
// and hooks it again if its pin went. A sweeper that starts again updates
// the pinned link to its own program.
func (r *runner) syncLocal() {
	if r.localCgroup == "" || !bpf.AfterNATSupported() {
		return
	}
	pin := pinpath.Root(r.pins.Path()).LocalLink()
	if r.localHooked && localhook.Hooked(pin) {
		return
	}
	g, err := r.pins.Global()
	if err != nil {
		return
	}
	p, err := bpf.LoadLocal(g)
	if err != nil {
		r.log.Error("load the local judge of Service flows; the next pass tries again", "error", err)
		return
	}
	defer p.Close() // the link holds it
	if err := localhook.Hook(r.localCgroup, pin, p); err != nil {
		r.log.Error("hook the local judge of Service flows; the next pass tries again", "error", err)
		return
	}
	r.localHooked = true
	r.log.Info("Service flows delivered to the node's sockets are judged on arrival", "cgroup", r.localCgroup)
}

// sweepSlots frees the slots of identifiers gone without releasing them.
func (r *runner) sweepSlots() {
	g, err := r.pins.Global()
	if err != nil {
		return
	}
	if n, err := g.SweepSlots(); err != nil {
		r.log.Error("free the slots of removed identifiers", "error", err)
	} else if n > 0 {
		r.log.Info("freed the slots of removed identifiers", "slots", n)
	}
}

// followLinks signals links when the kernel adds an interface, until ctx
// ends; a subscription that fails leaves the passes to find new uplinks.
func followLinks(ctx context.Context, links chan<- struct{}, log *slog.Logger) {
	updates := make(chan netlink.LinkUpdate, 64)
	done := make(chan struct{})
	go func() {
		<-ctx.Done()
		close(done)
	}()
	err := netlink.LinkSubscribeWithOptions(updates, done, netlink.LinkSubscribeOptions{
		ErrorCallback: func(err error) { log.Warn("following new links failed; the passes hook new uplinks", "error", err) },
	})
	if err != nil {
		log.Warn("cannot follow new links; the passes hook new uplinks", "error", err)
		return
	}
	for u := range updates {
		if u.Header.Type != unix.RTM_NEWLINK || !uplink.Candidate(u.Link) {
			continue
		}
		select {
		case links <- struct{}{}:
		default:
		}
	}
}

// newServiceWatch follows the cluster's Services into the services map.
func newServiceWatch(cfg *rest.Config, root *pinroot.Root, log *slog.Logger) (*servicewatch.Watcher, error) {
	client, err := dynamic.NewForConfig(cfg)
	if err != nil {
		return nil, err
	}
	return servicewatch.New(client, servicewatch.Options{
		NodeAddrs: nodeaddr.List,
		Apply: func(f []bpf.Frontend) (int, int, error) {
			g, err := root.Global()
			if err != nil {
				return 0, 0, err
			}
			return g.SetServices(f)
		},
		Log: log.With("source", sourceKubernetes),
	})
}
