package packet

import (
	"bytes"
	"encoding/binary"
	"hash/crc32"
	"net/netip"
	"slices"
	"strings"
	"testing"
)

var (
	v4a = netip.MustParseAddr("10.0.0.1")
	v4b = netip.MustParseAddr("10.0.0.2")
	v6a = netip.MustParseAddr("fd00::1")
	v6b = netip.MustParseAddr("fd00::2")
)

// decoded holds the fields a test reads back from a frame, decoded by hand
// and independently of the builder.
type decoded struct {
	ethType    uint16
	src, dst   netip.Addr
	ihl        int // IPv4 header length in 32-bit words
	totalLen   int // IPv4 total length, or IPv6 payload length + 40
	ttl        uint8
	fragOffset uint16 // IPv4 field, or the IPv6 fragment header's
	mf         bool
	chain      []uint8 // IPv6: every Next Header value; IPv4: the protocol
	extLens    []int   // IPv6 extension header lengths in bytes
	l4Off      int     // frame offset after the IP headers
	l4         []byte  // frame bytes after the IP headers
	ports      [2]uint16
	tcpFlags   uint8
	icmpType   uint8
	echoID     uint16
}

func (d decoded) proto() uint8 { return d.chain[len(d.chain)-1] }

// decode parses frame the way a datapath parser would, failing the test on
// any length that does not add up.
func decode(t *testing.T, frame []byte) decoded {
	t.Helper()
	var d decoded
	d.ethType = binary.BigEndian.Uint16(frame[12:14])
	ip := frame[14:]
	switch d.ethType {
	case 0x0800:
		if ip[0]>>4 != 4 {
			t.Fatalf("IPv4 version nibble %d", ip[0]>>4)
		}
		d.ihl = int(ip[0] & 0x0f)
		d.totalLen = int(binary.BigEndian.Uint16(ip[2:4]))
		frag := binary.BigEndian.Uint16(ip[6:8])
		d.fragOffset, d.mf = frag&0x1fff, frag&0x2000 != 0
		d.ttl = ip[8]
		d.chain = []uint8{ip[9]}
		d.src = netip.AddrFrom4([4]byte(ip[12:16]))
		d.dst = netip.AddrFrom4([4]byte(ip[16:20]))
		if got := onesSum(ip[:d.ihl*4], 0); got != 0xffff {
			t.Errorf("IPv4 header sums to %#04x, want 0xffff", got)
		}
		d.l4Off = 14 + d.ihl*4
	case 0x86DD:
		if ip[0]>>4 != 6 {
			t.Fatalf("IPv6 version nibble %d", ip[0]>>4)
		}
		d.totalLen = 40 + int(binary.BigEndian.Uint16(ip[4:6]))
		d.ttl = ip[7]
		d.src = netip.AddrFrom16([16]byte(ip[8:24]))
		d.dst = netip.AddrFrom16([16]byte(ip[24:40]))
		next, off := ip[6], 40
		d.chain = []uint8{next}
		for {
			var n int
			switch next {
			case 44:
				n = 8
				frag := binary.BigEndian.Uint16(ip[off+2:])
				d.fragOffset, d.mf = frag>>3, frag&1 != 0
			case 51:
				n = (int(ip[off+1]) + 2) * 4
			case 0, 43, 60, 135, 139, 140, 253, 254:
				n = (int(ip[off+1]) + 1) * 8
			}
			if n == 0 {
				break
			}
			next = ip[off]
			d.chain = append(d.chain, next)
			d.extLens = append(d.extLens, n)
			off += n
		}
		d.l4Off = 14 + off
	default:
		t.Fatalf("ethertype %#04x", d.ethType)
	}
	if want := len(frame) - 14; d.totalLen != want {
		t.Fatalf("IP length field says %d bytes, frame holds %d", d.totalLen, want)
	}
	d.l4 = frame[d.l4Off:]
	if d.fragOffset != 0 {
		return d // no L4 header in a later fragment
	}
	l4 := d.l4
	switch d.proto() {
	case 6, 17, 132:
		d.ports = [2]uint16{binary.BigEndian.Uint16(l4[0:]), binary.BigEndian.Uint16(l4[2:])}
	}
	switch d.proto() {
	case 6:
		if l4[12]>>4 != 5 {
			t.Errorf("TCP data offset %d", l4[12]>>4)
		}
		d.tcpFlags = l4[13]
		checkL4Sum(t, d, "TCP")
	case 17:
		if n := int(binary.BigEndian.Uint16(l4[4:])); n != len(l4) {
			t.Errorf("UDP length %d, datagram holds %d", n, len(l4))
		}
		checkL4Sum(t, d, "UDP")
	case 132:
		c := slices.Clone(l4)
		clear(c[8:12])
		want := crc32.Checksum(c, crc32.MakeTable(crc32.Castagnoli))
		if got := binary.LittleEndian.Uint32(l4[8:]); got != want {
			t.Errorf("SCTP CRC32c %#08x, want %#08x", got, want)
		}
	case 1, 58:
		d.icmpType = l4[0]
		d.echoID = binary.BigEndian.Uint16(l4[4:])
		if d.proto() == 58 {
			checkL4Sum(t, d, "ICMPv6")
		} else if got := onesSum(l4, 0); got != 0xffff {
			t.Errorf("ICMP sums to %#04x, want 0xffff", got)
		}
	}
	return d
}

