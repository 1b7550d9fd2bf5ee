package weights

import (
	"context"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/meshnode/meshnode/ggufstage/gguf"
)

// headerBound is the most the header reads may fetch: the first chunk, or
// up to twice the header when it has to grow.
func headerBound(t *testing.T, data []byte) uint64 {
	return max(uint64(headerChunk), 2*parseGGUF(t, data).DataOffset)
}

func testCtx(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// TestFetchSliceStoriesHF fetches the three stages of stories260K from a
// fake hub and checks each is byte-identical to the slice cut locally, and
// that only the stage's tensors and the header were downloaded.
func TestFetchSliceStoriesHF(t *testing.T) {
	data := readStories(t)
	h := newFakeHub(t, data, false)
	ctx := testCtx(t)
	dir := t.TempDir()
	for _, r := range [][2]int{{0, 2}, {2, 4}, {4, 5}} {
		src, err := OpenHF(ctx, h.ref(), h.opts())
		if err != nil {
			t.Fatal(err)
		}
		var last, total uint64
		res, err := FetchSliceWith(ctx, src, dir, r[0], r[1], FetchOptions{Progress: func(what string, d, n uint64) {
			if !strings.Contains(what, "layers") {
				t.Errorf("progress says %q", what)
			}
			last, total = d, n
		}})
		if err != nil {
			t.Fatal(err)
		}
		if filepath.Base(res.Path) != DefaultModelSHA256[:16]+"-"+string(rune('0'+r[0]))+"-"+string(rune('0'+r[1]))+".gguf" {
			t.Errorf("slice named %s; want the name ggufstage.Slice gives", res.Path)
		}
		sameFile(t, res.Path, localSlice(t, data, r[0], r[1], DefaultModelSHA256))
		need := partsSize(t, data, r[0], r[1])
		if last != need || total != need {
			t.Errorf("progress ended at %d/%d, want %d", last, total, need)
		}
		got := src.Stats().BytesFetched
		if bound := need + headerBound(t, data); got > bound {
			t.Errorf("[%d,%d): fetched %d bytes, more than the %d of its tensors and header", r[0], r[1], got, bound)
		}
		if res.Fetched != got {
			t.Errorf("result says %d bytes, source counted %d", res.Fetched, got)
		}
		t.Logf("[%d,%d): fetched %d of %d bytes (tensors %d)", r[0], r[1], got, len(data), need)

		// A second fetch finds the slice and reads nothing.
		res2, err := FetchSliceWith(ctx, src, dir, r[0], r[1], FetchOptions{})
		if err != nil || !res2.Reused || res2.Path != res.Path || src.Stats().BytesFetched != got {
			t.Fatalf("refetch: %+v %v, fetched %d", res2, err, src.Stats().BytesFetched-got)
		}
	}
	if n := h.cdnAuth.Load(); n != 0 {
		t.Errorf("token sent to the CDN %d times", n)
	}
}

// TestFetchSliceSynthHF does the same on a 45 MB model with a header that
// takes several reads, where the byte counts tell a slice from the whole.
func TestFetchSliceSynthHF(t *testing.T) {
	data := synth(t, false)
	h := newFakeHub(t, data, false)
	ctx := testCtx(t)
	dir := t.TempDir()
	id := sha256Hex(data)
	for _, r := range [][2]int{{0, 3}, {3, 6}, {6, 8}} {
		src, err := OpenHF(ctx, h.ref(), h.opts())
		if err != nil {
			t.Fatal(err)
		}
		path, err := FetchSlice(ctx, src, dir, r[0], r[1], nil)
		if err != nil {
			t.Fatal(err)
		}
		sameFile(t, path, localSlice(t, data, r[0], r[1], id))
		need := partsSize(t, data, r[0], r[1])
		got := src.Stats().BytesFetched
		if got < need || got > need+headerBound(t, data) {
			t.Errorf("[%d,%d): fetched %d bytes, want between %d and %d", r[0], r[1], got, need, need+headerBound(t, data))
		}
		if got > uint64(len(data))/2 {
			t.Errorf("[%d,%d): fetched %d of the file's %d bytes", r[0], r[1], got, len(data))
		}
	}
}

// interrupted runs a fetch that is cancelled once half the stage's bytes
// are in, and returns the source it used.
func interrupted(t *testing.T, h *fakeHub, dir string, start, end int, opts FetchOptions) *HFSource {
	t.Helper()
	ctx, cancel := context.WithCancel(testCtx(t))
	defer cancel()
	src, err := OpenHF(ctx, h.ref(), h.opts())
	if err != nil {
		t.Fatal(err)
	}
	opts.Progress = func(_ string, d, n uint64) {
		if d >= n/2 {
			cancel()
		}
	}
	_, err = FetchSliceWith(ctx, src, dir, start, end, opts)
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("interrupted fetch: %v", err)
	}
	name := filepath.Join(dir, SliceName(src.ID(), start, end))
	if _, err := os.Stat(name); err == nil {
		t.Fatal("an interrupted fetch left a slice in place")
	}
	for _, ext := range []string{".part", ".journal"} {
		if _, err := os.Stat(name + ext); err != nil {
			t.Fatalf("no %s to resume from: %v", ext, err)
		}
	}
	return src
}

