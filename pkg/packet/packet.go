package packet

import (
	"encoding/binary"
	"fmt"
	"net/netip"
)

// Protocol numbers (IANA "Assigned Internet Protocol Numbers") the builder
// encodes specially; any other Packet.Proto is followed by the raw Payload.
const (
	protoICMP   = 1
	protoTCP    = 6
	protoUDP    = 17
	protoICMPv6 = 58
	protoSCTP   = 132
)

// ICMP and ICMPv6 echo message types.
const (
	icmpEchoReply     = 0
	icmpEchoRequest   = 8
	icmpv6EchoRequest = 128
	icmpv6EchoReply   = 129
)

// tcpSYN and tcpACK are TCP flag bits.
const (
	tcpSYN = 0x02
	tcpACK = 0x10
)

// Ethernet header fields of every frame built here.
const (
	ethHeaderLen = 14
	ethTypeIPv4  = 0x0800
	ethTypeIPv6  = 0x86DD
	ethTypeARP   = 0x0806
	defaultTTL   = 64
)

// srcMAC and dstMAC are the Ethernet addresses of every frame built here
// (ARP is broadcast instead).
var (
	srcMAC = [6]byte{0x02, 0, 0, 0, 0, 0x01}
	dstMAC = [6]byte{0x02, 0, 0, 0, 0, 0x02}
)

// Packet describes one IP datagram in an Ethernet frame. The zero value of
// every field except Src and Dst is usable.
type Packet struct {
	// Src and Dst decide the family: both IPv4 (v4-mapped IPv6 addresses
	// count as IPv4) or both IPv6. Anything else panics in Marshal.
	Src, Dst netip.Addr
	// Proto is the IP protocol number, or for IPv6 the last Next Header of
	// the extension header chain: 6 TCP, 17 UDP, 132 SCTP, 1 ICMP and 58
	// ICMPv6 get a real header; any other number is followed by Payload only.
	Proto uint8
	// SrcPort and DstPort are the TCP, UDP or SCTP ports. For ICMP and
	// ICMPv6 echo messages SrcPort is the echo identifier and DstPort is
	// unused.
	SrcPort, DstPort uint16
	// ICMPType is the ICMP or ICMPv6 message type. Zero means echo request
	// (8 for ICMP, 128 for ICMPv6) unless EchoReply is set.
	ICMPType uint8
	// EchoReply selects the echo reply (type 0 for ICMP, 129 for ICMPv6)
	// when ICMPType is zero. It exists because the ICMP echo reply type is
	// 0, which ICMPType cannot tell from "unset"; Reply sets it.
	EchoReply bool
	// TCPFlags are the TCP flag bits (FIN 0x01 ... CWR 0x80); zero means SYN.
	TCPFlags uint8
	// IPOptions are IPv4 options, copied after the fixed header and padded
	// with End of Option List (0) bytes to a multiple of 4. More than 40
	// bytes, or any options on IPv6, panic.
	IPOptions []byte
	// ExtHeaders are IPv6 extension headers in wire order; the last one's
	// Next Header is Proto. Any on IPv4 panic.
	ExtHeaders []ExtHeader
	// FragOffset is the IPv4 fragment offset in 8-byte units (at most
	// 8191). A non-zero offset makes a non-first fragment, which carries
	// no L4 header: Payload follows the IP header directly.
	FragOffset uint16
	// MoreFragments sets the IPv4 MF flag. Fragmenting IPv6 needs an
	// ExtHeader of type 44; both fields panic on IPv6.
	MoreFragments bool
	// IPID is the IPv4 identification; zero means 0x4242.
	IPID uint16
	// Payload follows the L4 header (or the IP header when there is none).
	Payload []byte
	// TTL is the IPv4 TTL or IPv6 hop limit; zero means 64.
	TTL uint8
}

// ExtHeader is one IPv6 extension header.
type ExtHeader struct {
	// Type is the header's protocol number: 0 hop-by-hop options, 43
	// routing, 60 destination options, 44 fragment, 51 AH, or any other,
	// which is encoded like an options header.
	Type uint8
	// Len is the total length in bytes, Next Header and length byte
	// included. For AH it is a multiple of 4 and at least 12 (zero means
	// 16), encoded as Len/4-2 (RFC 4302); IPv6 requires a multiple of 8 but
	// that is left to the test. For every other type except fragment it is
	// a multiple of 8 and at least 8 (zero means 8), encoded as Len/8-1.
	// A fragment header is always 8 bytes; Len must be 0 or 8.
	Len int
	// FragOffset is the fragment offset in 8-byte units (at most 8191);
	// Type 44 only. A non-zero offset makes a non-first fragment, which
	// carries no L4 header: Payload follows the extension headers.
	FragOffset uint16
	// MoreFragments sets the M flag; Type 44 only.
	MoreFragments bool
	// FragID is the fragment identification; Type 44 only. Zero means
	// 0x42424242.
	FragID uint32
}

// Marshal returns the frame: Ethernet (to 02:00:00:00:00:02 from
// 02:00:00:00:00:01, ethertype 0x0800 or 0x86DD), the IP header with options
// or extension headers, the L4 header and Payload. It panics on a Packet
// that cannot be encoded; see the field comments.
func (p Packet) Marshal() []byte {
	ethType, ip, l4 := p.layers()
	frame := ethernet(dstMAC, ethType)
	frame = append(frame, ip...)
	return append(frame, l4...)
}

