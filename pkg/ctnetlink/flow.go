package ctnetlink

import (
	"encoding/binary"
	"fmt"
	"net/netip"
)

// Tuple is one direction of a flow, as the kernel tracks it. Addresses hold
// IPv4 in their first 4 bytes. Ports are in host order; for ICMP and ICMPv6
// the echo identifier is in both, which is how the eBPF datapath keys echo.
//
// The fields and their order match liveness.Key, so a Tuple converts to one.
type Tuple struct {
	Family   uint8 // 4 or 6
	Proto    uint8
	SrcPort  uint16
	DstPort  uint16
	Src, Dst [16]byte
}

// Source is the tuple's source address and port.
func (t Tuple) Source() netip.AddrPort { return netip.AddrPortFrom(t.addr(t.Src), t.SrcPort) }

// Destination is the tuple's destination address and port.
func (t Tuple) Destination() netip.AddrPort { return netip.AddrPortFrom(t.addr(t.Dst), t.DstPort) }

// addr is one of the tuple's addresses: IPv4 in the first 4 bytes.
func (t Tuple) addr(b [16]byte) netip.Addr {
	if t.Family == 4 {
		return netip.AddrFrom4([4]byte(b[:4]))
	}
	return netip.AddrFrom16(b)
}

// Flow is a kernel conntrack entry: the original tuple (as the first packet
// left its sender, before NAT) and the reply tuple (as the answers leave the
// other side, after NAT).
type Flow struct {
	Orig, Reply Tuple
}

// Netlink and ctnetlink numbers, from linux/netlink.h,
// linux/netfilter/nfnetlink.h and linux/netfilter/nfnetlink_conntrack.h.
const (
	nlmsgHdrLen  = 16
	nfgenHdrLen  = 4
	nlmsgError   = 2
	nlmsgDone    = 3
	nlfRequest   = 0x1
	nlfDump      = 0x300
	nlaTypeMask  = 0x3fff // without NLA_F_NESTED and NLA_F_NET_BYTEORDER
	subsysCT     = 1      // NFNL_SUBSYS_CTNETLINK
	msgCTNew     = 0      // IPCTNL_MSG_CT_NEW: a dumped flow
	msgCTGet     = 1      // IPCTNL_MSG_CT_GET: the dump request
	msgCTDelete  = 2      // IPCTNL_MSG_CT_DELETE: a destroy event
	groupDestroy = 3      // NFNLGRP_CONNTRACK_DESTROY

	afInet  = 2
	afInet6 = 10

	ctaTupleOrig  = 1
	ctaTupleReply = 2
	ctaTupleIP    = 1
	ctaTupleProto = 2
	ctaIPv4Src    = 1
	ctaIPv4Dst    = 2
	ctaIPv6Src    = 3
	ctaIPv6Dst    = 4
	ctaProtoNum   = 1
	ctaProtoSrc   = 2
	ctaProtoDst   = 3
	ctaICMPID     = 4
	ctaICMPv6ID   = 7
)

// attrs walks netlink attributes without copying them.
type attrs struct {
	b   []byte
	typ uint16
	val []byte
	err error
}

// next moves to the next attribute; false at the end or on a malformed one
// (then a.err is set).
func (a *attrs) next() bool {
	if len(a.b) < 4 {
		return false
	}
	n := int(binary.NativeEndian.Uint16(a.b))
	if n < 4 || n > len(a.b) {
		a.err = fmt.Errorf("%w: attribute of %d bytes in %d", ErrMalformed, n, len(a.b))
		return false
	}
	a.typ = binary.NativeEndian.Uint16(a.b[2:]) & nlaTypeMask
	a.val = a.b[4:n]
	aligned := (n + 3) &^ 3
	if aligned > len(a.b) {
		aligned = len(a.b)
	}
	a.b = a.b[aligned:]
	return true
}

// unmarshal decodes a flow's attributes (after the nfgenmsg header).
// Attributes it does not compare are skipped.
func (f *Flow) unmarshal(family uint8, b []byte) error {
	*f = Flow{}
	var seen uint8 // bit 0: original, bit 1: reply
	a := attrs{b: b}
	for a.next() {
		var t *Tuple
		switch a.typ {
		case ctaTupleOrig:
			t = &f.Orig
			seen |= 1
		case ctaTupleReply:
			t = &f.Reply
			seen |= 2
		default:
			continue
		}
		if err := t.unmarshal(family, a.val); err != nil {
			return err
		}
	}
	if a.err != nil {
		return a.err
	}
	if seen != 3 {
		return fmt.Errorf("%w: a flow without both tuples", ErrMalformed)
	}
	return nil
}

