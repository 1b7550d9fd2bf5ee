package weights

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"hash"
	"io"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"

	"github.com/meshnode/meshnode/ggufstage/gguf"
)

// FetchOptions tune FetchSliceWith. Zero values take the defaults.
type FetchOptions struct {
	Progress Progress

	// Concurrency is how many tensors are fetched at once; default 4.
	// Parallel range requests are what make a CDN or a far peer fast.
	Concurrency int

	// ChunkSize is the bytes of one read, and how far a tensor gets between
	// journal checkpoints; default 16 MiB.
	ChunkSize int

	// TensorHashes are the SHA-256 of each tensor's bytes, by name in the
	// source file, from a source the caller trusts (another peer, a signed
	// manifest). When nil, a source that implements TensorHasher is asked.
	TensorHashes map[string][32]byte
}

// FetchResult tells what FetchSliceWith did.
type FetchResult struct {
	Path    string
	Fetched uint64 // bytes read from the source by this call: header and tensors
	Resumed uint64 // tensor bytes kept from an earlier, interrupted call
	Reused  bool   // the slice was already complete; nothing was read
}

// Defaults of FetchOptions; headerChunk is the first read of the header,
// which grows by doubling when the header is longer.
const (
	defaultConcurrency = 4
	defaultChunk       = 16 << 20
	headerChunk        = 256 << 10
	maxHeader          = 256 << 20
)

// SliceName is the file name of the slice of layers [start,end) of the
// file with content id. For an id that is a hex SHA-256 (a peer's file id,
// the Hub's ETag of an LFS file) it is the name ggufstage.Slice gives a
// slice cut from a local copy, so all three are interchangeable.
func SliceName(id string, start, end int) string {
	p := id
	if len(p) < 16 || !isHex(p) {
		sum := sha256.Sum256([]byte(id))
		p = hex.EncodeToString(sum[:])
	}
	return fmt.Sprintf("%s-%d-%d.gguf", p[:16], start, end)
}

// FetchSlice makes sure the slice of layers [start,end) of src exists in
// dstDir and returns its path; see FetchSliceWith.
func FetchSlice(ctx context.Context, src RangeSource, dstDir string, start, end int, progress Progress) (string, error) {
	res, err := FetchSliceWith(ctx, src, dstDir, start, end, FetchOptions{Progress: progress})
	return res.Path, err
}

// FetchSliceWith writes the GGUF holding layers [start,end) of src into
// dstDir, reading only the header and the stage's tensors from src. The
// result is byte-identical to gguf.WriteSlice's from a local copy, with
// src.ID() as the source hash.
//
// The download goes to a .part file beside a journal of the tensors done
// and a SHA-256 of each; an interrupted fetch resumes where it stopped
// (within a tensor, at the last chunk checkpointed), after rehashing what
// the journal claims so that a torn write is fetched again rather than
// trusted. The slice is put in place only when complete. When per-tensor
// hashes are known (FetchOptions.TensorHashes, or a TensorHasher source),
// each tensor must match its hash.
//
// A range that covers the whole model is fetched like any other (every
// tensor, plus the slice keys); ggufstage.Slice instead returns a local
// file itself. Since the journal is keyed by src.ID(), a fetch begun from
// one source resumes from another with the same ID (a peer and an LFS file
// on the Hub share it). Fetches of one slice in one process are
// serialised; two processes must not fetch the same slice into one
// directory at once.
func FetchSliceWith(ctx context.Context, src RangeSource, dstDir string, start, end int, opts FetchOptions) (FetchResult, error) {
	id := src.ID()
	if id == "" {
		return FetchResult{}, errors.New("source has no content id")
	}
	if err := os.MkdirAll(dstDir, 0o700); err != nil {
		return FetchResult{}, fmt.Errorf("creating %s: %w", dstDir, err)
	}
	path := filepath.Join(dstDir, SliceName(id, start, end))
	defer lockPath(path)()
	if sliceComplete(path, id, start, end) {
		return FetchResult{Path: path, Reused: true}, nil
	}
	fs := &fetch{ctx: ctx, src: src, path: path, opts: opts, size: src.Size()}
	if fs.opts.Concurrency <= 0 {
		fs.opts.Concurrency = defaultConcurrency
	}
	if fs.opts.ChunkSize <= 0 {
		fs.opts.ChunkSize = defaultChunk
	}
	err := fs.run(id, start, end)
	res := FetchResult{Fetched: fs.fetched.Load(), Resumed: fs.resumed}
	if err != nil {
		if errors.Is(err, ErrSourceChanged) {
			// What was fetched belongs to a version that no longer exists:
			// keeping it would only invite mixing.
			os.Remove(path + ".part")
			os.Remove(path + ".journal")
		}
		return res, fmt.Errorf("fetching layers [%d,%d) from %s: %w", start, end, describe(src), err)
	}
	res.Path = path
	return res, nil
}

