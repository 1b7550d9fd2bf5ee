//go:build unix

package host

import (
	"bytes"
	"context"
	"errors"
	"io"
	"math/rand/v2"
	"net"
	"sync/atomic"
	"testing"
	"time"
)

// TestBusyReader reads messages with and without gaps through a busy
// reader, spinning and sleeping in turn, and checks every byte and the end
// of stream.
func TestBusyReader(t *testing.T) {
	tests := []struct {
		name   string
		window time.Duration
		gap    time.Duration
	}{
		{"off", 0, time.Millisecond},
		{"spinning", 50 * time.Millisecond, 0},
		{"spin then sleep", 2 * time.Millisecond, 5 * time.Millisecond},
		{"gaps inside the window", 50 * time.Millisecond, time.Millisecond},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			client, server := tcpPair(t)
			var window atomic.Int64
			window.Store(int64(tc.window))
			r := newBusyReader(server, &window)
			if r == nil {
				t.Fatal("no busy reader for a TCP connection")
			}
			rng := rand.New(rand.NewPCG(1, 2))
			var want bytes.Buffer
			var msgs [][]byte
			for i := range 40 {
				msg := make([]byte, 1+rng.IntN(40<<10))
				for j := range msg {
					msg[j] = byte(i + j)
				}
				want.Write(msg)
				msgs = append(msgs, msg)
			}
			go func() {
				defer client.Close()
				for _, msg := range msgs {
					if _, err := client.Write(msg); err != nil {
						return
					}
					time.Sleep(tc.gap)
				}
			}()
			got, err := io.ReadAll(r)
			if err != nil {
				t.Fatalf("reading: %v", err)
			}
			if !bytes.Equal(got, want.Bytes()) {
				t.Fatalf("read %d bytes that differ from the %d written", len(got), want.Len())
			}
			if polled := r.caught > 0; polled != (tc.window > 0) {
				t.Errorf("%d reads found their data while polling, with a window of %v", r.caught, tc.window)
			}
		})
	}
}

// TestBusyReaderClose: a spinning read ends with an error when the
// connection is closed under it, within the window.
func TestBusyReaderClose(t *testing.T) {
	client, server := tcpPair(t)
	var window atomic.Int64
	window.Store(int64(time.Second))
	r := newBusyReader(server, &window)
	if _, err := client.Write([]byte("x")); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 8)
	if n, err := r.Read(buf); n != 1 || err != nil {
		t.Fatalf("first read: %d, %v", n, err)
	}
	done := make(chan error, 1)
	go func() { _, err := r.Read(buf); done <- err }()
	time.Sleep(10 * time.Millisecond) // spinning now
	start := time.Now()
	r.Close()
	select {
	case err := <-done:
		if !errors.Is(err, net.ErrClosed) {
			t.Fatalf("read after close: %v, want net.ErrClosed", err)
		}
		if d := time.Since(start); d > 500*time.Millisecond {
			t.Fatalf("the read ended %v after Close, not at once", d)
		}
	case <-time.After(3 * time.Second):
		t.Fatal("a spinning read outlived its connection")
	}
}

// TestBusyPollMesh runs a round trip between two hosts of a mesh with busy
// polling on both.
func TestBusyPollMesh(t *testing.T) {
	c, hosts := meshStream(t, echo)
	defer c.Close()
	msg := bytes.Repeat([]byte("meshnode"), 4096)
	for i := range 20 {
		if i == 1 {
			for _, h := range hosts {
				h.SetBusyPoll(20 * time.Millisecond)
			}
		}
		if _, err := c.Write(msg); err != nil {
			t.Fatal(err)
		}
		got := make([]byte, len(msg))
		if _, err := io.ReadFull(c, got); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(got, msg) {
			t.Fatalf("round trip %d changed the message", i)
		}
		time.Sleep(time.Duration(i%3) * time.Millisecond)
	}
}

func tcpPair(t *testing.T) (client, server net.Conn) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	accepted := make(chan net.Conn, 1)
	go func() {
		c, _ := ln.Accept()
		accepted <- c
	}()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	client, err = (&net.Dialer{}).DialContext(ctx, "tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	server = <-accepted
	if server == nil {
		t.Fatal("accept failed")
	}
	t.Cleanup(func() { client.Close(); server.Close() })
	return client, server
}
