package gguf

import (
	"bytes"
	"encoding/binary"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"testing"
)

const stories = "../../../shared/models/stories260K.gguf"

func readFile(t *testing.T, path string) *File {
	t.Helper()
	fh, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer fh.Close()
	st, _ := fh.Stat()
	f, err := Read(fh, st.Size())
	if err != nil {
		t.Fatalf("read %s: %v", path, err)
	}
	return f
}

func TestReadStories(t *testing.T) {
	f := readFile(t, stories)
	if f.Arch() != "llama" {
		t.Fatalf("arch %q", f.Arch())
	}
	n, err := f.BlockCount()
	if err != nil || n != 5 {
		t.Fatalf("block count %d %v", n, err)
	}
	emb, ok := f.Tensor("token_embd.weight")
	if !ok || emb.Shape[0] != 64 || emb.Shape[1] != 512 || emb.Size() != 64*512*4 {
		t.Fatalf("token_embd %+v", emb)
	}
	v, _ := f.Get("tokenizer.ggml.tokens")
	if toks, ok := v.V.([]string); !ok || len(toks) != 512 {
		t.Fatalf("tokens %T", v.V)
	}
}

func TestSliceRoundTrip(t *testing.T) {
	f := readFile(t, stories)
	src, err := os.Open(stories)
	if err != nil {
		t.Fatal(err)
	}
	defer src.Close()
	tests := []struct {
		start, end int
		want       []string // some tensors that must be there
		wantNot    []string
	}{
		{0, 2, []string{"token_embd.weight", "blk.0.attn_q.weight", "blk.1.ffn_down.weight"}, []string{"blk.2.attn_q.weight", "output.weight", "output_norm.weight"}},
		{2, 4, []string{"blk.2.attn_q.weight", "blk.3.ffn_up.weight"}, []string{"token_embd.weight", "blk.1.attn_q.weight", "blk.4.attn_q.weight", "output.weight"}},
		{4, 5, []string{"blk.4.attn_q.weight", "output.weight", "output_norm.weight"}, []string{"token_embd.weight", "blk.3.attn_q.weight"}},
		{0, 5, []string{"token_embd.weight", "blk.4.attn_q.weight", "output.weight"}, nil},
	}
	for _, tc := range tests {
		parts, err := StageParts(f, tc.start, tc.end)
		if err != nil {
			t.Fatal(err)
		}
		path := filepath.Join(t.TempDir(), "slice.gguf")
		out, err := os.Create(path)
		if err != nil {
			t.Fatal(err)
		}
		var last uint64
		if err := WriteSlice(out, f, src, parts, tc.start, tc.end, "abc", func(d, total uint64) { last = d }); err != nil {
			t.Fatal(err)
		}
		out.Close()
		if last != PartsSize(parts) {
			t.Errorf("progress ended at %d, want %d", last, PartsSize(parts))
		}
		s := readFile(t, path)
		for _, n := range tc.want {
			st, ok := s.Tensor(n)
			if !ok {
				t.Errorf("[%d,%d): missing %s", tc.start, tc.end, n)
				continue
			}
			// the data must be byte-identical to the source's
			ft, _ := f.Tensor(n)
			a := make([]byte, ft.Size())
			b := make([]byte, st.Size())
			so, _ := f.Range(ft)
			do, _ := s.Range(st)
			src.ReadAt(a, int64(so))
			sf, _ := os.Open(path)
			sf.ReadAt(b, int64(do))
			sf.Close()
			if !bytes.Equal(a, b) {
				t.Errorf("[%d,%d): %s data differs", tc.start, tc.end, n)
			}
		}
		for _, n := range tc.wantNot {
			if _, ok := s.Tensor(n); ok {
				t.Errorf("[%d,%d): unexpected %s", tc.start, tc.end, n)
			}
		}
		if v, _ := s.Get(KeySliceEnd); v.V != uint32(tc.end) {
			t.Errorf("slice end key %v", v.V)
		}
		if len(s.KVs) != len(f.KVs)+4 {
			t.Errorf("slice has %d KVs, source %d", len(s.KVs), len(f.KVs))
		}
		// The whole model's types, whatever the slice holds; a slice of
		// the slice keeps them.
		if got, want := ModelTypes(s), ModelTypes(f); !slices.Equal(got, want) || len(want) == 0 {
			t.Errorf("[%d,%d): model types %v, want the source's %v", tc.start, tc.end, got, want)
		}
	}
}