var pathLocks sync.Map // slice path → *sync.Mutex

func lockPath(p string) (unlock func()) {
	m, _ := pathLocks.LoadOrStore(p, &sync.Mutex{})
	mu := m.(*sync.Mutex)
	mu.Lock()
	return mu.Unlock
}

// sliceComplete checks that an existing slice is of the right source and
// range and not truncated (the header reader checks every tensor lies
// inside the file).
func sliceComplete(path, id string, start, end int) bool {
	fh, err := os.Open(path)
	if err != nil {
		return false
	}
	defer fh.Close()
	st, err := fh.Stat()
	if err != nil {
		return false
	}
	m, err := gguf.Read(fh, st.Size())
	if err != nil {
		return false
	}
	s, _ := m.Get(gguf.KeySliceStart)
	e, _ := m.Get(gguf.KeySliceEnd)
	return m.String(gguf.KeySliceSource) == id && s.V == uint32(start) && e.V == uint32(end)
}

// journal records a fetch's progress next to its .part file.
type journal struct {
	Version int    `json:"version"`
	Source  string `json:"source"`
	Start   int    `json:"start"`
	End     int    `json:"end"`
	// Header is the SHA-256 of the slice's header: equal headers mean an
	// equal layout, so the tensors' places in the .part are the same.
	Header  string                `json:"header_sha256"`
	Done    map[string]string     `json:"done"`              // slice tensor name → SHA-256 of its bytes
	Partial map[string]partTensor `json:"partial,omitempty"` // tensors begun
}

// partTensor is a tensor's first Bytes bytes, with their SHA-256.
type partTensor struct {
	Bytes  uint64 `json:"bytes"`
	SHA256 string `json:"sha256"`
}

const journalVersion = 1

type fetch struct {
	ctx  context.Context
	src  RangeSource
	path string
	opts FetchOptions
	size int64

	f       *gguf.File
	parts   []gguf.Part
	infos   []gguf.TensorInfo // the slice's tensor table, with offsets
	dataOff uint64
	prefix  []byte // the file's first bytes, read for the header
	hashes  map[string][32]byte
	hashSrc string // where hashes came from, for messages
	total   uint64 // tensor bytes of the stage
	out     *os.File
	what    string

	fetched atomic.Uint64
	resumed uint64

	mu   sync.Mutex // guards j, done and progress calls
	j    *journal
	done uint64
}

