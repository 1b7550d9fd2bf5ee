// Package safetensors reads the safetensors container that Hugging Face
// models ship their weights in: an 8-byte little-endian header length, a JSON
// header naming each tensor's dtype, shape and byte range, then the raw
// tensor bytes.
//
// Like ggufstage/gguf it trusts nothing in a file: the header length, every
// shape and every byte range are checked against the file's size before
// anything is allocated, so a truncated or hostile file is an error, never a
// panic or a huge allocation. It exists (rather than loading whole files)
// because a pipeline stage needs the byte ranges of single tensors: it reads
// the headers, then only its own layers' bytes, locally, from a peer or by
// HTTP range requests.
package safetensors

import (
	"bytes"
	"cmp"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"slices"
	"strings"

	"github.com/meshnode/meshnode/stage"
)

// ErrFormat is wrapped by every error about a malformed file.
var ErrFormat = errors.New("malformed safetensors")

// ErrDType is wrapped when a tensor's dtype cannot be converted to floats.
var ErrDType = errors.New("unsupported tensor dtype")

// DType is a tensor element type as the header spells it ("F32", "BF16").
type DType string

// The element types the format defines. Only F32, F16 and BF16 can be
// converted to floats (what models of the supported architectures store);
// the others are still sized, so that a file holding, say, an int64 buffer
// next to its weights is indexed and validated rather than refused.
const (
	F32  DType = "F32"
	F16  DType = "F16"
	BF16 DType = "BF16"
	F64  DType = "F64"
	I64  DType = "I64"
	U64  DType = "U64"
	I32  DType = "I32"
	U32  DType = "U32"
	I16  DType = "I16"
	U16  DType = "U16"
	I8   DType = "I8"
	U8   DType = "U8"
	Bool DType = "BOOL"
	F8E4 DType = "F8_E4M3"
	F8E5 DType = "F8_E5M2"
)

var dtypeSizes = map[DType]int{
	F32: 4, F16: 2, BF16: 2, F64: 8, I64: 8, U64: 8, I32: 4, U32: 4,
	I16: 2, U16: 2, I8: 1, U8: 1, Bool: 1, F8E4: 1, F8E5: 1,
}

// Size is the number of bytes of one element, 0 for an unknown dtype.
func (d DType) Size() int { return dtypeSizes[d] }

// Float reports whether ToFloat32 converts the dtype.
func (d DType) Float() bool { return d == F32 || d == F16 || d == BF16 }

// Stage is the activation dtype of the same encoding, for the float types.
func (d DType) Stage() (stage.DType, bool) {
	switch d {
	case F32:
		return stage.F32, true
	case F16:
		return stage.F16, true
	case BF16:
		return stage.BF16, true
	}
	return 0, false
}

// Tensor is one entry of the header.
type Tensor struct {
	Name   string
	DType  DType
	Shape  []int64 // outermost first, as in PyTorch: a Linear weight is [out, in]
	Offset int64   // absolute offset of the data in the file
	Length int64   // bytes of data
}

// Elements is the number of elements (1 for a scalar).
func (t *Tensor) Elements() int64 {
	n := int64(1)
	for _, d := range t.Shape {
		n *= d
	}
	return n
}

// File is a parsed safetensors header.
type File struct {
	Tensors    []Tensor          // in the order of their data in the file
	Metadata   map[string]string // the optional __metadata__ object
	HeaderSize int64             // bytes before the data: 8 + the JSON length
	Size       int64             // the file's size, as given to Read

	byName map[string]int
}

// Tensor returns the header entry of a tensor.
func (f *File) Tensor(name string) (*Tensor, bool) {
	i, ok := f.byName[name]
	if !ok {
		return nil, false
	}
	return &f.Tensors[i], true
}

// Limits bound what a header may ask for.
type Limits struct {
	MaxHeader   int64 // bytes of the JSON header
	MaxTensors  int
	MaxDims     int
	MaxElements int64 // elements of one tensor
}

// DefaultLimits fit every real model. The header bound is the one the
// reference implementation uses (100 MB); the largest real headers are a
// few MB.
var DefaultLimits = Limits{
	MaxHeader:   100_000_000,
	MaxTensors:  1 << 20,
	MaxDims:     8,
	MaxElements: 1 << 40,
}

// Read parses the header of a safetensors file of the given size, reading
// only the header's bytes from r.
func Read(r io.ReaderAt, size int64) (*File, error) {
	return ReadLimits(r, size, DefaultLimits)
}

