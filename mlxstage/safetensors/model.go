package safetensors

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
)

// IndexName is the file that maps tensor names to shards in a model split
// over several files.
const IndexName = "model.safetensors.index.json"

// SingleName is the weights file of an unsharded model.
const SingleName = "model.safetensors"

// maxSideFile bounds the JSON files read whole (index, config, tokenizer):
// the largest tokenizer.json files are around 20 MB.
const maxSideFile = 64 << 20

// Source is one file of a model, read by byte ranges: a local file, or a
// remote one (node/weights' HTTP and peer sources have this method set).
type Source interface {
	io.ReaderAt
	Size() int64
}

// Opener opens a model file by its name in the model's directory ("config.json",
// "model-00001-of-00002.safetensors"). It returns an error wrapping
// fs.ErrNotExist for a file the model does not have. A Source that is also
// an io.Closer is closed with the Model.
type Opener func(name string) (Source, error)

// localFile is an *os.File with the Size method Source needs.
type localFile struct {
	*os.File
	size int64
}

func (l localFile) Size() int64 { return l.size }

// Dir opens the files of a local model directory.
func Dir(dir string) Opener {
	return func(name string) (Source, error) {
		if !ValidName(name) {
			return nil, fmt.Errorf("model file name %q: %w", name, fs.ErrInvalid)
		}
		f, err := os.Open(filepath.Join(dir, filepath.FromSlash(name)))
		if err != nil {
			return nil, err
		}
		st, err := f.Stat()
		if err != nil {
			f.Close()
			return nil, err
		}
		if st.IsDir() {
			f.Close()
			return nil, fmt.Errorf("%s is a directory", f.Name())
		}
		return localFile{f, st.Size()}, nil
	}
}

