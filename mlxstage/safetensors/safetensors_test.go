package safetensors

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

const storiesHF = "../../../shared/models/stories260K-hf"

// build writes a file of F32 tensors whose values are their element index
// plus a per-tensor base.
func build(t testing.TB, tensors []Tensor) []byte {
	t.Helper()
	hdr, laid, err := Header(tensors, map[string]string{"format": "pt"})
	if err != nil {
		t.Fatal(err)
	}
	out := bytes.NewBuffer(hdr)
	for i, tn := range laid {
		for j := range tn.Elements() {
			v := float32(100*i) + float32(j)
			switch tn.DType {
			case F32:
				binary.Write(out, binary.LittleEndian, v)
			case F16, BF16:
				out.Write([]byte{byte(j), byte(i)})
			default:
				out.Write(make([]byte, tn.DType.Size()))
			}
		}
	}
	return out.Bytes()
}

var sample = []Tensor{
	{Name: "b", DType: F32, Shape: []int64{2, 3}},
	{Name: "a", DType: F32, Shape: []int64{4}},
	{Name: "scalar", DType: F32, Shape: []int64{}},
	{Name: "empty", DType: F16, Shape: []int64{0, 5}},
	{Name: "ids", DType: I64, Shape: []int64{3}},
}

func TestRoundTrip(t *testing.T) {
	data := build(t, sample)
	f, err := Read(bytes.NewReader(data), int64(len(data)))
	if err != nil {
		t.Fatal(err)
	}
	if f.HeaderSize%8 != 0 {
		t.Errorf("header size %d is not 8-aligned", f.HeaderSize)
	}
	if f.Metadata["format"] != "pt" {
		t.Errorf("metadata %v", f.Metadata)
	}
	if len(f.Tensors) != len(sample) {
		t.Fatalf("%d tensors, want %d", len(f.Tensors), len(sample))
	}
	b, ok := f.Tensor("b")
	if !ok || b.DType != F32 || fmt.Sprint(b.Shape) != "[2 3]" || b.Length != 24 || b.Offset != f.HeaderSize {
		t.Fatalf("tensor b = %+v", b)
	}
	raw, err := ReadTensor(bytes.NewReader(data), b, nil)
	if err != nil {
		t.Fatal(err)
	}
	vals, err := ToFloat32(b.DType, raw, nil)
	if err != nil {
		t.Fatal(err)
	}
	if fmt.Sprint(vals) != "[0 1 2 3 4 5]" {
		t.Errorf("b = %v", vals)
	}
	a, _ := f.Tensor("a")
	raw, _ = ReadTensor(bytes.NewReader(data), a, nil)
	vals, _ = ToFloat32(F32, raw, nil)
	if fmt.Sprint(vals) != "[100 101 102 103]" {
		t.Errorf("a = %v", vals)
	}
	if s, _ := f.Tensor("scalar"); s.Elements() != 1 || s.Length != 4 {
		t.Errorf("scalar = %+v", s)
	}
	ids, _ := f.Tensor("ids")
	if _, err := ToFloat32(ids.DType, make([]byte, ids.Length), nil); !errors.Is(err, ErrDType) {
		t.Errorf("converting I64: %v, want ErrDType", err)
	}
}

func TestHalfConversions(t *testing.T) {
	// 1.0, -2.0 and the smallest subnormal, in both half formats.
	f16 := []byte{0x00, 0x3c, 0x00, 0xc0, 0x01, 0x00}
	bf16 := []byte{0x80, 0x3f, 0x00, 0xc0, 0x01, 0x00}
	v, err := ToFloat32(F16, f16, nil)
	if err != nil || v[0] != 1 || v[1] != -2 || v[2] != float32(math.Ldexp(1, -24)) {
		t.Errorf("F16: %v %v", v, err)
	}
	v, err = ToFloat32(BF16, bf16, nil)
	if err != nil || v[0] != 1 || v[1] != -2 || v[2] != math.Float32frombits(0x10000) {
		t.Errorf("BF16: %v %v", v, err)
	}
}

// header builds a file from a literal JSON header and a data section.
func header(js string, data int) []byte {
	b := binary.LittleEndian.AppendUint64(nil, uint64(len(js)))
	b = append(b, js...)
	return append(b, make([]byte, data)...)
}