// ReadLimits is Read with explicit limits.
func ReadLimits(r io.ReaderAt, size int64, lim Limits) (*File, error) {
	if size < 8 {
		return nil, fmt.Errorf("%w: file of %d bytes is too short for a header", ErrFormat, size)
	}
	var lenBuf [8]byte
	if _, err := r.ReadAt(lenBuf[:], 0); err != nil {
		return nil, fmt.Errorf("reading header length: %w", err)
	}
	n := binary.LittleEndian.Uint64(lenBuf[:])
	if n > uint64(lim.MaxHeader) {
		return nil, fmt.Errorf("%w: header of %d bytes is over the %d limit", ErrFormat, n, lim.MaxHeader)
	}
	if n > uint64(size-8) {
		return nil, fmt.Errorf("%w: header of %d bytes is longer than the %d-byte file: truncated, or not safetensors?", ErrFormat, n, size)
	}
	if n < 2 {
		return nil, fmt.Errorf("%w: header of %d bytes cannot hold a JSON object", ErrFormat, n)
	}
	hdr := make([]byte, n)
	if _, err := r.ReadAt(hdr, 8); err != nil {
		return nil, fmt.Errorf("reading %d-byte header: %w", n, err)
	}
	return parseHeader(hdr, size, lim)
}

// entry is one tensor's JSON object.
type entry struct {
	DType   DType    `json:"dtype"`
	Shape   []int64  `json:"shape"`
	Offsets []uint64 `json:"data_offsets"`
}

func parseHeader(hdr []byte, size int64, lim Limits) (*File, error) {
	f := &File{HeaderSize: 8 + int64(len(hdr)), Size: size, byName: map[string]int{}}
	dataLen := size - f.HeaderSize

	// The header is walked token by token rather than unmarshalled into a
	// map so that a duplicate tensor name (which a map would silently
	// resolve to the last one) is an error.
	dec := json.NewDecoder(bytes.NewReader(hdr))
	tok, err := dec.Token()
	if err != nil || tok != json.Delim('{') {
		return nil, fmt.Errorf("%w: header is not a JSON object", ErrFormat)
	}
	for dec.More() {
		tok, err := dec.Token()
		if err != nil {
			return nil, fmt.Errorf("%w: header JSON: %w", ErrFormat, err)
		}
		name, _ := tok.(string)
		if name == "__metadata__" {
			if f.Metadata != nil {
				return nil, fmt.Errorf("%w: two __metadata__ objects", ErrFormat)
			}
			if err := dec.Decode(&f.Metadata); err != nil {
				return nil, fmt.Errorf("%w: __metadata__ must map strings to strings: %w", ErrFormat, err)
			}
			if f.Metadata == nil {
				f.Metadata = map[string]string{}
			}
			continue
		}
		if _, dup := f.byName[name]; dup {
			return nil, fmt.Errorf("%w: duplicate tensor %q", ErrFormat, name)
		}
		if len(f.Tensors) >= lim.MaxTensors {
			return nil, fmt.Errorf("%w: more than %d tensors", ErrFormat, lim.MaxTensors)
		}
		var e entry
		if err := dec.Decode(&e); err != nil {
			return nil, fmt.Errorf("%w: tensor %q: %w", ErrFormat, name, err)
		}
		t, err := e.check(name, dataLen, f.HeaderSize, lim)
		if err != nil {
			return nil, err
		}
		f.byName[name] = len(f.Tensors)
		f.Tensors = append(f.Tensors, t)
	}
	if _, err := dec.Token(); err != nil {
		return nil, fmt.Errorf("%w: header JSON: %w", ErrFormat, err)
	}
	// Anything after the object but the space padding writers add is junk.
	rest, _ := io.ReadAll(dec.Buffered())
	if len(bytes.Trim(rest, " \t\r\n\x00")) != 0 {
		return nil, fmt.Errorf("%w: bytes after the header's JSON object", ErrFormat)
	}
	if err := f.checkLayout(dataLen); err != nil {
		return nil, err
	}
	return f, nil
}

// check validates one tensor entry against the data section's length.
func (e entry) check(name string, dataLen, base int64, lim Limits) (Tensor, error) {
	fail := func(format string, args ...any) (Tensor, error) {
		return Tensor{}, fmt.Errorf("%w: tensor %q: %s", ErrFormat, name, fmt.Sprintf(format, args...))
	}
	size := e.DType.Size()
	if size == 0 {
		return fail("unknown dtype %q", e.DType)
	}
	if e.Shape == nil {
		return fail("no shape")
	}
	if len(e.Shape) > lim.MaxDims {
		return fail("%d dimensions is over the %d limit", len(e.Shape), lim.MaxDims)
	}
	elems := int64(1)
	for _, d := range e.Shape {
		if d < 0 || d > lim.MaxElements || (d > 0 && elems > lim.MaxElements/d) {
			return fail("absurd shape %v", e.Shape)
		}
		elems *= d
	}
	if len(e.Offsets) != 2 {
		return fail("data_offsets must be [begin, end], got %v", e.Offsets)
	}
	begin, end := e.Offsets[0], e.Offsets[1]
	if end < begin || end > uint64(dataLen) {
		return fail("data_offsets [%d, %d] do not lie inside the %d bytes of data", begin, end, dataLen)
	}
	if want := elems * int64(size); int64(end-begin) != want {
		return fail("%d bytes of data, but %s%v needs %d", end-begin, e.DType, e.Shape, want)
	}
	return Tensor{Name: name, DType: e.DType, Shape: e.Shape, Offset: base + int64(begin), Length: int64(end - begin)}, nil
}

