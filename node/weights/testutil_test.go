package weights

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/meshnode/meshnode/ggufstage/gguf"
)

const storiesPath = "../../../shared/models/stories260K.gguf"

func readStories(t *testing.T) []byte {
	t.Helper()
	b, err := os.ReadFile(storiesPath)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func sha256Hex(b []byte) string {
	s := sha256.Sum256(b)
	return hex.EncodeToString(s[:])
}

func parseGGUF(t *testing.T, data []byte) *gguf.File {
	t.Helper()
	f, err := gguf.Read(bytes.NewReader(data), int64(len(data)))
	if err != nil {
		t.Fatal(err)
	}
	return f
}

// localSlice is what gguf.WriteSlice makes from a local copy: the
// reference every fetched slice must equal.
func localSlice(t *testing.T, data []byte, start, end int, id string) []byte {
	t.Helper()
	f := parseGGUF(t, data)
	parts, err := gguf.StageParts(f, start, end)
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(t.TempDir(), "local.gguf")
	out, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	if err := gguf.WriteSlice(out, f, bytes.NewReader(data), parts, start, end, id, nil); err != nil {
		t.Fatal(err)
	}
	out.Close()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// partsSize is the tensor bytes of a stage.
func partsSize(t *testing.T, data []byte, start, end int) uint64 {
	t.Helper()
	parts, err := gguf.StageParts(parseGGUF(t, data), start, end)
	if err != nil {
		t.Fatal(err)
	}
	return gguf.PartsSize(parts)
}

func sameFile(t *testing.T, path string, want []byte) {
	t.Helper()
	got, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, want) {
		i := 0
		for i < min(len(got), len(want)) && got[i] == want[i] {
			i++
		}
		t.Fatalf("%s differs from the local slice at byte %d (sizes %d, %d)", path, i, len(got), len(want))
	}
}

var (
	synthOnce  sync.Once
	synthModel []byte
	synthTied  []byte
)

// synth returns an 8-layer llama-shaped GGUF of ~45 MB with random tensor
// data and a ~600 KB header (a 30k-token vocabulary), so that the header
// needs more than one read and byte counts mean something. The tied
// variant has no output.weight.
func synth(t *testing.T, tied bool) []byte {
	t.Helper()
	synthOnce.Do(func() {
		synthModel = makeSynth(8, false, 1)
		synthTied = makeSynth(8, true, 2)
	})
	if tied {
		return synthTied
	}
	return synthModel
}

func makeSynth(layers int, tied bool, seed uint64) []byte {
	const dim, ff, vocab = 512, 1024, 2000
	toks := make([]string, 30000)
	scores := make([]float32, len(toks))
	for i := range toks {
		toks[i] = fmt.Sprintf("tok%05d", i)
		scores[i] = float32(i)
	}
	kvs := []gguf.KV{
		{Key: "general.architecture", Value: gguf.Value{Type: gguf.TypeString, V: "llama"}},
		{Key: "general.name", Value: gguf.Value{Type: gguf.TypeString, V: fmt.Sprintf("synth-%d", seed)}},
		{Key: "llama.block_count", Value: gguf.Value{Type: gguf.TypeUint32, V: uint32(layers)}},
		{Key: "llama.embedding_length", Value: gguf.Value{Type: gguf.TypeUint32, V: uint32(dim)}},
		{Key: "tokenizer.ggml.tokens", Value: gguf.Value{Type: gguf.TypeArray, ElemType: gguf.TypeString, V: toks}},
		{Key: "tokenizer.ggml.scores", Value: gguf.Value{Type: gguf.TypeArray, ElemType: gguf.TypeFloat32, V: scores}},
	}
	f16 := func(name string, shape ...uint64) gguf.TensorInfo {
		return gguf.TensorInfo{Name: name, Shape: shape, Type: gguf.TypeF16}
	}
	f32 := func(name string, shape ...uint64) gguf.TensorInfo {
		return gguf.TensorInfo{Name: name, Shape: shape, Type: gguf.TypeF32}
	}
	ts := []gguf.TensorInfo{f16("token_embd.weight", dim, vocab), f32("rope_freqs.weight", 32)}
	for b := range layers {
		p := fmt.Sprintf("blk.%d.", b)
		ts = append(ts,
			f32(p+"attn_norm.weight", dim),
			f16(p+"attn_q.weight", dim, dim), f16(p+"attn_k.weight", dim, dim),
			f16(p+"attn_v.weight", dim, dim), f16(p+"attn_output.weight", dim, dim),
			f32(p+"ffn_norm.weight", dim),
			f16(p+"ffn_gate.weight", dim, ff), f16(p+"ffn_up.weight", dim, ff), f16(p+"ffn_down.weight", ff, dim))
	}
	ts = append(ts, f32("output_norm.weight", dim))
	if !tied {
		ts = append(ts, f16("output.weight", dim, vocab))
	}
	var hdr bytes.Buffer
	dataOff, err := gguf.Write(&hdr, kvs, ts, 32)
	if err != nil {
		panic(err)
	}
	last := ts[len(ts)-1]
	data := make([]byte, alignUp(dataOff+last.Offset+last.Size(), 32))
	copy(data, hdr.Bytes())
	rng := rand.NewChaCha8([32]byte{byte(seed)})
	for _, t := range ts {
		off := dataOff + t.Offset
		rng.Read(data[off : off+t.Size()])
	}
	return data
}

// fakeHub answers like the Hub's resolve URLs: /ORG/REPO/resolve/REV/FILE
// answers 302 to /cdn/COMMIT/FILE with the pinning headers, on a second
// server (another host) unless sameHost. The CDN serves HEAD and single
// ranges, and can fail on purpose.
type fakeHub struct {
	repo, file string
	token      string // required by the hub when set

	mu          sync.Mutex
	data        []byte
	sum         string // sha256Hex(data), kept: hashing on every request is slow
	commit      string
	commits     map[string]bool // every commit served, old ones included
	next        []byte          // content that replaces data ...
	changeAfter int             // ... once the CDN has answered this many requests
	cdnReqs     int
	failNext    int   // CDN answers 503 to this many requests
	dropAt      int64 // CDN aborts connections once it has sent this many body bytes in all (0: never)
	dropOnce    bool  // stop dropping after the first abort
	noRange     bool  // CDN ignores Range
	hubPaths    []string

	sent     atomic.Int64 // body bytes the CDN sent
	cdnAuth  atomic.Int32 // CDN requests that carried Authorization
	cdnTotal atomic.Int32

	hub, cdn *httptest.Server
}

func newFakeHub(t *testing.T, data []byte, sameHost bool) *fakeHub {
	h := &fakeHub{repo: "org/models", file: "sub/model.gguf", data: data, commits: map[string]bool{}}
	h.sum = sha256Hex(data)
	h.commit = h.sum[:40]
	h.commits[h.commit] = true
	h.hub = httptest.NewServer(http.HandlerFunc(h.serveHub))
	t.Cleanup(h.hub.Close)
	if sameHost {
		h.cdn = h.hub
	} else {
		h.cdn = httptest.NewServer(http.HandlerFunc(h.serveCDN))
		t.Cleanup(h.cdn.Close)
	}
	return h
}

func (h *fakeHub) ref() HFRef { return HFRef{Repo: h.repo, File: h.file, Revision: "main"} }

func (h *fakeHub) opts() HFOptions {
	return HFOptions{Endpoint: h.hub.URL, RetryBackoff: time.Millisecond, Retries: 3}
}

func (h *fakeHub) serveHub(w http.ResponseWriter, r *http.Request) {
	if strings.HasPrefix(r.URL.Path, "/cdn/") && h.cdn == h.hub {
		h.serveCDN(w, r)
		return
	}
	rest, ok := strings.CutPrefix(r.URL.EscapedPath(), "/"+h.repo+"/resolve/")
	if !ok {
		// The Hub hides whether a repository exists from those who may
		// not see it.
		w.Header().Set("X-Error-Code", "RepoNotFound")
		http.Error(w, "Repository not found", http.StatusUnauthorized)
		return
	}
	if h.token != "" && r.Header.Get("Authorization") != "Bearer "+h.token {
		w.Header().Set("X-Error-Code", "GatedRepo")
		http.Error(w, "Access to this repository is restricted", http.StatusUnauthorized)
		return
	}
	revEsc, file, _ := strings.Cut(rest, "/")
	rev, _ := url.PathUnescape(revEsc)
	file, _ = url.PathUnescape(file)
	h.mu.Lock()
	defer h.mu.Unlock()
	h.hubPaths = append(h.hubPaths, r.Method+" "+rev)
	if file != h.file {
		w.Header().Set("X-Error-Code", "EntryNotFound")
		w.Header().Set("X-Error-Message", "Entry not found")
		http.Error(w, "Entry not found", http.StatusNotFound)
		return
	}
	if rev != "main" && !h.commits[rev] {
		w.Header().Set("X-Error-Code", "RevisionNotFound")
		http.Error(w, "Revision not found", http.StatusNotFound)
		return
	}
	w.Header().Set("X-Repo-Commit", h.commit)
	w.Header().Set("X-Linked-Etag", `"`+h.sum+`"`)
	w.Header().Set("X-Linked-Size", strconv.Itoa(len(h.data)))
	w.Header().Set("ETag", `W/"hub-`+h.commit[:8]+`"`)
	w.Header().Set("Location", h.cdn.URL+"/cdn/"+h.commit+"/"+h.file+"?sig=abc")
	w.WriteHeader(http.StatusFound)
}

func (h *fakeHub) serveCDN(w http.ResponseWriter, r *http.Request) {
	h.cdnTotal.Add(1)
	if r.Header.Get("Authorization") != "" {
		h.cdnAuth.Add(1)
	}
	h.mu.Lock()
	h.cdnReqs++
	if h.next != nil && h.cdnReqs > h.changeAfter {
		h.data, h.next = h.next, nil
		h.sum = sha256Hex(h.data)
		h.commit = h.sum[:40]
		h.commits[h.commit] = true
	}
	data, sum, fail, noRange := h.data, h.sum, h.failNext > 0, h.noRange
	if fail {
		h.failNext--
	}
	h.mu.Unlock()
	if fail {
		http.Error(w, "try again", http.StatusServiceUnavailable)
		return
	}
	w.Header().Set("ETag", `"`+sum+`"`)
	w.Header().Set("Accept-Ranges", "bytes")
	body := data
	status := http.StatusOK
	if rng := r.Header.Get("Range"); rng != "" && !noRange {
		var a, b int64
		if _, err := fmt.Sscanf(rng, "bytes=%d-%d", &a, &b); err != nil || a < 0 || b < a || b >= int64(len(data)) {
			w.Header().Set("Content-Range", fmt.Sprintf("bytes */%d", len(data)))
			http.Error(w, "bad range", http.StatusRequestedRangeNotSatisfiable)
			return
		}
		body = data[a : b+1]
		status = http.StatusPartialContent
		w.Header().Set("Content-Range", fmt.Sprintf("bytes %d-%d/%d", a, b, len(data)))
	}
	w.Header().Set("Content-Length", strconv.Itoa(len(body)))
	w.WriteHeader(status)
	if r.Method == http.MethodHead {
		return
	}
	h.mu.Lock()
	dropAt := h.dropAt
	h.mu.Unlock()
	if dropAt > 0 {
		allowed := max(dropAt-h.sent.Load(), 0)
		if allowed < int64(len(body)) {
			n, _ := w.Write(body[:allowed])
			h.sent.Add(int64(n))
			w.(http.Flusher).Flush()
			h.mu.Lock()
			if h.dropOnce {
				h.dropAt = 0
			}
			h.mu.Unlock()
			panic(http.ErrAbortHandler) // the connection is cut mid-body
		}
	}
	n, _ := w.Write(body)
	h.sent.Add(int64(n))
}

func (h *fakeHub) set(fn func(h *fakeHub)) {
	h.mu.Lock()
	defer h.mu.Unlock()
	fn(h)
}
