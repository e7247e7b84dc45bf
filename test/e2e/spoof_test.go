package e2e

import (
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/containernetworking/cni/libcni"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/podfence/podfence/bpf"
	"github.com/podfence/podfence/pkg/packet"
	"github.com/podfence/podfence/pkg/podid"
	"github.com/podfence/podfence/test/netnsutil"
)

// TestForgedSources attacks a victim pod from an intruder pod with raw
// frames in another's name, in both attach modes and both families: the
// address of the one client the victim's policy lets in, of the node, of
// the gateway ptp puts on every host veth, and of a neighbour in the
// pod's own range; SYNs, bare ACKs and UDP, with and without IPv4 options
// and IPv6 extension headers; and the upstream agent's conntrack poisoning
// (a forged reply from the victim meant to open the reverse flow). The
// node's reverse-path and martian filters are off. Nothing
// may reach the victim, and no conntrack entry may be written for a forged
// tuple, while the intruder's own traffic goes on. A second intruder,
// added with sourceCheck false, sends the same frames: those the victim's
// policy allows do arrive, which shows that the scene would let them in
// but for the check.
func TestForgedSources(t *testing.T) {
	for _, mode := range attachModes(t) {
		t.Run(mode, func(t *testing.T) { testForgedSources(t, mode) })
	}
}

const (
	victimTCP = 8080
	victimUDP = 5353
)

