package node_test

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/meshnode/meshnode/node"
)

// fakeHub answers like the Hugging Face Hub's resolve URLs for one file:
// commit and ETag headers, HEAD, and byte ranges. It counts bytes served.
func fakeHub(t *testing.T, repo, file string, data []byte) (*httptest.Server, *atomic.Int64) {
	sum := sha256.Sum256(data)
	etag := `"` + hex.EncodeToString(sum[:]) + `"`
	const commit = "0123456789abcdef0123456789abcdef01234567"
	var served atomic.Int64
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ok := false
		for _, rev := range []string{"main", commit} {
			if r.URL.Path == "/"+repo+"/resolve/"+rev+"/"+file {
				ok = true
			}
		}
		if !ok {
			http.NotFound(w, r)
			return
		}
		w.Header().Set("X-Repo-Commit", commit)
		w.Header().Set("ETag", etag)
		cw := &countingWriter{ResponseWriter: w, n: &served}
		http.ServeContent(cw, r, file, time.Time{}, bytes.NewReader(data))
	}))
	t.Cleanup(srv.Close)
	return srv, &served
}

type countingWriter struct {
	http.ResponseWriter
	n *atomic.Int64
}

func (c *countingWriter) Write(b []byte) (int, error) {
	c.n.Add(int64(len(b)))
	return c.ResponseWriter.Write(b)
}

// TestHFModelSplitMesh serves a model that lives only on a (fake) Hugging
// Face hub, split over two nodes in one process: each node fetches just its
// layers' bytes from the hub, and a request through the joiner gives the
// single-node greedy text.
func TestHFModelSplitMesh(t *testing.T) {
	data, err := os.ReadFile(modelPath)
	if err != nil {
		t.Fatal(err)
	}
	hub, served := fakeHub(t, "ggml-org/models", "tinyllamas/stories260K.gguf", data)
	t.Setenv("HF_ENDPOINT", hub.URL)

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	joinCmd := make(chan string, 1)
	ready := make(chan string, 2)
	done := make(chan error, 2)
	base := node.Config{
		HTTPAddr: "127.0.0.1:0", Threads: 1, Context: 256, Parallel: 2,
		Listen: []string{"/ip4/127.0.0.1/tcp/0"}, GossipPort: -1,
	}
	a := base
	a.Model, a.Split, a.DataDir = "hf://ggml-org/models/tinyllamas/stories260K.gguf", true, t.TempDir()
	a.JoinCommand = func(cmd string) { joinCmd <- cmd }
	a.Ready = func(string) {}
	go func() { done <- node.Run(ctx, a) }()

	var cmd string
	select {
	case cmd = <-joinCmd:
	case err := <-done:
		t.Fatalf("first node: %v", err)
	case <-time.After(30 * time.Second):
		t.Fatal("no join command")
	}
	f := strings.Fields(cmd) // meshnode join ADDR --mesh-key KEY
	b := base
	b.DataDir, b.Join, b.MeshKey = t.TempDir(), []string{f[2]}, f[4]
	b.Ready = func(addr string) { ready <- addr }
	go func() { done <- node.Run(ctx, b) }()

	var addr string
	select {
	case addr = <-ready:
	case err := <-done:
		t.Fatalf("joiner: %v", err)
	case <-time.After(60 * time.Second):
		t.Fatal("joiner never ready")
	}
	// Wait for the split: two stages, one per node.
	var st node.Status
	deadline := time.Now().Add(30 * time.Second)
	for {
		resp, err := http.Get("http://" + addr + "/api/status")
		if err == nil {
			json.NewDecoder(resp.Body).Decode(&st)
			resp.Body.Close()
		}
		if len(st.Plan) == 2 && st.Ready {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("no 2-stage plan: %+v", st.Plan)
		}
		time.Sleep(200 * time.Millisecond)
	}
	// The first node served the whole model alone before the joiner came
	// (so it fetched every layer once), then its share of the split; the
	// joiner fetched its share. Headers are read in 256 KiB pieces, twice
	// per node (to learn the model, to slice it).
	if limit := int64(2*len(data)) + 2*2*256<<10; served.Load() > limit {
		t.Errorf("the hub served %d bytes for a %d-byte model split in two (limit %d)", served.Load(), len(data), limit)
	}
	if st.Local == nil || st.Local.Fetched == 0 || st.Local.Fetched >= uint64(len(data)) {
		t.Errorf("joiner fetched %+v of a %d-byte model", st.Local, len(data))
	}

	body := `{"model":"stories260K","prompt":"Once upon a time","max_tokens":24,"temperature":0}`
	var got string
	for try := 0; ; try++ {
		resp, err := http.Post("http://"+addr+"/v1/completions", "application/json", strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		var out struct {
			Choices []struct{ Text string } `json:"choices"`
		}
		json.NewDecoder(resp.Body).Decode(&out)
		resp.Body.Close()
		if resp.StatusCode == 200 && len(out.Choices) == 1 {
			got = out.Choices[0].Text
			break
		}
		if try > 20 {
			t.Fatalf("completion: status %d", resp.StatusCode)
		}
		time.Sleep(250 * time.Millisecond)
	}
	want := ref.completion(t, "Once upon a time", 24).text
	if got != want {
		t.Fatalf("split over the hub's bytes:\n got %q\nwant %q", got, want)
	}
	cancel()
	for range 2 {
		if err := <-done; err != nil {
			t.Errorf("node.Run: %v", err)
		}
	}
	t.Logf("hub served %d bytes for a %d-byte model", served.Load(), len(data))
}
