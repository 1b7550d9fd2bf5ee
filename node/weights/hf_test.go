package weights

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"
	"time"
)

func TestParseHFURL(t *testing.T) {
	tests := []struct {
		in   string
		want HFRef
		err  bool
	}{
		{in: "hf://org/repo/model.gguf", want: HFRef{"org/repo", "model.gguf", "main"}},
		{in: "hf://org/repo/dir/sub/model-Q4_K_M.gguf", want: HFRef{"org/repo", "dir/sub/model-Q4_K_M.gguf", "main"}},
		{in: "hf://org/repo/model.gguf@v1.0", want: HFRef{"org/repo", "model.gguf", "v1.0"}},
		{in: "hf://org/repo/model.gguf@0123456789abcdef0123456789abcdef01234567", want: HFRef{"org/repo", "model.gguf", "0123456789abcdef0123456789abcdef01234567"}},
		{in: "hf://org/repo/model.gguf@refs/pr/1", want: HFRef{"org/repo", "model.gguf", "refs/pr/1"}},
		{in: "https://huggingface.co/org/repo/model.gguf", err: true},
		{in: "hf://org/repo", err: true},
		{in: "hf://org/repo/", err: true},
		{in: "hf://org//model.gguf", err: true},
		{in: "hf://org/repo/../x.gguf", err: true},
		{in: "hf://org/repo/./x.gguf", err: true},
		{in: "hf://org/repo/model.gguf@", err: true},
		{in: "hf://org/repo/model.gguf@a/../b", err: true},
		{in: "hf://org/repo/model.gguf?x=1", err: true},
		{in: "hf://", err: true},
	}
	for _, tc := range tests {
		got, err := ParseHFURL(tc.in)
		if (err != nil) != tc.err {
			t.Errorf("ParseHFURL(%q) error %v, want error %v", tc.in, err, tc.err)
			continue
		}
		if !tc.err && got != tc.want {
			t.Errorf("ParseHFURL(%q) = %+v, want %+v", tc.in, got, tc.want)
		}
	}
	if s := (HFRef{"org/repo", "a/b.gguf", "main"}).String(); s != "hf://org/repo/a/b.gguf@main" {
		t.Errorf("String() = %q", s)
	}
}

// TestOpenHFPinsAndAuth checks the resolution: the token goes to the hub
// (from $HF_TOKEN), never to the CDN on another host; the commit, LFS ETag
// and size are read from the redirect; reads go to the pinned commit.
func TestOpenHFPinsAndAuth(t *testing.T) {
	data := readStories(t)
	for _, sameHost := range []bool{false, true} {
		h := newFakeHub(t, data, sameHost)
		h.token = "secret"
		t.Setenv("HF_TOKEN", "secret")
		ctx := context.Background()
		src, err := OpenHF(ctx, h.ref(), h.opts())
		if err != nil {
			t.Fatal(err)
		}
		if src.Size() != int64(len(data)) || src.Commit() != h.commit || src.ETag() != DefaultModelSHA256 {
			t.Fatalf("size %d commit %s etag %s", src.Size(), src.Commit(), src.ETag())
		}
		// The LFS ETag is the file's SHA-256, so the ID is the same as a
		// peer's file id for the same model.
		if src.ID() != DefaultModelSHA256 {
			t.Fatalf("ID %s", src.ID())
		}
		if h.cdnTotal.Load() != 0 {
			t.Fatalf("resolving touched the CDN %d times; the hub's redirect carries all it needs", h.cdnTotal.Load())
		}
		buf := make([]byte, 1000)
		if n, err := src.ReadAt(buf, 5000); err != nil || n != 1000 || !bytes.Equal(buf, data[5000:6000]) {
			t.Fatalf("ReadAt: %d %v", n, err)
		}
		// io.ReaderAt's contract at the end of the file.
		if n, err := src.ReadAt(buf, int64(len(data))-10); n != 10 || err == nil || !bytes.Equal(buf[:10], data[len(data)-10:]) {
			t.Fatalf("ReadAt at the end: %d %v", n, err)
		}
		if n, err := src.ReadAt(buf, -1); n != 0 || err == nil {
			t.Fatalf("ReadAt(-1): %d %v", n, err)
		}
		h.mu.Lock()
		paths := append([]string(nil), h.hubPaths...)
		h.mu.Unlock()
		if len(paths) < 3 || paths[0] != "HEAD main" || paths[1] != "GET "+h.commit || paths[2] != "GET "+h.commit {
			t.Fatalf("hub saw %v: want a HEAD on main, then reads pinned to %s", paths, h.commit)
		}
		if sameHost {
			if h.cdnAuth.Load() == 0 {
				t.Error("the token was not kept for a redirect to the hub's own host")
			}
		} else if n := h.cdnAuth.Load(); n != 0 {
			t.Errorf("the token was sent to another host %d times", n)
		}
		if st := src.Stats(); st.BytesFetched != 1010 {
			t.Errorf("fetched %d bytes, want 1010", st.BytesFetched)
		}
	}
}

