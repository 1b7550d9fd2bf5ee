// Package gguf reads and writes the GGUF container: header, metadata and
// tensor table. It trusts nothing in a file: every count, length and offset
// is checked against the file's size before anything is allocated, so a
// truncated or hostile file is an error, never a panic or a huge allocation.
//
// It exists beside ollama's fs/ggml (which loads models) because meshnode
// needs three things that reader does not give: validation of untrusted
// files, byte ranges of single tensors (to slice a model by layer, and to
// fetch only a stage's bytes from a peer or over HTTP), and a writer that
// copies metadata verbatim into a slice.
package gguf

import (
	"bufio"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math"
	"slices"
	"strconv"
	"strings"
)

// Magic is "GGUF" read as a little-endian uint32.
const Magic = 0x46554747

// DefaultAlignment of tensor data when general.alignment is absent.
const DefaultAlignment = 32

// Metadata value types.
type ValueType uint32

const (
	TypeUint8   ValueType = 0
	TypeInt8    ValueType = 1
	TypeUint16  ValueType = 2
	TypeInt16   ValueType = 3
	TypeUint32  ValueType = 4
	TypeInt32   ValueType = 5
	TypeFloat32 ValueType = 6
	TypeBool    ValueType = 7
	TypeString  ValueType = 8
	TypeArray   ValueType = 9
	TypeUint64  ValueType = 10
	TypeInt64   ValueType = 11
	TypeFloat64 ValueType = 12
)

func (t ValueType) scalarSize() int {
	switch t {
	case TypeUint8, TypeInt8, TypeBool:
		return 1
	case TypeUint16, TypeInt16:
		return 2
	case TypeUint32, TypeInt32, TypeFloat32:
		return 4
	case TypeUint64, TypeInt64, TypeFloat64:
		return 8
	}
	return 0
}

// Value is one metadata value. V holds uint8, int8, uint16, int16, uint32,
// int32, float32, bool, string, uint64, int64, float64, or for arrays a
// slice of one of those ([]string, []int32, ...). ElemType is the element
// type of an array.
type Value struct {
	Type     ValueType
	ElemType ValueType
	V        any
}

// KV is one metadata entry; order is kept as in the file.
type KV struct {
	Key   string
	Value Value
}

// TensorInfo is one entry of the tensor table.
type TensorInfo struct {
	Name   string
	Shape  []uint64 // ne[0] first (innermost)
	Type   uint32   // ggml type id
	Offset uint64   // relative to the data section
}

// Elements is the number of elements.
func (t *TensorInfo) Elements() uint64 {
	n := uint64(1)
	for _, d := range t.Shape {
		n *= d
	}
	return n
}

// Size is the number of bytes of the tensor's data.
func (t *TensorInfo) Size() uint64 {
	tt, ok := types[t.Type]
	if !ok {
		return 0
	}
	return t.Elements() / tt.block * tt.size
}

// TypeName is the ggml name of the tensor's type.
func (t *TensorInfo) TypeName() string { return TypeName(t.Type) }

// File is a parsed GGUF header.
type File struct {
	Version    uint32
	KVs        []KV
	Tensors    []TensorInfo
	Alignment  uint64
	DataOffset uint64 // absolute offset of the data section
	Size       int64  // the file's size, as given to Read
}

// Limits bound what a header may ask for.
type Limits struct {
	MaxTensors  uint64
	MaxKVs      uint64
	MaxString   uint64 // bytes of one string
	MaxArray    uint64 // elements of one array
	MaxDims     uint32
	MaxElements uint64 // elements of one tensor
}

// DefaultLimits fit every real model: the largest vocabularies are ~260k
// tokens, the largest tensors well under 2^40 elements.
var DefaultLimits = Limits{
	MaxTensors:  1 << 20,
	MaxKVs:      1 << 16,
	MaxString:   1 << 24,
	MaxArray:    1 << 24,
	MaxDims:     4,
	MaxElements: 1 << 40,
}

// ErrFormat is wrapped by every error about a malformed file.
var ErrFormat = errors.New("malformed GGUF")

type reader struct {
	r    *bufio.Reader
	pos  uint64
	size uint64
	lim  Limits
	buf  [8]byte
}

func (r *reader) fail(format string, args ...any) error {
	return fmt.Errorf("%w: at byte %d: %s", ErrFormat, r.pos, fmt.Sprintf(format, args...))
}

func (r *reader) read(n int) ([]byte, error) {
	if r.pos+uint64(n) > r.size {
		return nil, r.fail("file ends early (need %d more bytes, %d left)", n, r.size-r.pos)
	}
	b := r.buf[:n]
	if _, err := io.ReadFull(r.r, b); err != nil {
		return nil, r.fail("reading: %v", err)
	}
	r.pos += uint64(n)
	return b, nil
}

