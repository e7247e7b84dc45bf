package attach

import (
	"errors"
	"fmt"

	"github.com/cilium/ebpf"

	"github.com/podfence/podfence/pkg/objinfo"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// podfence's legacy filter: a cls_bpf filter in direct-action mode for every
// protocol, at a priority and handle that podfence owns on both hooks. Other
// tools' filters live at other priorities and are never touched.
const (
	tcPriority  = 0x5046 // "PF"; lower priorities run first
	tcHandle    = 0x5046
	defaultName = "podfence"
)

// tcParent is the clsact class of the hook.
func tcParent(h Hook) uint32 {
	if h == HookEgress {
		return netlink.HANDLE_MIN_EGRESS
	}
	return netlink.HANDLE_MIN_INGRESS
}

// newHandle opens an rtnetlink socket in the calling thread's network
// namespace. Only NETLINK_ROUTE: kernels without XFRM (a minimal guest)
// refuse the other families netlink's default handle opens.
func newHandle() (*netlink.Handle, error) {
	h, err := netlink.NewHandle(unix.NETLINK_ROUTE)
	if err != nil {
		return nil, fmt.Errorf("open rtnetlink socket: %w", err)
	}
	return h, nil
}

// attachTC replaces podfence's filter on the hook with one running
// o.Program, creating the clsact qdisc when the interface has none. Requires
// Linux 4.5 (clsact, cls_bpf direct action); the filter reports its
// program's ID from Linux 4.13.
func attachTC(o Options) error {
	want, err := objinfo.ProgramID(o.Program)
	if err != nil {
		return fmt.Errorf("attach tc to interface %d %s: %w", o.Ifindex, o.Hook, err)
	}
	name := o.Name
	if name == "" {
		name = defaultName
	}
	h, err := newHandle()
	if err != nil {
		return fmt.Errorf("attach tc to interface %d %s: %w", o.Ifindex, o.Hook, err)
	}
	defer h.Close()
	l, err := h.LinkByIndex(o.Ifindex)
	if err != nil {
		return fmt.Errorf("attach tc to interface %d %s: %w", o.Ifindex, o.Hook, err)
	}
	if err := ensureQdisc(h, l, o.Hook); err != nil {
		return fmt.Errorf("attach tc to interface %d %s: %w", o.Ifindex, o.Hook, err)
	}
	filters, err := bpfFilters(h, l, o.Hook)
	if err != nil {
		return fmt.Errorf("attach tc to interface %d %s: %w", o.Ifindex, o.Hook, err)
	}
	if f := ownFilter(filters); f != nil && f.Id == int(want) && f.DirectAction && f.Name == name {
		return nil
	}
	f := &netlink.BpfFilter{
		FilterAttrs:  filterAttrs(o.Ifindex, o.Hook),
		Fd:           o.Program.FD(),
		Name:         name,
		DirectAction: true,
	}
	if err := h.FilterReplace(f); err != nil {
		return fmt.Errorf("attach tc to interface %d %s: replace filter: %w", o.Ifindex, o.Hook, err)
	}
	return nil
}

// detachTC deletes podfence's filter from the hook. With want set, a filter
// running another program is left alone.
func detachTC(ifindex int, hook Hook, want ebpf.ProgramID) error {
	h, err := newHandle()
	if err != nil {
		return fmt.Errorf("detach tc from interface %d %s: %w", ifindex, hook, err)
	}
	defer h.Close()
	l, err := h.LinkByIndex(ifindex)
	if err != nil {
		if isLinkNotFound(err) {
			return nil
		}
		return fmt.Errorf("detach tc from interface %d %s: %w", ifindex, hook, err)
	}
	has, err := hasQdisc(h, l, hook)
	if err != nil || !has {
		if err != nil {
			err = fmt.Errorf("detach tc from interface %d %s: %w", ifindex, hook, err)
		}
		return err
	}
	filters, err := bpfFilters(h, l, hook)
	if err != nil {
		return fmt.Errorf("detach tc from interface %d %s: %w", ifindex, hook, err)
	}
	f := ownFilter(filters)
	if f == nil || (want != 0 && f.Id != int(want)) {
		return nil
	}
	// Only the filter's identity goes into the request (Fd -1: no program).
	del := &netlink.BpfFilter{FilterAttrs: filterAttrs(ifindex, hook), Fd: -1}
	if err := h.FilterDel(del); err != nil && !errors.Is(err, unix.ENOENT) && !errors.Is(err, unix.ENODEV) {
		return fmt.Errorf("detach tc from interface %d %s: delete filter: %w", ifindex, hook, err)
	}
	return nil
}

// attachedTC lists the programs of the BPF filters on the hook.
func attachedTC(ifindex int, hook Hook) ([]ebpf.ProgramID, error) {
	h, err := newHandle()
	if err != nil {
		return nil, fmt.Errorf("list tc programs on interface %d %s: %w", ifindex, hook, err)
	}
	defer h.Close()
	l, err := h.LinkByIndex(ifindex)
	if err != nil {
		return nil, fmt.Errorf("list tc programs on interface %d %s: %w", ifindex, hook, err)
	}
	has, err := hasQdisc(h, l, hook)
	if err != nil {
		return nil, fmt.Errorf("list tc programs on interface %d %s: %w", ifindex, hook, err)
	}
	if !has {
		return nil, nil
	}
	filters, err := bpfFilters(h, l, hook)
	if err != nil {
		return nil, fmt.Errorf("list tc programs on interface %d %s: %w", ifindex, hook, err)
	}
	var ids []ebpf.ProgramID
	for _, f := range filters {
		ids = append(ids, ebpf.ProgramID(f.Id))
	}
	return ids, nil
}

func filterAttrs(ifindex int, hook Hook) netlink.FilterAttrs {
	return netlink.FilterAttrs{
		LinkIndex: ifindex,
		Parent:    tcParent(hook),
		Handle:    tcHandle,
		Priority:  tcPriority,
		Protocol:  unix.ETH_P_ALL,
	}
}

// ownFilter returns podfence's filter among filters, or nil.
func ownFilter(filters []*netlink.BpfFilter) *netlink.BpfFilter {
	for _, f := range filters {
		if f.Priority == tcPriority && f.Handle == tcHandle {
			return f
		}
	}
	return nil
}

// hasQdisc tells whether the interface has a qdisc that carries the hook's
// filters: clsact for both hooks; the older ingress qdisc, which occupies
// the same place, for the ingress hook.
func hasQdisc(h *netlink.Handle, l netlink.Link, hook Hook) (bool, error) {
	typ, err := qdiscType(h, l)
	if err != nil {
		return false, err
	}
	return typ == "clsact" || (typ == "ingress" && hook == HookIngress), nil
}

// qdiscType is the type of the qdisc at clsact's place, "" when none.
func qdiscType(h *netlink.Handle, l netlink.Link) (string, error) {
	qdiscs, err := h.QdiscList(l)
	if err != nil {
		return "", fmt.Errorf("list qdiscs: %w", err)
	}
	for _, q := range qdiscs {
		if q.Attrs().Parent == netlink.HANDLE_CLSACT {
			return q.Type(), nil
		}
	}
	return "", nil
}

// ensureQdisc adds a clsact qdisc unless one that carries the hook is there.
func ensureQdisc(h *netlink.Handle, l netlink.Link, hook Hook) error {
	for attempt := 0; ; attempt++ {
		typ, err := qdiscType(h, l)
		if err != nil {
			return err
		}
		switch {
		case typ == "clsact" || (typ == "ingress" && hook == HookIngress):
			return nil
		case typ != "":
			return fmt.Errorf("a %s qdisc holds the place of clsact; remove it or use tcx", typ)
		}
		q := &netlink.GenericQdisc{
			QdiscAttrs: netlink.QdiscAttrs{
				LinkIndex: l.Attrs().Index,
				Handle:    netlink.MakeHandle(0xffff, 0),
				Parent:    netlink.HANDLE_CLSACT,
			},
			QdiscType: "clsact",
		}
		err = h.QdiscAdd(q)
		if err == nil {
			return nil
		}
		if !errors.Is(err, unix.EEXIST) || attempt > 0 {
			return fmt.Errorf("add clsact qdisc: %w", err)
		}
		// Added concurrently: check once more that it is one we can use.
	}
}

// bpfFilters lists the filters on the hook that run a BPF program.
func bpfFilters(h *netlink.Handle, l netlink.Link, hook Hook) ([]*netlink.BpfFilter, error) {
	var (
		all []netlink.Filter
		err error
	)
	for attempt := 0; attempt < 3; attempt++ {
		all, err = h.FilterList(l, tcParent(hook))
		if !errors.Is(err, netlink.ErrDumpInterrupted) {
			break
		}
	}
	if err != nil {
		return nil, fmt.Errorf("list filters: %w", err)
	}
	var out []*netlink.BpfFilter
	for _, f := range all {
		// The dump also holds one entry per priority without a filter
		// handle; it carries no program.
		if bf, ok := f.(*netlink.BpfFilter); ok && bf.Id != 0 {
			out = append(out, bf)
		}
	}
	return out, nil
}

func isLinkNotFound(err error) bool {
	var nf netlink.LinkNotFoundError
	return errors.As(err, &nf) || errors.Is(err, unix.ENODEV)
}
