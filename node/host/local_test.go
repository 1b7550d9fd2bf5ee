//go:build unix

package host

import (
	"context"
	"errors"
	"io"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/libp2p/go-libp2p/core/peer"
)

// acceptOne waits for the listener's next connection, or none within d.
func acceptOne(l *LocalListener, d time.Duration) (net.Conn, error) {
	got := make(chan net.Conn, 1)
	go func() {
		c, err := l.Accept()
		if err == nil {
			got <- c
		}
	}()
	select {
	case c := <-got:
		return c, nil
	case <-time.After(d):
		return nil, errors.New("nothing accepted")
	}
}

// TestLocalConnections checks who gets a local connection: a node with the
// mesh key that expects the right node, and no one else.
func TestLocalConnections(t *testing.T) {
	t.Setenv("TMPDIR", t.TempDir())
	key := mustMeshKey(t)
	server := newTestHost(t, key, nil, nil)
	l, err := server.ListenLocal()
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	if fi, err := os.Stat(l.Path()); err != nil || fi.Mode()&os.ModeSocket == 0 || fi.Mode().Perm() != 0o600 {
		t.Fatalf("socket %s: %v, %v", l.Path(), fi, err)
	}
	if fi, err := os.Stat(filepath.Dir(l.Path())); err != nil || fi.Mode().Perm() != 0o700 {
		t.Fatalf("socket directory: %v, %v", fi, err)
	}

	t.Run("member", func(t *testing.T) {
		client := newTestHost(t, key, nil, nil)
		c, err := client.DialLocal(t.Context(), l.Path(), server.ID())
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		s, err := acceptOne(l, 5*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		defer s.Close()
		if got := s.RemoteAddr().String(); got != client.ID().String() {
			t.Fatalf("the server sees %s, want %s", got, client.ID())
		}
		if got := c.RemoteAddr().String(); got != server.ID().String() {
			t.Fatalf("the client sees %s, want %s", got, server.ID())
		}
		for _, dir := range []struct{ from, to net.Conn }{{c, s}, {s, c}} {
			if _, err := dir.from.Write([]byte("hello")); err != nil {
				t.Fatal(err)
			}
			buf := make([]byte, 5)
			if _, err := io.ReadFull(dir.to, buf); err != nil || string(buf) != "hello" {
				t.Fatalf("read %q, %v", buf, err)
			}
		}
	})

	refused := []struct {
		name  string
		key   MeshKey
		want  func() peer.ID // the node the client expects at the socket
		errIs error
	}{
		{name: "wrong mesh key", key: mustMeshKey(t), want: server.ID, errIs: ErrLocalAuth},
		{name: "another node expected", key: key, want: func() peer.ID { return newTestHost(t, key, nil, nil).ID() }, errIs: ErrLocalAuth},
	}
	for _, tt := range refused {
		t.Run(tt.name, func(t *testing.T) {
			client := newTestHost(t, tt.key, nil, nil)
			c, err := client.DialLocal(t.Context(), l.Path(), tt.want())
			if err == nil {
				c.Close()
				t.Fatal("connected")
			}
			if !errors.Is(err, tt.errIs) {
				t.Fatalf("error %v, want %v", err, tt.errIs)
			}
			if c, err := acceptOne(l, 300*time.Millisecond); err == nil {
				c.Close()
				t.Fatal("the server accepted the connection")
			}
		})
	}

	t.Run("not in the allowlist", func(t *testing.T) {
		strict := newTestHost(t, key, nil, func(c *Config) { c.Allow = func(peer.ID) bool { return false } })
		sl, err := strict.ListenLocal()
		if err != nil {
			t.Fatal(err)
		}
		defer sl.Close()
		c, err := newTestHost(t, key, nil, nil).DialLocal(t.Context(), sl.Path(), strict.ID())
		if err == nil {
			c.Close()
			t.Fatal("connected")
		}
		if !strings.Contains(err.Error(), "refused this peer") {
			t.Fatalf("error %v", err)
		}
		if c, err := acceptOne(sl, 300*time.Millisecond); err == nil {
			c.Close()
			t.Fatal("the server accepted the connection")
		}
	})

	t.Run("garbage", func(t *testing.T) {
		for _, junk := range []string{"", "GET / HTTP/1.1\r\n\r\n", "MNL1" + strings.Repeat("x", 32) + "\x05abc"} {
			raw, err := net.Dial("unix", l.Path())
			if err != nil {
				t.Fatal(err)
			}
			_, _ = raw.Write([]byte(junk))
			raw.(*net.UnixConn).CloseWrite()
			if c, err := acceptOne(l, 300*time.Millisecond); err == nil {
				c.Close()
				t.Fatalf("accepted after %q", junk)
			}
			raw.Close()
		}
	})

	t.Run("a second listener of the same node", func(t *testing.T) {
		if l2, err := server.ListenLocal(); err == nil || !strings.Contains(err.Error(), "is running") {
			if l2 != nil {
				l2.Close()
			}
			t.Fatalf("ListenLocal again: %v", err)
		}
	})

	t.Run("cancel", func(t *testing.T) {
		// A socket that never answers: dialing it ends with the context.
		path := filepath.Join(t.TempDir(), "mute.sock")
		mute, err := net.Listen("unix", path)
		if err != nil {
			t.Fatal(err)
		}
		defer mute.Close()
		ctx, cancel := context.WithTimeout(t.Context(), 200*time.Millisecond)
		defer cancel()
		start := time.Now()
		if _, err := newTestHost(t, key, nil, nil).DialLocal(ctx, path, server.ID()); err == nil || !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("DialLocal: %v", err)
		}
		if time.Since(start) > 3*time.Second {
			t.Fatal("the dial outlived its context")
		}
	})

	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(l.Path()); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("the socket outlived its listener: %v", err)
	}
	if _, err := l.Accept(); !errors.Is(err, net.ErrClosed) {
		t.Fatalf("Accept after Close: %v", err)
	}
}

// TestLocalDirectoryChecked: a socket directory other users could enter is
// refused, not used.
func TestLocalDirectoryChecked(t *testing.T) {
	tmp := t.TempDir()
	t.Setenv("TMPDIR", tmp)
	dir := filepath.Join(tmp, "meshnode-"+strconv.Itoa(os.Getuid()))
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	h := newTestHost(t, mustMeshKey(t), nil, nil)
	if l, err := h.ListenLocal(); err == nil || !strings.Contains(err.Error(), "open to other users") {
		if l != nil {
			l.Close()
		}
		t.Fatalf("ListenLocal: %v", err)
	}
}

// TestLocalStaleSocket: a socket left behind by a node of this identity
// that died is replaced, not an error.
func TestLocalStaleSocket(t *testing.T) {
	t.Setenv("TMPDIR", t.TempDir())
	h := newTestHost(t, mustMeshKey(t), nil, nil)
	l, err := h.ListenLocal()
	if err != nil {
		t.Fatal(err)
	}
	path := l.Path()
	l.Close()
	// What a killed process leaves: the file, with nobody listening.
	stale, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	stale.SetUnlinkOnClose(false)
	stale.Close()
	if _, err := os.Stat(path); err != nil {
		t.Fatalf("no stale socket to test with: %v", err)
	}
	l, err = h.ListenLocal()
	if err != nil {
		t.Fatalf("ListenLocal over a stale socket: %v", err)
	}
	defer l.Close()
	c, err := newTestHost(t, h.key, nil, nil).DialLocal(t.Context(), l.Path(), h.ID())
	if err != nil {
		t.Fatal(err)
	}
	c.Close()
}
