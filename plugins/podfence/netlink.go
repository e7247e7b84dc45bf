package main

import (
	"fmt"
	"net/netip"
	"slices"
	"strings"

	"github.com/containernetworking/cni/pkg/types"
	current "github.com/containernetworking/cni/pkg/types/100"
	"github.com/containernetworking/plugins/pkg/ns"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// hostVeth is the host side of a pod's veth, in the plugin's (the node's)
// network namespace.
type hostVeth struct {
	Name  string
	Index int
}

// findHostVeth finds the pod's host veth: the peer of CNI_IFNAME inside the
// pod's namespace, cross-checked against the interfaces the primary plugin
// reported on the host (those without a sandbox). The AWS VPC CNI also
// reports a dummy interface whose sandbox is not a path; it is neither.
func findHostVeth(prev *current.Result, netnsPath, ifname string) (hostVeth, error) {
	var reported []string
	for _, iface := range prev.Interfaces {
		if iface.Sandbox == "" {
			reported = append(reported, iface.Name)
		}
	}

	var podIndex, peerIndex int
	err := ns.WithNetNSPath(netnsPath, func(ns.NetNS) error {
		h, err := netlink.NewHandle(unix.NETLINK_ROUTE)
		if err != nil {
			return err
		}
		defer h.Close()
		link, err := h.LinkByName(ifname)
		if err != nil {
			return fmt.Errorf("interface %s in %s: %w", ifname, netnsPath, err)
		}
		if link.Type() != "veth" {
			return fmt.Errorf("interface %s in %s is a %s, not a veth", ifname, netnsPath, link.Type())
		}
		// IFLA_LINK of a veth is its peer's index, in the peer's namespace.
		podIndex, peerIndex = link.Attrs().Index, link.Attrs().ParentIndex
		return nil
	})
	if err != nil {
		return hostVeth{}, types.NewError(types.ErrInvalidNetNS, fmt.Sprintf("find the pod's veth: %v", err), "")
	}

	h, err := netlink.NewHandle(unix.NETLINK_ROUTE)
	if err != nil {
		return hostVeth{}, types.NewError(errAttach, fmt.Sprintf("netlink: %v", err), "")
	}
	defer h.Close()
	peer, err := h.LinkByIndex(peerIndex)
	if err != nil {
		return hostVeth{}, types.NewError(types.ErrInvalidNetNS,
			fmt.Sprintf("the peer of %s (ifindex %d) is not in this namespace: %v", ifname, peerIndex, err), "")
	}
	name := peer.Attrs().Name
	// The peer may be in another namespace, and the index here another
	// interface's: only the veth whose own peer is the pod's end is it.
	if peer.Type() != "veth" || peer.Attrs().ParentIndex != podIndex {
		return hostVeth{}, types.NewError(types.ErrInvalidNetNS,
			fmt.Sprintf("the peer of %s (ifindex %d) is not in this namespace: interface %d here is %s, a %s whose peer is not %s",
				ifname, peerIndex, peerIndex, name, peer.Type(), ifname), "")
	}
	if len(reported) > 0 && !slices.Contains(reported, name) {
		return hostVeth{}, types.NewError(types.ErrInvalidNetNS,
			fmt.Sprintf("the peer of %s is %s, but the primary plugin reported host interfaces %s", ifname, name, strings.Join(reported, ", ")), "")
	}
	return hostVeth{Name: name, Index: peerIndex}, nil
}

// podIPs are the pod's addresses from the primary plugin's result.
func podIPs(prev *current.Result) []netip.Prefix {
	var out []netip.Prefix
	for _, ip := range prev.IPs {
		addr, ok := netip.AddrFromSlice(ip.Address.IP)
		if !ok {
			continue
		}
		bits, _ := ip.Address.Mask.Size()
		out = append(out, netip.PrefixFrom(addr.Unmap(), bits))
	}
	return out
}
