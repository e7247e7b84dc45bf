package ctnetlink

import (
	"encoding/binary"
	"errors"
	"net/netip"
	"testing"
)

// The encoders below build what the kernel sends, so that the decoder is
// tested without root; kernel_test.go checks the same against the kernel.

func attr(typ uint16, val ...[]byte) []byte {
	var body []byte
	for _, v := range val {
		body = append(body, v...)
	}
	b := make([]byte, 4, 4+len(body)+3)
	binary.NativeEndian.PutUint16(b, uint16(4+len(body)))
	binary.NativeEndian.PutUint16(b[2:], typ)
	b = append(b, body...)
	for len(b)%4 != 0 {
		b = append(b, 0)
	}
	return b
}

func nested(typ uint16, val ...[]byte) []byte { return attr(typ|0x8000, val...) }

func be16(v uint16) []byte { return binary.BigEndian.AppendUint16(nil, v) }

func tupleAttr(typ uint16, src, dst netip.Addr, proto uint8, sport, dport uint16) []byte {
	srcType, dstType := uint16(ctaIPv4Src), uint16(ctaIPv4Dst)
	if src.Is6() {
		srcType, dstType = ctaIPv6Src, ctaIPv6Dst
	}
	ports := [][]byte{attr(ctaProtoNum, []byte{proto})}
	switch proto {
	case 1:
		ports = append(ports, attr(ctaICMPID, be16(sport)), attr(5, []byte{8}), attr(6, []byte{0}))
	case 58:
		ports = append(ports, attr(ctaICMPv6ID, be16(sport)), attr(8, []byte{128}), attr(9, []byte{0}))
	default:
		ports = append(ports, attr(ctaProtoSrc, be16(sport)), attr(ctaProtoDst, be16(dport)))
	}
	return nested(typ,
		nested(ctaTupleIP, attr(srcType, src.AsSlice()), attr(dstType, dst.AsSlice())),
		nested(ctaTupleProto, ports...),
		attr(3, be16(0)), // CTA_TUPLE_ZONE, ignored
	)
}

func msg(typ uint16, family uint8, attrs ...[]byte) []byte {
	b := make([]byte, nlmsgHdrLen, 64)
	b = append(b, family, 0, 0, 0)
	for _, a := range attrs {
		b = append(b, a...)
	}
	binary.NativeEndian.PutUint32(b, uint32(len(b)))
	binary.NativeEndian.PutUint16(b[4:], typ)
	binary.NativeEndian.PutUint32(b[8:], 1)
	return b
}

// tuple is tupleOf (kernel_test.go) from strings; the family follows the
// addresses.
func tuple(proto uint8, src, dst string, sport, dport uint16) Tuple {
	return tupleOf(netip.AddrPortFrom(netip.MustParseAddr(src), sport), netip.AddrPortFrom(netip.MustParseAddr(dst), dport), proto)
}

var (
	a4, b4, vip4 = netip.MustParseAddr("10.0.0.1"), netip.MustParseAddr("10.0.0.2"), netip.MustParseAddr("172.20.0.10")
	a6, b6       = netip.MustParseAddr("fd00::1"), netip.MustParseAddr("fd00::2")
	newType      = uint16(subsysCT<<8 | msgCTNew)
	status       = attr(3, []byte{0, 0, 0, 8}) // CTA_STATUS, ignored
)

