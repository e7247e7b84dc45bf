package packet

import (
	"encoding/binary"
	"fmt"
	"net/netip"
)

// IPv4 header constants.
const (
	ipv4HeaderLen     = 20
	ipv4MaxOptionsLen = 40
	ipv4ID            = 0x4242 // identification of every datagram built here
	ipv4MF            = 0x2000
	maxFragOffset     = 0x1fff
)

// IPv6 header and extension header constants.
const (
	ipv6HeaderLen  = 40
	extHopByHop    = 0
	extRouting     = 43
	extFragment    = 44
	extAH          = 51
	extDestOptions = 60
	fragHeaderLen  = 8
	ipv6FragmentID = 0x42424242 // identification of every fragment header
	ahSPI          = 0x100      // security parameters index of every AH
	routingType    = 253        // RFC 4727 experimental; segments left is 0
)

// ipv4Header returns the IPv4 header, options included, for l4Len bytes
// after it.
func (p Packet) ipv4Header(src, dst netip.Addr, l4Len int) []byte {
	if len(p.ExtHeaders) != 0 {
		panic("packet: ExtHeaders are IPv6 only")
	}
	if p.FragOffset > maxFragOffset {
		panic(fmt.Sprintf("packet: IPv4 fragment offset %d exceeds %d", p.FragOffset, maxFragOffset))
	}
	opts := append([]byte(nil), p.IPOptions...)
	for len(opts)%4 != 0 {
		opts = append(opts, 0) // End of Option List
	}
	if len(opts) > ipv4MaxOptionsLen {
		panic(fmt.Sprintf("packet: %d bytes of IPv4 options exceed %d", len(p.IPOptions), ipv4MaxOptionsLen))
	}
	hlen := ipv4HeaderLen + len(opts)
	total := hlen + l4Len
	if total > 0xffff {
		panic(fmt.Sprintf("packet: IPv4 total length %d exceeds 65535", total))
	}
	frag := p.FragOffset
	if p.MoreFragments {
		frag |= ipv4MF
	}
	h := make([]byte, ipv4HeaderLen, hlen)
	h[0] = 4<<4 | byte(hlen/4)
	binary.BigEndian.PutUint16(h[2:], uint16(total))
	id := p.IPID
	if id == 0 {
		id = ipv4ID
	}
	binary.BigEndian.PutUint16(h[4:], id)
	binary.BigEndian.PutUint16(h[6:], frag)
	h[8] = p.ttl()
	h[9] = p.Proto
	s, d := src.As4(), dst.As4()
	copy(h[12:], s[:])
	copy(h[16:], d[:])
	h = append(h, opts...)
	binary.BigEndian.PutUint16(h[10:], checksum(h, 0))
	return h
}

// ipv6Header returns the fixed IPv6 header.
func ipv6Header(src, dst netip.Addr, next, hopLimit uint8, payloadLen int) []byte {
	if payloadLen > 0xffff {
		panic(fmt.Sprintf("packet: IPv6 payload length %d exceeds 65535", payloadLen))
	}
	h := make([]byte, ipv6HeaderLen)
	h[0] = 6 << 4
	binary.BigEndian.PutUint16(h[4:], uint16(payloadLen))
	h[6] = next
	h[7] = hopLimit
	s, d := src.As16(), dst.As16()
	copy(h[8:], s[:])
	copy(h[24:], d[:])
	return h
}

// firstHeader returns the Next Header of the fixed IPv6 header.
func (p Packet) firstHeader() uint8 {
	if len(p.ExtHeaders) == 0 {
		return p.Proto
	}
	return p.ExtHeaders[0].Type
}

// extHeaders returns the encoded extension header chain and whether it
// contains a fragment header with a non-zero offset.
func (p Packet) extHeaders() (b []byte, laterFragment bool) {
	for i, e := range p.ExtHeaders {
		next := p.Proto
		if i+1 < len(p.ExtHeaders) {
			next = p.ExtHeaders[i+1].Type
		}
		b = append(b, e.marshal(next)...)
		if e.Type == extFragment && e.FragOffset != 0 {
			laterFragment = true
		}
	}
	return b, laterFragment
}

// marshal encodes the header with the given Next Header.
func (e ExtHeader) marshal(next uint8) []byte {
	if e.Type != extFragment && (e.FragOffset != 0 || e.MoreFragments || e.FragID != 0) {
		panic(fmt.Sprintf("packet: FragOffset, MoreFragments or FragID set on extension header type %d, not 44", e.Type))
	}
	switch e.Type {
	case extFragment:
		if e.Len != 0 && e.Len != fragHeaderLen {
			panic(fmt.Sprintf("packet: fragment header length %d, must be 0 or 8", e.Len))
		}
		if e.FragOffset > maxFragOffset {
			panic(fmt.Sprintf("packet: IPv6 fragment offset %d exceeds %d", e.FragOffset, maxFragOffset))
		}
		b := make([]byte, fragHeaderLen)
		b[0] = next
		off := e.FragOffset << 3
		if e.MoreFragments {
			off |= 1
		}
		binary.BigEndian.PutUint16(b[2:], off)
		id := e.FragID
		if id == 0 {
			id = ipv6FragmentID
		}
		binary.BigEndian.PutUint32(b[4:], id)
		return b
	case extAH:
		n := e.Len
		if n == 0 {
			n = 16
		}
		if n < 12 || n%4 != 0 || n/4-2 > 0xff {
			panic(fmt.Sprintf("packet: AH length %d, must be a multiple of 4 from 12 to 1028", e.Len))
		}
		b := make([]byte, n)
		b[0] = next
		b[1] = byte(n/4 - 2)
		binary.BigEndian.PutUint32(b[4:], ahSPI)
		binary.BigEndian.PutUint32(b[8:], 1) // sequence number
		return b
	}
	n := e.Len
	if n == 0 {
		n = 8
	}
	if n < 8 || n%8 != 0 || n/8-1 > 0xff {
		panic(fmt.Sprintf("packet: extension header type %d length %d, must be a multiple of 8 from 8 to 2048", e.Type, e.Len))
	}
	b := make([]byte, n)
	b[0] = next
	b[1] = byte(n/8 - 1)
	switch e.Type {
	case extHopByHop, extDestOptions:
		padOptions(b[2:])
	case extRouting:
		b[2] = routingType // segments left b[3] stays 0: every node skips it
	}
	return b
}

// padOptions fills b with PadN options (Pad1 for a last single byte).
func padOptions(b []byte) {
	for len(b) > 0 {
		if len(b) == 1 {
			b[0] = 0 // Pad1
			return
		}
		n := min(len(b)-2, 0xff)
		b[0], b[1] = 1, byte(n) // PadN with n zero bytes of data
		b = b[2+n:]
	}
}