func (r *reader) u32() (uint32, error) {
	b, err := r.read(4)
	if err != nil {
		return 0, err
	}
	return binary.LittleEndian.Uint32(b), nil
}

func (r *reader) u64() (uint64, error) {
	b, err := r.read(8)
	if err != nil {
		return 0, err
	}
	return binary.LittleEndian.Uint64(b), nil
}

func (r *reader) str() (string, error) {
	n, err := r.u64()
	if err != nil {
		return "", err
	}
	if n > r.lim.MaxString {
		return "", r.fail("string of %d bytes is over the %d limit", n, r.lim.MaxString)
	}
	if n > r.size-r.pos {
		return "", r.fail("string of %d bytes runs past the end of the file", n)
	}
	b := make([]byte, n)
	if _, err := io.ReadFull(r.r, b); err != nil {
		return "", r.fail("reading string: %v", err)
	}
	r.pos += n
	return string(b), nil
}

func (r *reader) scalar(t ValueType) (any, error) {
	size := t.scalarSize()
	if size == 0 {
		return nil, r.fail("unknown value type %d", t)
	}
	b, err := r.read(size)
	if err != nil {
		return nil, err
	}
	switch t {
	case TypeUint8:
		return b[0], nil
	case TypeInt8:
		return int8(b[0]), nil
	case TypeBool:
		if b[0] > 1 {
			return nil, r.fail("bool value %d", b[0])
		}
		return b[0] == 1, nil
	case TypeUint16:
		return binary.LittleEndian.Uint16(b), nil
	case TypeInt16:
		return int16(binary.LittleEndian.Uint16(b)), nil
	case TypeUint32:
		return binary.LittleEndian.Uint32(b), nil
	case TypeInt32:
		return int32(binary.LittleEndian.Uint32(b)), nil
	case TypeFloat32:
		return math.Float32frombits(binary.LittleEndian.Uint32(b)), nil
	case TypeUint64:
		return binary.LittleEndian.Uint64(b), nil
	case TypeInt64:
		return int64(binary.LittleEndian.Uint64(b)), nil
	default: // TypeFloat64
		return math.Float64frombits(binary.LittleEndian.Uint64(b)), nil
	}
}

func readArray[T any](r *reader, t ValueType, n uint64) ([]T, error) {
	out := make([]T, 0, n)
	for range n {
		v, err := r.scalar(t)
		if err != nil {
			return nil, err
		}
		out = append(out, v.(T))
	}
	return out, nil
}

func (r *reader) value(t ValueType) (Value, error) {
	switch t {
	case TypeString:
		s, err := r.str()
		return Value{Type: t, V: s}, err
	case TypeArray:
		et, err := r.u32()
		if err != nil {
			return Value{}, err
		}
		n, err := r.u64()
		if err != nil {
			return Value{}, err
		}
		if n > r.lim.MaxArray {
			return Value{}, r.fail("array of %d elements is over the %d limit", n, r.lim.MaxArray)
		}
		elem := ValueType(et)
		// Every element takes at least one byte (strings eight), so a count
		// beyond the bytes left is a lie: refuse before allocating.
		minSize := uint64(elem.scalarSize())
		if elem == TypeString {
			minSize = 8
		}
		if minSize == 0 {
			return Value{}, r.fail("array of unsupported element type %d", et)
		}
		if n > (r.size-r.pos)/minSize {
			return Value{}, r.fail("array of %d elements runs past the end of the file", n)
		}
		v := Value{Type: TypeArray, ElemType: elem}
		switch elem {
		case TypeString:
			ss := make([]string, 0, n)
			for range n {
				s, err := r.str()
				if err != nil {
					return Value{}, err
				}
				ss = append(ss, s)
			}
			v.V = ss
		case TypeUint8:
			v.V, err = readArray[uint8](r, elem, n)
		case TypeInt8:
			v.V, err = readArray[int8](r, elem, n)
		case TypeUint16:
			v.V, err = readArray[uint16](r, elem, n)
		case TypeInt16:
			v.V, err = readArray[int16](r, elem, n)
		case TypeUint32:
			v.V, err = readArray[uint32](r, elem, n)
		case TypeInt32:
			v.V, err = readArray[int32](r, elem, n)
		case TypeFloat32:
			v.V, err = readArray[float32](r, elem, n)
		case TypeBool:
			v.V, err = readArray[bool](r, elem, n)
		case TypeUint64:
			v.V, err = readArray[uint64](r, elem, n)
		case TypeInt64:
			v.V, err = readArray[int64](r, elem, n)
		case TypeFloat64:
			v.V, err = readArray[float64](r, elem, n)
		}
		return v, err
	default:
		s, err := r.scalar(t)
		return Value{Type: t, V: s}, err
	}
}

