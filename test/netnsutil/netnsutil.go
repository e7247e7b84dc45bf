// Package netnsutil builds throwaway network namespaces for kernel tests: a
// "node" namespace and a "pod" namespace joined by a veth, the way a routed
// CNI wires a pod, plus TCP listeners and dials between them. Everything is
// removed when the test ends, also when it fails. The root network namespace
// is never changed. Needs root.
package netnsutil

import (
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/containernetworking/plugins/pkg/ns"
	"github.com/containernetworking/plugins/pkg/testutils"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// New returns a fresh network namespace with lo up. It is closed and its
// bind mount removed when the test ends; the kernel deletes its interfaces
// once nothing (socket, listener) refers to it any more.
func New(tb testing.TB) ns.NetNS {
	tb.Helper()
	n, err := testutils.NewNS()
	if err != nil {
		tb.Fatalf("create network namespace: %v", err)
	}
	tb.Cleanup(func() {
		n.Close()
		if err := testutils.UnmountNS(n); err != nil {
			tb.Errorf("remove network namespace %s: %v", n.Path(), err)
		}
	})
	Do(tb, n, func() error {
		return withHandle(func(h *netlink.Handle) error {
			lo, err := h.LinkByName("lo")
			if err != nil {
				return err
			}
			return h.LinkSetUp(lo)
		})
	})
	return n
}

// Do runs fn inside n on a locked OS thread and fails the test when fn
// returns an error.
func Do(tb testing.TB, n ns.NetNS, fn func() error) {
	tb.Helper()
	if err := n.Do(func(ns.NetNS) error { return fn() }); err != nil {
		tb.Fatalf("in %s: %v", n.Path(), err)
	}
}

// withHandle runs fn with an rtnetlink handle of the calling thread's
// namespace (NETLINK_ROUTE only: a minimal guest kernel lacks XFRM).
func withHandle(fn func(h *netlink.Handle) error) error {
	h, err := netlink.NewHandle(unix.NETLINK_ROUTE)
	if err != nil {
		return err
	}
	defer h.Close()
	return fn(h)
}

// Addresses of a Pair.
var (
	NodeV4 = netip.MustParsePrefix("10.200.0.1/24")
	PodV4  = netip.MustParsePrefix("10.200.0.2/24")
	NodeV6 = netip.MustParsePrefix("fd20::1/64")
	PodV6  = netip.MustParsePrefix("fd20::2/64")
)

// Pair is a node namespace and a pod namespace joined by a veth whose host
// end (HostVeth, index HostIndex) is in Node and whose other end, eth0, is in
// Pod. Both ends carry an address of NodeV4/NodeV6 and PodV4/PodV6.
//
// Both ends learn each other's addresses as a real pod and node do: ARP,
// which is not IP, and IPv6 neighbour discovery, which podfence's programs
// pass whatever the policy. FlushNeighbours makes the next connection need
// them again.
type Pair struct {
	Node, Pod ns.NetNS
	HostVeth  string
	HostIndex int
}

// NewPair creates the namespaces and the veth.
func NewPair(tb testing.TB) *Pair {
	tb.Helper()
	p := &Pair{Node: New(tb), Pod: New(tb), HostVeth: "veth0"}
	Do(tb, p.Node, func() error {
		return withHandle(func(h *netlink.Handle) error {
			veth := &netlink.Veth{
				LinkAttrs:     netlink.LinkAttrs{Name: p.HostVeth},
				PeerName:      "eth0",
				PeerNamespace: netlink.NsFd(int(p.Pod.Fd())),
			}
			if err := h.LinkAdd(veth); err != nil {
				return fmt.Errorf("add veth: %w", err)
			}
			l, err := setUp(h, p.HostVeth, NodeV4, NodeV6)
			if err != nil {
				return err
			}
			p.HostIndex = l.Attrs().Index
			return nil
		})
	})
	Do(tb, p.Pod, func() error {
		return withHandle(func(h *netlink.Handle) error {
			_, err := setUp(h, "eth0", PodV4, PodV6)
			return err
		})
	})
	return p
}

// FlushNeighbours forgets the IPv6 neighbours both ends have learnt.
func (p *Pair) FlushNeighbours(tb testing.TB) {
	tb.Helper()
	for _, end := range []struct {
		n    ns.NetNS
		link string
	}{{p.Node, p.HostVeth}, {p.Pod, "eth0"}} {
		Do(tb, end.n, func() error {
			return withHandle(func(h *netlink.Handle) error {
				l, err := h.LinkByName(end.link)
				if err != nil {
					return err
				}
				neighs, err := h.NeighList(l.Attrs().Index, unix.AF_INET6)
				if err != nil {
					return fmt.Errorf("list neighbours of %s: %w", end.link, err)
				}
				for _, n := range neighs {
					if err := h.NeighDel(&n); err != nil && !errors.Is(err, unix.ENOENT) {
						return fmt.Errorf("delete neighbour %s of %s: %w", n.IP, end.link, err)
					}
				}
				return nil
			})
		})
	}
}

// setUp gives the interface its addresses (without duplicate address
// detection, so they are usable at once) and brings it up.
func setUp(h *netlink.Handle, name string, addrs ...netip.Prefix) (netlink.Link, error) {
	l, err := h.LinkByName(name)
	if err != nil {
		return nil, fmt.Errorf("find %s: %w", name, err)
	}
	for _, a := range addrs {
		addr := &netlink.Addr{
			IPNet: &net.IPNet{IP: a.Addr().AsSlice(), Mask: net.CIDRMask(a.Bits(), a.Addr().BitLen())},
		}
		if a.Addr().Is6() {
			addr.Flags = unix.IFA_F_NODAD
		}
		if err := h.AddrAdd(l, addr); err != nil {
			return nil, fmt.Errorf("add %s to %s: %w", a, name, err)
		}
	}
	if err := h.LinkSetUp(l); err != nil {
		return nil, fmt.Errorf("set %s up: %w", name, err)
	}
	return h.LinkByName(name) // again, for the attributes of an up link
}

// DeleteHostVeth deletes the veth (both ends) from the node namespace.
func (p *Pair) DeleteHostVeth(tb testing.TB) {
	tb.Helper()
	Do(tb, p.Node, func() error {
		return withHandle(func(h *netlink.Handle) error {
			l, err := h.LinkByIndex(p.HostIndex)
			if err != nil {
				return err
			}
			return h.LinkDel(l)
		})
	})
}

// Listen accepts TCP connections on port (all addresses, IPv4 and IPv6) in
// n and closes each at once. The listener is closed when the test ends. The
// function returned tells the source address of the last connection
// accepted (what a SNAT made of it), the zero Addr before the first.
func Listen(tb testing.TB, n ns.NetNS, port uint16) (lastFrom func() netip.Addr) {
	tb.Helper()
	ln := listenIn(tb, n, port)
	var (
		wg   sync.WaitGroup
		mu   sync.Mutex
		last netip.Addr
	)
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			last = c.RemoteAddr().(*net.TCPAddr).AddrPort().Addr().Unmap()
			mu.Unlock()
			c.Close()
		}
	}()
	tb.Cleanup(func() {
		ln.Close()
		wg.Wait()
	})
	return func() netip.Addr {
		mu.Lock()
		defer mu.Unlock()
		return last
	}
}