// TestFetchResumeAfterCancel: a fetch cancelled midway resumes without
// fetching again what it had, and ends byte-identical.
func TestFetchResumeAfterCancel(t *testing.T) {
	data := synth(t, false)
	h := newFakeHub(t, data, false)
	dir := t.TempDir()
	const chunk = 256 << 10
	opts := FetchOptions{Concurrency: 2, ChunkSize: chunk}
	first := interrupted(t, h, dir, 2, 6, opts)

	ctx := testCtx(t)
	src, err := OpenHF(ctx, h.ref(), h.opts())
	if err != nil {
		t.Fatal(err)
	}
	res, err := FetchSliceWith(ctx, src, dir, 2, 6, opts)
	if err != nil {
		t.Fatal(err)
	}
	sameFile(t, res.Path, localSlice(t, data, 2, 6, src.ID()))
	need := partsSize(t, data, 2, 6)
	total := first.Stats().BytesFetched + src.Stats().BytesFetched
	// Two headers, and at most one chunk per worker lost in flight.
	if bound := need + 2*headerBound(t, data) + 2*chunk; total > bound {
		t.Errorf("both attempts fetched %d bytes, want at most %d (the slice's tensors are %d)", total, bound, need)
	}
	if res.Resumed < need/2-2*chunk {
		t.Errorf("resumed %d bytes, want about half of %d", res.Resumed, need)
	}
	for _, ext := range []string{".part", ".journal", ".journal.tmp"} {
		if _, err := os.Stat(res.Path + ext); err == nil {
			t.Errorf("%s left behind", ext)
		}
	}
	t.Logf("first attempt %d bytes, second %d (resumed %d), tensors %d", first.Stats().BytesFetched, src.Stats().BytesFetched, res.Resumed, need)
}

// TestFetchResumeAfterServerDrops: the server cuts every connection past
// some point; the fetch gives up after bounded retries and a later fetch
// resumes.
func TestFetchResumeAfterServerDrops(t *testing.T) {
	data := synth(t, true)
	h := newFakeHub(t, data, false)
	dir := t.TempDir()
	ctx := testCtx(t)
	need := partsSize(t, data, 5, 8)
	h.set(func(h *fakeHub) { h.dropAt = int64(need / 2) })
	src1, err := OpenHF(ctx, h.ref(), h.opts())
	if err != nil {
		t.Fatal(err)
	}
	const chunk = 512 << 10
	opts := FetchOptions{Concurrency: 3, ChunkSize: chunk}
	if _, err := FetchSliceWith(ctx, src1, dir, 5, 8, opts); err == nil || errors.Is(err, context.Canceled) {
		t.Fatalf("fetch from a failing server: %v", err)
	}
	h.set(func(h *fakeHub) { h.dropAt = 0 })
	src2, err := OpenHF(ctx, h.ref(), h.opts())
	if err != nil {
		t.Fatal(err)
	}
	res, err := FetchSliceWith(ctx, src2, dir, 5, 8, opts)
	if err != nil {
		t.Fatal(err)
	}
	// The last stage of a tied model stores the embedding as its head.
	sl := parseGGUF(t, localSlice(t, data, 5, 8, src2.ID()))
	if _, ok := sl.Tensor("output.weight"); !ok {
		t.Fatal("the tied head is missing from the reference slice")
	}
	sameFile(t, res.Path, localSlice(t, data, 5, 8, src2.ID()))
	total := src1.Stats().BytesFetched + src2.Stats().BytesFetched
	if bound := need + 2*headerBound(t, data) + 3*chunk; total > bound {
		t.Errorf("both attempts fetched %d bytes, want at most %d", total, bound)
	}
	if res.Resumed == 0 {
		t.Error("nothing resumed")
	}
}

