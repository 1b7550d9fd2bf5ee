//go:build linux

package pipeline

import (
	"bufio"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"runtime"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"

	"github.com/meshnode/meshnode/node/spin"
)

// Rings: a socket stream between two processes of one machine carries its
// messages through shared memory, one ring a direction, and keeps the
// socket for what memory cannot say: that a reader asleep should look
// (a bell), messages too large for a ring, and the peer's end.
//
// Why. On an H200 host (a VM), a 16 KiB hidden state took 11 µs to write
// to a Unix socket and 20 µs more to be read and decoded on the other
// side, after the ~0.9 ms each stage's kernels keep the host idle; a
// token's reply, a few bytes, 10 µs more (BenchmarkWideStep's
// compute cases, run 221). Through a ring, a message is one copy into
// memory the reader polls.
//
// The client makes the memory (ringCreate: a memfd sealed at its size, so
// that the peer cannot shrink it under the server's mapping), offers it
// with its open message (the method name plus ringOffer, the descriptor
// beside it as SCM_RIGHTS), and waits for the server's socketRingAck: an
// empty body accepts, else it says why not, and the stream stays on the
// socket. A server that predates rings refuses the method
// (Unimplemented), and the client opens the stream again without the
// offer. Linux only: elsewhere there are no sealed memfds.
//
// A ring is a single-producer single-consumer queue of records, each an
// 8-byte header (kind, the padding before the body, 2 zero bytes, the
// body's length), the padding and the body, padded to 8 bytes; a record
// never wraps (ringWrap fills the end). Each side keeps its own head or
// tail and only stores it in the shared memory, and reads the other's
// with every bound checked: a peer that scribbles on its ring ends the
// stream, nothing more. The reader returns a body in place and releases
// it at its next read, as readSocketMsg reuses its buffer; RecvMsg holds
// a lock while it reads and decodes, and the memory is unmapped only
// under it. A message over ringMaxRecord goes on the socket behind a
// ringViaSocket record, which keeps the order.
//
// Bells: a reader that has found nothing for its busy-poll window sets
// its ring's sleeping flag, looks once more, and blocks reading the
// socket; a writer that finds the flag set after publishing writes a bell
// (socketBell). Both sides' flag and head are sequentially consistent
// atomics, so one of them sees the other's store: no wake-up is lost. A
// reader takes stray bells in its stride.
const (
	ringOffer = "+ring"

	socketRingAck byte = 5 // server to client: the ring's answer
	socketBell    byte = 6 // a doorbell: the ring has something

	ringWrap      byte = 0xff // record: the rest of the ring is unused; go on at its start
	ringViaSocket byte = 0xfe // record: the next message is on the socket

	ringHeader = 8
	// ringCtl is the bytes of a ring's control block: head, tail and the
	// sleeping flag, each on a cache line of its own.
	ringCtl = 3 * 128
	// ringData is a ring's capacity. An eight-row decode step of an 8B
	// model is 128 KiB.
	ringData = 2 << 20
	// ringMaxRecord is the largest record a ring takes.
	ringMaxRecord = ringData / 4
	// ringBytes is the shared memory of a stream: the client's ring,
	// then the server's. Pages are taken as the rings go round, so a
	// stream that carries decode steps ends up holding all 4 MiB.
	ringBytes = 2 * (ringCtl + ringData)

	// ringFullBell is how often a writer waiting for room rings: a peer
	// that is gone then fails the write.
	ringFullBell = time.Millisecond
)

var (
	errRingClosed  = errors.New("stage stream: ring closed")
	errRingCorrupt = errors.New("stage stream: the peer's ring is corrupt")
)

// ringMem is a stream's shared memory. Every access holds mu's read
// lock; unmapping takes the write lock, so that nothing touches memory
// that is gone.
type ringMem struct {
	mu     sync.RWMutex
	mem    []byte
	closed bool
}

func mapRing(fd int) (*ringMem, error) {
	if err := checkSeals(fd); err != nil {
		return nil, err
	}
	var st syscall.Stat_t
	if err := syscall.Fstat(fd, &st); err != nil {
		return nil, fmt.Errorf("ring: %w", err)
	}
	if st.Size != ringBytes {
		return nil, fmt.Errorf("ring: shared memory of %d bytes, want %d", st.Size, ringBytes)
	}
	mem, err := syscall.Mmap(fd, 0, ringBytes, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_SHARED)
	if err != nil {
		return nil, fmt.Errorf("ring: mapping shared memory: %w", err)
	}
	return &ringMem{mem: mem}, nil
}