// Read parses the header of a GGUF file of the given size and checks that
// every tensor lies inside the file.
func Read(rd io.Reader, size int64) (*File, error) {
	return ReadLimits(rd, size, DefaultLimits)
}

// ReadLimits is Read with explicit limits.
func ReadLimits(rd io.Reader, size int64, lim Limits) (*File, error) {
	if size < 0 {
		return nil, fmt.Errorf("%w: negative size", ErrFormat)
	}
	r := &reader{r: bufio.NewReaderSize(rd, 64<<10), size: uint64(size), lim: lim}
	magic, err := r.u32()
	if err != nil {
		return nil, err
	}
	if magic != Magic {
		return nil, fmt.Errorf("%w: not a GGUF file (magic %#08x, want %#08x \"GGUF\")", ErrFormat, magic, uint32(Magic))
	}
	f := &File{Size: size}
	if f.Version, err = r.u32(); err != nil {
		return nil, err
	}
	if f.Version != 2 && f.Version != 3 {
		return nil, fmt.Errorf("%w: GGUF version %d is not supported (want 2 or 3)", ErrFormat, f.Version)
	}
	nt, err := r.u64()
	if err != nil {
		return nil, err
	}
	nkv, err := r.u64()
	if err != nil {
		return nil, err
	}
	if nt > lim.MaxTensors {
		return nil, r.fail("%d tensors is over the %d limit", nt, lim.MaxTensors)
	}
	if nkv > lim.MaxKVs {
		return nil, r.fail("%d metadata entries is over the %d limit", nkv, lim.MaxKVs)
	}
	// A KV takes at least 8+4+1 bytes and a tensor info 8+4+8+4+8.
	if nkv*13+nt*32 > r.size-r.pos {
		return nil, r.fail("header claims %d metadata entries and %d tensors, more than the file can hold", nkv, nt)
	}
	seen := make(map[string]bool, nkv)
	f.KVs = make([]KV, 0, nkv)
	for range nkv {
		key, err := r.str()
		if err != nil {
			return nil, err
		}
		if seen[key] {
			return nil, r.fail("duplicate metadata key %q", key)
		}
		seen[key] = true
		t, err := r.u32()
		if err != nil {
			return nil, err
		}
		v, err := r.value(ValueType(t))
		if err != nil {
			return nil, fmt.Errorf("metadata %q: %w", key, err)
		}
		f.KVs = append(f.KVs, KV{Key: key, Value: v})
	}
	f.Alignment = DefaultAlignment
	if v, ok := f.Get("general.alignment"); ok {
		a, ok := v.Uint()
		if !ok || a == 0 || a&(a-1) != 0 || a > 1<<20 {
			return nil, fmt.Errorf("%w: general.alignment %v is not a power of two", ErrFormat, v.V)
		}
		f.Alignment = a
	}
	names := make(map[string]bool, nt)
	f.Tensors = make([]TensorInfo, 0, nt)
	for range nt {
		var t TensorInfo
		if t.Name, err = r.str(); err != nil {
			return nil, err
		}
		if names[t.Name] {
			return nil, r.fail("duplicate tensor %q", t.Name)
		}
		names[t.Name] = true
		nd, err := r.u32()
		if err != nil {
			return nil, err
		}
		if nd == 0 || nd > lim.MaxDims {
			return nil, r.fail("tensor %q has %d dimensions", t.Name, nd)
		}
		elems := uint64(1)
		for range nd {
			d, err := r.u64()
			if err != nil {
				return nil, err
			}
			if d == 0 || d > lim.MaxElements || elems > lim.MaxElements/d {
				return nil, r.fail("tensor %q has absurd dimension %d", t.Name, d)
			}
			elems *= d
			t.Shape = append(t.Shape, d)
		}
		if t.Type, err = r.u32(); err != nil {
			return nil, err
		}
		tt, ok := types[t.Type]
		if !ok {
			return nil, r.fail("tensor %q has unknown type %d", t.Name, t.Type)
		}
		if t.Shape[0]%tt.block != 0 {
			return nil, r.fail("tensor %q: row of %d elements is not a multiple of the %s block (%d)", t.Name, t.Shape[0], tt.name, tt.block)
		}
		if t.Offset, err = r.u64(); err != nil {
			return nil, err
		}
		f.Tensors = append(f.Tensors, t)
	}
	f.DataOffset = align(r.pos, f.Alignment)
	for i := range f.Tensors {
		t := &f.Tensors[i]
		if t.Offset%f.Alignment != 0 {
			return nil, fmt.Errorf("%w: tensor %q offset %d is not aligned to %d", ErrFormat, t.Name, t.Offset, f.Alignment)
		}
		end := f.DataOffset + t.Offset + t.Size()
		if end < f.DataOffset || end > uint64(size) {
			return nil, fmt.Errorf("%w: tensor %q (%d bytes at %d) lies past the end of the file (%d bytes): truncated?", ErrFormat, t.Name, t.Size(), f.DataOffset+t.Offset, size)
		}
	}
	return f, nil
}