func TestMessageFlow(t *testing.T) {
	for _, tc := range []struct {
		name    string
		msg     []byte
		want    Flow
		skipped bool // a family Flow cannot hold
		err     error
	}{{
		name: "TCP through a ClusterIP: reply tuple from the backend",
		msg: msg(newType, afInet, tupleAttr(ctaTupleOrig, a4, vip4, 6, 40000, 80),
			tupleAttr(ctaTupleReply, b4, a4, 6, 8080, 40000), status),
		want: Flow{tuple(6, "10.0.0.1", "172.20.0.10", 40000, 80), tuple(6, "10.0.0.2", "10.0.0.1", 8080, 40000)},
	}, {
		name: "UDP over IPv6",
		msg: msg(newType, afInet6, tupleAttr(ctaTupleOrig, a6, b6, 17, 5353, 53),
			tupleAttr(ctaTupleReply, b6, a6, 17, 53, 5353)),
		want: Flow{tuple(17, "fd00::1", "fd00::2", 5353, 53), tuple(17, "fd00::2", "fd00::1", 53, 5353)},
	}, {
		name: "ICMP echo: the identifier in both ports",
		msg: msg(newType, afInet, tupleAttr(ctaTupleOrig, a4, b4, 1, 77, 0),
			tupleAttr(ctaTupleReply, b4, a4, 1, 77, 0)),
		want: Flow{tuple(1, "10.0.0.1", "10.0.0.2", 77, 77), tuple(1, "10.0.0.2", "10.0.0.1", 77, 77)},
	}, {
		name: "ICMPv6 echo",
		msg: msg(newType, afInet6, tupleAttr(ctaTupleOrig, a6, b6, 58, 9, 0),
			tupleAttr(ctaTupleReply, b6, a6, 58, 9, 0)),
		want: Flow{tuple(58, "fd00::1", "fd00::2", 9, 9), tuple(58, "fd00::2", "fd00::1", 9, 9)},
	}, {
		name:    "another family is skipped",
		msg:     msg(newType, 7, tupleAttr(ctaTupleOrig, a4, b4, 6, 1, 2), tupleAttr(ctaTupleReply, b4, a4, 6, 2, 1)),
		skipped: true,
	}, {
		name: "no reply tuple",
		msg:  msg(newType, afInet, tupleAttr(ctaTupleOrig, a4, b4, 6, 1, 2), status),
		err:  ErrMalformed,
	}, {
		name: "an IPv4 address of 3 bytes",
		msg: msg(newType, afInet, nested(ctaTupleOrig, nested(ctaTupleIP, attr(ctaIPv4Src, []byte{10, 0, 0}))),
			tupleAttr(ctaTupleReply, b4, a4, 6, 2, 1)),
		err: ErrMalformed,
	}, {
		name: "a port of 1 byte",
		msg: msg(newType, afInet, nested(ctaTupleOrig, nested(ctaTupleProto, attr(ctaProtoSrc, []byte{1}))),
			tupleAttr(ctaTupleReply, b4, a4, 6, 2, 1)),
		err: ErrMalformed,
	}, {
		name: "an attribute longer than its message",
		msg:  append(msg(newType, afInet), 0xff, 0x00, 1, 0),
		err:  ErrMalformed,
	}, {
		name: "no nfgenmsg header",
		msg:  msg(newType, afInet)[:nlmsgHdrLen+2],
		err:  ErrMalformed,
	}} {
		t.Run(tc.name, func(t *testing.T) {
			b := tc.msg
			binary.NativeEndian.PutUint32(b, uint32(len(b)))
			ms := messages{b: b}
			if !ms.next() {
				t.Fatalf("no message: %v", ms.err)
			}
			var f Flow
			ok, err := ms.m.flow(&f)
			if tc.err != nil {
				if !errors.Is(err, tc.err) {
					t.Fatalf("error %v, want %v", err, tc.err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if ok == tc.skipped {
				t.Fatalf("decoded %v, want skipped %v", ok, tc.skipped)
			}
			if ok && f != tc.want {
				t.Fatalf("flow\n got %+v\nwant %+v", f, tc.want)
			}
		})
	}
}

func TestMessagesFraming(t *testing.T) {
	one := msg(newType, afInet, tupleAttr(ctaTupleOrig, a4, b4, 6, 1, 2), tupleAttr(ctaTupleReply, b4, a4, 6, 2, 1))
	done := make([]byte, nlmsgHdrLen+4)
	binary.NativeEndian.PutUint32(done, uint32(len(done)))
	binary.NativeEndian.PutUint16(done[4:], nlmsgDone)
	for _, tc := range []struct {
		name  string
		b     []byte
		types []uint16
		err   error
	}{
		{"two messages and done", append(append(append([]byte{}, one...), one...), done...), []uint16{newType, newType, nlmsgDone}, nil},
		{"trailing bytes", append(append([]byte{}, one...), 1, 2, 3), []uint16{newType}, ErrMalformed},
		{"a length past the buffer", one[:len(one)-4], nil, ErrMalformed},
		{"a length below the header", append([]byte{8, 0, 0, 0}, make([]byte, 12)...), nil, ErrMalformed},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var got []uint16
			ms := messages{b: tc.b}
			for ms.next() {
				got = append(got, ms.m.typ)
			}
			if !errors.Is(ms.err, tc.err) || (tc.err == nil && ms.err != nil) {
				t.Fatalf("error %v, want %v", ms.err, tc.err)
			}
			if len(got) != len(tc.types) {
				t.Fatalf("types %v, want %v", got, tc.types)
			}
			for i := range got {
				if got[i] != tc.types[i] {
					t.Fatalf("types %v, want %v", got, tc.types)
				}
			}
		})
	}
}

func TestErrorMessage(t *testing.T) {
	b := make([]byte, nlmsgHdrLen+4)
	binary.NativeEndian.PutUint32(b, uint32(len(b)))
	binary.NativeEndian.PutUint16(b[4:], nlmsgError)
	var code int32 = -1 // EPERM
	binary.NativeEndian.PutUint32(b[nlmsgHdrLen:], uint32(code))
	ms := messages{b: b}
	ms.next()
	if err := ms.m.errno(); err == nil || err.Error() != "operation not permitted" {
		t.Fatalf("errno %v, want EPERM", err)
	}
}

// The decoder's input comes from the kernel, but a bound check missed is a
// panic in a DaemonSet: any input must decode or fail, never crash.
func FuzzMessages(f *testing.F) {
	f.Add(msg(newType, afInet, tupleAttr(ctaTupleOrig, a4, vip4, 6, 40000, 80), tupleAttr(ctaTupleReply, b4, a4, 6, 8080, 40000)))
	f.Add(msg(newType, afInet6, tupleAttr(ctaTupleOrig, a6, b6, 58, 9, 0), tupleAttr(ctaTupleReply, b6, a6, 58, 9, 0)))
	f.Fuzz(func(t *testing.T, b []byte) {
		ms := messages{b: b}
		for ms.next() {
			var fl Flow
			ok, err := ms.m.flow(&fl)
			if ok && (err != nil || fl.Orig.Family != fl.Reply.Family || (fl.Orig.Family != 4 && fl.Orig.Family != 6)) {
				t.Fatalf("decoded %+v with error %v", fl, err)
			}
			_ = ms.m.errno()
		}
	})
}

func BenchmarkDecode(b *testing.B) {
	m := msg(newType, afInet, tupleAttr(ctaTupleOrig, a4, vip4, 6, 40000, 80), tupleAttr(ctaTupleReply, b4, a4, 6, 8080, 40000), status)
	var f Flow
	b.ReportAllocs()
	for b.Loop() {
		ms := messages{b: m}
		for ms.next() {
			if _, err := ms.m.flow(&f); err != nil {
				b.Fatal(err)
			}
		}
	}
}