// listenIn listens for TCP on port (all addresses) in n.
func listenIn(tb testing.TB, n ns.NetNS, port uint16) net.Listener {
	tb.Helper()
	var ln net.Listener
	Do(tb, n, func() error {
		var err error
		ln, err = net.Listen("tcp", ":"+strconv.Itoa(int(port)))
		return err
	})
	return ln
}

// Echo accepts TCP connections on port in n and sends back whatever each
// sends, until the test ends, which closes the listener and every
// connection still open (a peer whose packets are dropped never closes its
// own).
func Echo(tb testing.TB, n ns.NetNS, port uint16) {
	tb.Helper()
	ln := listenIn(tb, n, port)
	var (
		wg     sync.WaitGroup
		mu     sync.Mutex
		conns  = map[net.Conn]bool{}
		closed bool
	)
	tb.Cleanup(func() {
		ln.Close()
		mu.Lock()
		closed = true
		for c := range conns {
			c.Close()
		}
		mu.Unlock()
		wg.Wait()
	})
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			if closed {
				mu.Unlock()
				c.Close()
				return
			}
			conns[c] = true
			mu.Unlock()
			wg.Add(1)
			go func() {
				defer wg.Done()
				io.Copy(c, c) //nolint:errcheck // ends with the connection
				mu.Lock()
				delete(conns, c)
				mu.Unlock()
				c.Close()
			}()
		}
	}()
}