func (fs *fetch) run(id string, start, end int) error {
	if err := fs.readHeader(); err != nil {
		return err
	}
	parts, err := gguf.StageParts(fs.f, start, end)
	if err != nil {
		return err
	}
	fs.parts = parts
	header, err := fs.layout(id, start, end)
	if err != nil {
		return err
	}
	fs.total = gguf.PartsSize(parts)
	fs.hashes, fs.hashSrc = fs.opts.TensorHashes, "the caller"
	if th, ok := fs.src.(TensorHasher); ok && fs.hashes == nil {
		if fs.hashes, err = th.TensorHashes(fs.ctx); err != nil {
			return err
		}
		fs.hashSrc = describe(fs.src)
	}
	fs.what = fmt.Sprintf("fetching layers [%d,%d) from %s", start, end, describe(fs.src))

	hsum := sha256.Sum256(header)
	want := journal{Version: journalVersion, Source: id, Start: start, End: end, Header: hex.EncodeToString(hsum[:])}
	fs.j = fs.loadJournal(want)
	fresh := fs.j == nil
	if fresh {
		fs.j = &want
		fs.j.Done = map[string]string{}
	}
	if fs.j.Partial == nil {
		fs.j.Partial = map[string]partTensor{}
	}
	if fs.out, err = os.OpenFile(fs.path+".part", os.O_RDWR|os.O_CREATE, 0o600); err != nil {
		return fmt.Errorf("opening download file: %w", err)
	}
	defer func() {
		if fs.out != nil {
			fs.out.Close()
		}
	}()
	last := fs.infos[len(fs.infos)-1]
	total := int64(alignUp(fs.dataOff+last.Offset+last.Size(), fs.f.Alignment))
	if fresh {
		// Old bytes of another layout would end up in the padding, which
		// must be zero.
		if err := fs.out.Truncate(0); err != nil {
			return fmt.Errorf("resetting download file: %w", err)
		}
	}
	if err := fs.out.Truncate(total); err != nil {
		return fmt.Errorf("sizing download file: %w", err)
	}
	if _, err := fs.out.WriteAt(header, 0); err != nil {
		return fmt.Errorf("writing slice header: %w", err)
	}
	if err := fs.saveJournal(); err != nil {
		return err
	}

	resumeFrom, err := fs.verifyJournal()
	if err != nil {
		return err
	}
	if err := fs.fetchParts(resumeFrom); err != nil {
		return err
	}

	if err := fs.out.Sync(); err != nil {
		return fmt.Errorf("syncing slice: %w", err)
	}
	if err := fs.out.Close(); err != nil {
		return fmt.Errorf("closing slice: %w", err)
	}
	fs.out = nil
	if err := os.Rename(fs.path+".part", fs.path); err != nil {
		return fmt.Errorf("placing slice: %w", err)
	}
	os.Remove(fs.path + ".journal")
	if d, err := os.Open(filepath.Dir(fs.path)); err == nil {
		_ = d.Sync() // best effort: makes the rename durable
		d.Close()
	}
	return nil
}

// readHeader parses the GGUF header from the start of the source, reading
// more as the parser asks for it.
func (fs *fetch) readHeader() error {
	pr := &prefixReader{fs: fs}
	f, err := gguf.Read(io.NewSectionReader(pr, 0, fs.size), fs.size)
	if pr.err != nil {
		// The parser reports a failed read as a malformed file; the read
		// error is the one worth seeing.
		return fmt.Errorf("reading the GGUF header: %w", pr.err)
	}
	if err != nil {
		return fmt.Errorf("reading the GGUF header: %w", err)
	}
	fs.f, fs.prefix = f, pr.buf
	return nil
}

// prefixReader serves the file's first bytes from memory, fetching more
// (at least doubling) when a read goes past them.
type prefixReader struct {
	fs  *fetch
	buf []byte
	err error
}

func (r *prefixReader) ReadAt(p []byte, off int64) (int, error) {
	size := r.fs.size
	if off >= size {
		return 0, io.EOF
	}
	need := min(off+int64(len(p)), size)
	if need > int64(len(r.buf)) {
		grow := min(max(need, 2*int64(len(r.buf)), headerChunk), size)
		if grow > maxHeader {
			r.err = fmt.Errorf("GGUF header is over %d bytes", maxHeader)
			return 0, r.err
		}
		chunk := make([]byte, grow-int64(len(r.buf)))
		if err := readFull(r.fs.ctx, r.fs.src, chunk, int64(len(r.buf))); err != nil {
			r.err = err
			return 0, err
		}
		r.fs.fetched.Add(uint64(len(chunk)))
		r.buf = append(r.buf, chunk...)
	}
	n := copy(p, r.buf[off:need])
	if n < len(p) {
		return n, io.EOF
	}
	return n, nil
}

