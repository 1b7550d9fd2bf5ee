package netdelay

import (
	"io"
	"net"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"
)

// pingServer answers every byte it reads with the same byte and records
// when each byte arrived; it runs until the test ends.
type pingServer struct {
	ln      net.Listener
	arrived chan time.Time // one per byte read
	remote  chan net.Addr  // one per connection accepted
	wg      sync.WaitGroup
}

// relayedPing starts a ping server, puts a relay with delay d in front of
// it and dials the relay. The connection closes with the test; the caller
// closes the relay.
func relayedPing(t *testing.T, d *Delay) (*pingServer, net.Listener, *Relay, net.Conn) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := startPingServer(t, ln)
	r := NewRelay()
	addr, err := r.Forward("127.0.0.1:0", ln.Addr().String(), d)
	if err != nil {
		r.Close()
		t.Fatal(err)
	}
	c, err := net.Dial("tcp", addr.String())
	if err != nil {
		r.Close()
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return srv, ln, r, c
}

func startPingServer(t *testing.T, ln net.Listener) *pingServer {
	t.Helper()
	s := &pingServer{ln: ln, arrived: make(chan time.Time, 64), remote: make(chan net.Addr, 16)}
	var mu sync.Mutex
	var conns []net.Conn
	s.wg.Go(func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns = append(conns, c)
			mu.Unlock()
			s.remote <- c.RemoteAddr()
			s.wg.Go(func() {
				b := make([]byte, 1)
				for {
					if _, err := c.Read(b); err != nil {
						return
					}
					s.arrived <- time.Now()
					if _, err := c.Write(b); err != nil {
						return
					}
				}
			})
		}
	})
	t.Cleanup(func() {
		ln.Close()
		mu.Lock()
		for _, c := range conns {
			c.Close()
		}
		mu.Unlock()
		s.wg.Wait()
	})
	return s
}

// ping sends one byte over c and returns how long it took to reach the
// server and how long the answer took to come back.
func (s *pingServer) ping(t *testing.T, c net.Conn) (there, back time.Duration) {
	t.Helper()
	start := time.Now()
	if _, err := c.Write([]byte{'x'}); err != nil {
		t.Fatalf("ping: %v", err)
	}
	var at time.Time
	select {
	case at = <-s.arrived:
	case <-time.After(5 * time.Second):
		t.Fatal("ping: the server got nothing in 5 s")
	}
	c.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := io.ReadFull(c, make([]byte, 1)); err != nil {
		t.Fatalf("ping: reading the answer: %v", err)
	}
	return at.Sub(start), time.Since(at)
}

// slack is how much later than its delay a chunk may arrive: the relay's
// own hop and a busy test machine's scheduling.
const slack = 25 * time.Millisecond

// checkDelay fails unless both directions took d, within slack.
func checkDelay(t *testing.T, what string, d, there, back time.Duration) {
	t.Helper()
	for _, leg := range []struct {
		name string
		got  time.Duration
	}{{"there", there}, {"back", back}} {
		if leg.got < d || leg.got > d+slack {
			t.Errorf("%s: %s took %v, want %v to %v", what, leg.name, leg.got, d, d+slack)
		}
	}
}

func TestRelayDelaysBothWays(t *testing.T) {
	for _, tc := range []struct {
		name  string
		delay time.Duration
	}{
		{"none", 0},
		{"30ms", 30 * time.Millisecond},
		{"80ms", 80 * time.Millisecond},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var d Delay
			d.Set(tc.delay)
			srv, _, r, c := relayedPing(t, &d)
			t.Cleanup(r.Close)
			for i := range 3 {
				there, back := srv.ping(t, c)
				checkDelay(t, "ping "+string(rune('1'+i)), tc.delay, there, back)
			}
			// The relay counts a chunk after writing it, so the last may
			// be counted just after the client read it.
			st := r.Stats()
			for deadline := time.Now().Add(time.Second); st.Bytes < 6 && time.Now().Before(deadline); st = r.Stats() {
				time.Sleep(time.Millisecond)
			}
			if st.Conns != 1 || st.Bytes != 6 {
				t.Errorf("stats %+v, want 1 connection and 6 bytes", st)
			}
		})
	}
}

// A delay set on a live connection applies to the next chunk.
func TestRelaySetOnLiveConnection(t *testing.T) {
	var d Delay
	srv, _, r, c := relayedPing(t, &d)
	t.Cleanup(r.Close)
	for _, want := range []time.Duration{0, 60 * time.Millisecond, 0} {
		d.Set(want)
		there, back := srv.ping(t, c)
		checkDelay(t, "delay "+want.String(), want, there, back)
	}
}

// Close ends every goroutine of the relay, with a connection open and a
// chunk waiting out a long delay.
func TestRelayClose(t *testing.T) {
	before := runtime.NumGoroutine()
	var d Delay
	d.Set(time.Hour)
	srv, ln, r, c := relayedPing(t, &d)
	if _, err := c.Write([]byte{'x'}); err != nil {
		t.Fatal(err)
	}
	<-srv.remote // the relay dialed through
	time.Sleep(50 * time.Millisecond)
	closed := make(chan struct{})
	go func() { r.Close(); close(closed) }()
	select {
	case <-closed:
	case <-time.After(5 * time.Second):
		t.Fatal("Close did not return in 5 s")
	}
	c.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := c.Read(make([]byte, 1)); err == nil {
		t.Error("the client's connection is still open after Close")
	}
	if _, err := r.Forward("127.0.0.1:0", ln.Addr().String(), &d); err == nil {
		t.Error("Forward after Close succeeded")
	}
	r.Close() // twice is fine
	c.Close()
	ln.Close()
	// The server's goroutines end with the test; the relay's must be gone
	// now: at most the server's accept loop and handler remain.
	deadline := time.Now().Add(2 * time.Second)
	for runtime.NumGoroutine() > before+2 && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	if n := runtime.NumGoroutine(); n > before+2 {
		buf := make([]byte, 1<<16)
		t.Errorf("%d goroutines after Close, %d before:\n%s", n, before, buf[:runtime.Stack(buf, true)])
	}
}

func TestRules(t *testing.T) {
	for _, tc := range []struct {
		name  string
		rules []DNAT
		want  []string // lines that must be there, in order
	}{
		{"none", nil, []string{"table ip meshdelay {", "type nat hook output priority -100;", "type nat hook postrouting priority 100;"}},
		{"two", []DNAT{{"10.0.0.12", 4001, "10.0.0.1", 41012}, {"10.0.0.13", 4001, "10.0.0.1", 41013}}, []string{
			"ip daddr 10.0.0.12 tcp dport 4001 dnat to 10.0.0.1:41012",
			"ip daddr 10.0.0.13 tcp dport 4001 dnat to 10.0.0.1:41013",
			"type nat hook postrouting",
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := Rules(tc.rules)
			rest := got
			for _, w := range tc.want {
				k := strings.Index(rest, w)
				if k < 0 {
					t.Fatalf("no %q (in order) in\n%s", w, got)
				}
				rest = rest[k+len(w):]
			}
			if n := strings.Count(got, "dnat to"); n != len(tc.rules) {
				t.Errorf("%d dnat rules, want %d:\n%s", n, len(tc.rules), got)
			}
		})
	}
}
