package weights

import (
	"context"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
)

// TestDefaultModelDownload serves the real stories260K bytes from a local
// server that answers like the hub's resolve URL, and checks that the
// default model is fetched once, verified and then reused.
func TestDefaultModelDownload(t *testing.T) {
	data, err := os.ReadFile("../../../shared/models/stories260K.gguf")
	if err != nil {
		t.Fatal(err)
	}
	var hits atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/ggml-org/models/resolve/main/tinyllamas/stories260K.gguf" {
			http.NotFound(w, r)
			return
		}
		if r.Header.Get("Authorization") != "Bearer secret" {
			http.Error(w, "no token", http.StatusUnauthorized)
			return
		}
		hits.Add(1)
		w.Write(data)
	}))
	defer srv.Close()
	t.Setenv("HF_ENDPOINT", srv.URL)
	t.Setenv("HF_TOKEN", "secret")
	t.Setenv("MESHNODE_MODELS", t.TempDir())
	t.Chdir(t.TempDir()) // no ../shared/models here

	cache := t.TempDir()
	var sawProgress bool
	for range 2 {
		p, err := DefaultModel(context.Background(), cache, func(string, uint64, uint64) { sawProgress = true })
		if err != nil {
			t.Fatal(err)
		}
		if !strings.HasPrefix(p, cache) {
			t.Fatalf("model at %s, want under %s", p, cache)
		}
	}
	if hits.Load() != 1 || !sawProgress {
		t.Fatalf("downloaded %d times (progress %v), want once", hits.Load(), sawProgress)
	}

	// A corrupted download is refused and leaves nothing behind.
	data[100] ^= 0xff
	cache2 := t.TempDir()
	if _, err := DefaultModel(context.Background(), cache2, nil); err == nil || !strings.Contains(err.Error(), "SHA-256") {
		t.Fatalf("corrupt download: %v", err)
	}
	if entries, _ := os.ReadDir(filepath.Join(cache2, "models")); len(entries) != 0 {
		t.Fatalf("left %d files", len(entries))
	}
}

func TestDefaultModelPrefersLocal(t *testing.T) {
	t.Setenv("HF_ENDPOINT", "http://127.0.0.1:1") // would fail if used
	t.Chdir("../..")                              // the repo root, beside ../shared
	p, err := DefaultModel(context.Background(), t.TempDir(), nil)
	if err != nil {
		t.Fatal(err)
	}
	if filepath.Base(p) != DefaultModelName {
		t.Fatal(p)
	}
}