// layout builds the slice's header and tensor table exactly as
// gguf.WriteSlice does, so that a fetched slice and one cut locally are
// the same bytes (a test holds the two together).
func (fs *fetch) layout(id string, start, end int) ([]byte, error) {
	kvs := gguf.SliceKVs(fs.f, start, end, id)
	fs.infos = make([]gguf.TensorInfo, len(fs.parts))
	for i, p := range fs.parts {
		fs.infos[i] = gguf.TensorInfo{Name: p.Name, Shape: p.Src.Shape, Type: p.Src.Type}
	}
	var hb bytes.Buffer
	off, err := gguf.Write(&hb, kvs, fs.infos, fs.f.Alignment)
	if err != nil {
		return nil, fmt.Errorf("writing slice header: %w", err)
	}
	fs.dataOff = off
	return hb.Bytes(), nil
}

func alignUp(n, a uint64) uint64 { return (n + a - 1) / a * a }

func (fs *fetch) loadJournal(want journal) *journal {
	b, err := os.ReadFile(fs.path + ".journal")
	if err != nil {
		return nil
	}
	var j journal
	if json.Unmarshal(b, &j) != nil || j.Version != want.Version || j.Source != want.Source ||
		j.Start != want.Start || j.End != want.End || j.Header != want.Header || j.Done == nil {
		return nil
	}
	return &j
}

// saveJournal replaces the journal atomically; the caller holds fs.mu or
// runs alone.
func (fs *fetch) saveJournal() error {
	b, err := json.Marshal(fs.j)
	if err != nil {
		return err
	}
	tmp := fs.path + ".journal.tmp"
	if err := os.WriteFile(tmp, b, 0o600); err != nil {
		return fmt.Errorf("writing fetch journal: %w", err)
	}
	if err := os.Rename(tmp, fs.path+".journal"); err != nil {
		return fmt.Errorf("writing fetch journal: %w", err)
	}
	return nil
}

// resume is where a tensor's fetch starts: bytes already in place and the
// hash state over them.
type resume struct {
	have uint64
	h    hash.Hash
}

// verifyJournal rehashes what the journal claims is in the .part file and
// forgets whatever does not match, so it is fetched again. It returns the
// state to resume each begun tensor from; tensors done are marked in
// fs.j.Done.
func (fs *fetch) verifyJournal() (map[int]resume, error) {
	out := map[int]resume{}
	buf := make([]byte, 1<<20)
	for i, p := range fs.parts {
		dst := int64(fs.dataOff + fs.infos[i].Offset)
		n := p.Src.Size()
		if sum, ok := fs.j.Done[p.Name]; ok {
			h := sha256.New()
			if _, err := io.CopyBuffer(h, io.NewSectionReader(fs.out, dst, int64(n)), buf); err != nil {
				return nil, fmt.Errorf("rereading download file: %w", err)
			}
			got := h.Sum(nil)
			adv, hasAdv := fs.hashes[p.Src.Name]
			if hex.EncodeToString(got) != sum || (fs.hashes != nil && (!hasAdv || !bytes.Equal(adv[:], got))) {
				delete(fs.j.Done, p.Name)
				continue
			}
			fs.resumed += n
			continue
		}
		pt, ok := fs.j.Partial[p.Name]
		if !ok {
			continue
		}
		delete(fs.j.Partial, p.Name)
		if pt.Bytes == 0 || pt.Bytes >= n {
			continue
		}
		h := sha256.New()
		if _, err := io.CopyBuffer(h, io.NewSectionReader(fs.out, dst, int64(pt.Bytes)), buf); err != nil {
			return nil, fmt.Errorf("rereading download file: %w", err)
		}
		if hex.EncodeToString(h.Sum(nil)) != pt.SHA256 {
			continue
		}
		fs.j.Partial[p.Name] = pt
		fs.resumed += pt.Bytes
		out[i] = resume{have: pt.Bytes, h: h}
	}
	fs.done = fs.resumed
	return out, fs.saveJournal()
}