func testForgedSources(t *testing.T, mode string) {
	c := newDualStackCluster(t, mode)
	// The node's own IPv4 filters off, set before the veths exist so
	// that they inherit them: podfence must not depend on sysctls it
	// does not own. rp_filter 0 passes forged sources of other pods, and
	// accept_local 1 those of the node's own addresses, which Linux
	// otherwise drops as martians from a pod's veth (IPv6 has neither
	// filter).
	netnsutil.Do(t, c.node, func() error {
		for _, k := range []string{"all", "default"} {
			for sysctl, v := range map[string]string{"rp_filter": "0", "accept_local": "1"} {
				if err := os.WriteFile("/proc/sys/net/ipv4/conf/"+k+"/"+sysctl, []byte(v), 0o644); err != nil {
					return err
				}
			}
		}
		return nil
	})
	client := c.addPod("client", "default")
	neighbour := c.addPod("neighbour", "default")
	server := c.addPod("server", "default")
	victim := c.addPod("victim", "default")
	intruder := c.addPod("intruder", "default")
	unchecked := c.addPodWith("unchecked", "default", map[string]any{"sourceCheck": false})
	for _, p := range []*pod{victim, server} {
		netnsutil.Listen(t, p.netns, victimTCP)
	}
	victimUDPListen(t, victim)

	doc := endpointDoc{name: "victim", pods: []string{"victim"}, isolate: []string{"Ingress"}}
	for _, a := range []netip.Addr{client.ip, client.ip6} {
		doc.ingress = append(doc.ingress, tcpRule(netip.PrefixFrom(a, a.BitLen()).String(), victimTCP),
			protoRule(netip.PrefixFrom(a, a.BitLen()).String(), "UDP", victimUDP))
	}
	c.writePolicy("victim", doc.String())
	c.applyPolicies()

	gw4, gw6 := c.gateways(t, victim)
	node4, node6 := c.nodeAddrs(t)
	type forger struct {
		name string
		addr netip.Addr
		// allowed: the victim's policy lets it in, so a frame in its
		// name from the unchecked intruder arrives.
		allowed bool
	}
	forgers := []forger{
		{"allowed client", client.ip, true}, {"allowed client", client.ip6, true},
		{"node", node4, true}, {"node", node6, true},
		{"veth gateway", gw4, true}, {"veth gateway", gw6, true},
		{"neighbour in the /24", neighbour.ip, false}, {"neighbour", neighbour.ip6, false},
	}

	sniff := startSniffer(t, victim)
	sent := 0
	type arrival struct {
		name string
		src  netip.Addr
		port uint16
	}
	var wantArrive []arrival
	// The node routes the frames, so the victim sees the node's MAC: the
	// intruders' frames are told apart by their source ports.
	basePort := map[*pod]uint16{intruder: 41000, unchecked: 42000}
	for _, from := range []*pod{intruder, unchecked} {
		for _, f := range forgers {
			dst := victim.ip
			if f.addr.Is6() {
				dst = victim.ip6
			}
			for _, fr := range forgedFrames(f.addr, dst, basePort[from]) {
				sendFrame(t, c, from, fr.pkt)
				sent++
				if from == unchecked && f.allowed {
					wantArrive = append(wantArrive, arrival{fmt.Sprintf("%s (%s) %s", f.name, f.addr, fr.name), f.addr, fr.pkt.SrcPort})
				}
			}
		}
		// Conntrack poisoning: a "reply" from the victim's port to the
		// intruder, then the intruder's "answer" as if the victim had
		// opened the flow.
		for _, fam := range [][2]netip.Addr{{victim.ip, from.ip}, {victim.ip6, from.ip6}} {
			reply := packet.Packet{Src: fam[0], Dst: fam[1], Proto: 6, SrcPort: victimTCP, DstPort: basePort[from] + 999, TCPFlags: 0x10}
			sendFrame(t, c, from, reply)
			sendFrame(t, c, from, reply.Reply())
			sent += 2
		}
	}
	time.Sleep(300 * time.Millisecond)
	got := sniff.stop()
	t.Logf("%d forged frames sent from %s and %s; the victim received %d IP frames", sent, intruder.name, unchecked.name, len(got))

	// Nothing from the checked intruder's forgeries reached the victim;
	// its own poisoning "answer" came from its own address and was
	// refused by the victim's policy.
	from := func(f sniffed, p *pod) bool { return f.sport >= basePort[p] && f.sport < basePort[p]+1000 }
	for _, f := range got {
		if from(f, intruder) {
			t.Errorf("forged frame from %s reached the victim: %s:%d -> %s proto %d", intruder.name, f.src, f.sport, f.dst, f.proto)
		}
	}
	// The unchecked intruder's frames in the name of allowed sources
	// arrived: the scene would deliver them.
	for _, w := range wantArrive {
		if !slices.ContainsFunc(got, func(f sniffed) bool { return f.src == w.src && f.sport == w.port }) {
			t.Errorf("the unchecked intruder's frame in the name of the %s did not reach the victim: the test cannot tell the check's effect", w.name)
		}
	}

	// No entry names a forged source on the intruder's veth.
	intruderIfindex := c.hostIfindex(t, intruder)
	own := map[netip.Addr]bool{intruder.ip: true, intruder.ip6: true}
	for _, e := range c.conntrack(t) {
		if src := e.Key.SrcAddrPort().Addr(); e.Ifindex == uint32(intruderIfindex) && !own[src] {
			t.Errorf("conntrack entry for a forged tuple on %s's veth: %s", intruder.name, e.Key)
		}
	}

	// The intruder's own traffic is unaffected, in both families.
	if !c.connects(intruder, server, victimTCP) {
		t.Errorf("%s cannot reach %s from its own address", intruder.name, server.name)
	}
	if !netnsutil.Connects(t, intruder.netns, netip.AddrPortFrom(server.ip6, victimTCP), 300*time.Millisecond, 3) {
		t.Errorf("%s cannot reach %s over IPv6 from its own address", intruder.name, server.name)
	}
	if !c.connects(client, victim, victimTCP) {
		t.Errorf("the allowed client cannot reach the victim")
	}
	if n := c.counter(t, intruder, bpf.ReasonSpoofed); n == 0 {
		t.Errorf("no packet of the intruder counted as spoofed")
	}

	// trace reports the forgeries under their reason, and why explains one.
	out, err := c.sweeper(t, "trace", "--json", "--pin-root", c.pinRoot, "--policy-dir", c.policyDir,
		"--pod", "intruder@default", "--duration", "1s")
	if err != nil {
		t.Fatal(err)
	}
	if !slices.ContainsFunc(jsonLines(t, out), func(l []byte) bool {
		var ev struct{ Reason, Direction, Src string }
		return json.Unmarshal(l, &ev) == nil && ev.Reason == "spoofed" && ev.Direction == "egress" &&
			strings.HasPrefix(ev.Src, client.ip.String()+":")
	}) {
		t.Errorf("trace printed no spoofed egress event in the client's name:\n%s", out)
	}
	out, err = c.sweeper(t, "why", "--pin-root", c.pinRoot, "--policy-dir", c.policyDir, "--pod", "intruder",
		"--to", victim.ip.String(), "--source", client.ip.String(), fmt.Sprintf("%d/tcp", victimTCP))
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(out), "deny (spoofed)") || !strings.Contains(string(out), intruder.ip.String()) {
		t.Errorf("why printed %q, want a deny as spoofed that names the intruder's own address", out)
	}
}