func TestMalformed(t *testing.T) {
	cases := map[string]struct {
		file []byte
		want string
	}{
		"short":           {[]byte{1, 2, 3}, "too short"},
		"huge header":     {binary.LittleEndian.AppendUint64(nil, 1<<40), "over the"},
		"header past end": {binary.LittleEndian.AppendUint64(nil, 100), "longer than"},
		"not json":        {header("nope", 0), "not a JSON object"},
		"array":           {header("[1,2]", 0), "not a JSON object"},
		"unknown dtype":   {header(`{"x":{"dtype":"Q4","shape":[1],"data_offsets":[0,1]}}`, 1), "unknown dtype"},
		"negative dim":    {header(`{"x":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}}`, 4), "absurd shape"},
		"no shape":        {header(`{"x":{"dtype":"F32","data_offsets":[0,4]}}`, 4), "no shape"},
		"wrong length":    {header(`{"x":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}}`, 4), "needs 8"},
		"past end":        {header(`{"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}`, 4), "do not lie inside"},
		"backwards":       {header(`{"x":{"dtype":"F32","shape":[0],"data_offsets":[4,0]}}`, 4), "do not lie inside"},
		"fraction":        {header(`{"x":{"dtype":"F32","shape":[1],"data_offsets":[0.5,4.5]}}`, 5), "tensor \"x\""},
		"negative off":    {header(`{"x":{"dtype":"F32","shape":[1],"data_offsets":[-4,0]}}`, 4), "tensor \"x\""},
		"overlap": {header(`{"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"y":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}`, 8),
			"overlaps"},
		"hole":       {header(`{"x":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}`, 8), "belong to no tensor"},
		"tail":       {header(`{"x":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}`, 8), "at the end of the file"},
		"duplicate":  {header(`{"x":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"x":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}`, 8), "duplicate"},
		"junk after": {header(`{}xyz`, 0), "after the header"},
		"metadata":   {header(`{"__metadata__":{"a":1}}`, 0), "__metadata__"},
		"overflow": {header(`{"x":{"dtype":"F32","shape":[4294967296,4294967296,4294967296],"data_offsets":[0,4]}}`, 4),
			"absurd shape"},
		"too many dims": {header(`{"x":{"dtype":"F32","shape":[1,1,1,1,1,1,1,1,1],"data_offsets":[0,4]}}`, 4), "dimensions"},
	}
	for name, c := range cases {
		t.Run(name, func(t *testing.T) {
			_, err := Read(bytes.NewReader(c.file), int64(len(c.file)))
			if err == nil {
				t.Fatal("accepted")
			}
			if !strings.Contains(err.Error(), c.want) {
				t.Errorf("error %q does not say %q", err, c.want)
			}
			if name != "short" && !errors.Is(err, ErrFormat) {
				t.Errorf("error %q does not wrap ErrFormat", err)
			}
		})
	}
}

func TestEmptyAndPadded(t *testing.T) {
	for _, js := range []string{"{}", "{}      ", `{"__metadata__":{}}`} {
		b := header(js, 0)
		f, err := Read(bytes.NewReader(b), int64(len(b)))
		if err != nil || len(f.Tensors) != 0 {
			t.Errorf("%q: %v", js, err)
		}
	}
}

func TestStoriesHeader(t *testing.T) {
	open := Dir(storiesHF)
	src, err := open(SingleName)
	if err != nil {
		t.Skip("stories260K-hf not available:", err)
	}
	defer src.(interface{ Close() error }).Close()
	f, err := Read(src, src.Size())
	if err != nil {
		t.Fatal(err)
	}
	if len(f.Tensors) != 2+1+5*9 {
		t.Errorf("%d tensors, want 48", len(f.Tensors))
	}
	q, ok := f.Tensor("model.layers.4.self_attn.q_proj.weight")
	if !ok || q.DType != F32 || fmt.Sprint(q.Shape) != "[64 64]" {
		t.Errorf("q_proj: %+v", q)
	}
}

