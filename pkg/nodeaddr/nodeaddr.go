// Package nodeaddr reads the node's own addresses, from which kubelet
// probes come and which the datapath therefore always allows. The plugin
// reads them at every ADD; the sweeper follows their changes.
package nodeaddr

import (
	"errors"
	"fmt"
	"net/netip"
	"runtime"
	"time"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

// List returns the addresses of the calling thread's network namespace,
// link-local and loopback ones excluded (a probe never comes from those).
// A node without any simply has nothing to always allow.
func List() ([]netip.Addr, error) {
	h, err := netlink.NewHandle(unix.NETLINK_ROUTE)
	if err != nil {
		return nil, fmt.Errorf("netlink: %w", err)
	}
	defer h.Close()
	// A dump that spans several messages is flagged as interrupted when an
	// address changes meanwhile, which is routine on a node where pods'
	// veths come and go: dump again rather than fail.
	var addrs []netlink.Addr
	for attempt := 0; ; attempt++ {
		addrs, err = h.AddrList(nil, netlink.FAMILY_ALL)
		if !errors.Is(err, netlink.ErrDumpInterrupted) || attempt == 9 {
			break
		}
	}
	if err != nil {
		return nil, fmt.Errorf("list node addresses: %w", err)
	}
	var out []netip.Addr
	for _, a := range addrs {
		if ip, ok := usable(a.IP); ok {
			out = append(out, ip)
		}
	}
	return out, nil
}

func usable(b []byte) (netip.Addr, bool) {
	ip, ok := netip.AddrFromSlice(b)
	if !ok {
		return netip.Addr{}, false
	}
	ip = ip.Unmap()
	if ip.IsLinkLocalUnicast() || ip.IsLoopback() {
		return netip.Addr{}, false
	}
	return ip, true
}

// Watch sends a value on the returned channel whenever an address of the
// calling thread's network namespace is added or removed, until done is
// closed. Callers list the addresses again (List) rather than apply the
// update: a burst of changes then costs one reading. The channel holds one
// pending notice; further changes before it is read merge into it. A
// subscription that fails (a lost update, ENOBUFS) is renewed, with a
// notice, since it may have hidden a change.
func Watch(done <-chan struct{}) (<-chan struct{}, error) {
	// Renewals run on whatever thread the goroutine has: they subscribe
	// in the namespace Watch was called in, held open meanwhile.
	ns, err := netns.Get()
	if err != nil {
		return nil, fmt.Errorf("follow node addresses: %w", err)
	}
	updates, err := subscribe(done, ns, true)
	if err != nil {
		ns.Close()
		return nil, err
	}
	out := make(chan struct{}, 1)
	notify := func() {
		select {
		case out <- struct{}{}:
		default:
		}
	}
	go func() {
		defer ns.Close()
		for {
			for range updates {
				notify()
			}
			// The subscription ended: done, or an error.
			select {
			case <-done:
				return
			case <-time.After(time.Second):
			}
			notify()
			u, err := renew(done, ns)
			if err != nil {
				u = make(chan netlink.AddrUpdate)
				close(u) // try again in a second
			}
			updates = u
		}
	}()
	return out, nil
}

// renew subscribes again from the watching goroutine's thread.
func renew(done <-chan struct{}, ns netns.NsHandle) (chan netlink.AddrUpdate, error) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	cur, err := netns.Get()
	if err != nil {
		return nil, fmt.Errorf("follow node addresses: %w", err)
	}
	defer cur.Close()
	return subscribe(done, ns, cur.Equal(ns))
}

// subscribe opens an address subscription in ns. here says the calling
// thread is in ns already: entering it costs setns(2), which needs
// CAP_SYS_ADMIN, and the sweeper's DaemonSet does not grant that. A process
// that never leaves its namespace (the sweeper) always subscribes here.
func subscribe(done <-chan struct{}, ns netns.NsHandle, here bool) (chan netlink.AddrUpdate, error) {
	updates := make(chan netlink.AddrUpdate, 64)
	opts := netlink.AddrSubscribeOptions{ReceiveBufferSize: 1 << 20, ErrorCallback: func(error) {}}
	if !here {
		opts.Namespace = &ns
	}
	if err := netlink.AddrSubscribeWithOptions(updates, done, opts); err != nil {
		return nil, fmt.Errorf("follow node addresses: %w", err)
	}
	return updates, nil
}