// checkL4Sum verifies a checksum that covers a pseudo-header.
func checkL4Sum(t *testing.T, d decoded, name string) {
	t.Helper()
	var pseudo []byte
	pseudo = append(pseudo, d.src.AsSlice()...)
	pseudo = append(pseudo, d.dst.AsSlice()...)
	pseudo = binary.BigEndian.AppendUint32(pseudo, uint32(len(d.l4)))
	pseudo = append(pseudo, 0, d.proto())
	if got := onesSum(d.l4, uint32(onesSum(pseudo, 0))); got != 0xffff {
		t.Errorf("%s checksum: sum %#04x, want 0xffff", name, got)
	}
}

// onesSum is a second, deliberately plain implementation of the folded
// one's complement sum.
func onesSum(b []byte, sum uint32) uint16 {
	for i := range b {
		if i%2 == 0 {
			sum += uint32(b[i]) << 8
		} else {
			sum += uint32(b[i])
		}
	}
	for sum>>16 != 0 {
		sum = sum&0xffff + sum>>16
	}
	return uint16(sum)
}

func TestMarshal(t *testing.T) {
	payload := []byte("hello")
	tests := []struct {
		name string
		p    Packet
		// want holds the expected ethertype, TTL, fragment fields, ports,
		// TCP flags and ICMP type and identifier; the fields below the rest.
		want     decoded
		ihl      int
		totalLen int
		chain    []uint8
		extLens  []int
		l4Len    int // bytes after the IP headers
	}{
		{
			name:     "ipv4 tcp defaults",
			p:        Packet{Src: v4a, Dst: v4b, Proto: 6, SrcPort: 40000, DstPort: 80},
			want:     decoded{ethType: 0x0800, ttl: 64, ports: [2]uint16{40000, 80}, tcpFlags: 0x02},
			ihl:      5,
			totalLen: 40,
			chain:    []uint8{6},
			l4Len:    20,
		},
		{
			name:     "ipv4 udp payload ttl",
			p:        Packet{Src: v4a, Dst: v4b, Proto: 17, SrcPort: 5353, DstPort: 53, Payload: payload, TTL: 1},
			want:     decoded{ethType: 0x0800, ttl: 1, ports: [2]uint16{5353, 53}},
			ihl:      5,
			totalLen: 20 + 8 + 5,
			chain:    []uint8{17},
			l4Len:    13,
		},
		{
			name:     "ipv4 sctp",
			p:        Packet{Src: v4a, Dst: v4b, Proto: 132, SrcPort: 3868, DstPort: 3869, Payload: payload},
			want:     decoded{ethType: 0x0800, ttl: 64, ports: [2]uint16{3868, 3869}},
			ihl:      5,
			totalLen: 20 + 12 + 5,
			chain:    []uint8{132},
			l4Len:    17,
		},
		{
			name:     "ipv4 icmp echo request",
			p:        Packet{Src: v4a, Dst: v4b, Proto: 1, SrcPort: 0x1234, Payload: payload},
			want:     decoded{ethType: 0x0800, ttl: 64, icmpType: 8, echoID: 0x1234},
			ihl:      5,
			totalLen: 20 + 8 + 5,
			chain:    []uint8{1},
			l4Len:    13,
		},
		{
			name:     "ipv4 icmp echo reply",
			p:        Packet{Src: v4a, Dst: v4b, Proto: 1, SrcPort: 0x1234, EchoReply: true},
			want:     decoded{ethType: 0x0800, ttl: 64, icmpType: 0, echoID: 0x1234},
			ihl:      5,
			totalLen: 28,
			chain:    []uint8{1},
			l4Len:    8,
		},
		{
			name:     "ipv4 icmp destination unreachable has no identifier",
			p:        Packet{Src: v4a, Dst: v4b, Proto: 1, ICMPType: 3, SrcPort: 0x1234},
			want:     decoded{ethType: 0x0800, ttl: 64, icmpType: 3, echoID: 0},
			ihl:      5,
			totalLen: 28,
			chain:    []uint8{1},
			l4Len:    8,
		},
		{
			name:     "ipv4 options padded",
			p:        Packet{Src: v4a, Dst: v4b, Proto: 6, SrcPort: 1, DstPort: 2, IPOptions: []byte{1, 1, 1}},
			want:     decoded{ethType: 0x0800, ttl: 64, ports: [2]uint16{1, 2}, tcpFlags: 0x02},
			ihl:      6,
			totalLen: 24 + 20,
			chain:    []uint8{6},
			l4Len:    20,
		},
		{
			name: "ipv4 options 40 bytes",
			p: Packet{Src: v4a, Dst: v4b, Proto: 17, SrcPort: 1, DstPort: 2,
				IPOptions: append([]byte{7, 39, 4}, make([]byte, 37)...)}, // record route
			want:     decoded{ethType: 0x0800, ttl: 64, ports: [2]uint16{1, 2}},
			ihl:      15,
			totalLen: 60 + 8,
			chain:    []uint8{17},
			l4Len:    8,
		},
		{
			name:     "ipv4 first fragment keeps l4",
			p:        Packet{Src: v4a, Dst: v4b, Proto: 17, SrcPort: 1, DstPort: 2, MoreFragments: true, Payload: payload},
			want:     decoded{ethType: 0x0800, ttl: 64, ports: [2]uint16{1, 2}, mf: true},
			ihl:      5,
			totalLen: 20 + 8 + 5,
			chain:    []uint8{17},
			l4Len:    13,
		},
		{
			name:     "ipv4 later fragment has no l4",
			p:        Packet{Src: v4a, Dst: v4b, Proto: 6, SrcPort: 1, DstPort: 2, FragOffset: 185, MoreFragments: true, Payload: payload},
			want:     decoded{ethType: 0x0800, ttl: 64, fragOffset: 185, mf: true},
			ihl:      5,
			totalLen: 20 + 5,
			chain:    []uint8{6},
			l4Len:    5,
		},
		{
			name:     "ipv4 last fragment",
			p:        Packet{Src: v4a, Dst: v4b, Proto: 17, FragOffset: 8191},
			want:     decoded{ethType: 0x0800, ttl: 64, fragOffset: 8191},
			ihl:      5,
			totalLen: 20,
			chain:    []uint8{17},
			l4Len:    0,
		},
		{
			name:     "ipv4 other protocol",
			p:        Packet{Src: v4a, Dst: v4b, Proto: 47, SrcPort: 1, DstPort: 2, Payload: payload},
			want:     decoded{ethType: 0x0800, ttl: 64},
			ihl:      5,
			totalLen: 25,
			chain:    []uint8{47},
			l4Len:    5,
		},
		{
			name:     "v4-mapped addresses are ipv4",
			p:        Packet{Src: netip.MustParseAddr("::ffff:10.0.0.1"), Dst: v4b, Proto: 6, SrcPort: 1, DstPort: 2},
			want:     decoded{ethType: 0x0800, ttl: 64, ports: [2]uint16{1, 2}, tcpFlags: 0x02},
			ihl:      5,
			totalLen: 40,
			chain:    []uint8{6},
			l4Len:    20,
		},
		{
			name:     "ipv6 tcp flags",
			p:        Packet{Src: v6a, Dst: v6b, Proto: 6, SrcPort: 40000, DstPort: 443, TCPFlags: 0x18, Payload: payload},
			want:     decoded{ethType: 0x86DD, ttl: 64, ports: [2]uint16{40000, 443}, tcpFlags: 0x18},
			totalLen: 40 + 20 + 5,
			chain:    []uint8{6},
			l4Len:    25,
		},
		{
			name:     "ipv6 udp",
			p:        Packet{Src: v6a, Dst: v6b, Proto: 17, SrcPort: 1, DstPort: 53},
			want:     decoded{ethType: 0x86DD, ttl: 64, ports: [2]uint16{1, 53}},
			totalLen: 48,
			chain:    []uint8{17},
			l4Len:    8,
		},
		{
			name:     "ipv6 sctp",
			p:        Packet{Src: v6a, Dst: v6b, Proto: 132, SrcPort: 9, DstPort: 10},
			want:     decoded{ethType: 0x86DD, ttl: 64, ports: [2]uint16{9, 10}},
			totalLen: 52,
			chain:    []uint8{132},
			l4Len:    12,
		},
		{
			name:     "ipv6 icmpv6 echo request",
			p:        Packet{Src: v6a, Dst: v6b, Proto: 58, SrcPort: 0xbeef, Payload: payload},
			want:     decoded{ethType: 0x86DD, ttl: 64, icmpType: 128, echoID: 0xbeef},
			totalLen: 40 + 8 + 5,
			chain:    []uint8{58},
			l4Len:    13,
		},
		{
			name:     "ipv6 icmpv6 echo reply",
			p:        Packet{Src: v6a, Dst: v6b, Proto: 58, SrcPort: 0xbeef, ICMPType: 129},
			want:     decoded{ethType: 0x86DD, ttl: 64, icmpType: 129, echoID: 0xbeef},
			totalLen: 48,
			chain:    []uint8{58},
			l4Len:    8,
		},
		{
			name: "ipv6 extension header chain",
			p: Packet{Src: v6a, Dst: v6b, Proto: 17, SrcPort: 7, DstPort: 8, Payload: payload, ExtHeaders: []ExtHeader{
				{Type: 0},
				{Type: 43, Len: 24},
				{Type: 60, Len: 16},
				{Type: 44, MoreFragments: true},
				{Type: 51, Len: 24},
			}},
			want:     decoded{ethType: 0x86DD, ttl: 64, ports: [2]uint16{7, 8}, mf: true},
			totalLen: 40 + 8 + 24 + 16 + 8 + 24 + 8 + 5,
			chain:    []uint8{0, 43, 60, 44, 51, 17},
			extLens:  []int{8, 24, 16, 8, 24},
			l4Len:    13,
		},
		{
			name: "ipv6 ah in 4-byte units",
			p: Packet{Src: v6a, Dst: v6b, Proto: 6, SrcPort: 7, DstPort: 8, ExtHeaders: []ExtHeader{
				{Type: 51, Len: 12}, {Type: 51}, {Type: 60},
			}},
			want:     decoded{ethType: 0x86DD, ttl: 64, ports: [2]uint16{7, 8}, tcpFlags: 0x02},
			totalLen: 40 + 12 + 16 + 8 + 20,
			chain:    []uint8{51, 51, 60, 6},
			extLens:  []int{12, 16, 8},
			l4Len:    20,
		},
		{
			name: "ipv6 later fragment has no l4",
			p: Packet{Src: v6a, Dst: v6b, Proto: 58, SrcPort: 1, Payload: payload, ExtHeaders: []ExtHeader{
				{Type: 0, Len: 16}, {Type: 44, FragOffset: 1000},
			}},
			want:     decoded{ethType: 0x86DD, ttl: 64, fragOffset: 1000},
			totalLen: 40 + 16 + 8 + 5,
			chain:    []uint8{0, 44, 58},
			extLens:  []int{16, 8},
			l4Len:    5,
		},
		{
			name: "ipv6 other extension type and protocol",
			p: Packet{Src: v6a, Dst: v6b, Proto: 59, Payload: payload, TTL: 255, ExtHeaders: []ExtHeader{
				{Type: 135, Len: 32},
			}},
			want:     decoded{ethType: 0x86DD, ttl: 255},
			totalLen: 40 + 32 + 5,
			chain:    []uint8{135, 59},
			extLens:  []int{32},
			l4Len:    5,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			frame := tt.p.Marshal()
			if !bytes.Equal(frame[0:6], []byte{2, 0, 0, 0, 0, 2}) || !bytes.Equal(frame[6:12], []byte{2, 0, 0, 0, 0, 1}) {
				t.Errorf("MACs % x", frame[:12])
			}
			d := decode(t, frame)
			if d.ethType != tt.want.ethType {
				t.Errorf("ethertype %#04x, want %#04x", d.ethType, tt.want.ethType)
			}
			if d.src != tt.p.Src.Unmap() || d.dst != tt.p.Dst.Unmap() {
				t.Errorf("addresses %v -> %v, want %v -> %v", d.src, d.dst, tt.p.Src, tt.p.Dst)
			}
			if d.ihl != tt.ihl {
				t.Errorf("IHL %d, want %d", d.ihl, tt.ihl)
			}
			if d.totalLen != tt.totalLen {
				t.Errorf("total length %d, want %d", d.totalLen, tt.totalLen)
			}
			if d.ttl != tt.want.ttl {
				t.Errorf("TTL %d, want %d", d.ttl, tt.want.ttl)
			}
			if !slices.Equal(d.chain, tt.chain) {
				t.Errorf("next header chain %v, want %v", d.chain, tt.chain)
			}
			if !slices.Equal(d.extLens, tt.extLens) {
				t.Errorf("extension header lengths %v, want %v", d.extLens, tt.extLens)
			}
			if d.fragOffset != tt.want.fragOffset || d.mf != tt.want.mf {
				t.Errorf("fragment offset %d MF %v, want %d %v", d.fragOffset, d.mf, tt.want.fragOffset, tt.want.mf)
			}
			if len(d.l4) != tt.l4Len {
				t.Errorf("%d bytes after the IP headers, want %d", len(d.l4), tt.l4Len)
			}
			if got := tt.p.L4Offset(); got != d.l4Off {
				t.Errorf("L4Offset %d, decoded %d", got, d.l4Off)
			}
			if !bytes.HasSuffix(d.l4, tt.p.Payload) {
				t.Errorf("frame does not end with the payload")
			}
			if d.ports != tt.want.ports {
				t.Errorf("ports %v, want %v", d.ports, tt.want.ports)
			}
			if d.tcpFlags != tt.want.tcpFlags {
				t.Errorf("TCP flags %#02x, want %#02x", d.tcpFlags, tt.want.tcpFlags)
			}
			if d.icmpType != tt.want.icmpType || d.echoID != tt.want.echoID {
				t.Errorf("ICMP type %d id %#x, want %d %#x", d.icmpType, d.echoID, tt.want.icmpType, tt.want.echoID)
			}
		})
	}
}