// writeSharded splits sample over two shard files with an index.
func writeSharded(t *testing.T) string {
	t.Helper()
	dir := t.TempDir()
	parts := [][]Tensor{sample[:2], sample[2:]}
	wm := map[string]string{}
	for i, p := range parts {
		name := fmt.Sprintf("model-%05d-of-00002.safetensors", i+1)
		if err := os.WriteFile(filepath.Join(dir, name), build(t, p), 0o644); err != nil {
			t.Fatal(err)
		}
		for _, tn := range p {
			wm[tn.Name] = name
		}
	}
	ix, _ := json.Marshal(Index{Metadata: map[string]any{"total_size": 1}, WeightMap: wm})
	if err := os.WriteFile(filepath.Join(dir, IndexName), ix, 0o644); err != nil {
		t.Fatal(err)
	}
	return dir
}

func TestShardedReadsOnlyWhatItNeeds(t *testing.T) {
	dir := writeSharded(t)
	m, err := OpenModel(Dir(dir))
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	if !m.Sharded() {
		t.Fatal("index not found")
	}
	names, _ := m.Names()
	if fmt.Sprint(names) != "[a b empty ids scalar]" {
		t.Errorf("names %v", names)
	}
	st := m.Stats()
	if st.Shards != 0 || st.HeaderBytes != 0 || st.TensorBytes != 0 || st.IndexBytes == 0 {
		t.Fatalf("opening read %+v", st)
	}
	raw, tn, err := m.ReadTensor("a", nil)
	if err != nil {
		t.Fatal(err)
	}
	vals, _ := ToFloat32(tn.DType, raw, nil)
	if fmt.Sprint(vals) != "[100 101 102 103]" {
		t.Errorf("a = %v", vals)
	}
	st = m.Stats()
	first := build(t, sample[:2])
	f, _ := Read(bytes.NewReader(first), int64(len(first)))
	if st.Shards != 1 || st.HeaderBytes != f.HeaderSize || st.TensorBytes != 16 {
		t.Errorf("after one tensor: %+v, want 1 shard, %d header bytes, 16 tensor bytes", st, f.HeaderSize)
	}
	if ok, _ := m.Has("nope"); ok {
		t.Error("Has(nope)")
	}
	if _, _, err := m.ReadTensor("nope", nil); !errors.Is(err, ErrNoTensor) {
		t.Errorf("missing tensor: %v", err)
	}
}

func TestSingleFileModel(t *testing.T) {
	dir := t.TempDir()
	os.WriteFile(filepath.Join(dir, SingleName), build(t, sample), 0o644)
	m, err := OpenModel(Dir(dir))
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	if m.Sharded() {
		t.Error("sharded")
	}
	if _, tn, err := m.ReadTensor("b", nil); err != nil || tn.Length != 24 {
		t.Fatal(tn, err)
	}
	if st := m.Stats(); st.TensorBytes != 24 {
		t.Errorf("%+v", st)
	}
}

func TestIndexEscapes(t *testing.T) {
	for _, bad := range []string{"../x.safetensors", "/etc/passwd", "a/../../b", `..\x`, ""} {
		ix, _ := json.Marshal(Index{WeightMap: map[string]string{"w": bad}})
		if _, err := ParseIndex(ix); !errors.Is(err, ErrFormat) {
			t.Errorf("%q accepted: %v", bad, err)
		}
	}
	if _, err := Dir(t.TempDir())("../x"); !errors.Is(err, fs.ErrInvalid) {
		t.Errorf("Dir opened ../x: %v", err)
	}
	if _, err := OpenModel(Dir(t.TempDir())); err != nil {
		t.Errorf("a directory without an index is a single-file model until read: %v", err)
	}
}

func FuzzRead(f *testing.F) {
	f.Add(build(f, sample))
	f.Add(header(`{"x":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}`, 4))
	f.Add(header(`{"__metadata__":{"a":"b"}}`, 0))
	f.Fuzz(func(t *testing.T, b []byte) {
		file, err := Read(bytes.NewReader(b), int64(len(b)))
		if err != nil {
			return
		}
		for i := range file.Tensors {
			tn := &file.Tensors[i]
			if tn.Offset < file.HeaderSize || tn.Offset+tn.Length > int64(len(b)) {
				t.Fatalf("tensor %q [%d,+%d) outside the %d-byte file", tn.Name, tn.Offset, tn.Length, len(b))
			}
			if _, err := ReadTensor(bytes.NewReader(b), tn, nil); err != nil {
				t.Fatal(err)
			}
		}
	})
}
