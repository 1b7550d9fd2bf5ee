//go:build !linux

package pipeline

import (
	"bufio"
	"net"
	"sync"
	"sync/atomic"
	"time"
)

// Rings need Linux's sealed memfds (a peer cannot shrink the memory under
// a mapping); elsewhere streams stay on their sockets.

const (
	ringOffer          = "+ring"
	socketRingAck byte = 5
)

type ringMem struct{}

func (*ringMem) close() {}

type ringSide struct {
	mem      *ringMem
	stopRead atomic.Bool
}

func newRingSide(m *ringMem, client bool) *ringSide { return &ringSide{mem: m} }
func acceptRing(int) (*ringSide, error)             { return nil, errNoRings }
func (r *ringSide) close()                          {}
func (r *ringSide) shut(net.Conn, *sync.Mutex)      {}
func (r *ringSide) write(byte, [][]byte, net.Conn, func() error) error {
	return errNoRings
}

type ringReader struct {
	side   *ringSide
	sock   *bufio.Reader
	window func() time.Duration
}

func (r *ringReader) read(int) (byte, []byte, error) { return 0, nil, errNoRings }

var errNoRings = errRingUnsupported{}

type errRingUnsupported struct{}

func (errRingUnsupported) Error() string { return "rings need Linux" }

func busyWindow(net.Conn) func() time.Duration     { return nil }
func offerRing(net.Conn, string) (*ringMem, error) { return nil, nil }
func closeFD(int)                                  {}

// openReader reads its connection; no descriptors come beside.
type openReader struct{ c net.Conn }

func newOpenReader(c net.Conn) *openReader       { return &openReader{c} }
func (o *openReader) Read(b []byte) (int, error) { return o.c.Read(b) }
func (o *openReader) done() int                  { return -1 }
