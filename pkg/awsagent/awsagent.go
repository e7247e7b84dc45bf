// Package awsagent finds, and removes on request, what the upstream AWS
// network-policy node agent (aws/aws-network-policy-agent) leaves on a node
// when it stops, for it has no teardown: on each pod's host veth a clsact
// qdisc and two cls_bpf filters at priority 1, handle 1, whose programs
// are named handle_ingress (on the veth's egress hook: packets to the pod)
// and handle_egress (on its ingress hook: packets from the pod); and its
// pins under /sys/fs/bpf/globals/aws (programs, per-pod policy maps, its
// conntrack map and event ring). Those filters keep enforcing the rules
// they were last given, beside podfence, until their pod is recreated: in
// tc mode they run before podfence's filter, in tcx mode after its
// program. Read from the agent's pkg/ebpf/bpf_client.go and the SDK's
// pkg/tc/tc.go.
package awsagent

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// DefaultPinDir is where the agent pins its programs and maps.
const DefaultPinDir = "/sys/fs/bpf/globals/aws"

// programNames are the names the agent gives its filters.
var programNames = map[string]bool{"handle_ingress": true, "handle_egress": true}

// Filter is one of the agent's filters on a veth.
type Filter struct {
	Link    string
	Ifindex int
	Hook    string // the veth's clsact hook: ingress (from the pod) or egress (to it)
	Name    string
	f       *netlink.BpfFilter
}

// Leftovers are the agent's filters and pins on a node.
type Leftovers struct {
	Filters []Filter
	Pins    []string
}

// Empty says whether nothing of the agent is left.
func (l Leftovers) Empty() bool { return len(l.Filters) == 0 && len(l.Pins) == 0 }

// Find lists the agent's filters on the veths and vlan links of the calling thread's
// network namespace (the node's) and its pins under pinDir.
func Find(pinDir string) (Leftovers, error) {
	var l Leftovers
	h, err := netlink.NewHandle(unix.NETLINK_ROUTE)
	if err != nil {
		return l, fmt.Errorf("rtnetlink: %w", err)
	}
	defer h.Close()
	links, err := h.LinkList()
	if err != nil {
		return l, fmt.Errorf("list links: %w", err)
	}
	for _, link := range links {
		if t := link.Type(); t != "veth" && t != "vlan" { // vlan: pods with their own security groups
			continue
		}
		for _, hook := range []struct {
			name   string
			parent uint32
		}{{"ingress", netlink.HANDLE_MIN_INGRESS}, {"egress", netlink.HANDLE_MIN_EGRESS}} {
			filters, err := h.FilterList(link, hook.parent)
			if errors.Is(err, unix.EINVAL) || errors.Is(err, unix.ENOENT) {
				continue // no clsact qdisc
			}
			if err != nil {
				return l, fmt.Errorf("filters of %s %s: %w", link.Attrs().Name, hook.name, err)
			}
			for _, f := range filters {
				if bf, ok := f.(*netlink.BpfFilter); ok && programNames[bf.Name] {
					l.Filters = append(l.Filters, Filter{Link: link.Attrs().Name, Ifindex: link.Attrs().Index,
						Hook: hook.name, Name: bf.Name, f: bf})
				}
			}
		}
	}
	err = filepath.WalkDir(pinDir, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if !d.IsDir() {
			l.Pins = append(l.Pins, path)
		}
		return nil
	})
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		return l, fmt.Errorf("the agent's pins: %w", err)
	}
	return l, nil
}

// Remove takes the filters off their veths and removes pinDir. A filter
// or veth gone meanwhile is fine. The clsact qdiscs stay: podfence's own
// filter may sit in them.
func Remove(l Leftovers, pinDir string) error {
	h, err := netlink.NewHandle(unix.NETLINK_ROUTE)
	if err != nil {
		return fmt.Errorf("rtnetlink: %w", err)
	}
	defer h.Close()
	var errs []error
	for _, f := range l.Filters {
		if err := h.FilterDel(f.f); err != nil && !errors.Is(err, unix.ENOENT) && !errors.Is(err, unix.ENODEV) {
			errs = append(errs, fmt.Errorf("remove %s from %s %s: %w", f.Name, f.Link, f.Hook, err))
		}
	}
	if len(l.Pins) > 0 {
		if err := os.RemoveAll(pinDir); err != nil {
			errs = append(errs, fmt.Errorf("remove the agent's pins: %w", err))
		}
	}
	return errors.Join(errs...)
}