// TestOptionsPadding checks that hop-by-hop and destination options headers
// hold a well-formed option list of any length.
func TestOptionsPadding(t *testing.T) {
	for _, n := range []int{8, 16, 256, 264, 2048} {
		for _, typ := range []uint8{0, 60} {
			b := ExtHeader{Type: typ, Len: n}.marshal(17)
			if len(b) != n || b[0] != 17 || (int(b[1])+1)*8 != n {
				t.Fatalf("type %d len %d: header % x", typ, n, b[:2])
			}
			opts := b[2:]
			for len(opts) > 0 {
				if opts[0] == 0 {
					opts = opts[1:]
					continue
				}
				if opts[0] != 1 || len(opts) < 2 || len(opts) < 2+int(opts[1]) {
					t.Fatalf("type %d len %d: bad option % x", typ, n, opts[:min(len(opts), 2)])
				}
				opts = opts[2+int(opts[1]):]
			}
		}
	}
}

func TestIPv4OptionsPadding(t *testing.T) {
	frame := Packet{Src: v4a, Dst: v4b, Proto: 6, IPOptions: []byte{1, 1, 1, 1, 148}}.Marshal()
	if got, want := frame[34:42], []byte{1, 1, 1, 1, 148, 0, 0, 0}; !bytes.Equal(got, want) {
		t.Errorf("options % x, want % x", got, want)
	}
}