// Dial opens a TCP connection from n to dst and closes it again.
func Dial(n ns.NetNS, dst netip.AddrPort, timeout time.Duration) error {
	return n.Do(func(ns.NetNS) error {
		c, err := net.DialTimeout("tcp", dst.String(), timeout)
		if err != nil {
			return err
		}
		return c.Close()
	})
}

// Connects reports whether a TCP connection from n to dst succeeds within
// attempts tries of timeout each. It fails the test on an error that is
// neither success nor a timeout (a refused connection means the SYN got
// through, so it is not what a dropping filter causes).
func Connects(tb testing.TB, n ns.NetNS, dst netip.AddrPort, timeout time.Duration, attempts int) bool {
	tb.Helper()
	for i := 0; i < attempts; i++ {
		err := Dial(n, dst, timeout)
		if err == nil {
			return true
		}
		var ne net.Error
		if !errors.As(err, &ne) || !ne.Timeout() {
			tb.Fatalf("dial %s: %v", dst, err)
		}
	}
	return false
}

// Veth is a veth made by AddVeth: its host end in the node namespace and
// its pod end, eth0, in the pod namespace.
type Veth struct {
	HostName  string
	HostIndex int
	HostMAC   net.HardwareAddr
	PodMAC    net.HardwareAddr
}

// AddVeth joins an existing pod namespace to an existing node namespace
// with a veth named hostName on the node and eth0 in the pod, gives the
// host end hostAddr and eth0 podAddr (either may be the zero Prefix: no
// address) and brings both ends up. The veth goes with the namespaces.
func AddVeth(tb testing.TB, node, pod ns.NetNS, hostName string, hostAddr, podAddr netip.Prefix) Veth {
	tb.Helper()
	v := Veth{HostName: hostName}
	Do(tb, node, func() error {
		return withHandle(func(h *netlink.Handle) error {
			veth := &netlink.Veth{
				LinkAttrs:     netlink.LinkAttrs{Name: hostName},
				PeerName:      "eth0",
				PeerNamespace: netlink.NsFd(int(pod.Fd())),
			}
			if err := h.LinkAdd(veth); err != nil {
				return fmt.Errorf("add veth %s: %w", hostName, err)
			}
			l, err := setUp(h, hostName, validOnly(hostAddr)...)
			if err != nil {
				return err
			}
			v.HostIndex, v.HostMAC = l.Attrs().Index, l.Attrs().HardwareAddr
			return nil
		})
	})
	Do(tb, pod, func() error {
		return withHandle(func(h *netlink.Handle) error {
			l, err := setUp(h, "eth0", validOnly(podAddr)...)
			if err != nil {
				return err
			}
			v.PodMAC = l.Attrs().HardwareAddr
			return nil
		})
	})
	return v
}

func validOnly(p netip.Prefix) []netip.Prefix {
	if !p.IsValid() {
		return nil
	}
	return []netip.Prefix{p}
}

// DeleteLink deletes the interface name in n; deleting one end of a veth
// deletes both.
func DeleteLink(tb testing.TB, n ns.NetNS, name string) {
	tb.Helper()
	Do(tb, n, func() error {
		return withHandle(func(h *netlink.Handle) error {
			l, err := h.LinkByName(name)
			if err != nil {
				return fmt.Errorf("find %s: %w", name, err)
			}
			if err := h.LinkDel(l); err != nil {
				return fmt.Errorf("delete %s: %w", name, err)
			}
			return nil
		})
	})
}
