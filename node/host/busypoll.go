//go:build unix

package host

import (
	"io"
	"net"
	"os"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/meshnode/meshnode/node/spin"
)

// Why busy polling. A pipeline hop is one small message every few
// milliseconds (a decode step's hidden state). Between two, every thread
// of the receiving process parks, and waking the one the next message
// needs costs tens to hundreds of microseconds, more on a VM whose idle
// vCPUs halt. On loopback here a 64-byte libp2p round trip took 33 µs
// back to back and 122 µs after a 2 ms pause; on a two-GPU H200 host, a
// one-stream decode step spent 0.68 ms outside its two stages, 0.50 ms
// with busy polling. A busyReader keeps the reading goroutine on its CPU
// for a while after each message, trying the socket and yielding to other
// goroutines in turn, so that the next message is taken as soon as it
// lands and the goroutines it wakes (libp2p's, gRPC's, the stage's) run
// on a warm thread. It spends one CPU per busy connection while traffic
// flows, and nothing once the connection has been quiet for the window: a
// trade for GPU stages, where the host is otherwise idle.

// busyReader reads a socket, spinning for up to the window after the
// last data it returned before it waits the ordinary way. The window is
// shared by a host's connections and can change at any time (0: off).
type busyReader struct {
	conn   net.Conn
	raw    syscall.RawConn
	window *atomic.Int64 // nanoseconds
	last   time.Time     // when a read last returned data
	closed atomic.Bool   // Close stops a spin at once
	caught int           // reads that found their data while polling (tests)
}

// newBusyReader returns nil when c exposes no socket to poll.
func newBusyReader(c net.Conn, window *atomic.Int64) *busyReader {
	sc, ok := c.(syscall.Conn)
	if !ok {
		return nil
	}
	raw, err := sc.SyscallConn()
	if err != nil {
		return nil
	}
	return &busyReader{conn: c, raw: raw, window: window}
}

// Read reads into b like the connection's Read. Calls must not overlap.
func (r *busyReader) Read(b []byte) (int, error) {
	if len(b) == 0 {
		return 0, nil
	}
	until := r.last.Add(time.Duration(r.window.Load()))
	if !time.Now().Before(until) {
		n, err := r.conn.Read(b)
		r.note(n)
		return n, err
	}
	var n int
	var rerr error
	spun := false
	var pace spin.Pacer
	err := r.raw.Read(func(fd uintptr) bool {
		for {
			n, rerr = syscall.Read(int(fd), b)
			if rerr == syscall.EINTR {
				continue
			}
			if rerr != syscall.EAGAIN {
				return true
			}
			now := time.Now()
			if spun || r.closed.Load() || !now.Before(until) {
				spun = true
				return false // wait for the socket through the poller
			}
			pace.Missed(now)
		}
	})
	switch {
	case err != nil:
		return 0, err
	case rerr != nil:
		return 0, &net.OpError{Op: "read", Net: "tcp", Source: r.conn.LocalAddr(), Addr: r.conn.RemoteAddr(), Err: os.NewSyscallError("read", rerr)}
	case n == 0:
		return 0, io.EOF
	}
	if !spun {
		r.caught++
	}
	r.note(n)
	return n, nil
}

func (r *busyReader) note(n int) {
	if n > 0 {
		r.last = time.Now()
	}
}

// Close closes the connection, ending a read that spins.
func (r *busyReader) Close() error {
	r.closed.Store(true)
	return r.conn.Close()
}