func TestChecksum(t *testing.T) {
	// RFC 1071 section 3 example: the sum is 0xddf2.
	if got := checksum([]byte{0x00, 0x01, 0xf2, 0x03, 0xf4, 0xf5, 0xf6, 0xf7}, 0); got != ^uint16(0xddf2) {
		t.Errorf("checksum %#04x, want %#04x", got, ^uint16(0xddf2))
	}
	// Odd length: the last byte is padded with zero.
	if got := checksum([]byte{0x01}, 0); got != ^uint16(0x0100) {
		t.Errorf("odd checksum %#04x", got)
	}
}

func TestReply(t *testing.T) {
	tests := []struct {
		name string
		p    Packet
		// expected on the reply's frame
		ports    [2]uint16
		tcpFlags uint8
		icmpType uint8
		echoID   uint16
	}{
		{"tcp syn", Packet{Src: v4a, Dst: v4b, Proto: 6, SrcPort: 40000, DstPort: 80}, [2]uint16{80, 40000}, 0x12, 0, 0},
		{"tcp ack", Packet{Src: v6a, Dst: v6b, Proto: 6, SrcPort: 40000, DstPort: 80, TCPFlags: 0x10}, [2]uint16{80, 40000}, 0x10, 0, 0},
		{"udp", Packet{Src: v6a, Dst: v6b, Proto: 17, SrcPort: 1, DstPort: 2}, [2]uint16{2, 1}, 0, 0, 0},
		{"sctp", Packet{Src: v4a, Dst: v4b, Proto: 132, SrcPort: 1, DstPort: 2}, [2]uint16{2, 1}, 0, 0, 0},
		{"icmp echo", Packet{Src: v4a, Dst: v4b, Proto: 1, SrcPort: 77, DstPort: 5}, [2]uint16{}, 0, 0, 77},
		{"icmp explicit echo", Packet{Src: v4a, Dst: v4b, Proto: 1, ICMPType: 8, SrcPort: 77}, [2]uint16{}, 0, 0, 77},
		{"icmpv6 echo", Packet{Src: v6a, Dst: v6b, Proto: 58, SrcPort: 78}, [2]uint16{}, 0, 129, 78},
		{"icmp other type kept", Packet{Src: v4a, Dst: v4b, Proto: 1, ICMPType: 11}, [2]uint16{}, 0, 11, 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := tt.p.Reply()
			d := decode(t, r.Marshal())
			if d.src != tt.p.Dst || d.dst != tt.p.Src {
				t.Errorf("reply %v -> %v, want %v -> %v", d.src, d.dst, tt.p.Dst, tt.p.Src)
			}
			if d.ports != tt.ports || d.tcpFlags != tt.tcpFlags || d.icmpType != tt.icmpType || d.echoID != tt.echoID {
				t.Errorf("ports %v flags %#x ICMP type %d id %d, want %v %#x %d %d",
					d.ports, d.tcpFlags, d.icmpType, d.echoID, tt.ports, tt.tcpFlags, tt.icmpType, tt.echoID)
			}
		})
	}

	p := Packet{Src: v4a, Dst: v4b, Proto: 17, Payload: []byte{1}, IPOptions: []byte{1}}
	r := p.Reply()
	r.Payload[0], r.IPOptions[0] = 9, 9
	if p.Payload[0] != 1 || p.IPOptions[0] != 1 {
		t.Error("Reply shares slices with the request")
	}
}