// checkLayout sorts the tensors by offset and requires them to tile the
// data section exactly, as the format's reference implementation does: no
// overlaps (one tensor's bytes read as another's) and no holes (bytes no
// tensor accounts for, where a polyglot file could hide something).
func (f *File) checkLayout(dataLen int64) error {
	slices.SortStableFunc(f.Tensors, func(a, b Tensor) int {
		return cmp.Or(cmp.Compare(a.Offset, b.Offset), strings.Compare(a.Name, b.Name))
	})
	at := f.HeaderSize
	for i := range f.Tensors {
		t := &f.Tensors[i]
		if t.Offset != at {
			if t.Offset < at {
				return fmt.Errorf("%w: tensor %q overlaps the one before it", ErrFormat, t.Name)
			}
			return fmt.Errorf("%w: %d bytes before tensor %q belong to no tensor", ErrFormat, t.Offset-at, t.Name)
		}
		at += t.Length
		f.byName[t.Name] = i
	}
	if at != f.HeaderSize+dataLen {
		return fmt.Errorf("%w: %d bytes at the end of the file belong to no tensor", ErrFormat, f.HeaderSize+dataLen-at)
	}
	return nil
}

// ReadTensor reads exactly the tensor's bytes from r (the file the header
// came from) into dst, which is grown as needed, and returns them.
func ReadTensor(r io.ReaderAt, t *Tensor, dst []byte) ([]byte, error) {
	if int64(cap(dst)) < t.Length {
		dst = make([]byte, t.Length)
	}
	dst = dst[:t.Length]
	n, err := r.ReadAt(dst, t.Offset)
	if int64(n) == t.Length {
		return dst, nil
	}
	if err == nil || errors.Is(err, io.EOF) {
		err = io.ErrUnexpectedEOF
	}
	return nil, fmt.Errorf("reading tensor %s (%d bytes at %d): %w", t.Name, t.Length, t.Offset, err)
}

// ToFloat32 appends the float32 values of data, encoded as dtype, to dst.
func ToFloat32(dtype DType, data []byte, dst []float32) ([]float32, error) {
	sd, ok := dtype.Stage()
	if !ok {
		return nil, fmt.Errorf("%w %s: only F32, F16 and BF16 convert to floats", ErrDType, dtype)
	}
	return stage.Decode(sd, data, dst)
}

// Header encodes a header for tensors laid out one after the other in the
// given order, their offsets recomputed, padded with spaces to a multiple of
// 8 bytes as the reference writer does. It returns the bytes to write before
// the data (length prefix included) and the tensors with their absolute
// offsets.
func Header(tensors []Tensor, metadata map[string]string) ([]byte, []Tensor, error) {
	var b bytes.Buffer
	b.WriteByte('{')
	if len(metadata) > 0 {
		m, err := json.Marshal(metadata)
		if err != nil {
			return nil, nil, err
		}
		b.WriteString(`"__metadata__":`)
		b.Write(m)
	}
	var off int64
	out := make([]Tensor, len(tensors))
	for i, t := range tensors {
		if t.DType.Size() == 0 {
			return nil, nil, fmt.Errorf("safetensors: tensor %q has unknown dtype %q", t.Name, t.DType)
		}
		t.Length = t.Elements() * int64(t.DType.Size())
		name, _ := json.Marshal(t.Name)
		shape := t.Shape
		if shape == nil {
			shape = []int64{}
		}
		sh, _ := json.Marshal(shape)
		if b.Len() > 1 {
			b.WriteByte(',')
		}
		fmt.Fprintf(&b, `%s:{"dtype":%q,"shape":%s,"data_offsets":[%d,%d]}`, name, t.DType, sh, off, off+t.Length)
		t.Offset = off
		off += t.Length
		out[i] = t
	}
	b.WriteByte('}')
	for b.Len()%8 != 0 {
		b.WriteByte(' ')
	}
	hdr := make([]byte, 8, 8+b.Len())
	binary.LittleEndian.PutUint64(hdr, uint64(b.Len()))
	hdr = append(hdr, b.Bytes()...)
	for i := range out {
		out[i].Offset += int64(len(hdr))
	}
	return hdr, out, nil
}