// TestFetchJournalReverified: a tensor the journal calls done but whose
// bytes on disk were damaged is fetched again, not trusted.
func TestFetchJournalReverified(t *testing.T) {
	data := synth(t, false)
	h := newFakeHub(t, data, false)
	dir := t.TempDir()
	opts := FetchOptions{Concurrency: 1, ChunkSize: 1 << 20}
	first := interrupted(t, h, dir, 0, 3, opts)
	name := filepath.Join(dir, SliceName(first.ID(), 0, 3))

	b, err := os.ReadFile(name + ".journal")
	if err != nil {
		t.Fatal(err)
	}
	var j journal
	if err := json.Unmarshal(b, &j); err != nil || len(j.Done) == 0 {
		t.Fatalf("journal %s: %v", b, err)
	}
	part, err := os.ReadFile(name + ".part")
	if err != nil {
		t.Fatal(err)
	}
	pf := parseGGUF(t, part)
	var victim *gguf.TensorInfo
	for n := range j.Done {
		victim, _ = pf.Tensor(n)
		break
	}
	off, _ := pf.Range(victim)
	part[off+7] ^= 0x40
	if err := os.WriteFile(name+".part", part, 0o600); err != nil {
		t.Fatal(err)
	}

	ctx := testCtx(t)
	src, err := OpenHF(ctx, h.ref(), h.opts())
	if err != nil {
		t.Fatal(err)
	}
	res, err := FetchSliceWith(ctx, src, dir, 0, 3, opts)
	if err != nil {
		t.Fatal(err)
	}
	sameFile(t, res.Path, localSlice(t, data, 0, 3, src.ID()))
	if res.Fetched < victim.Size() {
		t.Errorf("fetched %d bytes; the damaged %s (%d bytes) was not fetched again", res.Fetched, victim.Name, victim.Size())
	}
}

// TestFetchSourceChanged: the file changes on the server mid-download; the
// fetch fails clearly and leaves nothing that could be mistaken for the
// slice. The new version then fetches under its own name.
func TestFetchSourceChanged(t *testing.T) {
	data := synth(t, false)
	changed := append([]byte(nil), data...)
	changed[len(changed)-100] ^= 1 // in output.weight
	h := newFakeHub(t, data, false)
	h.set(func(h *fakeHub) { h.next = changed; h.changeAfter = 5 })
	dir := t.TempDir()
	ctx := testCtx(t)
	src, err := OpenHF(ctx, h.ref(), h.opts())
	if err != nil {
		t.Fatal(err)
	}
	_, err = FetchSliceWith(ctx, src, dir, 4, 8, FetchOptions{Concurrency: 1, ChunkSize: 256 << 10})
	if !errors.Is(err, ErrSourceChanged) || !strings.Contains(err.Error(), "changed") {
		t.Fatalf("fetch across a change: %v", err)
	}
	if entries, _ := os.ReadDir(dir); len(entries) != 0 {
		t.Fatalf("left %d files (%s ...)", len(entries), entries[0].Name())
	}

	src2, err := OpenHF(ctx, h.ref(), h.opts())
	if err != nil {
		t.Fatal(err)
	}
	if src2.ID() == src.ID() {
		t.Fatal("the changed file kept its ID")
	}
	path, err := FetchSlice(ctx, src2, dir, 4, 8, nil)
	if err != nil {
		t.Fatal(err)
	}
	sameFile(t, path, localSlice(t, changed, 4, 8, src2.ID()))
}

func TestFetchSliceBadRange(t *testing.T) {
	data := readStories(t)
	h := newFakeHub(t, data, false)
	ctx := testCtx(t)
	src, err := OpenHF(ctx, h.ref(), h.opts())
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range [][2]int{{3, 3}, {4, 6}, {-1, 2}} {
		if _, err := FetchSlice(ctx, src, t.TempDir(), r[0], r[1], nil); err == nil || !strings.Contains(err.Error(), "not inside") {
			t.Errorf("[%d,%d): %v", r[0], r[1], err)
		}
	}
	// Not a GGUF at all: the header reader says so.
	h2 := newFakeHub(t, make([]byte, 4096), false)
	src2, err := OpenHF(ctx, h2.ref(), h2.opts())
	if err != nil {
		t.Fatal(err)
	}
	if _, err := FetchSlice(ctx, src2, t.TempDir(), 0, 1, nil); !errors.Is(err, gguf.ErrFormat) {
		t.Errorf("non-GGUF: %v", err)
	}
}