type namedFrame struct {
	name string
	pkt  packet.Packet
}

// forgedFrames are what the intruder sends in src's name to dst: TCP SYN
// and bare ACK to the victim's port, UDP, and each again behind IPv4
// options or IPv6 extension headers (hop-by-hop and destination options).
func forgedFrames(src, dst netip.Addr, port uint16) []namedFrame {
	syn := packet.Packet{Src: src, Dst: dst, Proto: 6, SrcPort: port + 1, DstPort: victimTCP, TCPFlags: 0x02}
	ack := syn
	ack.SrcPort, ack.TCPFlags = port+2, 0x10
	udp := packet.Packet{Src: src, Dst: dst, Proto: 17, SrcPort: port + 3, DstPort: victimUDP, Payload: []byte("forged")}
	out := []namedFrame{{"syn", syn}, {"ack", ack}, {"udp", udp}}
	for _, f := range out[:3] {
		p := f.pkt
		p.SrcPort += 100
		if src.Is4() {
			p.IPOptions = []byte{1, 1, 1, 1, 1, 1, 1, 1} // NOPs
			out = append(out, namedFrame{f.name + " with ip options", p})
		} else {
			p.ExtHeaders = []packet.ExtHeader{{Type: 0}, {Type: 60}}
			out = append(out, namedFrame{f.name + " with extension headers", p})
		}
	}
	return out
}

// addPodWith adds a pod with extra settings in podfence's part of the
// conflist, as a node configured differently would.
func (c *cluster) addPodWith(name, namespace string, settings map[string]any) *pod {
	c.t.Helper()
	var conf map[string]any
	if err := json.Unmarshal(c.confBytes, &conf); err != nil {
		c.t.Fatal(err)
	}
	plugins := conf["plugins"].([]any)
	pf := plugins[len(plugins)-1].(map[string]any)
	for k, v := range settings {
		pf[k] = v
	}
	b, err := json.Marshal(conf)
	if err != nil {
		c.t.Fatal(err)
	}
	list, err := libcni.ConfListFromBytes(b)
	if err != nil {
		c.t.Fatal(err)
	}
	saved := c.list
	c.list = list
	defer func() { c.list = saved }()
	p := c.addPod(name, namespace)
	// DEL goes through the node's usual conflist: the record carries
	// what the ADD decided.
	return p
}

// applyPolicies programs every identifier with the policy directory, as
// the sweeper does on a change.
func (c *cluster) applyPolicies() {
	c.t.Helper()
	if _, err := c.sweeper(c.t, "apply", "--pin-root", c.pinRoot, "--policy-dir", c.policyDir); err != nil {
		c.t.Fatal(err)
	}
}

// gateways are the addresses ptp put on p's host veth.
func (c *cluster) gateways(t *testing.T, p *pod) (v4, v6 netip.Addr) {
	t.Helper()
	netnsutil.Do(t, c.node, func() error {
		link, err := netlink.LinkByName(p.hostVeth)
		if err != nil {
			return err
		}
		addrs, err := netlink.AddrList(link, netlink.FAMILY_ALL)
		if err != nil {
			return err
		}
		for _, a := range addrs {
			ip, _ := netip.AddrFromSlice(a.IP)
			ip = ip.Unmap()
			switch {
			case ip.Is4():
				v4 = ip
			case ip.Is6() && !ip.IsLinkLocalUnicast():
				v6 = ip
			}
		}
		return nil
	})
	if !v4.IsValid() || !v6.IsValid() {
		t.Fatalf("host veth %s has no gateway address of each family: %s %s", p.hostVeth, v4, v6)
	}
	return v4, v6
}

