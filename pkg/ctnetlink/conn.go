package ctnetlink

import (
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"syscall"

	"golang.org/x/sys/unix"
)

// readBuffer holds one read. The kernel fills a dump's reads up to 32 KiB
// (it sizes them after the reader's buffer, capped there); a larger buffer
// never sees a truncated message.
const readBuffer = 64 << 10

// conn is a NETLINK_NETFILTER socket on Go's poller, so that a blocked read
// ends when the socket is closed.
type conn struct {
	f  *os.File
	rc syscall.RawConn

	// The read callback and its results live here so that a read does not
	// allocate a closure.
	buf    []byte
	n      int
	rerr   error
	readFn func(fd uintptr) bool
}

func dial(groups uint32) (*conn, error) {
	fd, err := unix.Socket(unix.AF_NETLINK, unix.SOCK_RAW|unix.SOCK_CLOEXEC|unix.SOCK_NONBLOCK, unix.NETLINK_NETFILTER)
	if err != nil {
		return nil, fmt.Errorf("open netfilter netlink socket: %w", err)
	}
	if err := unix.Bind(fd, &unix.SockaddrNetlink{Family: unix.AF_NETLINK, Groups: groups}); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("bind netfilter netlink socket: %w", err)
	}
	f := os.NewFile(uintptr(fd), "ctnetlink")
	rc, err := f.SyscallConn()
	if err != nil {
		f.Close()
		return nil, fmt.Errorf("netfilter netlink socket: %w", err)
	}
	c := &conn{f: f, rc: rc, buf: make([]byte, readBuffer)}
	c.readFn = func(fd uintptr) bool {
		c.n, c.rerr = unix.Read(int(fd), c.buf)
		return c.rerr != unix.EAGAIN
	}
	return c, nil
}

// setReadBuffer asks for n bytes of receive buffer, beyond the system's
// limit where the caller has CAP_NET_ADMIN.
func (c *conn) setReadBuffer(n int) error {
	var serr error
	err := c.rc.Control(func(fd uintptr) {
		serr = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_RCVBUFFORCE, n)
		if serr != nil {
			serr = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_RCVBUF, n)
		}
	})
	if err != nil {
		return err
	}
	return serr
}

// read returns the messages of one read, valid until the next.
func (c *conn) read() ([]byte, error) {
	if err := c.rc.Read(c.readFn); err != nil {
		if errors.Is(err, os.ErrDeadlineExceeded) {
			return nil, err
		}
		// The poller's only other error: the socket was closed. Its own
		// value ("use of closed file") is not os.ErrClosed.
		return nil, os.ErrClosed
	}
	if c.rerr != nil {
		return nil, c.rerr
	}
	return c.buf[:c.n], nil
}

// request sends a ctnetlink request of type msg for every family.
func (c *conn) request(msg uint16, flags uint16, seq uint32) error {
	var b [nlmsgHdrLen + nfgenHdrLen]byte
	binary.NativeEndian.PutUint32(b[0:], uint32(len(b)))
	binary.NativeEndian.PutUint16(b[4:], subsysCT<<8|msg)
	binary.NativeEndian.PutUint16(b[6:], flags)
	binary.NativeEndian.PutUint32(b[8:], seq)
	// b[16:20] is the nfgenmsg: family AF_UNSPEC, version 0, resource 0.
	var werr error
	err := c.rc.Write(func(fd uintptr) bool {
		_, werr = unix.Write(int(fd), b[:])
		return werr != unix.EAGAIN
	})
	if err != nil {
		return err
	}
	return werr
}

func (c *conn) close() error { return c.f.Close() }

func errnoErr(code int32) error { return unix.Errno(code) }

var errNoBufs = unix.ENOBUFS