func TestTruncate(t *testing.T) {
	frame := Packet{Src: v6a, Dst: v6b, Proto: 6, ExtHeaders: []ExtHeader{{Type: 0}}}.Marshal()
	for n := 0; n <= len(frame); n++ {
		got := Truncate(frame, n)
		if !bytes.Equal(got, frame[:n]) {
			t.Fatalf("Truncate(%d) = % x", n, got)
		}
		if n > 0 {
			got[0] ^= 0xff
			if frame[0] == got[0] {
				t.Fatalf("Truncate(%d) aliases the frame", n)
			}
		}
	}
}

func TestARP(t *testing.T) {
	frame := ARP()
	if len(frame) != 42 {
		t.Fatalf("ARP frame is %d bytes, want 42", len(frame))
	}
	if et := binary.BigEndian.Uint16(frame[12:]); et != 0x0806 {
		t.Errorf("ethertype %#04x", et)
	}
	if op := binary.BigEndian.Uint16(frame[20:]); op != 1 {
		t.Errorf("ARP op %d, want request (1)", op)
	}
	if !bytes.Equal(frame[:6], []byte{0xff, 0xff, 0xff, 0xff, 0xff, 0xff}) {
		t.Errorf("destination % x, want broadcast", frame[:6])
	}
}

func TestMarshalPanics(t *testing.T) {
	tests := []struct {
		name string
		p    Packet
		want string
	}{
		{"mixed families", Packet{Src: v4a, Dst: v6b}, "not both"},
		{"no addresses", Packet{}, "not both"},
		{"ipv4 options too long", Packet{Src: v4a, Dst: v4b, IPOptions: make([]byte, 41)}, "exceed 40"},
		{"ipv4 fragment offset too large", Packet{Src: v4a, Dst: v4b, FragOffset: 8192}, "exceeds 8191"},
		{"ext headers on ipv4", Packet{Src: v4a, Dst: v4b, ExtHeaders: []ExtHeader{{}}}, "IPv6 only"},
		{"ip options on ipv6", Packet{Src: v6a, Dst: v6b, IPOptions: []byte{1}}, "IPv4 only"},
		{"ipv4 fragment on ipv6", Packet{Src: v6a, Dst: v6b, MoreFragments: true}, "IPv4 only"},
		{"options length not multiple of 8", Packet{Src: v6a, Dst: v6b, ExtHeaders: []ExtHeader{{Type: 0, Len: 12}}}, "multiple of 8"},
		{"options header too long", Packet{Src: v6a, Dst: v6b, ExtHeaders: []ExtHeader{{Type: 60, Len: 2056}}}, "multiple of 8"},
		{"ah too short", Packet{Src: v6a, Dst: v6b, ExtHeaders: []ExtHeader{{Type: 51, Len: 8}}}, "AH length"},
		{"ah not multiple of 4", Packet{Src: v6a, Dst: v6b, ExtHeaders: []ExtHeader{{Type: 51, Len: 18}}}, "AH length"},
		{"fragment header length", Packet{Src: v6a, Dst: v6b, ExtHeaders: []ExtHeader{{Type: 44, Len: 16}}}, "fragment header length"},
		{"fragment fields on other header", Packet{Src: v6a, Dst: v6b, ExtHeaders: []ExtHeader{{Type: 60, FragOffset: 1}}}, "not 44"},
		{"ipv6 fragment offset too large", Packet{Src: v6a, Dst: v6b, ExtHeaders: []ExtHeader{{Type: 44, FragOffset: 8192}}}, "exceeds 8191"},
		{"echo reply with type", Packet{Src: v4a, Dst: v4b, Proto: 1, ICMPType: 8, EchoReply: true}, "EchoReply"},
		{"ipv6 payload too long", Packet{Src: v6a, Dst: v6b, Payload: make([]byte, 65536)}, "exceeds 65535"},
		{"ipv4 total length too long", Packet{Src: v4a, Dst: v4b, Payload: make([]byte, 65516)}, "exceeds 65535"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			defer func() {
				msg, _ := recover().(string)
				if !strings.Contains(msg, tt.want) {
					t.Errorf("panic %q, want one containing %q", msg, tt.want)
				}
			}()
			tt.p.Marshal()
		})
	}
}

