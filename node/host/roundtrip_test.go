package host

import (
	"context"
	"fmt"
	"io"
	"net"
	"slices"
	"testing"
	"time"
)

// BenchmarkRoundTrip measures a request/reply of a given size over a
// libp2p stream between two hosts on loopback (PSK, security, yamux), with
// plain loopback TCP as the reference: a pipeline hop pays this per step.
func BenchmarkRoundTrip(b *testing.B) {
	for _, size := range []int{64, 4 << 10, 16 << 10, 64 << 10} {
		b.Run(fmt.Sprintf("tcp/%dB", size), func(b *testing.B) {
			c := tcpStream(b, echo)
			defer c.Close()
			pingPong(b, c, size)
		})
		b.Run(fmt.Sprintf("libp2p/%dB", size), func(b *testing.B) {
			c := benchStream(b, echo)
			defer c.Close()
			pingPong(b, c, size)
		})
	}
}

// BenchmarkRoundTripAfterPause is BenchmarkRoundTrip with a pause before
// each round trip, as a decode step leaves between two hops, so that the
// threads that serve the connection go to sleep: plain TCP, libp2p, and
// libp2p with busy polling (see busypoll.go). It reports the median round
// trip; the pauses are not timed.
func BenchmarkRoundTripAfterPause(b *testing.B) {
	const size = 16 << 10
	for _, pause := range []time.Duration{0, 2 * time.Millisecond} {
		for _, tc := range []struct {
			name string
			busy time.Duration
		}{{"tcp", 0}, {"libp2p", 0}, {"libp2p-busy", 25 * time.Millisecond}} {
			b.Run(fmt.Sprintf("%s/pause=%v", tc.name, pause), func(b *testing.B) {
				var c net.Conn
				if tc.name == "tcp" {
					c = tcpStream(b, echo)
				} else {
					var hosts []*Host
					c, hosts = meshStream(b, echo)
					for _, h := range hosts {
						h.SetBusyPoll(tc.busy)
					}
				}
				defer c.Close()
				buf := make([]byte, size)
				rtts := make([]time.Duration, 0, b.N)
				b.ResetTimer()
				for range b.N {
					b.StopTimer()
					time.Sleep(pause)
					b.StartTimer()
					start := time.Now()
					if _, err := c.Write(buf); err != nil {
						b.Fatal(err)
					}
					if _, err := io.ReadFull(c, buf); err != nil {
						b.Fatal(err)
					}
					rtts = append(rtts, time.Since(start))
				}
				slices.Sort(rtts)
				b.ReportMetric(float64(rtts[len(rtts)/2].Microseconds()), "µs-median")
			})
		}
	}
}

// BenchmarkOneWay is the throughput of one libp2p stream on loopback, as a
// prefill's activations would use it.
func BenchmarkOneWay(b *testing.B) {
	c := benchStream(b, discard)
	defer c.Close()
	buf := make([]byte, 1<<20)
	b.SetBytes(int64(len(buf)))
	for range b.N {
		if _, err := c.Write(buf); err != nil {
			b.Fatal(err)
		}
	}
}

// tcpStream connects over plain loopback TCP to a server (echo or
// discard): the reference for the libp2p streams.
func tcpStream(b testing.TB, serve func(net.Listener)) net.Conn {
	b.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { ln.Close() })
	go serve(ln)
	c, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		b.Fatal(err)
	}
	return c
}

// benchStream connects two hosts of one mesh on loopback and opens a
// stream to a server (echo or discard) on the second.
func benchStream(b *testing.B, serve func(net.Listener)) net.Conn {
	c, _ := meshStream(b, serve)
	return c
}

// meshStream is benchStream for any test, returning the two hosts too.
func meshStream(b testing.TB, serve func(net.Listener)) (net.Conn, []*Host) {
	b.Helper()
	key, err := GenerateMeshKey()
	if err != nil {
		b.Fatal(err)
	}
	hosts := make([]*Host, 2)
	for i := range hosts {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		hosts[i], err = New(ctx, Config{DataDir: b.TempDir(), Listen: []string{"/ip4/127.0.0.1/tcp/0"}, MeshKey: key})
		cancel()
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { hosts[i].Close() })
	}
	ln := hosts[1].Listen("/meshnode/bench/1")
	b.Cleanup(func() { ln.Close() })
	go serve(ln)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := hosts[0].Connect(ctx, hosts[1].Addrs()[0].String()); err != nil {
		b.Fatal(err)
	}
	c, err := hosts[0].Dial(ctx, hosts[1].ID(), "/meshnode/bench/1")
	if err != nil {
		b.Fatal(err)
	}
	return c, hosts
}

// serveEach accepts connections on ln until it closes, handling each.
func serveEach(ln net.Listener, handle func(net.Conn)) {
	for {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		go func() {
			defer c.Close()
			handle(c)
		}()
	}
}

// BenchmarkHop measures one hop of a pipeline step of several rows: a
// message of 16 KiB (one row of an 8B model's hidden state in f32), 128 KiB
// (8 rows) or 512 KiB (32 rows) sent whole, then a 1-byte reply, over
// plain loopback TCP and over a libp2p stream. Each size reports the
// libp2p stream's time as a multiple of TCP's, measured in the same run
// (the "×tcp" metric on the libp2p case). (BenchmarkRoundTrip echoes the
// message back, which at these sizes fills both ends' windows at once.)
func BenchmarkHop(b *testing.B) {
	for _, size := range []int{16 << 10, 128 << 10, 512 << 10} {
		var tcp float64
		for _, kind := range []string{"tcp", "libp2p"} {
			b.Run(fmt.Sprintf("%s/%dKiB", kind, size>>10), func(b *testing.B) {
				var c net.Conn
				if kind == "tcp" {
					c = tcpStream(b, acker(size))
				} else {
					c, _ = meshStream(b, acker(size))
				}
				defer c.Close()
				buf := make([]byte, size)
				b.SetBytes(int64(size))
				b.ResetTimer()
				start := time.Now()
				for range b.N {
					if _, err := c.Write(buf); err != nil {
						b.Fatal(err)
					}
					if _, err := io.ReadFull(c, buf[:1]); err != nil {
						b.Fatal(err)
					}
				}
				per := float64(time.Since(start)) / float64(b.N)
				if kind == "tcp" {
					tcp = per
				} else if tcp > 0 {
					b.ReportMetric(per/tcp, "×tcp")
				}
			})
		}
	}
}

// acker reads messages of size bytes and answers each with one byte.
func acker(size int) func(net.Listener) {
	return func(ln net.Listener) {
		serveEach(ln, func(c net.Conn) {
			buf := make([]byte, size)
			for {
				if _, err := io.ReadFull(c, buf); err != nil {
					return
				}
				if _, err := c.Write(buf[:1]); err != nil {
					return
				}
			}
		})
	}
}

func echo(ln net.Listener) { serveEach(ln, func(c net.Conn) { io.Copy(c, c) }) }

func discard(ln net.Listener) { serveEach(ln, func(c net.Conn) { io.Copy(io.Discard, c) }) }

func pingPong(b *testing.B, c net.Conn, size int) {
	buf := make([]byte, size)
	b.SetBytes(int64(size))
	b.ResetTimer()
	for range b.N {
		if _, err := c.Write(buf); err != nil {
			b.Fatal(err)
		}
		if _, err := io.ReadFull(c, buf); err != nil {
			b.Fatal(err)
		}
	}
}
