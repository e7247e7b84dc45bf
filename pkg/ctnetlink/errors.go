package ctnetlink

import "errors"

var (
	// ErrLost means the kernel dropped events because the socket's receive
	// buffer was full (ENOBUFS). The socket keeps working; what the lost
	// events said must be learned from a dump.
	ErrLost = errors.New("ctnetlink: events lost")

	// ErrMalformed means a message from the kernel did not parse: a length
	// that runs past its buffer, or an attribute too short for its type.
	ErrMalformed = errors.New("ctnetlink: malformed message")
)
