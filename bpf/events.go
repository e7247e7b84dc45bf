package bpf

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"
	"time"

	"github.com/cilium/ebpf/ringbuf"
)

// ErrShortEvent is returned when a ring buffer record is smaller than a deny event.
var ErrShortEvent = errors.New("short deny event")

// denyEventSize is sizeof(struct deny_event) in types.h.
const denyEventSize = 8 + 4 + 4 + 2 + 2 + 16 + 16

// DenyEvent is a dropped packet as the datapath reports it (struct
// deny_event). The programs rate-limit these per CPU, so a trace shows
// examples of what is denied, not every packet.
type DenyEvent struct {
	Timestamp time.Duration // CLOCK_MONOTONIC
	Ifindex   uint32        // host veth
	Egress    bool          // dropped by the pod's egress program
	Reason    Reason
	Proto     uint8
	Src, Dst  netip.AddrPort
}

// UnmarshalBinary decodes one ring buffer record.
func (e *DenyEvent) UnmarshalBinary(b []byte) error {
	if len(b) < denyEventSize {
		return fmt.Errorf("%w: %d bytes, want %d", ErrShortEvent, len(b), denyEventSize)
	}
	le := binary.LittleEndian
	e.Timestamp = time.Duration(le.Uint64(b[0:]))
	e.Ifindex = le.Uint32(b[8:])
	family, proto, dir, reason := b[12], b[13], b[14], b[15]
	sport, dport := le.Uint16(b[16:]), le.Uint16(b[18:])
	src, dst := [16]byte(b[20:36]), [16]byte(b[36:52])
	e.Egress = dir == 1
	e.Reason = Reason(reason)
	e.Proto = proto
	if family == 4 {
		e.Src = netip.AddrPortFrom(netip.AddrFrom4([4]byte(src[:4])), sport)
		e.Dst = netip.AddrPortFrom(netip.AddrFrom4([4]byte(dst[:4])), dport)
	} else {
		e.Src = netip.AddrPortFrom(netip.AddrFrom16(src), sport)
		e.Dst = netip.AddrPortFrom(netip.AddrFrom16(dst), dport)
	}
	return nil
}

// DenyEvents reads deny events from the node's ring buffer. Only one reader
// should consume them at a time (records are removed as they are read).
type DenyEvents struct {
	r *ringbuf.Reader
}

// OpenDenyEvents starts reading g's deny-event ring buffer.
func OpenDenyEvents(g *Global) (*DenyEvents, error) {
	r, err := ringbuf.NewReader(g.DenyEvents)
	if err != nil {
		return nil, fmt.Errorf("open deny events: %w", err)
	}
	return &DenyEvents{r: r}, nil
}

// SetDeadline makes Read return os.ErrDeadlineExceeded once t has passed.
func (d *DenyEvents) SetDeadline(t time.Time) { d.r.SetDeadline(t) }

// Read blocks until the next event.
func (d *DenyEvents) Read() (DenyEvent, error) {
	var e DenyEvent
	rec, err := d.r.Read()
	if err != nil {
		return e, fmt.Errorf("read deny event: %w", err)
	}
	return e, e.UnmarshalBinary(rec.RawSample)
}

// Close stops reading; a blocked Read returns.
func (d *DenyEvents) Close() error { return d.r.Close() }