func TestTruncatePanics(t *testing.T) {
	for _, n := range []int{-1, 15} {
		func() {
			defer func() {
				if recover() == nil {
					t.Errorf("Truncate(14-byte frame, %d) did not panic", n)
				}
			}()
			Truncate(make([]byte, 14), n)
		}()
	}
}

func TestICMPError(t *testing.T) {
	router4, router6 := netip.MustParseAddr("192.0.2.1"), netip.MustParseAddr("2001:db8::1")
	tests := []struct {
		name   string
		from   netip.Addr
		orig   Packet
		typ    uint8
		proto  uint8
		quoted int // bytes of orig's frame after Ethernet the error carries
	}{
		{"v4 tcp with options", router4, Packet{Src: v4a, Dst: v4b, Proto: 6, SrcPort: 1, DstPort: 2, IPOptions: []byte{1, 1, 1, 1}, Payload: make([]byte, 100)}, 3, 1, 24 + 8},
		{"v6 udp after hop-by-hop", router6, Packet{Src: v6a, Dst: v6b, Proto: 17, SrcPort: 1, DstPort: 2, ExtHeaders: []ExtHeader{{Type: 0}}}, 2, 58, 40 + 8 + 8},
		{"v4 icmp echo", router4, Packet{Src: v4a, Dst: v4b, Proto: 1, SrcPort: 7}, 11, 1, 20 + 8},
		{"short original", router4, Packet{Src: v4a, Dst: v4b, Proto: 47, Payload: []byte{1, 2}}, 3, 1, 20 + 2},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			e := ICMPError(tt.from, tt.orig, tt.typ)
			d := decode(t, e.Marshal())
			if d.src != tt.from || d.dst != tt.orig.Src || d.proto() != tt.proto || d.icmpType != tt.typ {
				t.Errorf("error %v -> %v proto %d type %d, want %v -> %v proto %d type %d",
					d.src, d.dst, d.proto(), d.icmpType, tt.from, tt.orig.Src, tt.proto, tt.typ)
			}
			want := tt.orig.Marshal()[ethHeaderLen:][:tt.quoted]
			if got := d.l4[icmpHeaderLen:]; !bytes.Equal(got, want) {
				t.Errorf("quotes % x, want % x", got, want)
			}
		})
	}
}

func TestIdentification(t *testing.T) {
	for _, c := range []struct {
		id, want uint16
	}{{0, 0x4242}, {7, 7}} {
		frame := Packet{Src: v4a, Dst: v4b, Proto: 17, IPID: c.id}.Marshal()
		if got := binary.BigEndian.Uint16(frame[14+4:]); got != c.want {
			t.Errorf("IPID %d: identification %#x, want %#x", c.id, got, c.want)
		}
	}
	for _, c := range []struct {
		id, want uint32
	}{{0, 0x42424242}, {9, 9}} {
		frame := Packet{Src: v6a, Dst: v6b, Proto: 17, ExtHeaders: []ExtHeader{{Type: 44, FragID: c.id}}}.Marshal()
		if got := binary.BigEndian.Uint32(frame[14+40+4:]); got != c.want {
			t.Errorf("FragID %d: identification %#x, want %#x", c.id, got, c.want)
		}
	}
}