func TestOpenHFErrors(t *testing.T) {
	data := readStories(t)
	h := newFakeHub(t, data, false)
	h.token = "secret"
	ctx := context.Background()

	t.Setenv("HF_TOKEN", "")
	_, err := OpenHF(ctx, h.ref(), h.opts())
	if !errors.Is(err, ErrUnauthorized) || !strings.Contains(err.Error(), "set HF_TOKEN?") {
		t.Fatalf("no token: %v", err)
	}
	o := h.opts()
	o.Token = "wrong"
	_, err = OpenHF(ctx, h.ref(), o)
	if !errors.Is(err, ErrUnauthorized) || !strings.Contains(err.Error(), "HF_TOKEN was sent") {
		t.Fatalf("wrong token: %v", err)
	}

	t.Setenv("HF_TOKEN", "secret")
	ref := h.ref()
	ref.File = "missing.gguf"
	_, err = OpenHF(ctx, ref, h.opts())
	if !errors.Is(err, ErrNotFound) || !strings.Contains(err.Error(), "no such file") || !strings.Contains(err.Error(), "missing.gguf") {
		t.Fatalf("missing file: %v", err)
	}
	ref = h.ref()
	ref.Revision = "v9"
	if _, err = OpenHF(ctx, ref, h.opts()); !errors.Is(err, ErrNotFound) {
		t.Fatalf("missing revision: %v", err)
	}
	ref = h.ref()
	ref.Repo = "org/other"
	if _, err = OpenHF(ctx, ref, h.opts()); !errors.Is(err, ErrUnauthorized) {
		t.Fatalf("missing repository: %v", err)
	}

	// A server that ignores Range would cost a whole download per read:
	// refused.
	h.set(func(h *fakeHub) { h.noRange = true })
	src, err := OpenHF(ctx, h.ref(), h.opts())
	if err != nil {
		t.Fatal(err)
	}
	if _, err := src.ReadAt(make([]byte, 10), 100); err == nil || !strings.Contains(err.Error(), "ignores Range") {
		t.Fatalf("no range support: %v", err)
	}
	if st := src.Stats(); st.BytesFetched > 4096 {
		t.Fatalf("read %d bytes of a full answer", st.BytesFetched)
	}
}

// TestHFRetries: 503s and a connection cut mid-body are retried from where
// they stopped; a server that keeps failing gives up after the bounded
// retries; a cancelled context stops at once.
func TestHFRetries(t *testing.T) {
	data := readStories(t)
	h := newFakeHub(t, data, false)
	ctx := context.Background()
	src, err := OpenHF(ctx, h.ref(), h.opts())
	if err != nil {
		t.Fatal(err)
	}
	h.set(func(h *fakeHub) { h.failNext = 2; h.dropAt = 30000; h.dropOnce = true })
	buf := make([]byte, 100000)
	if _, err := src.ReadAt(buf, 1000); err != nil || !bytes.Equal(buf, data[1000:101000]) {
		t.Fatalf("flaky read: %v", err)
	}
	if got := src.Stats().BytesFetched; got != 100000 {
		t.Errorf("fetched %d bytes for a 100000-byte read cut once: the retry should resume", got)
	}

	h.set(func(h *fakeHub) { h.failNext = 1000 })
	start := time.Now()
	if _, err := src.ReadAt(buf, 0); err == nil || !strings.Contains(err.Error(), "503") || !strings.Contains(err.Error(), "attempts") {
		t.Fatalf("failing server: %v", err)
	}
	if time.Since(start) > 5*time.Second {
		t.Fatal("retries are not bounded")
	}

	cctx, cancel := context.WithCancel(ctx)
	cancel()
	if _, err := src.ReadAtContext(cctx, buf, 0); !errors.Is(err, context.Canceled) {
		t.Fatalf("cancelled: %v", err)
	}
}

// TestHFStall: a server that sends part of an answer and then nothing is
// given up after the stall timeout, and retried a bounded number of times.
func TestHFStall(t *testing.T) {
	data := readStories(t)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("X-Repo-Commit", strings.Repeat("1", 40))
		w.Header().Set("ETag", `"`+strings.Repeat("2", 40)+`"`)
		if r.Method == http.MethodHead {
			w.Header().Set("Content-Length", "1185376")
			return
		}
		var a, b int
		fmt.Sscanf(r.Header.Get("Range"), "bytes=%d-%d", &a, &b)
		w.Header().Set("Content-Range", fmt.Sprintf("bytes %d-%d/1185376", a, b))
		w.Header().Set("Content-Length", strconv.Itoa(b-a+1))
		w.WriteHeader(http.StatusPartialContent)
		w.Write(data[a : a+1])
		if b > a {
			w.(http.Flusher).Flush()
			<-r.Context().Done()
		}
	}))
	defer srv.Close()
	src, err := OpenHF(testCtx(t), HFRef{Repo: "a/b", File: "c.gguf"}, HFOptions{Endpoint: srv.URL, StallTimeout: 50 * time.Millisecond, RetryBackoff: time.Millisecond, Retries: 2})
	if err != nil {
		t.Fatal(err)
	}
	if src.ID() != strings.Repeat("2", 40) || src.Size() != 1185376 {
		t.Fatalf("a file kept in git: id %s size %d", src.ID(), src.Size())
	}
	start := time.Now()
	// Each attempt delivers one byte then stalls: progress keeps it going
	// until the read is done, byte by byte.
	buf := make([]byte, 5)
	if n, err := src.ReadAt(buf, 0); err != nil || n != 5 || !bytes.Equal(buf, data[:5]) {
		t.Fatalf("trickling server: %d %v", n, err)
	}
	if got := src.Stats().BytesFetched; got != 5 {
		t.Errorf("fetched %d bytes", got)
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Fatalf("took %v", d)
	}
}