func (t *Tuple) unmarshal(family uint8, b []byte) error {
	t.Family = family
	a := attrs{b: b}
	for a.next() {
		var err error
		switch a.typ {
		case ctaTupleIP:
			err = t.unmarshalIP(a.val)
		case ctaTupleProto:
			err = t.unmarshalProto(a.val)
		}
		if err != nil {
			return err
		}
	}
	return a.err
}

func (t *Tuple) unmarshalIP(b []byte) error {
	a := attrs{b: b}
	for a.next() {
		var dst *[16]byte
		want := 4
		switch a.typ {
		case ctaIPv4Src:
			dst = &t.Src
		case ctaIPv4Dst:
			dst = &t.Dst
		case ctaIPv6Src:
			dst, want = &t.Src, 16
		case ctaIPv6Dst:
			dst, want = &t.Dst, 16
		default:
			continue
		}
		if len(a.val) != want {
			return fmt.Errorf("%w: address of %d bytes", ErrMalformed, len(a.val))
		}
		copy(dst[:], a.val)
	}
	return a.err
}

func (t *Tuple) unmarshalProto(b []byte) error {
	a := attrs{b: b}
	for a.next() {
		switch a.typ {
		case ctaProtoNum:
			if len(a.val) < 1 {
				return fmt.Errorf("%w: empty protocol number", ErrMalformed)
			}
			t.Proto = a.val[0]
		case ctaProtoSrc, ctaProtoDst, ctaICMPID, ctaICMPv6ID:
			if len(a.val) < 2 {
				return fmt.Errorf("%w: port of %d bytes", ErrMalformed, len(a.val))
			}
			p := binary.BigEndian.Uint16(a.val)
			switch a.typ {
			case ctaProtoSrc:
				t.SrcPort = p
			case ctaProtoDst:
				t.DstPort = p
			default:
				t.SrcPort, t.DstPort = p, p
			}
		}
	}
	return a.err
}

// message is one netlink message, its header decoded.
type message struct {
	typ   uint16
	flags uint16
	seq   uint32
	body  []byte // after the netlink header
}

// messages walks the netlink messages in one read.
type messages struct {
	b   []byte
	m   message
	err error
}

func (ms *messages) next() bool {
	if len(ms.b) == 0 {
		return false
	}
	if len(ms.b) < nlmsgHdrLen {
		ms.err = fmt.Errorf("%w: %d trailing bytes", ErrMalformed, len(ms.b))
		return false
	}
	n := int(binary.NativeEndian.Uint32(ms.b))
	if n < nlmsgHdrLen || n > len(ms.b) {
		ms.err = fmt.Errorf("%w: message of %d bytes in %d", ErrMalformed, n, len(ms.b))
		return false
	}
	ms.m = message{
		typ:   binary.NativeEndian.Uint16(ms.b[4:]),
		flags: binary.NativeEndian.Uint16(ms.b[6:]),
		seq:   binary.NativeEndian.Uint32(ms.b[8:]),
		body:  ms.b[nlmsgHdrLen:n],
	}
	aligned := (n + 3) &^ 3
	if aligned > len(ms.b) {
		aligned = len(ms.b)
	}
	ms.b = ms.b[aligned:]
	return true
}

// flow decodes a conntrack message of type msg into f. It reports false
// for a flow of a family other than IPv4 and IPv6, which f cannot hold.
func (m *message) flow(f *Flow) (bool, error) {
	if len(m.body) < nfgenHdrLen {
		return false, fmt.Errorf("%w: conntrack message of %d bytes", ErrMalformed, len(m.body))
	}
	var family uint8
	switch m.body[0] {
	case afInet:
		family = 4
	case afInet6:
		family = 6
	default:
		return false, nil
	}
	if err := f.unmarshal(family, m.body[nfgenHdrLen:]); err != nil {
		return false, err
	}
	return true, nil
}

// errno is the error an NLMSG_ERROR message carries; nil for an ack.
func (m *message) errno() error {
	if len(m.body) < 4 {
		return fmt.Errorf("%w: short error message", ErrMalformed)
	}
	code := int32(binary.NativeEndian.Uint32(m.body))
	if code == 0 {
		return nil
	}
	return errnoErr(-code)
}
