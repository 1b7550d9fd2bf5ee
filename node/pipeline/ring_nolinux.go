//go:build !linux

package pipeline

import (
	"bufio"
	"net"
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
func readOpen(c net.Conn, r *bufio.Reader, buf *[]byte) (byte, []byte, []byte, int, error) {
	kind, body, err := readSocketMsg(r, buf, 1<<10)
	return kind, body, nil, -1, err
}