// nodeAddrs gives the node namespace an address of each family on a link
// of its own, as a node's primary interface has.
func (c *cluster) nodeAddrs(t *testing.T) (v4, v6 netip.Addr) {
	t.Helper()
	v4, v6 = netip.MustParseAddr("192.168.77.1"), netip.MustParseAddr("fd77:77::1")
	netnsutil.Do(t, c.node, func() error {
		lo, err := netlink.LinkByName("lo")
		if err != nil {
			return err
		}
		for _, a := range []netip.Addr{v4, v6} {
			ipn := &net.IPNet{IP: a.AsSlice(), Mask: net.CIDRMask(a.BitLen(), a.BitLen())}
			if err := netlink.AddrAdd(lo, &netlink.Addr{IPNet: ipn}); err != nil && !errors.Is(err, unix.EEXIST) {
				return err
			}
		}
		return nil
	})
	// The plugin and the sweeper read the node's addresses when they
	// program: the next apply writes them.
	c.applyPolicies()
	return v4, v6
}

func (c *cluster) hostIfindex(t *testing.T, p *pod) int {
	t.Helper()
	var idx int
	netnsutil.Do(t, c.node, func() error {
		link, err := netlink.LinkByName(p.hostVeth)
		if err != nil {
			return err
		}
		idx = link.Attrs().Index
		return nil
	})
	return idx
}

// sendFrame sends pkt from p's eth0 to its gateway as a raw frame: what a
// process with CAP_NET_RAW in the pod can do.
func sendFrame(t *testing.T, c *cluster, p *pod, pkt packet.Packet) {
	t.Helper()
	var gwMAC net.HardwareAddr
	netnsutil.Do(t, c.node, func() error {
		link, err := netlink.LinkByName(p.hostVeth)
		if err != nil {
			return err
		}
		gwMAC = link.Attrs().HardwareAddr
		return nil
	})
	frame := pkt.Marshal()
	netnsutil.Do(t, p.netns, func() error {
		link, err := netlink.LinkByName("eth0")
		if err != nil {
			return err
		}
		copy(frame[0:6], gwMAC)
		copy(frame[6:12], link.Attrs().HardwareAddr)
		fd, err := unix.Socket(unix.AF_PACKET, unix.SOCK_RAW, 0)
		if err != nil {
			return err
		}
		defer unix.Close(fd)
		to := &unix.SockaddrLinklayer{Ifindex: link.Attrs().Index, Halen: 6}
		copy(to.Addr[:], gwMAC)
		return unix.Sendto(fd, frame, 0, to)
	})
}

// sniffed is one IP frame a pod's eth0 received.
type sniffed struct {
	src, dst netip.Addr
	proto    uint8
	sport    uint16 // TCP and UDP without extension headers
}

type sniffer struct {
	fd   int
	mu   sync.Mutex
	got  []sniffed
	done chan struct{}
}

// startSniffer records every IP frame p's eth0 receives until stop.
func startSniffer(t *testing.T, p *pod) *sniffer {
	t.Helper()
	s := &sniffer{fd: -1, done: make(chan struct{})}
	netnsutil.Do(t, p.netns, func() error {
		link, err := netlink.LinkByName("eth0")
		if err != nil {
			return err
		}
		proto := int(htons(unix.ETH_P_ALL))
		if s.fd, err = unix.Socket(unix.AF_PACKET, unix.SOCK_RAW, proto); err != nil {
			return err
		}
		tv := unix.Timeval{Usec: 50000}
		if err := unix.SetsockoptTimeval(s.fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv); err != nil {
			return err
		}
		return unix.Bind(s.fd, &unix.SockaddrLinklayer{Protocol: htons(unix.ETH_P_ALL), Ifindex: link.Attrs().Index})
	})
	t.Cleanup(func() { s.stop() })
	go s.read()
	return s
}