// L4Offset returns the offset in the Marshal frame of the L4 header (or of
// Payload for a non-first fragment or another protocol): the length of the
// Ethernet and IP headers, IPv4 options and IPv6 extension headers
// included. Tests use it to truncate a frame inside the L4 header.
func (p Packet) L4Offset() int {
	_, ip, _ := p.layers()
	return ethHeaderLen + len(ip)
}

// Reply returns the packet the destination sends back: addresses swapped
// and, except for ICMP and ICMPv6, ports swapped. An echo request becomes
// an echo reply with the same identifier; a TCP SYN becomes a SYN-ACK.
// Every other field is copied.
func (p Packet) Reply() Packet {
	r := p
	r.Src, r.Dst = p.Dst, p.Src
	r.IPOptions = append([]byte(nil), p.IPOptions...)
	r.ExtHeaders = append([]ExtHeader(nil), p.ExtHeaders...)
	r.Payload = append([]byte(nil), p.Payload...)
	switch p.Proto {
	case protoICMP:
		if p.icmpType() == icmpEchoRequest {
			r.ICMPType, r.EchoReply = 0, true
		}
	case protoICMPv6:
		if p.icmpType() == icmpv6EchoRequest {
			r.ICMPType, r.EchoReply = icmpv6EchoReply, false
		}
	default:
		r.SrcPort, r.DstPort = p.DstPort, p.SrcPort
		if p.Proto == protoTCP && p.tcpFlags() == tcpSYN {
			r.TCPFlags = tcpSYN | tcpACK
		}
	}
	return r
}

// ICMPError returns the ICMP error (ICMPv6 for IPv6) of type typ that from
// sends to orig's source about orig, quoting orig's IP header (options and
// extension headers included) and the first 8 bytes after it, as RFC 792
// asks of a router. The rest of the error's header (the MTU of "packet too
// big", say) is zero.
func ICMPError(from netip.Addr, orig Packet, typ uint8) Packet {
	frame := orig.Marshal()
	end := min(orig.L4Offset()+8, len(frame))
	proto := uint8(protoICMP)
	if _, _, v4 := orig.family(); !v4 {
		proto = protoICMPv6
	}
	return Packet{
		Src: from, Dst: orig.Src, Proto: proto, ICMPType: typ,
		Payload: append([]byte(nil), frame[ethHeaderLen:end]...),
	}
}

// Truncate returns a copy of the first n bytes of frame. It panics if n is
// negative or larger than the frame.
func Truncate(frame []byte, n int) []byte {
	if n < 0 || n > len(frame) {
		panic(fmt.Sprintf("packet: truncate %d-byte frame to %d bytes", len(frame), n))
	}
	return append([]byte(nil), frame[:n]...)
}

// ARP returns a 42-byte ARP request frame (ethertype 0x0806) from
// 02:00:00:00:00:01 and 10.0.0.1, broadcast for 10.0.0.2: the "not IP" input
// for programs that must pass or drop what they do not parse.
func ARP() []byte {
	frame := ethernet([6]byte{0xff, 0xff, 0xff, 0xff, 0xff, 0xff}, ethTypeARP)
	frame = binary.BigEndian.AppendUint16(frame, 1) // hardware type Ethernet
	frame = binary.BigEndian.AppendUint16(frame, ethTypeIPv4)
	frame = append(frame, 6, 4)                     // address lengths
	frame = binary.BigEndian.AppendUint16(frame, 1) // request
	frame = append(frame, srcMAC[:]...)
	frame = append(frame, 10, 0, 0, 1)
	frame = append(frame, make([]byte, 6)...)
	return append(frame, 10, 0, 0, 2)
}

// layers returns the ethertype, the IP header (options and extension
// headers included) and everything after it.
func (p Packet) layers() (ethType uint16, ip, l4 []byte) {
	src, dst, v4 := p.family()
	if v4 {
		l4 = p.l4(src, dst, p.FragOffset != 0)
		return ethTypeIPv4, p.ipv4Header(src, dst, len(l4)), l4
	}
	if len(p.IPOptions) != 0 || p.FragOffset != 0 || p.MoreFragments {
		panic("packet: IPOptions, FragOffset and MoreFragments are IPv4 only; fragment IPv6 with ExtHeader type 44")
	}
	ext, laterFragment := p.extHeaders()
	l4 = p.l4(src, dst, laterFragment)
	return ethTypeIPv6, append(ipv6Header(src, dst, p.firstHeader(), p.ttl(), len(ext)+len(l4)), ext...), l4
}

// ethernet returns an Ethernet header from srcMAC to dst.
func ethernet(dst [6]byte, ethType uint16) []byte {
	b := make([]byte, 0, ethHeaderLen)
	b = append(b, dst[:]...)
	b = append(b, srcMAC[:]...)
	return binary.BigEndian.AppendUint16(b, ethType)
}

// family returns the unmapped addresses and whether they are IPv4.
func (p Packet) family() (src, dst netip.Addr, v4 bool) {
	src, dst = p.Src.Unmap(), p.Dst.Unmap()
	switch {
	case src.Is4() && dst.Is4():
		return src, dst, true
	case src.Is6() && dst.Is6():
		return src, dst, false
	}
	panic(fmt.Sprintf("packet: addresses %v and %v are not both IPv4 or both IPv6", p.Src, p.Dst))
}