func align(n, a uint64) uint64 { return (n + a - 1) / a * a }

// Get returns the value of a metadata key.
func (f *File) Get(key string) (Value, bool) {
	for i := range f.KVs {
		if f.KVs[i].Key == key {
			return f.KVs[i].Value, true
		}
	}
	return Value{}, false
}

// Set replaces or appends a metadata entry.
func (f *File) Set(key string, v Value) {
	for i := range f.KVs {
		if f.KVs[i].Key == key {
			f.KVs[i].Value = v
			return
		}
	}
	f.KVs = append(f.KVs, KV{Key: key, Value: v})
}

// Arch is general.architecture.
func (f *File) Arch() string { return f.String("general.architecture") }

// String returns a string value, or "".
func (f *File) String(key string) string {
	v, _ := f.Get(key)
	s, _ := v.V.(string)
	return s
}

// ArchUint returns the unsigned value of "{arch}.{key}".
func (f *File) ArchUint(key string) (uint64, bool) {
	v, ok := f.Get(f.Arch() + "." + key)
	if !ok {
		return 0, false
	}
	return v.Uint()
}

// Uint converts any integer value to uint64.
func (v Value) Uint() (uint64, bool) {
	switch x := v.V.(type) {
	case uint8:
		return uint64(x), true
	case uint16:
		return uint64(x), true
	case uint32:
		return uint64(x), true
	case uint64:
		return x, true
	case int8:
		return uint64(x), x >= 0
	case int16:
		return uint64(x), x >= 0
	case int32:
		return uint64(x), x >= 0
	case int64:
		return uint64(x), x >= 0
	}
	return 0, false
}

// Tensor returns the tensor table entry by name.
func (f *File) Tensor(name string) (*TensorInfo, bool) {
	for i := range f.Tensors {
		if f.Tensors[i].Name == name {
			return &f.Tensors[i], true
		}
	}
	return nil, false
}

// Range is the absolute byte range [Off, Off+Len) of a tensor's data.
func (f *File) Range(t *TensorInfo) (off, n uint64) {
	return f.DataOffset + t.Offset, t.Size()
}

// Block returns the block index of a tensor named "blk.N.…", or -1.
func Block(name string) int {
	rest, ok := strings.CutPrefix(name, "blk.")
	if !ok {
		return -1
	}
	num, _, ok := strings.Cut(rest, ".")
	if !ok {
		return -1
	}
	n, err := strconv.Atoi(num)
	if err != nil || n < 0 {
		return -1
	}
	return n
}

// Write writes a GGUF v3 header for kvs and tensors, with the tensors'
// offsets recomputed so that they follow one another aligned, and returns
// the absolute offset of the data section. Tensor data is written by the
// caller at DataOffset+Offset of each tensor.
func Write(w io.Writer, kvs []KV, tensors []TensorInfo, alignment uint64) (dataOffset uint64, err error) {
	if alignment == 0 {
		alignment = DefaultAlignment
	}
	bw := &countingWriter{w: bufio.NewWriterSize(w, 64<<10)}
	bw.u32(Magic)
	bw.u32(3)
	bw.u64(uint64(len(tensors)))
	bw.u64(uint64(len(kvs)))
	for _, kv := range kvs {
		bw.str(kv.Key)
		bw.u32(uint32(kv.Value.Type))
		if err := bw.value(kv.Value); err != nil {
			return 0, fmt.Errorf("writing metadata %q: %w", kv.Key, err)
		}
	}
	var off uint64
	for i := range tensors {
		t := &tensors[i]
		t.Offset = off
		bw.str(t.Name)
		bw.u32(uint32(len(t.Shape)))
		for _, d := range t.Shape {
			bw.u64(d)
		}
		bw.u32(t.Type)
		bw.u64(t.Offset)
		off = align(off+t.Size(), alignment)
	}
	dataOffset = align(bw.n, alignment)
	bw.pad(dataOffset - bw.n)
	if bw.err != nil {
		return 0, bw.err
	}
	return dataOffset, bw.w.(*bufio.Writer).Flush()
}