// ValidName reports whether name can be a file of a model directory: a
// relative path that stays inside it. Shard names come from the index, which
// is untrusted.
func ValidName(name string) bool {
	return name != "" && fs.ValidPath(name) && !strings.Contains(name, `\`) && path.Clean(name) == name
}

// ReadFile reads a small side file (config.json, tokenizer.json) whole.
func ReadFile(open Opener, name string) ([]byte, error) {
	src, err := open(name)
	if err != nil {
		return nil, err
	}
	if c, ok := src.(io.Closer); ok {
		defer c.Close()
	}
	if src.Size() > maxSideFile {
		return nil, fmt.Errorf("%s is %d bytes, over the %d limit", name, src.Size(), maxSideFile)
	}
	return readAll(src, src.Size(), name)
}

// readAll reads the n bytes of r; io.ReaderAt may report io.EOF with a full
// read, which is success.
func readAll(r io.ReaderAt, n int64, name string) ([]byte, error) {
	b := make([]byte, n)
	got, err := r.ReadAt(b, 0)
	if int64(got) == n {
		return b, nil
	}
	if err == nil || errors.Is(err, io.EOF) {
		err = io.ErrUnexpectedEOF
	}
	return nil, fmt.Errorf("reading %s: %w", name, err)
}

// Index is model.safetensors.index.json.
type Index struct {
	Metadata  map[string]any    `json:"metadata"`
	WeightMap map[string]string `json:"weight_map"` // tensor name -> shard file
}

// ParseIndex decodes and checks an index: every shard name must be a plain
// file name inside the model directory.
func ParseIndex(data []byte) (*Index, error) {
	var ix Index
	if err := json.Unmarshal(data, &ix); err != nil {
		return nil, fmt.Errorf("%w: %s: %w", ErrFormat, IndexName, err)
	}
	if len(ix.WeightMap) == 0 {
		return nil, fmt.Errorf("%w: %s has no weight_map", ErrFormat, IndexName)
	}
	for name, file := range ix.WeightMap {
		if !ValidName(file) {
			return nil, fmt.Errorf("%w: %s maps %q to the file %q, which is not inside the model directory", ErrFormat, IndexName, name, file)
		}
	}
	return &ix, nil
}

// Stats counts the bytes a Model read from its sources.
type Stats struct {
	IndexBytes  int64 // the index file
	HeaderBytes int64 // shard headers (length prefix and JSON)
	TensorBytes int64 // tensor data
	Shards      int   // shards whose header was read
}

// Total is every byte read.
func (s Stats) Total() int64 { return s.IndexBytes + s.HeaderBytes + s.TensorBytes }

// Model is the weights of a model, in one file or sharded with an index. It
// opens a shard, and reads its header, only when a tensor in it is first
// asked for, so that a stage touches only the shards and bytes its own
// tensors are in. It is safe for concurrent use.
type Model struct {
	open  Opener
	index *Index // nil for a single file

	mu     sync.Mutex
	shards map[string]*shard

	indexBytes, headerBytes, tensorBytes atomic.Int64
}

type shard struct {
	src  Source
	file *File
}

// countingReader counts what is read through it.
type countingReader struct {
	r io.ReaderAt
	n *atomic.Int64
}

func (c countingReader) ReadAt(p []byte, off int64) (int, error) {
	n, err := c.r.ReadAt(p, off)
	c.n.Add(int64(n))
	return n, err
}

// OpenModel opens the weights of a model: through its index if it has one,
// else its single model.safetensors. Only the index is read here.
func OpenModel(open Opener) (*Model, error) {
	m := &Model{open: open, shards: map[string]*shard{}}
	src, err := open(IndexName)
	switch {
	case err == nil:
		if c, ok := src.(io.Closer); ok {
			defer c.Close()
		}
		if src.Size() > maxSideFile {
			return nil, fmt.Errorf("%w: %s is %d bytes", ErrFormat, IndexName, src.Size())
		}
		b, err := readAll(countingReader{src, &m.indexBytes}, src.Size(), IndexName)
		if err != nil {
			return nil, err
		}
		if m.index, err = ParseIndex(b); err != nil {
			return nil, err
		}
	case errors.Is(err, fs.ErrNotExist):
		// A single-file model; its header is read on first use.
	default:
		return nil, fmt.Errorf("opening %s: %w", IndexName, err)
	}
	return m, nil
}

// Sharded reports whether the model has an index.
func (m *Model) Sharded() bool { return m.index != nil }

// fileOf names the shard that holds a tensor.
func (m *Model) fileOf(name string) (string, bool) {
	if m.index == nil {
		return SingleName, true
	}
	f, ok := m.index.WeightMap[name]
	return f, ok
}

// shard opens a shard and reads its header, once.
func (m *Model) shard(file string) (*shard, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if s, ok := m.shards[file]; ok {
		return s, nil
	}
	src, err := m.open(file)
	if err != nil {
		return nil, fmt.Errorf("opening %s: %w", file, err)
	}
	f, err := Read(countingReader{src, &m.headerBytes}, src.Size())
	if err != nil {
		if c, ok := src.(io.Closer); ok {
			c.Close()
		}
		return nil, fmt.Errorf("reading %s: %w", file, err)
	}
	s := &shard{src: src, file: f}
	m.shards[file] = s
	return s, nil
}

// Names lists every tensor of the model, sorted. For a sharded model it
// comes from the index alone; a single file's header is read.
func (m *Model) Names() ([]string, error) {
	var names []string
	if m.index != nil {
		for n := range m.index.WeightMap {
			names = append(names, n)
		}
	} else {
		s, err := m.shard(SingleName)
		if err != nil {
			return nil, err
		}
		for i := range s.file.Tensors {
			names = append(names, s.file.Tensors[i].Name)
		}
	}
	slices.Sort(names)
	return names, nil
}

// Has reports whether the model has a tensor, from the index when there is
// one (reading no shard).
func (m *Model) Has(name string) (bool, error) {
	if m.index != nil {
		_, ok := m.index.WeightMap[name]
		return ok, nil
	}
	s, err := m.shard(SingleName)
	if err != nil {
		return false, err
	}
	_, ok := s.file.Tensor(name)
	return ok, nil
}

// ErrNoTensor is wrapped when a tensor is not in the model.
var ErrNoTensor = errors.New("no such tensor")

// Locate returns the shard file and header entry of a tensor, reading the
// shard's header if it was not read yet.
func (m *Model) Locate(name string) (string, Tensor, error) {
	file, ok := m.fileOf(name)
	if !ok {
		return "", Tensor{}, fmt.Errorf("%w: %s is not in %s", ErrNoTensor, name, IndexName)
	}
	s, err := m.shard(file)
	if err != nil {
		return "", Tensor{}, err
	}
	t, ok := s.file.Tensor(name)
	if !ok {
		if m.index != nil {
			return "", Tensor{}, fmt.Errorf("%w: %s maps %s to %s, which does not have it", ErrFormat, IndexName, name, file)
		}
		return "", Tensor{}, fmt.Errorf("%w: %s is not in %s", ErrNoTensor, name, file)
	}
	return file, *t, nil
}

// ReadTensor reads one tensor's bytes, and no others, into dst (grown as
// needed).
func (m *Model) ReadTensor(name string, dst []byte) ([]byte, Tensor, error) {
	file, t, err := m.Locate(name)
	if err != nil {
		return nil, t, err
	}
	s, err := m.shard(file)
	if err != nil {
		return nil, t, err
	}
	b, err := ReadTensor(countingReader{s.src, &m.tensorBytes}, &t, dst)
	if err != nil {
		return nil, t, fmt.Errorf("%s: %w", file, err)
	}
	return b, t, nil
}

// Stats reports the bytes read so far.
func (m *Model) Stats() Stats {
	m.mu.Lock()
	n := len(m.shards)
	m.mu.Unlock()
	return Stats{
		IndexBytes: m.indexBytes.Load(), HeaderBytes: m.headerBytes.Load(),
		TensorBytes: m.tensorBytes.Load(), Shards: n,
	}
}

// Close closes every shard opened.
func (m *Model) Close() error {
	m.mu.Lock()
	defer m.mu.Unlock()
	var errs []error
	for _, s := range m.shards {
		if c, ok := s.src.(io.Closer); ok {
			errs = append(errs, c.Close())
		}
	}
	m.shards = map[string]*shard{}
	return errors.Join(errs...)
}
