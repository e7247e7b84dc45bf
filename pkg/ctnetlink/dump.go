package ctnetlink

import (
	"errors"
	"fmt"
)

// Dumper reads the whole conntrack table, IPv4 and IPv6, of the network
// namespace it was opened in. It reuses one buffer and one Flow, so a dump
// allocates nothing per flow. A Dumper is not safe for concurrent use.
type Dumper struct {
	c    *conn
	seq  uint32
	flow Flow
}

// NewDumper opens a socket in the calling thread's network namespace.
func NewDumper() (*Dumper, error) {
	c, err := dial(0)
	if err != nil {
		return nil, err
	}
	return &Dumper{c: c}, nil
}

// Dump calls fn for every IPv4 and IPv6 flow. The Flow is reused: fn must
// copy what it keeps. An error from fn ends the dump and is returned; the
// rest of the kernel's answer is read and dropped, so the Dumper stays
// usable.
//
// The kernel walks its hash table while flows come and go: a flow created
// or destroyed during the dump may or may not be in it. A flow that exists
// from start to end is.
func (d *Dumper) Dump(fn func(*Flow) error) error {
	d.seq++
	if err := d.c.request(msgCTGet, nlfRequest|nlfDump, d.seq); err != nil {
		return fmt.Errorf("request conntrack dump: %w", err)
	}
	var fnErr error
	for {
		b, err := d.c.read()
		if err != nil {
			return fmt.Errorf("read conntrack dump: %w", err)
		}
		ms := messages{b: b}
		for ms.next() {
			m := &ms.m
			if m.seq != d.seq {
				continue // the tail of an earlier, abandoned dump
			}
			switch m.typ {
			case nlmsgDone:
				return fnErr
			case nlmsgError:
				if err := m.errno(); err != nil {
					return fmt.Errorf("conntrack dump: %w", err)
				}
				continue
			case subsysCT<<8 | msgCTNew:
			default:
				continue
			}
			if fnErr != nil {
				continue
			}
			ok, err := m.flow(&d.flow)
			if err != nil {
				fnErr = fmt.Errorf("conntrack dump: %w", err)
				continue
			}
			if ok {
				fnErr = fn(&d.flow)
			}
		}
		if ms.err != nil {
			return fmt.Errorf("conntrack dump: %w", ms.err)
		}
	}
}

// Close closes the socket.
func (d *Dumper) Close() error { return d.c.close() }

// Dump reads the table once, with a Dumper of its own.
func Dump(fn func(*Flow) error) error {
	d, err := NewDumper()
	if err != nil {
		return err
	}
	defer d.Close()
	return d.Dump(fn)
}

// Events is a subscription to the kernel's conntrack destroy events.
type Events struct {
	c    *conn
	flow Flow
}

// DefaultEventsReadBuffer is the receive buffer Events asks for unless
// told otherwise: room for about 20,000 destroy events between two reads.
const DefaultEventsReadBuffer = 8 << 20

// EventsOptions are OpenEventsWith's settings.
type EventsOptions struct {
	// ReadBuffer is the socket's receive buffer in bytes; 0 is
	// DefaultEventsReadBuffer. The kernel drops events past it, and Read
	// says so with ErrLost. Beyond net.core.rmem_max it needs
	// CAP_NET_ADMIN.
	ReadBuffer int
}

// OpenEvents subscribes, in the calling thread's network namespace, to the
// destroy event of every flow.
func OpenEvents() (*Events, error) { return OpenEventsWith(EventsOptions{}) }

// OpenEventsWith is OpenEvents with settings.
func OpenEventsWith(opts EventsOptions) (*Events, error) {
	if opts.ReadBuffer == 0 {
		opts.ReadBuffer = DefaultEventsReadBuffer
	}
	c, err := dial(1 << (groupDestroy - 1))
	if err != nil {
		return nil, err
	}
	if err := c.setReadBuffer(opts.ReadBuffer); err != nil {
		c.close()
		return nil, fmt.Errorf("size conntrack event buffer: %w", err)
	}
	return &Events{c: c}, nil
}

// Read blocks until events arrive and calls fn for the flow of each. The
// Flow is reused: fn must copy what it keeps. It returns ErrLost when the
// kernel dropped events since the last read, and an error wrapping
// ErrMalformed when one did not parse (the others are still read); the
// subscription continues after both. Once Close was called, it returns an
// error wrapping os.ErrClosed.
func (e *Events) Read(fn func(*Flow)) error {
	b, err := e.c.read()
	if err != nil {
		if errors.Is(err, errNoBufs) {
			return ErrLost
		}
		return fmt.Errorf("read conntrack events: %w", err)
	}
	var bad error
	ms := messages{b: b}
	for ms.next() {
		if ms.m.typ != subsysCT<<8|msgCTDelete {
			continue
		}
		ok, err := ms.m.flow(&e.flow)
		if err != nil {
			bad = err
			continue
		}
		if ok {
			fn(&e.flow)
		}
	}
	if ms.err != nil {
		bad = ms.err
	}
	if bad != nil {
		return fmt.Errorf("conntrack event: %w", bad)
	}
	return nil
}

// Close ends the subscription; a blocked Read returns.
func (e *Events) Close() error { return e.c.close() }