type countingWriter struct {
	w   io.Writer
	n   uint64
	err error
	buf [8]byte
}

func (c *countingWriter) write(b []byte) {
	if c.err != nil {
		return
	}
	var n int
	n, c.err = c.w.Write(b)
	c.n += uint64(n)
}

func (c *countingWriter) u32(v uint32) {
	binary.LittleEndian.PutUint32(c.buf[:4], v)
	c.write(c.buf[:4])
}

func (c *countingWriter) u64(v uint64) {
	binary.LittleEndian.PutUint64(c.buf[:8], v)
	c.write(c.buf[:8])
}

func (c *countingWriter) str(s string) {
	c.u64(uint64(len(s)))
	c.write([]byte(s))
}

func (c *countingWriter) pad(n uint64) {
	c.write(make([]byte, n))
}

func (c *countingWriter) scalar(t ValueType, v any) error {
	b := c.buf[:t.scalarSize()]
	switch x := v.(type) {
	case uint8:
		b[0] = x
	case int8:
		b[0] = byte(x)
	case bool:
		b[0] = 0
		if x {
			b[0] = 1
		}
	case uint16:
		binary.LittleEndian.PutUint16(b, x)
	case int16:
		binary.LittleEndian.PutUint16(b, uint16(x))
	case uint32:
		binary.LittleEndian.PutUint32(b, x)
	case int32:
		binary.LittleEndian.PutUint32(b, uint32(x))
	case float32:
		binary.LittleEndian.PutUint32(b, math.Float32bits(x))
	case uint64:
		binary.LittleEndian.PutUint64(b, x)
	case int64:
		binary.LittleEndian.PutUint64(b, uint64(x))
	case float64:
		binary.LittleEndian.PutUint64(b, math.Float64bits(x))
	default:
		return fmt.Errorf("value %T does not match type %d", v, t)
	}
	c.write(b)
	return nil
}

func writeElems[T any](c *countingWriter, t ValueType, v any) error {
	s, ok := v.([]T)
	if !ok {
		return fmt.Errorf("array value %T does not match element type %d", v, t)
	}
	c.u32(uint32(t))
	c.u64(uint64(len(s)))
	for _, e := range s {
		if err := c.scalar(t, e); err != nil {
			return err
		}
	}
	return nil
}

func (c *countingWriter) value(v Value) error {
	switch v.Type {
	case TypeString:
		s, ok := v.V.(string)
		if !ok {
			return fmt.Errorf("string value is %T", v.V)
		}
		c.str(s)
		return nil
	case TypeArray:
		switch v.ElemType {
		case TypeString:
			s, ok := v.V.([]string)
			if !ok {
				return fmt.Errorf("string array is %T", v.V)
			}
			c.u32(uint32(TypeString))
			c.u64(uint64(len(s)))
			for _, e := range s {
				c.str(e)
			}
			return nil
		case TypeUint8:
			return writeElems[uint8](c, v.ElemType, v.V)
		case TypeInt8:
			return writeElems[int8](c, v.ElemType, v.V)
		case TypeUint16:
			return writeElems[uint16](c, v.ElemType, v.V)
		case TypeInt16:
			return writeElems[int16](c, v.ElemType, v.V)
		case TypeUint32:
			return writeElems[uint32](c, v.ElemType, v.V)
		case TypeInt32:
			return writeElems[int32](c, v.ElemType, v.V)
		case TypeFloat32:
			return writeElems[float32](c, v.ElemType, v.V)
		case TypeBool:
			return writeElems[bool](c, v.ElemType, v.V)
		case TypeUint64:
			return writeElems[uint64](c, v.ElemType, v.V)
		case TypeInt64:
			return writeElems[int64](c, v.ElemType, v.V)
		case TypeFloat64:
			return writeElems[float64](c, v.ElemType, v.V)
		}
		return fmt.Errorf("unknown array element type %d", v.ElemType)
	default:
		if v.Type.scalarSize() == 0 {
			return fmt.Errorf("unknown value type %d", v.Type)
		}
		return c.scalar(v.Type, v.V)
	}
}

// Keys lists the metadata keys, sorted.
func (f *File) Keys() []string {
	keys := make([]string, len(f.KVs))
	for i, kv := range f.KVs {
		keys[i] = kv.Key
	}
	slices.Sort(keys)
	return keys
}
