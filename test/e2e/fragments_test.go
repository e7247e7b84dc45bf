package e2e

import (
	"bytes"
	"fmt"
	"net"
	"net/netip"
	"testing"
	"time"

	"github.com/containernetworking/plugins/pkg/ns"

	"github.com/podfence/podfence/bpf"
	"github.com/podfence/podfence/pkg/policy"
	"github.com/podfence/podfence/test/netnsutil"
)

// TestFragmentedReplyReachesIsolatedPod: a pod whose ingress is closed asks
// another pod over UDP and gets an answer larger than the MTU, which the
// answering stack sends as fragments (as a DNS server does with a large
// EDNS answer). Only the first fragment carries the ports that match the
// pod's tracked flow; the others must be matched through it, or the answer
// never completes.
func TestFragmentedReplyReachesIsolatedPod(t *testing.T) {
	const port, answer = 5353, 4000
	for _, mode := range attachModes(t) {
		t.Run(mode, func(t *testing.T) {
			c := newCluster(t, mode)
			server := c.addPod("server", "default")
			c.writePolicy("client", egressOnly("client", protoRule(server.ip.String()+"/32", "UDP", port)))
			client := c.addPod("client", "default")
			udpAnswer(t, server.netns, port, answer)

			got, err := udpAsk(client.netns, netip.AddrPortFrom(server.ip, port))
			if err != nil {
				t.Fatalf("a %d-byte answer to the isolated pod: %v", answer, err)
			}
			if len(got) != answer || !bytes.Equal(got, bytes.Repeat([]byte{'a'}, answer)) {
				t.Fatalf("answer of %d bytes, want %d", len(got), answer)
			}
			if n := c.counters(t, "client@default")[policy.Ingress][bpf.ReasonCTReply]; n < 3 {
				t.Errorf("%d packets passed as replies, want the answer's 3 fragments at least", n)
			}
		})
	}
}

// udpAnswer answers every datagram to port in n with size bytes.
func udpAnswer(t *testing.T, n ns.NetNS, port, size int) {
	t.Helper()
	var conn net.PacketConn
	netnsutil.Do(t, n, func() error {
		var err error
		conn, err = net.ListenPacket("udp4", fmt.Sprintf(":%d", port))
		return err
	})
	t.Cleanup(func() { conn.Close() })
	go func() {
		buf := make([]byte, 1500)
		for {
			_, from, err := conn.ReadFrom(buf)
			if err != nil {
				return
			}
			_, _ = conn.WriteTo(bytes.Repeat([]byte{'a'}, size), from)
		}
	}()
}

// udpAsk sends a datagram from n to dst and returns the answer, asking up
// to three times (a first datagram may race the neighbour entries).
func udpAsk(n ns.NetNS, dst netip.AddrPort) ([]byte, error) {
	var conn net.Conn
	if err := n.Do(func(ns.NetNS) error {
		var err error
		conn, err = net.Dial("udp4", dst.String())
		return err
	}); err != nil {
		return nil, err
	}
	defer conn.Close()
	buf := make([]byte, 65536)
	var err error
	for try := 0; try < 3; try++ {
		if _, err = conn.Write([]byte("ask")); err != nil {
			return nil, err
		}
		_ = conn.SetReadDeadline(time.Now().Add(time.Second))
		var m int
		if m, err = conn.Read(buf); err == nil {
			return buf[:m], nil
		}
	}
	return nil, err
}
