package ggufstage

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sync"
	"time"

	"github.com/meshnode/meshnode/ggufstage/gguf"
)

// Progress reports long work: what is being done, bytes done and total.
type Progress func(what string, done, total uint64)

// Slice makes sure a GGUF holding only layers [start,end) of src exists in
// dataDir and returns its path. The slice is named by the source's content
// hash and the range, so a restart reuses it and a changed source never
// does. When the range is the whole model, src itself is returned: a copy
// would only cost disk.
func Slice(src, dataDir string, start, end int, progress Progress) (string, error) {
	meta, err := readHeader(src)
	if err != nil {
		return "", err
	}
	if err := checkArch(meta.Arch()); err != nil {
		return "", fmt.Errorf("slicing %s: %w", src, err)
	}
	parts, err := gguf.StageParts(meta, start, end)
	if err != nil {
		return "", fmt.Errorf("slicing %s: %w", src, err)
	}
	layers, _ := meta.BlockCount()
	// A slice that could not be loaded is refused here, where the source
	// is at hand, rather than where the slice is opened (maybe on a peer).
	if err := checkTensors(meta, start, end, layers); err != nil {
		return "", fmt.Errorf("slicing %s: %w", src, err)
	}
	if start == 0 && end == layers {
		return src, nil
	}
	sum, err := ContentHash(src, dataDir, progress)
	if err != nil {
		return "", err
	}
	dir := filepath.Join(dataDir, "slices")
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return "", fmt.Errorf("creating slice dir: %w", err)
	}
	path := filepath.Join(dir, fmt.Sprintf("%s-%d-%d.gguf", sum[:16], start, end))
	if ok, _ := sliceIntact(path, sum, start, end); ok {
		return path, nil
	}

	in, err := os.Open(src)
	if err != nil {
		return "", fmt.Errorf("opening %s: %w", src, err)
	}
	defer in.Close()
	tmp, err := os.CreateTemp(dir, ".slice-*")
	if err != nil {
		return "", fmt.Errorf("creating slice: %w", err)
	}
	defer os.Remove(tmp.Name())
	what := fmt.Sprintf("slicing layers [%d,%d)", start, end)
	var pf func(done, total uint64)
	if progress != nil {
		pf = func(done, total uint64) { progress(what, done, total) }
	}
	if err := gguf.WriteSlice(tmp, meta, in, parts, start, end, sum, pf); err != nil {
		tmp.Close()
		return "", fmt.Errorf("writing slice of %s: %w", src, err)
	}
	if err := tmp.Close(); err != nil {
		return "", fmt.Errorf("writing slice: %w", err)
	}
	if err := os.Rename(tmp.Name(), path); err != nil {
		return "", fmt.Errorf("placing slice: %w", err)
	}
	return path, nil
}

// sliceIntact checks that an existing slice is complete and is of the right
// source and range (a crash mid-write leaves only a temp file, but a disk
// can still truncate).
func sliceIntact(path, sum string, start, end int) (bool, error) {
	m, err := readHeader(path)
	if err != nil {
		return false, err
	}
	s, _ := m.Get(gguf.KeySliceStart)
	e, _ := m.Get(gguf.KeySliceEnd)
	return m.String(gguf.KeySliceSource) == sum && s.V == uint32(start) && e.V == uint32(end), nil
}

var hashMu sync.Mutex

type hashEntry struct {
	Size    int64     `json:"size"`
	ModTime time.Time `json:"mtime"`
	SHA256  string    `json:"sha256"`
}

// ContentHash is the SHA-256 of a file, remembered in dataDir by path, size
// and modification time so that a multi-gigabyte model is hashed once.
func ContentHash(path, dataDir string, progress Progress) (string, error) {
	hashMu.Lock()
	defer hashMu.Unlock()
	abs, err := filepath.Abs(path)
	if err != nil {
		return "", err
	}
	st, err := os.Stat(abs)
	if err != nil {
		return "", fmt.Errorf("hashing %s: %w", path, err)
	}
	idx := filepath.Join(dataDir, "hashes.json")
	known := map[string]hashEntry{}
	if b, err := os.ReadFile(idx); err == nil {
		_ = json.Unmarshal(b, &known) // a damaged index only costs a rehash
	}
	if h, ok := known[abs]; ok && h.Size == st.Size() && h.ModTime.Equal(st.ModTime()) && len(h.SHA256) == 64 {
		return h.SHA256, nil
	}
	f, err := os.Open(abs)
	if err != nil {
		return "", fmt.Errorf("hashing %s: %w", path, err)
	}
	defer f.Close()
	h := sha256.New()
	var r io.Reader = f
	if progress != nil {
		r = &progressReader{r: f, total: uint64(st.Size()), fn: func(d, t uint64) { progress("hashing "+filepath.Base(path), d, t) }}
	}
	if _, err := io.Copy(h, r); err != nil {
		return "", fmt.Errorf("hashing %s: %w", path, err)
	}
	sum := hex.EncodeToString(h.Sum(nil))
	known[abs] = hashEntry{Size: st.Size(), ModTime: st.ModTime(), SHA256: sum}
	if err := os.MkdirAll(dataDir, 0o700); err == nil {
		if b, err := json.MarshalIndent(known, "", "  "); err == nil {
			_ = os.WriteFile(idx, b, 0o600) // best effort: the hash is still right
		}
	}
	return sum, nil
}

type progressReader struct {
	r     io.Reader
	done  uint64
	total uint64
	fn    func(done, total uint64)
}

func (p *progressReader) Read(b []byte) (int, error) {
	n, err := p.r.Read(b)
	p.done += uint64(n)
	p.fn(p.done, p.total)
	return n, err
}
