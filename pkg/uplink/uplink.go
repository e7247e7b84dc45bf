// Package uplink hooks the node's judge of translated Service flows
// (bpf.LoadUplink, uplink_after_nat in bpf/podfence.c) on the TC egress of
// every interface a translated packet can leave the node by to a backend
// elsewhere: the uplinks (eth0, the ENIs the VPC CNI hot-adds, the VLAN
// branch devices of security groups for pods), bridges, bonds, tunnels.
// Pod veths are left out: each fenced pod's veth runs its identifier's
// ingress program, which judges a stamped packet itself. A packet a pod's
// veth stamped that leaves by an interface without the hook is not judged
// after the translation, so Sync runs at start, at every link the kernel
// adds, and at every pass.
package uplink

import (
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/cilium/ebpf"
	"github.com/vishvananda/netlink"

	"github.com/podfence/podfence/pkg/attach"
)

// Hooks are the uplink hooks of one node: where their TCX links are pinned,
// the program, and the mode.
type Hooks struct {
	// Dir holds one link pin per hooked interface, "if<ifindex>".
	Dir     string
	Program *ebpf.Program
	Mode    attach.Mode
}

// Report is what a Sync did.
type Report struct {
	Hooked   []string // interfaces hooked now or kept hooked
	Released int      // pins of interfaces gone, removed
}

// Candidate tells an interface that gets the hook: neither loopback, which
// delivers to the node itself, nor a veth (a pod's, judged by its own
// program; a container's on a bridge is judged at the bridge).
func Candidate(l netlink.Link) bool {
	a := l.Attrs()
	if a.Flags&net.FlagLoopback != 0 || l.Type() == "veth" {
		return false
	}
	return true
}

// Sync hooks every candidate interface of the calling thread's network
// namespace and releases the pins of interfaces that are gone. An
// interface that vanishes midway is skipped, not an error.
func (h Hooks) Sync() (Report, error) {
	var rep Report
	links, err := netlink.LinkList()
	if err != nil {
		return rep, fmt.Errorf("list links: %w", err)
	}
	if err := os.MkdirAll(h.Dir, 0o700); err != nil {
		return rep, fmt.Errorf("uplink pins: %w", err)
	}
	want := map[string]bool{}
	var errs []error
	for _, l := range links {
		if !Candidate(l) {
			continue
		}
		a := l.Attrs()
		pin := pinName(a.Index)
		want[pin] = true
		_, err := attach.Attach(attach.Options{Ifindex: a.Index, Hook: attach.HookEgress, Program: h.Program,
			Mode: h.Mode, LinkPin: filepath.Join(h.Dir, pin), Name: "podfence-uplink"})
		if err != nil {
			if _, gone := netlink.LinkByIndex(a.Index); gone != nil {
				continue // deleted meanwhile
			}
			errs = append(errs, fmt.Errorf("hook %s: %w", a.Name, err))
			continue
		}
		rep.Hooked = append(rep.Hooked, a.Name)
	}
	entries, err := os.ReadDir(h.Dir)
	if err != nil {
		return rep, errors.Join(append(errs, fmt.Errorf("uplink pins: %w", err))...)
	}
	for _, e := range entries {
		if want[e.Name()] {
			continue
		}
		if _, ok := ifindexOf(e.Name()); !ok {
			continue
		}
		// Gone, or the ifindex now names an interface left out (a pod's
		// veth, whose filter is its own): only the severed link's pin goes.
		o := attach.Options{Ifindex: 0, Hook: attach.HookEgress, LinkPin: filepath.Join(h.Dir, e.Name())}
		if err := attach.Detach(o); err != nil {
			errs = append(errs, fmt.Errorf("release %s: %w", e.Name(), err))
			continue
		}
		rep.Released++
	}
	return rep, errors.Join(errs...)
}

// Release takes the hook off every candidate interface, by either
// mechanism, and removes the link pins of interfaces gone: for an
// uninstall. Program is not needed.
func (h Hooks) Release() error {
	links, err := netlink.LinkList()
	if err != nil {
		return fmt.Errorf("list links: %w", err)
	}
	var errs []error
	for _, l := range links {
		if !Candidate(l) {
			continue
		}
		a := l.Attrs()
		errs = append(errs, attach.Detach(attach.Options{Ifindex: a.Index, Hook: attach.HookEgress,
			LinkPin: filepath.Join(h.Dir, pinName(a.Index))}))
	}
	entries, err := os.ReadDir(h.Dir)
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		errs = append(errs, err)
	}
	for _, e := range entries {
		if _, ok := ifindexOf(e.Name()); ok {
			errs = append(errs, attach.Detach(attach.Options{Hook: attach.HookEgress, LinkPin: filepath.Join(h.Dir, e.Name())}))
		}
	}
	return errors.Join(errs...)
}

func pinName(ifindex int) string { return "if" + strconv.Itoa(ifindex) }

func ifindexOf(pin string) (int, bool) {
	s, ok := strings.CutPrefix(pin, "if")
	if !ok {
		return 0, false
	}
	n, err := strconv.Atoi(s)
	return n, err == nil && n > 0
}