// fetchParts fetches the tensors not done, Concurrency at a time; the
// first error stops the rest.
func (fs *fetch) fetchParts(resumeFrom map[int]resume) error {
	ctx, cancel := context.WithCancel(fs.ctx)
	defer cancel()
	todo := make(chan int, len(fs.parts))
	for i, p := range fs.parts {
		if _, ok := fs.j.Done[p.Name]; !ok {
			todo <- i
		}
	}
	close(todo)
	var (
		wg       sync.WaitGroup
		errOnce  sync.Once
		firstErr error
	)
	for range min(fs.opts.Concurrency, len(todo)) {
		wg.Go(func() {
			buf := make([]byte, fs.opts.ChunkSize)
			for i := range todo {
				if ctx.Err() != nil {
					return
				}
				if err := fs.fetchPart(ctx, i, resumeFrom[i], buf); err != nil {
					errOnce.Do(func() { firstErr = err; cancel() })
					return
				}
			}
		})
	}
	wg.Wait()
	if firstErr != nil {
		return firstErr
	}
	// A cancellation can stop the workers between tensors, with no error.
	return fs.ctx.Err()
}

// fetchPart fetches tensor i from r.have on, checkpointing after each chunk.
func (fs *fetch) fetchPart(ctx context.Context, i int, r resume, buf []byte) error {
	p := fs.parts[i]
	srcOff, n := fs.f.Range(&p.Src)
	dst := fs.dataOff + fs.infos[i].Offset
	have, h := r.have, r.h
	if h == nil {
		h = sha256.New()
	}
	for have < n {
		c := buf[:min(uint64(len(buf)), n-have)]
		if err := fs.read(ctx, c, int64(srcOff+have)); err != nil {
			return fmt.Errorf("tensor %q: %w", p.Src.Name, err)
		}
		if _, err := fs.out.WriteAt(c, int64(dst+have)); err != nil {
			return fmt.Errorf("writing tensor %q: %w", p.Name, err)
		}
		h.Write(c)
		have += uint64(len(c))
		fs.mu.Lock()
		fs.done += uint64(len(c))
		if fs.opts.Progress != nil {
			fs.opts.Progress(fs.what, fs.done, fs.total)
		}
		var err error
		if have < n {
			fs.j.Partial[p.Name] = partTensor{Bytes: have, SHA256: hex.EncodeToString(h.Sum(nil))}
			err = fs.saveJournal()
		}
		fs.mu.Unlock()
		if err != nil {
			return err
		}
	}
	sum := h.Sum(nil)
	fs.mu.Lock()
	defer fs.mu.Unlock()
	delete(fs.j.Partial, p.Name)
	if fs.hashes != nil {
		adv, ok := fs.hashes[p.Src.Name]
		if !ok {
			_ = fs.saveJournal()
			return fmt.Errorf("%w: no hash for tensor %q in the hashes from %s", ErrTensorHash, p.Src.Name, fs.hashSrc)
		}
		if !bytes.Equal(adv[:], sum) {
			// The journal forgets the tensor, so a retry from another
			// source fetches it again.
			_ = fs.saveJournal()
			return fmt.Errorf("%w: tensor %q from %s has SHA-256 %x, but %s gives %x", ErrTensorHash, p.Src.Name, describe(fs.src), sum, fs.hashSrc, adv)
		}
	}
	fs.j.Done[p.Name] = hex.EncodeToString(sum)
	return fs.saveJournal()
}

// read fills p from the source at off, using the bytes already read with
// the header where they reach.
func (fs *fetch) read(ctx context.Context, p []byte, off int64) error {
	if off < int64(len(fs.prefix)) {
		n := copy(p, fs.prefix[off:])
		p, off = p[n:], off+int64(n)
	}
	if len(p) == 0 {
		return nil
	}
	if err := readFull(ctx, fs.src, p, off); err != nil {
		return err
	}
	fs.fetched.Add(uint64(len(p)))
	return nil
}
