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

// RawDenyEvent is struct deny_event (types.h) as the ring buffer carries it.
type RawDenyEvent = podfenceDenyEvent

// denyEventSize is sizeof(struct deny_event), padding included.
var denyEventSize = binary.Size(RawDenyEvent{})

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
	var raw RawDenyEvent
	// bpfel: the object's byte order on every architecture podfence runs on.
	if _, err := binary.Decode(b, binary.LittleEndian, &raw); err != nil {
		return fmt.Errorf("decode deny event: %w", err)
	}
	e.Timestamp = time.Duration(raw.TimestampNs)
	e.Ifindex = raw.Ifindex
	e.Egress = raw.Direction == 1
	e.Reason = Reason(raw.Reason)
	e.Proto = raw.Proto
	if raw.Family == 4 {
		e.Src = netip.AddrPortFrom(netip.AddrFrom4([4]byte(raw.Src[:4])), raw.Sport)
		e.Dst = netip.AddrPortFrom(netip.AddrFrom4([4]byte(raw.Dst[:4])), raw.Dport)
	} else {
		e.Src = netip.AddrPortFrom(netip.AddrFrom16(raw.Src), raw.Sport)
		e.Dst = netip.AddrPortFrom(netip.AddrFrom16(raw.Dst), raw.Dport)
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

// DroppedEvents is how many deny events the programs did not write since the
// node's maps were created, summed over CPUs: the rate limit's, and those a
// full ring buffer refused.
func (g *Global) DroppedEvents() (uint64, error) {
	var perCPU []podfenceEventBudget
	if err := g.EventBudget.Lookup(uint32(0), &perCPU); err != nil {
		return 0, fmt.Errorf("read the event budget: %w", err)
	}
	var n uint64
	for _, b := range perCPU {
		n += b.Dropped
	}
	return n, nil
}