func (s *sniffer) read() {
	defer close(s.done)
	buf := make([]byte, 2048)
	for {
		n, from, err := unix.Recvfrom(s.fd, buf, 0)
		if errors.Is(err, unix.EAGAIN) || errors.Is(err, unix.EINTR) {
			s.mu.Lock()
			closed := s.fd < 0
			s.mu.Unlock()
			if closed {
				return
			}
			continue
		}
		if err != nil {
			return
		}
		if ll, ok := from.(*unix.SockaddrLinklayer); ok && ll.Pkttype == unix.PACKET_OUTGOING {
			continue
		}
		if f, ok := parseSniffed(buf[:n]); ok {
			s.mu.Lock()
			s.got = append(s.got, f)
			s.mu.Unlock()
		}
	}
}

func (s *sniffer) stop() []sniffed {
	s.mu.Lock()
	fd := s.fd
	s.fd = -1
	s.mu.Unlock()
	if fd >= 0 {
		<-s.done
		unix.Close(fd)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]sniffed(nil), s.got...)
}

func parseSniffed(b []byte) (sniffed, bool) {
	if len(b) < 14 {
		return sniffed{}, false
	}
	var f sniffed
	ip := b[14:]
	var l4 []byte
	switch binary.BigEndian.Uint16(b[12:]) {
	case unix.ETH_P_IP:
		if len(ip) < 20 {
			return f, false
		}
		f.src, f.dst, f.proto = netip.AddrFrom4([4]byte(ip[12:16])), netip.AddrFrom4([4]byte(ip[16:20])), ip[9]
		l4 = ip[int(ip[0]&0xf)*4:]
	case unix.ETH_P_IPV6:
		if len(ip) < 40 {
			return f, false
		}
		f.src, f.dst, f.proto = netip.AddrFrom16([16]byte(ip[8:24])), netip.AddrFrom16([16]byte(ip[24:40])), ip[6]
		l4 = ip[40:]
		// Walk hop-by-hop and destination options to the ports.
		for (f.proto == 0 || f.proto == 60) && len(l4) >= 8 {
			f.proto, l4 = l4[0], l4[(int(l4[1])+1)*8:]
		}
		if f.dst.IsMulticast() || f.src.IsLinkLocalUnicast() || f.proto == 58 {
			return f, false // the link's own chatter (ND, MLD)
		}
	default:
		return f, false
	}
	if (f.proto == 6 || f.proto == 17) && len(l4) >= 2 {
		f.sport = binary.BigEndian.Uint16(l4)
	}
	return f, true
}

func htons(v uint16) uint16 { return v<<8 | v>>8 }

// victimUDPListen binds the victim's UDP port in both families, so that
// forged datagrams would be delivered to a socket.
func victimUDPListen(t *testing.T, p *pod) {
	t.Helper()
	netnsutil.Do(t, p.netns, func() error {
		conn, err := net.ListenPacket("udp", fmt.Sprintf(":%d", victimUDP))
		if err != nil {
			return err
		}
		t.Cleanup(func() { conn.Close() })
		return nil
	})
}

// conntrack is every entry of the node's eBPF conntrack maps.
func (c *cluster) conntrack(t *testing.T) []bpf.CTEntry {
	t.Helper()
	g, err := bpf.OpenGlobal(globalDir(c.pinRoot), bpf.GlobalOptions{KeepLayout: true})
	if err != nil {
		t.Fatal(err)
	}
	defer g.Close()
	var out []bpf.CTEntry
	if err := g.ScanConntrack(func(batch []bpf.CTEntry) error {
		out = append(out, batch...)
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	return out
}

// counter is the node's count of reason for the identifier of pod p.
func (c *cluster) counter(t *testing.T, p *pod, r bpf.Reason) uint64 {
	t.Helper()
	id, err := podid.FromPod(p.name, p.namespace)
	if err != nil {
		t.Fatal(err)
	}
	info, err := bpf.InspectIdentifier(c.identifierDir(string(id)), id)
	if err != nil {
		t.Fatal(err)
	}
	return info.Counters[0][r] + info.Counters[1][r]
}
