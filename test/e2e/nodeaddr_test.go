package e2e

import (
	"fmt"
	"net"
	"net/netip"
	"runtime"
	"sync"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// TestAddWhileNodeAddressesChange runs ADD and DEL while addresses on the
// node come and go, as they do on a real node whenever a pod's veth comes
// up (its IPv6 link-local address, duplicate address detection). It catches
// an ADD that fails because the kernel flagged its dump of the node's
// addresses as interrupted (NLM_F_DUMP_INTR, netlink.ErrDumpInterrupted)
// instead of dumping again.
func TestAddWhileNodeAddressesChange(t *testing.T) {
	c := newCluster(t, "tc")
	s := c.newSlots(1)[0]
	if err := c.inNode(func() error {
		h, err := netlink.NewHandle(unix.NETLINK_ROUTE)
		if err != nil {
			return err
		}
		defer h.Close()
		return h.LinkAdd(&netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: "churn0"}, PeerName: "churn1"})
	}); err != nil {
		t.Fatal(err)
	}

	// Flip an address on churn0 until the calls are done.
	stop, ready := make(chan struct{}), make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		runtime.LockOSThread() // the thread stays in the node namespace; it dies with the goroutine
		if err := c.node.Set(); err != nil {
			t.Error(err)
			return
		}
		h, err := netlink.NewHandle(unix.NETLINK_ROUTE)
		if err != nil {
			t.Error(err)
			return
		}
		defer h.Close()
		l, err := h.LinkByName("churn0")
		if err != nil {
			t.Error(err)
			return
		}
		var addrs []*netlink.Addr
		for _, s := range []string{"10.99.0.1/32", "fd99::1/128"} {
			p := netip.MustParsePrefix(s)
			addrs = append(addrs, &netlink.Addr{
				IPNet: &net.IPNet{IP: p.Addr().AsSlice(), Mask: net.CIDRMask(p.Bits(), p.Addr().BitLen())},
				Flags: unix.IFA_F_NODAD,
			})
		}
		if err := h.LinkSetUp(l); err != nil {
			t.Error(err)
			return
		}
		// A node with many pods has many addresses (a link-local one per
		// veth): enough that the dump takes several messages.
		for i := range 100 {
			ip := netip.AddrFrom4([4]byte{10, 99, 1, byte(i + 1)})
			if err := h.AddrAdd(l, &netlink.Addr{IPNet: &net.IPNet{IP: ip.AsSlice(), Mask: net.CIDRMask(32, 32)}}); err != nil {
				t.Error(err)
				return
			}
		}
		close(ready)
		for {
			select {
			case <-stop:
				return
			default:
			}
			for _, a := range addrs {
				_ = h.AddrAdd(l, a)
				_ = h.AddrDel(l, a)
			}
		}
	}()
	defer func() {
		close(stop)
		wg.Wait()
	}()
	select {
	case <-ready:
	case <-time.After(10 * time.Second):
		t.Fatal("node addresses not set up")
	}

	deadline := time.Now().Add(10 * time.Second)
	for i := 0; i < 40 && time.Now().Before(deadline); i++ {
		ctr := fmt.Sprintf("churn-%03d", i)
		if err := c.exec(invocation{command: "ADD", containerID: ctr, pod: "churn-7f65cc6544-bcdfg", slot: s}); err != nil {
			t.Fatalf("call %d: %v", i, err)
		}
		if err := c.exec(invocation{command: "DEL", containerID: ctr, pod: "churn-7f65cc6544-bcdfg", slot: s}); err != nil {
			t.Fatalf("call %d: %v", i, err)
		}
	}
}
