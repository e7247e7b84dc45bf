package packet

import (
	"encoding/binary"
	"hash/crc32"
	"net/netip"
)

// Header lengths and fixed field values of the L4 headers.
const (
	tcpHeaderLen  = 20
	udpHeaderLen  = 8
	sctpHeaderLen = 12
	icmpHeaderLen = 8
	tcpSeq        = 1
	tcpWindow     = 65535
	sctpVerTag    = 0x2a2a2a2a
	icmpSeq       = 1
)

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// l4 returns everything after the IP headers: the L4 header and Payload, or
// Payload alone for a non-first fragment or a protocol without a header.
func (p Packet) l4(src, dst netip.Addr, laterFragment bool) []byte {
	if laterFragment {
		return append([]byte(nil), p.Payload...)
	}
	var b []byte
	switch p.Proto {
	case protoTCP:
		b = make([]byte, tcpHeaderLen)
		binary.BigEndian.PutUint16(b[0:], p.SrcPort)
		binary.BigEndian.PutUint16(b[2:], p.DstPort)
		binary.BigEndian.PutUint32(b[4:], tcpSeq)
		if p.tcpFlags()&tcpACK != 0 {
			binary.BigEndian.PutUint32(b[8:], tcpSeq)
		}
		b[12] = tcpHeaderLen / 4 << 4
		b[13] = p.tcpFlags()
		binary.BigEndian.PutUint16(b[14:], tcpWindow)
		b = append(b, p.Payload...)
		binary.BigEndian.PutUint16(b[16:], checksum(b, pseudoHeader(src, dst, p.Proto, len(b))))
	case protoUDP:
		b = make([]byte, udpHeaderLen)
		binary.BigEndian.PutUint16(b[0:], p.SrcPort)
		binary.BigEndian.PutUint16(b[2:], p.DstPort)
		binary.BigEndian.PutUint16(b[4:], uint16(udpHeaderLen+len(p.Payload)))
		b = append(b, p.Payload...)
		sum := checksum(b, pseudoHeader(src, dst, p.Proto, len(b)))
		if sum == 0 {
			sum = 0xffff // zero means "no checksum" in UDP
		}
		binary.BigEndian.PutUint16(b[6:], sum)
	case protoSCTP:
		b = make([]byte, sctpHeaderLen)
		binary.BigEndian.PutUint16(b[0:], p.SrcPort)
		binary.BigEndian.PutUint16(b[2:], p.DstPort)
		binary.BigEndian.PutUint32(b[4:], sctpVerTag)
		b = append(b, p.Payload...)
		// RFC 9260 appendix A: CRC32c, stored least significant byte first.
		binary.LittleEndian.PutUint32(b[8:], crc32.Checksum(b, castagnoli))
	case protoICMP, protoICMPv6:
		b = make([]byte, icmpHeaderLen)
		b[0] = p.icmpType()
		if p.isEcho() {
			binary.BigEndian.PutUint16(b[4:], p.SrcPort)
			binary.BigEndian.PutUint16(b[6:], icmpSeq)
		}
		b = append(b, p.Payload...)
		var initial uint32 // ICMP has no pseudo-header, ICMPv6 does
		if p.Proto == protoICMPv6 {
			initial = pseudoHeader(src, dst, p.Proto, len(b))
		}
		binary.BigEndian.PutUint16(b[2:], checksum(b, initial))
	default:
		b = append(b, p.Payload...)
	}
	return b
}

// ttl returns the IPv4 TTL or IPv6 hop limit.
func (p Packet) ttl() uint8 {
	if p.TTL == 0 {
		return defaultTTL
	}
	return p.TTL
}

// tcpFlags returns the TCP flags, SYN by default.
func (p Packet) tcpFlags() uint8 {
	if p.TCPFlags == 0 {
		return tcpSYN
	}
	return p.TCPFlags
}

// icmpType returns the ICMP or ICMPv6 type on the wire.
func (p Packet) icmpType() uint8 {
	if p.ICMPType != 0 {
		if p.EchoReply {
			panic("packet: EchoReply set with a non-zero ICMPType")
		}
		return p.ICMPType
	}
	switch {
	case p.Proto == protoICMPv6 && p.EchoReply:
		return icmpv6EchoReply
	case p.Proto == protoICMPv6:
		return icmpv6EchoRequest
	case p.EchoReply:
		return icmpEchoReply
	}
	return icmpEchoRequest
}

// isEcho reports whether the ICMP or ICMPv6 message is an echo request or
// reply, the messages that carry an identifier.
func (p Packet) isEcho() bool {
	t := p.icmpType()
	if p.Proto == protoICMPv6 {
		return t == icmpv6EchoRequest || t == icmpv6EchoReply
	}
	return t == icmpEchoRequest || t == icmpEchoReply
}

// pseudoHeader returns the unfolded one's complement sum of the TCP, UDP or
// ICMPv6 pseudo-header (RFC 9293, RFC 768, RFC 8200 section 8.1).
func pseudoHeader(src, dst netip.Addr, proto uint8, length int) uint32 {
	var sum uint32
	for _, b := range [][]byte{src.AsSlice(), dst.AsSlice()} {
		for i := 0; i < len(b); i += 2 {
			sum += uint32(b[i])<<8 | uint32(b[i+1])
		}
	}
	return sum + uint32(proto) + uint32(length)>>16 + uint32(length)&0xffff
}

// checksum returns the Internet checksum (RFC 1071) of b, starting from the
// unfolded sum initial. The checksum field in b must be zero.
func checksum(b []byte, initial uint32) uint16 {
	sum := initial
	for i := 0; i+1 < len(b); i += 2 {
		sum += uint32(b[i])<<8 | uint32(b[i+1])
	}
	if len(b)%2 == 1 {
		sum += uint32(b[len(b)-1]) << 8
	}
	for sum > 0xffff {
		sum = sum>>16 + sum&0xffff
	}
	return ^uint16(sum)
}