// close unmaps the memory once no access is under way; later accesses
// fail with errRingClosed.
func (m *ringMem) close() {
	if m == nil {
		return
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.closed {
		return
	}
	m.closed = true
	_ = syscall.Munmap(m.mem)
	m.mem = nil
}

// half is one direction's ring: 0 the client's (client to server), 1 the
// server's.
func (m *ringMem) half(dir int) ringHalf {
	base := dir * (ringCtl + ringData)
	ctl := m.mem[base : base+ringCtl]
	return ringHalf{
		head:     (*atomic.Uint64)(unsafe.Pointer(&ctl[0])),
		tail:     (*atomic.Uint64)(unsafe.Pointer(&ctl[128])),
		sleeping: (*atomic.Uint32)(unsafe.Pointer(&ctl[256])),
		data:     m.mem[base+ringCtl : base+ringCtl+ringData],
	}
}

// ringHalf's head is written by the producer, tail by the consumer: byte
// counts since the start, never wrapped.
type ringHalf struct {
	head, tail *atomic.Uint64
	sleeping   *atomic.Uint32
	data       []byte
}

// ringSide is one end of a stream's rings: it writes one and reads the
// other.
type ringSide struct {
	mem      *ringMem
	out      ringHalf
	in       ringHalf
	head     uint64      // out's head: only stored to the shared memory, which the peer could change
	stopRead atomic.Bool // reads end (the stream's context, cancelRecv)
}

func newRingSide(m *ringMem, client bool) *ringSide {
	out, in := 0, 1
	if !client {
		out, in = 1, 0
	}
	return &ringSide{mem: m, out: m.half(out), in: m.half(in)}
}

// acceptRing maps the shared memory a client offered with its open
// message.
func acceptRing(fd int) (*ringSide, error) {
	if fd < 0 {
		return nil, errors.New("no shared memory came with the offer")
	}
	defer closeFD(fd)
	m, err := mapRing(fd)
	if err != nil {
		return nil, err
	}
	return newRingSide(m, false), nil
}

// close unmaps the stream's memory; nil is fine.
func (r *ringSide) close() {
	if r != nil {
		r.mem.close()
	}
}

// shut ends the side's reads and closes c, which ends a read asleep on
// it, then unmaps the memory once reads is free: a stream's reader holds
// it while it reads and decodes from the memory.
func (r *ringSide) shut(c net.Conn, reads *sync.Mutex) {
	r.stopRead.Store(true)
	c.Close()
	reads.Lock()
	defer reads.Unlock()
	r.close()
}

func pad8(n int) int { return (n + 7) &^ 7 }

// write puts a message of kind whose body is the parts' concatenation on
// the ring, or, too large for it, on the socket (sock writes it whole)
// behind a ringViaSocket record; conn rings the peer's bell. Where parts
// holds a second part (a frame's payload, after its head), the record's
// padding puts that part at an address that is a multiple of 16, so that
// the reader can lend it as it lies (wire.UnmarshalLent moves it
// otherwise). The caller holds the stream's write lock.
func (r *ringSide) write(kind byte, parts [][]byte, conn net.Conn, sock func() error) error {
	n := 0
	for _, p := range parts {
		n += len(p)
	}
	align := -1 // the body's offset to align
	if len(parts) > 1 && len(parts[1]) > 0 {
		align = len(parts[0])
	}
	most := ringHeader + pad8(n+ringMaxPad) // with any padding
	via := most > ringMaxRecord
	if via {
		most, align = ringHeader, -1
	}
	if err := r.put(kind, parts, n, most, align, via, conn); err != nil {
		return err
	}
	if via {
		return sock()
	}
	return nil
}

// ringMaxPad is the most padding a record has before its body.
const ringMaxPad = 15

// recordPad is the padding before a body at pos whose byte at align must
// sit at a multiple of 16 (each ring's data starts at one: ringCtl is).
func recordPad(pos, align int) int {
	if align < 0 {
		return 0
	}
	return (16 - (pos+ringHeader+align)%16) % 16
}

func (r *ringSide) put(kind byte, parts [][]byte, n, most, align int, via bool, conn net.Conn) error {
	r.mem.mu.RLock()
	defer r.mem.mu.RUnlock()
	if r.mem.closed {
		return errRingClosed
	}
	h := r.out
	head := r.head
	pos := int(head % ringData)
	need := most
	if ringData-pos < most {
		need += ringData - pos // a wrap record fills the end
	}
	lastBell := time.Now()
	nap := 20 * time.Microsecond
	for spins := 0; ; spins++ {
		tail := h.tail.Load()
		if tail > head || head-tail > ringData {
			return errRingCorrupt // the peer's tail
		}
		if ringData-(head-tail) >= uint64(need) {
			break
		}
		if time.Since(lastBell) > ringFullBell {
			// The reader may be asleep, or gone: a bell wakes the one and
			// fails on the other.
			if err := writeBell(conn); err != nil {
				return err
			}
			lastBell = time.Now()
		}
		if spins < 64 {
			runtime.Gosched()
			continue
		}
		time.Sleep(nap)
		nap = min(2*nap, time.Millisecond)
	}
	if ringData-pos < most {
		putHeader(h.data[pos:], ringWrap, 0, ringData-pos-ringHeader)
		head += uint64(ringData - pos)
		pos = 0
	}
	rec := ringHeader
	if via {
		putHeader(h.data[pos:], ringViaSocket, 0, 0)
	} else {
		pad := recordPad(pos, align)
		putHeader(h.data[pos:], kind, pad, n)
		off := pos + ringHeader + pad
		for _, p := range parts {
			off += copy(h.data[off:], p)
		}
		rec += pad8(pad + n)
	}
	r.head = head + uint64(rec)
	h.head.Store(r.head)
	if h.sleeping.Load() != 0 {
		return writeBell(conn)
	}
	return nil
}

// putHeader writes a record's header: its kind, the padding before its
// body, and the body's length.
func putHeader(b []byte, kind byte, pad, n int) {
	b[0], b[1], b[2], b[3] = kind, byte(pad), 0, 0
	binary.LittleEndian.PutUint32(b[4:], uint32(n))
}

func writeBell(conn net.Conn) error {
	_, err := conn.Write([]byte{socketBell, 0, 0, 0, 0})
	return err
}

// ringReader reads a stream's messages from its ring, and from the socket
// where the ring says so.
type ringReader struct {
	side    *ringSide
	sock    *bufio.Reader
	sbuf    []byte
	window  func() time.Duration // the busy-poll window
	tail    uint64               // the ring's tail: only stored to the shared memory, which the peer could change
	pending uint64               // the record last returned, released at the next read
	last    time.Time            // when a message last came
}

// read returns the next message, its body valid until the next read.
func (r *ringReader) read(limit int) (byte, []byte, error) {
	var pace spin.Pacer
	for {
		kind, body, ok, err := r.poll(limit)
		if ok || err != nil {
			if ok {
				r.last = time.Now()
			}
			return kind, body, err
		}
		if kind == ringViaSocket {
			kind, body, err := r.sockMsg(limit)
			r.last = time.Now()
			return kind, body, err
		}
		// Nothing: poll for the window, then sleep on the socket.
		if r.side.stopRead.Load() {
			return 0, nil, errRingClosed
		}
		if now := time.Now(); now.Sub(r.last) < r.window() {
			pace.Missed(now)
			continue
		}
		if err := r.sleep(); err != nil {
			return 0, nil, err
		}
	}
}

// poll looks at the ring once: ok with a message; or kind ringViaSocket
// when the next message is on the socket; or nothing.
func (r *ringReader) poll(limit int) (kind byte, body []byte, ok bool, err error) {
	r.side.mem.mu.RLock()
	defer r.side.mem.mu.RUnlock()
	if r.side.mem.closed {
		return 0, nil, false, errRingClosed
	}
	h := r.side.in
	r.tail += r.pending
	r.pending = 0
	h.tail.Store(r.tail)
	wrapped := false
	for {
		tail := r.tail
		head := h.head.Load()
		if head == tail {
			return 0, nil, false, nil
		}
		if head-tail > ringData || head%8 != 0 {
			return 0, nil, false, errRingCorrupt
		}
		pos := int(tail % ringData) // a multiple of 8: a header fits before the end
		k, pad := h.data[pos], int(h.data[pos+1])
		n := int(binary.LittleEndian.Uint32(h.data[pos+4:]))
		if pad > ringMaxPad || n > ringData {
			return 0, nil, false, errRingCorrupt
		}
		rec := ringHeader + pad8(pad+n)
		if rec > ringData-pos || uint64(rec) > head-tail {
			return 0, nil, false, errRingCorrupt
		}
		switch k {
		case ringWrap:
			// A wrap fills the ring's end, once a read: a peer cannot keep
			// the reader here.
			if wrapped || pos+rec != ringData {
				return 0, nil, false, errRingCorrupt
			}
			wrapped = true
			r.tail += uint64(rec)
			h.tail.Store(r.tail)
			continue
		case ringViaSocket:
			r.tail += uint64(rec)
			h.tail.Store(r.tail)
			return ringViaSocket, nil, false, nil
		}
		if n > limit {
			r.tail += uint64(rec)
			h.tail.Store(r.tail)
			return k, nil, false, fmt.Errorf("%w: %d bytes, at most %d", errSocketTooLarge, n, limit)
		}
		r.pending = uint64(rec)
		at := pos + ringHeader + pad
		return k, h.data[at : at+n : at+n], true, nil
	}
}

// sockMsg reads the message a ringViaSocket record stands for.
func (r *ringReader) sockMsg(limit int) (byte, []byte, error) {
	for {
		kind, body, err := readSocketMsg(r.sock, &r.sbuf, limit)
		if err != nil || kind != socketBell {
			return kind, body, err
		}
	}
}

// sleep waits on the socket for a bell, unless the ring has something.
func (r *ringReader) sleep() error {
	if err := r.setSleeping(1); err != nil {
		return err
	}
	if more, err := r.more(); more || err != nil {
		_ = r.setSleeping(0)
		return err
	}
	kind, _, err := readSocketMsg(r.sock, &r.sbuf, 1<<10)
	_ = r.setSleeping(0)
	switch {
	case err != nil:
		return err
	case kind != socketBell:
		return fmt.Errorf("stage stream: message kind %d on the socket outside the ring", kind)
	}
	r.last = time.Now()
	return nil
}

func (r *ringReader) setSleeping(v uint32) error {
	r.side.mem.mu.RLock()
	defer r.side.mem.mu.RUnlock()
	if r.side.mem.closed {
		return errRingClosed
	}
	r.side.in.sleeping.Store(v)
	return nil
}

// more says whether the ring holds a record past the one lent.
func (r *ringReader) more() (bool, error) {
	r.side.mem.mu.RLock()
	defer r.side.mem.mu.RUnlock()
	if r.side.mem.closed {
		return false, errRingClosed
	}
	return r.side.in.head.Load() != r.tail+r.pending, nil
}

// ringConn is what a connection needs to carry rings: a Unix socket's
// descriptor passing.
type ringConn interface {
	net.Conn
	WriteMsgUnix(b, oob []byte, addr *net.UnixAddr) (n, oobn int, err error)
	ReadMsgUnix(b, oob []byte) (n, oobn, flags int, addr *net.UnixAddr, err error)
}

// busyWindow is the connection's busy-poll window, if it has one.
func busyWindow(c net.Conn) func() time.Duration {
	if w, ok := c.(interface{ BusyPollWindow() time.Duration }); ok {
		return w.BusyPollWindow
	}
	return func() time.Duration { return 0 }
}

// offerRing makes a stream's shared memory and sends the open message for
// method with it. It returns nil memory, and sends nothing, where the
// connection cannot pass it.
func offerRing(c net.Conn, method string) (*ringMem, error) {
	rc, ok := c.(ringConn)
	if !ok {
		return nil, nil
	}
	fd, err := ringCreate()
	if err != nil {
		return nil, nil // a stream on the socket alone
	}
	defer syscall.Close(fd)
	m, err := mapRing(fd)
	if err != nil {
		return nil, nil
	}
	body := []byte(method + ringOffer)
	msg := binary.LittleEndian.AppendUint32([]byte{socketOpen}, uint32(len(body)))
	if _, _, err := rc.WriteMsgUnix(append(msg, body...), syscall.UnixRights(fd), nil); err != nil {
		m.close()
		return nil, err
	}
	return m, nil
}

// openReader reads a connection for a bufio.Reader, keeping the first
// descriptor passed beside its bytes (a ring's, with the open message)
// until done; then it reads as the connection does (busy-polling, say).
type openReader struct {
	c    net.Conn
	rc   ringConn // nil: c passes no descriptors
	fd   int
	open bool
}

func newOpenReader(c net.Conn) *openReader {
	rc, _ := c.(ringConn)
	return &openReader{c: c, rc: rc, fd: -1, open: rc != nil}
}

func (o *openReader) Read(b []byte) (int, error) {
	if !o.open {
		return o.c.Read(b)
	}
	oob := make([]byte, syscall.CmsgSpace(4*4))
	n, oobn, _, _, err := o.rc.ReadMsgUnix(b, oob)
	if oobn > 0 {
		o.fd = keepOneFD(oob[:oobn], o.fd)
	}
	if err == nil && n == 0 && len(b) > 0 {
		err = io.EOF
	}
	return n, err
}

// done ends the keeping and returns the descriptor kept, or -1; the
// caller owns it.
func (o *openReader) done() int {
	o.open = false
	fd := o.fd
	o.fd = -1
	return fd
}

// keepOneFD takes the descriptors of a control message: the first one
// passed is kept (prev, if set, stays), the others closed.
func keepOneFD(oob []byte, prev int) int {
	msgs, err := syscall.ParseSocketControlMessage(oob)
	if err != nil {
		return prev
	}
	for _, m := range msgs {
		fds, err := syscall.ParseUnixRights(&m)
		if err != nil {
			continue
		}
		for _, fd := range fds {
			if prev < 0 {
				prev = fd
			} else {
				syscall.Close(fd)
			}
		}
	}
	return prev
}

func closeFD(fd int) {
	if fd >= 0 {
		syscall.Close(fd)
	}
}
