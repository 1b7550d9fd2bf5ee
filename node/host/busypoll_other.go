//go:build !unix

package host

import (
	"net"
	"sync/atomic"
)

// busyReader polls only unix sockets; elsewhere reads wait as usual.
type busyReader struct{ net.Conn }

func newBusyReader(net.Conn, *atomic.Int64) *busyReader { return nil }