func header(nt, nkv uint64) []byte {
	var b bytes.Buffer
	binary.Write(&b, binary.LittleEndian, uint32(Magic))
	binary.Write(&b, binary.LittleEndian, uint32(3))
	binary.Write(&b, binary.LittleEndian, nt)
	binary.Write(&b, binary.LittleEndian, nkv)
	return b.Bytes()
}

func TestMalformed(t *testing.T) {
	good, err := os.ReadFile(stories)
	if err != nil {
		t.Fatal(err)
	}
	f := readFile(t, stories)
	tests := []struct {
		name string
		data []byte
	}{
		{"empty", nil},
		{"wrong magic", append([]byte("GGML"), good[4:]...)},
		{"version 1", append(append([]byte("GGUF"), 1, 0, 0, 0), good[8:]...)},
		{"truncated header", good[:100]},
		{"truncated data", good[:f.DataOffset+1000]},
		{"absurd tensor count", header(1<<40, 0)},
		{"absurd kv count", header(0, 1<<40)},
		{"count beyond file", append(header(1000, 1000), make([]byte, 64)...)},
		{"huge string", append(header(0, 1), 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x7f)},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, err := Read(bytes.NewReader(tc.data), int64(len(tc.data)))
			if !errors.Is(err, ErrFormat) {
				t.Fatalf("got %v, want ErrFormat", err)
			}
		})
	}
}

func FuzzRead(f *testing.F) {
	good, err := os.ReadFile(stories)
	if err != nil {
		f.Fatal(err)
	}
	fh := readFile(&testing.T{}, stories)
	f.Add(good[:fh.DataOffset])
	f.Add(header(1, 1))
	f.Add([]byte("GGUF"))
	f.Fuzz(func(t *testing.T, data []byte) {
		file, err := Read(bytes.NewReader(data), int64(len(data)))
		if err != nil {
			return
		}
		// whatever parses must be sliceable or refused cleanly
		if n, err := file.BlockCount(); err == nil {
			StageParts(file, 0, n)
		}
	})
}

func TestModelTypes(t *testing.T) {
	tensor := func(name string, typ uint32) TensorInfo { return TensorInfo{Name: name, Type: typ} }
	tests := []struct {
		name string
		f    *File
		want []string
	}{
		{"layers fold into one kind", &File{Tensors: []TensorInfo{
			tensor("token_embd.weight", 2), tensor("blk.0.attn_q.weight", 2), tensor("blk.11.attn_q.weight", 2),
			tensor("blk.0.attn_norm.weight", 0), tensor("output.weight", 14),
		}}, []string{"attn_norm.weight=0", "attn_q.weight=2", "output.weight=14", "token_embd.weight=2"}},
		{"a kind in two types lists both", &File{Tensors: []TensorInfo{
			tensor("blk.0.ffn_down.weight", 14), tensor("blk.1.ffn_down.weight", 12), tensor("blk.2.ffn_down.weight", 12),
		}}, []string{"ffn_down.weight=12", "ffn_down.weight=14"}},
		{"a slice answers for its source", &File{
			KVs:     []KV{{Key: KeySliceTypes, Value: Value{Type: TypeArray, ElemType: TypeString, V: []string{"attn_q.weight=8"}}}},
			Tensors: []TensorInfo{tensor("blk.3.attn_q.weight", 2)},
		}, []string{"attn_q.weight=8"}},
		{"odd names stay whole", &File{Tensors: []TensorInfo{tensor("blk.rope", 0), tensor("rope_freqs.weight", 0)}},
			[]string{"blk.rope=0", "rope_freqs.weight=0"}},
	}
	for _, tc := range tests {
		if got := ModelTypes(tc.f); !slices.Equal(got, tc.want) {
			t.Errorf("%s: %v, want %v", tc.name, got, tc.want)
		}
	}
}
