// Package netdelay delays the TCP traffic between network namespaces, for
// tests and benchmarks of a mesh on one machine. It does so with the
// kernel's netem qdisc where the kernel has one (Netem), and otherwise with
// a userspace relay (Relay, Start): an nftables dnat rule in each
// namespace sends the connections to a port to a relay in this process,
// which forwards every chunk it reads a settable delay after reading it,
// in both directions.
package netdelay

import (
	"context"
	"errors"
	"fmt"
	"net"
	"sync"
	"sync/atomic"
	"time"
)

// Delay is a one-way delay that may change while connections run; a chunk
// waits the delay in force when it was read. The zero Delay is no delay.
type Delay struct{ ns atomic.Int64 }

// Set changes the delay.
func (d *Delay) Set(v time.Duration) { d.ns.Store(int64(v)) }

// Get returns the delay.
func (d *Delay) Get() time.Duration { return time.Duration(d.ns.Load()) }

// Stats is what a relay has carried.
type Stats struct {
	Conns int64 // connections accepted and dialed through
	Bytes int64 // bytes forwarded, both directions
}

// Relay forwards TCP connections from its listeners to their
// destinations, each chunk a delay after it was read. It owns every
// goroutine it starts; Close stops them all.
type Relay struct {
	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup
	mu     sync.Mutex
	lns    []net.Listener
	conns  map[net.Conn]struct{}
	nconns atomic.Int64
	nbytes atomic.Int64
}

// NewRelay returns a relay with no listeners.
func NewRelay() *Relay {
	r := &Relay{conns: map[net.Conn]struct{}{}}
	r.ctx, r.cancel = context.WithCancel(context.Background())
	return r
}

// Forward listens on the TCP address listen and forwards every connection
// it accepts to dst, delaying the data both ways by delay. It returns the
// listener's address (listen may have port 0).
func (r *Relay) Forward(listen, dst string, delay *Delay) (net.Addr, error) {
	ln, err := net.Listen("tcp", listen)
	if err != nil {
		return nil, fmt.Errorf("relay to %s: %w", dst, err)
	}
	r.mu.Lock()
	if r.ctx.Err() != nil {
		r.mu.Unlock()
		ln.Close()
		return nil, errors.New("relay: closed")
	}
	r.lns = append(r.lns, ln)
	r.wg.Go(func() { r.serve(ln, dst, delay) })
	r.mu.Unlock()
	return ln.Addr(), nil
}

// Stats returns what the relay has carried so far.
func (r *Relay) Stats() Stats {
	return Stats{Conns: r.nconns.Load(), Bytes: r.nbytes.Load()}
}

// Close stops the listeners, closes every connection and returns once
// every goroutine of the relay has ended. It may be called more than once.
func (r *Relay) Close() {
	r.mu.Lock()
	r.cancel()
	for _, ln := range r.lns {
		ln.Close()
	}
	for c := range r.conns {
		c.Close()
	}
	r.mu.Unlock()
	r.wg.Wait()
}

// track registers a connection for Close; false when the relay is closed
// (and the caller must close it).
func (r *Relay) track(c net.Conn) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.ctx.Err() != nil {
		return false
	}
	r.conns[c] = struct{}{}
	return true
}

func (r *Relay) untrack(c net.Conn) {
	r.mu.Lock()
	delete(r.conns, c)
	r.mu.Unlock()
	c.Close()
}

func (r *Relay) serve(ln net.Listener, dst string, delay *Delay) {
	for {
		in, err := ln.Accept()
		if err != nil {
			return // closed
		}
		if !r.track(in) {
			in.Close()
			return
		}
		r.wg.Go(func() {
			defer r.untrack(in)
			d := net.Dialer{Timeout: 5 * time.Second}
			out, err := d.DialContext(r.ctx, "tcp", dst)
			if err != nil {
				return // the client sees its connection close
			}
			if !r.track(out) {
				out.Close()
				return
			}
			defer r.untrack(out)
			r.nconns.Add(1)
			var pipes sync.WaitGroup
			pipes.Go(func() { r.delayCopy(out, in, delay) })
			pipes.Go(func() { r.delayCopy(in, out, delay) })
			pipes.Wait()
		})
	}
}

// delayCopy forwards what it reads from src to dst, each chunk the delay
// after it was read (a reader and a writer, so that a long delay does not
// slow the rate), and closes dst's write side at src's end. A failure on
// either side, or the relay's Close, closes both.
func (r *Relay) delayCopy(dst, src net.Conn, delay *Delay) {
	type chunk struct {
		data []byte
		due  time.Time
	}
	q := make(chan chunk, 4096)
	// The reader ends at src's end, or when src is closed (by the writer
	// or by Close); the writer returns only once q is closed, so it
	// outlives the reader.
	go func() {
		defer close(q)
		for {
			buf := make([]byte, 32<<10)
			n, err := src.Read(buf)
			if n > 0 {
				q <- chunk{buf[:n], time.Now().Add(delay.Get())}
			}
			if err != nil {
				return
			}
		}
	}()
	fail := func() {
		src.Close()
		dst.Close()
		for range q { // let the reader end
		}
	}
	timer := time.NewTimer(time.Hour)
	timer.Stop() // armed per chunk; since Go 1.23 a stopped timer holds no stale tick
	defer timer.Stop()
	for c := range q {
		if wait := time.Until(c.due); wait > 0 {
			timer.Reset(wait)
			select {
			case <-timer.C:
			case <-r.ctx.Done():
				fail()
				return
			}
		}
		if _, err := dst.Write(c.data); err != nil {
			fail()
			return
		}
		r.nbytes.Add(int64(len(c.data)))
	}
	if tc, ok := dst.(*net.TCPConn); ok {
		_ = tc.CloseWrite()
	} else {
		dst.Close()
	}
}
