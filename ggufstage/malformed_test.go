package ggufstage

// Broken model files must give an error that says what is wrong, never a
// panic (ggml and ollama abort or panic on bad input, so everything has to
// be caught before them) and never a huge allocation. Models come from
// users and, in the mesh, from peers.

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/meshnode/meshnode/ggufstage/gguf"
	"github.com/meshnode/meshnode/ggufstage/synth"
	"github.com/meshnode/meshnode/stage"
	"github.com/ollama/ollama/ml"
)

// ggufLayout locates the sections of a GGUF file: where the metadata ends
// (the tensor table starts) and where each tensor table entry ends. It
// re-encodes the header with gguf.Write and checks that the bytes agree
// with the file, so that the offsets used to cut and patch files below are
// right by construction.
type ggufLayout struct {
	meta     *gguf.File
	kvEnd    int   // first byte of the tensor table
	entryEnd []int // end of each tensor table entry
}

func layoutOf(t *testing.T, data []byte) ggufLayout {
	t.Helper()
	meta, err := gguf.Read(bytes.NewReader(data), int64(len(data)))
	if err != nil {
		t.Fatal(err)
	}
	var kvOnly bytes.Buffer
	if _, err := gguf.Write(&kvOnly, meta.KVs, nil, 1); err != nil { // alignment 1: no padding
		t.Fatal(err)
	}
	l := ggufLayout{meta: meta, kvEnd: kvOnly.Len()}
	// The tensor count (bytes 8..16) differs between the two; the rest of the
	// header and the metadata must be byte for byte the same.
	if !bytes.Equal(kvOnly.Bytes()[16:], data[16:l.kvEnd]) {
		t.Fatal("re-encoded metadata does not match the file")
	}
	pos := l.kvEnd
	for _, ti := range meta.Tensors {
		if n := binary.LittleEndian.Uint64(data[pos:]); n != uint64(len(ti.Name)) || string(data[pos+8:pos+8+int(n)]) != ti.Name {
			t.Fatalf("tensor table entry at %d is not %s", pos, ti.Name)
		}
		pos += 8 + len(ti.Name) + 4 + 8*len(ti.Shape) + 4 + 8
		l.entryEnd = append(l.entryEnd, pos)
	}
	if uint64(pos) > meta.DataOffset {
		t.Fatalf("tensor table ends at %d, after the data at %d", pos, meta.DataOffset)
	}
	return l
}

// rewriteGGUF writes a copy of src's model to dst with its metadata and
// tensor table passed through edit; the data of every tensor that keeps its
// name and size is copied, laid out afresh.
func rewriteGGUF(t *testing.T, src, dst string, edit func(kvs []gguf.KV, ts []gguf.TensorInfo) ([]gguf.KV, []gguf.TensorInfo)) {
	t.Helper()
	data, err := os.ReadFile(src)
	if err != nil {
		t.Fatal(err)
	}
	meta, err := gguf.Read(bytes.NewReader(data), int64(len(data)))
	if err != nil {
		t.Fatal(err)
	}
	kvs, ts := edit(slices.Clone(meta.KVs), slices.Clone(meta.Tensors))
	var out bytes.Buffer
	dataOff, err := gguf.Write(&out, kvs, ts, meta.Alignment)
	if err != nil {
		t.Fatal(err)
	}
	file := out.Bytes()
	for _, ti := range ts {
		orig, ok := meta.Tensor(ti.Name)
		if !ok || orig.Size() != ti.Size() {
			continue
		}
		off, n := meta.Range(orig)
		end := dataOff + ti.Offset + n
		if end > 1<<28 {
			continue // laid out after an absurd tensor: the file just ends
		}
		if grow := int(end) - len(file); grow > 0 {
			file = append(file, make([]byte, grow)...)
		}
		copy(file[dataOff+ti.Offset:end], data[off:off+n])
	}
	if err := os.WriteFile(dst, file, 0o644); err != nil {
		t.Fatal(err)
	}
}

func setArch(arch string) func([]gguf.KV, []gguf.TensorInfo) ([]gguf.KV, []gguf.TensorInfo) {
	return func(kvs []gguf.KV, ts []gguf.TensorInfo) ([]gguf.KV, []gguf.TensorInfo) {
		for i := range kvs {
			if kvs[i].Key == "general.architecture" {
				kvs[i].Value = gguf.Value{Type: gguf.TypeString, V: arch}
			}
		}
		return kvs, ts
	}
}

func dropTensor(name string) func([]gguf.KV, []gguf.TensorInfo) ([]gguf.KV, []gguf.TensorInfo) {
	return func(kvs []gguf.KV, ts []gguf.TensorInfo) ([]gguf.KV, []gguf.TensorInfo) {
		return kvs, slices.DeleteFunc(ts, func(ti gguf.TensorInfo) bool { return ti.Name == name })
	}
}

func setShape(name string, shape ...uint64) func([]gguf.KV, []gguf.TensorInfo) ([]gguf.KV, []gguf.TensorInfo) {
	return func(kvs []gguf.KV, ts []gguf.TensorInfo) ([]gguf.KV, []gguf.TensorInfo) {
		for i := range ts {
			if ts[i].Name == name {
				ts[i].Shape = shape
			}
		}
		return kvs, ts
	}
}

// expect is what one entry point must do with a file: fail with an error
// containing every piece of err, or succeed when err is nil.
type expect struct {
	err []string
}

func fails(pieces ...string) expect { return expect{err: pieces} }

var succeeds = expect{}

// call runs f, turning a panic into a test failure.
func call(t *testing.T, what string, f func() error) (err error) {
	t.Helper()
	defer func() {
		if r := recover(); r != nil {
			t.Fatalf("%s panicked: %v", what, r)
		}
	}()
	return f()
}

func (e expect) check(t *testing.T, what string, err error) {
	t.Helper()
	if e.err == nil {
		if err != nil {
			t.Errorf("%s: %v", what, err)
		}
		return
	}
	if err == nil {
		t.Errorf("%s succeeded, want an error containing %q", what, e.err)
		return
	}
	for _, p := range e.err {
		if !strings.Contains(err.Error(), p) {
			t.Errorf("%s: error %q does not contain %q", what, err, p)
		}
	}
	// ggml's panics are turned into errors that carry a stack trace; a
	// malformed file must be caught before it reaches ggml at all.
	if strings.Contains(err.Error(), "engine panic") {
		t.Errorf("%s reached ggml: %v", what, err)
	}
}

func TestMalformedFiles(t *testing.T) {
	dir := t.TempDir()
	src := filepath.Join(dir, "good.gguf")
	if err := synth.Write(src, synth.Tiny("qwen3"), nil); err != nil {
		t.Fatal(err)
	}
	good, err := os.ReadFile(src)
	if err != nil {
		t.Fatal(err)
	}
	l := layoutOf(t, good)
	firstData, _ := l.meta.Range(&l.meta.Tensors[0])
	lastOff, lastLen := l.meta.Range(&l.meta.Tensors[len(l.meta.Tensors)-1])
	if lastOff+lastLen != uint64(len(good)) {
		t.Fatalf("synth file has %d bytes after its last tensor", uint64(len(good))-lastOff-lastLen)
	}

	write := func(name string, data []byte) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, data, 0o644); err != nil {
			t.Fatal(err)
		}
		return p
	}
	truncated := func(n int) func() string {
		return func() string { return write(fmt.Sprintf("trunc-%d.gguf", n), good[:n]) }
	}
	patched := func(name string, at int, v uint64) func() string {
		return func() string {
			b := slices.Clone(good)
			binary.LittleEndian.PutUint64(b[at:], v)
			return write(name, b)
		}
	}
	rewritten := func(name string, edit func([]gguf.KV, []gguf.TensorInfo) ([]gguf.KV, []gguf.TensorInfo)) func() string {
		return func() string {
			p := filepath.Join(dir, name)
			rewriteGGUF(t, src, p, edit)
			return p
		}
	}
	// Where the first tensor's offset field sits: the last 8 bytes of its
	// table entry.
	firstOffsetField := l.entryEnd[0] - 8
	// The first tensor's first dimension: after its name length, name and
	// dimension count.
	firstDim := l.kvEnd + 8 + len(l.meta.Tensors[0].Name) + 4

	const missing = "blk.1.attn_q.weight"
	notGGUF := fails("not a GGUF file")
	allFail := func(pieces ...string) map[string]expect {
		e := fails(pieces...)
		return map[string]expect{"Open": e, "Slice": e, "LoadTokenizer": e, "ReadInfo": e}
	}

	tests := []struct {
		name string
		file func() string
		want map[string]expect // by entry point
	}{
		{"truncated in magic", truncated(2), allFail("malformed GGUF", "file ends early")},
		{"truncated in header counts", truncated(20), allFail("malformed GGUF", "file ends early")},
		// The header's counts are checked against the bytes that follow
		// before anything is read or allocated.
		{"truncated after header", truncated(24), allFail("malformed GGUF", "more than the file can hold")},
		{"truncated in metadata", truncated(l.kvEnd / 2), allFail("malformed GGUF")},
		{"truncated at end of metadata", truncated(l.kvEnd - 1), allFail("malformed GGUF")},
		{"truncated in tensor table", truncated(l.entryEnd[len(l.entryEnd)/2] + 5), allFail("malformed GGUF", "file ends early")},
		{"truncated at end of tensor table", truncated(l.entryEnd[len(l.entryEnd)-1] - 1), allFail("malformed GGUF", "file ends early")},
		{"truncated before data", truncated(int(firstData)), allFail("malformed GGUF", "past the end of the file")},
		{"truncated in data", truncated(int(firstData+lastOff+lastLen) / 2), allFail("malformed GGUF", "past the end of the file", "truncated?")},
		{"last byte missing", truncated(len(good) - 1), allFail("malformed GGUF", l.meta.Tensors[len(l.meta.Tensors)-1].Name, "past the end of the file")},
		{"wrong magic", func() string {
			b := slices.Clone(good)
			copy(b, "GGML")
			return write("magic.gguf", b)
		}, allFail("not a GGUF file")},
		{"unknown version", func() string {
			b := slices.Clone(good)
			binary.LittleEndian.PutUint32(b[4:], 99)
			return write("version.gguf", b)
		}, allFail("GGUF version 99")},
		{"absurd tensor count", patched("ntensors.gguf", 8, 1<<40), allFail("malformed GGUF", "tensors")},
		{"absurd metadata count", patched("nkv.gguf", 16, 1<<62), allFail("malformed GGUF", "metadata entries")},
		{"absurd dimension", patched("dim.gguf", firstDim, 1<<62), allFail("absurd dimension", l.meta.Tensors[0].Name)},
		// Each dimension is plausible; their product is not.
		{"absurd element count", rewritten("elems.gguf", setShape("blk.0.attn_k.weight", 1<<30, 1<<30)), allFail("absurd dimension", "blk.0.attn_k.weight")},
		{"zero dimension", patched("zero.gguf", firstDim, 0), allFail("absurd dimension")},
		{"offset past EOF", patched("offset.gguf", firstOffsetField, 1<<32), allFail(l.meta.Tensors[0].Name, "past the end of the file")},
		{"offset unaligned", patched("unaligned.gguf", firstOffsetField, 3), allFail(l.meta.Tensors[0].Name, "not aligned")},
		// A shape that claims more bytes than the file holds.
		{"tensor larger than file", rewritten("big.gguf", setShape("blk.2.ffn_up.weight", 1<<20, 1<<20)), allFail("blk.2.ffn_up.weight", "past the end of the file")},
		{"unsupported architecture", rewritten("gemma.gguf", setArch("gemma3")), allFail("unsupported architecture", `"gemma3"`, "llama, qwen2, qwen3")},
		{"no architecture", rewritten("noarch.gguf", setArch("")), allFail("unsupported architecture")},
		{"missing tensor", rewritten("missing.gguf", dropTensor(missing)), map[string]expect{
			"Open":  fails(missing),
			"Slice": fails(missing),
			// Metadata alone is intact: the tokenizer loads.
			"LoadTokenizer": succeeds,
			"ReadInfo":      fails(missing),
		}},
		{"missing block", rewritten("noblock.gguf", func(kvs []gguf.KV, ts []gguf.TensorInfo) ([]gguf.KV, []gguf.TensorInfo) {
			return kvs, slices.DeleteFunc(ts, func(ti gguf.TensorInfo) bool { return gguf.Block(ti.Name) == 1 })
		}), map[string]expect{
			"Open": fails("blk.1."), "Slice": fails("block 1"), "LoadTokenizer": succeeds, "ReadInfo": fails("blk.1."),
		}},
		{"random bytes", func() string {
			b := make([]byte, 4096)
			r := rand.New(rand.NewPCG(5, 6))
			for i := range b {
				b[i] = byte(r.Uint32())
			}
			return write("random.gguf", b)
		}, allFail("not a GGUF file")},
		{"empty file", func() string { return write("empty.gguf", nil) }, allFail("empty", "not a GGUF file")},
		{"text file", func() string { return write("readme.gguf", []byte("# not a model\n")) }, map[string]expect{
			"Open": notGGUF, "Slice": notGGUF, "LoadTokenizer": notGGUF, "ReadInfo": notGGUF,
		}},
		{"directory", func() string {
			p := filepath.Join(dir, "models.gguf")
			if err := os.Mkdir(p, 0o755); err != nil {
				t.Fatal(err)
			}
			return p
		}, allFail("is a directory")},
		{"no such file", func() string { return filepath.Join(dir, "absent.gguf") }, allFail("no such file")},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			path := tt.file()
			calls := map[string]func() error{
				"Open": func() error {
					e, err := Open(path, 0, 3, tinyOpts)
					if e != nil {
						e.Close()
					}
					return err
				},
				"Slice": func() error {
					_, err := Slice(path, t.TempDir(), 0, 2, nil)
					return err
				},
				"LoadTokenizer": func() error {
					_, err := LoadTokenizer(path)
					return err
				},
				"ReadInfo": func() error {
					_, err := ReadInfo(path)
					return err
				},
			}
			for _, what := range []string{"Open", "Slice", "LoadTokenizer", "ReadInfo"} {
				want, ok := tt.want[what]
				if !ok {
					t.Fatalf("no expectation for %s", what)
				}
				err := call(t, what, calls[what])
				want.check(t, what, err)
				// Format errors are recognisable as such by callers (the
				// node tells a bad file from a bad setup).
				if err != nil && want.err != nil && !strings.Contains(tt.name, "architecture") &&
					tt.name != "directory" && tt.name != "no such file" && !errors.Is(err, gguf.ErrFormat) {
					t.Errorf("%s: %v does not wrap gguf.ErrFormat", what, err)
				}
				if err != nil && !strings.Contains(err.Error(), filepath.Base(path)) {
					t.Errorf("%s: error %q does not name the file", what, err)
				}
			}
		})
	}
}

// TestMissingTensorOutsideRange: a file that lacks a tensor of block 1 is
// still good for a stage that does not run block 1, and its slice of the
// layers that do need it is refused before it is written.
func TestMissingTensorOutsideRange(t *testing.T) {
	dir := t.TempDir()
	src := filepath.Join(dir, "good.gguf")
	if err := synth.Write(src, synth.Tiny("llama"), nil); err != nil {
		t.Fatal(err)
	}
	broken := filepath.Join(dir, "broken.gguf")
	rewriteGGUF(t, src, broken, dropTensor("blk.1.attn_q.weight"))

	data := t.TempDir()
	path, err := Slice(broken, data, 2, 3, nil)
	if err != nil {
		t.Fatalf("slicing layers [2,3), which do not need the tensor: %v", err)
	}
	e, err := Open(path, 2, 3, tinyOpts)
	if err != nil {
		t.Fatalf("opening layers [2,3): %v", err)
	}
	e.Close()
	if e, err := Open(broken, 2, 3, tinyOpts); err != nil {
		t.Errorf("opening layers [2,3) of the whole broken file: %v", err)
	} else {
		e.Close()
	}

	if _, err := Slice(broken, data, 1, 2, nil); err == nil || !strings.Contains(err.Error(), "blk.1.attn_q.weight") {
		t.Errorf("slicing layers [1,2): %v, want an error naming blk.1.attn_q.weight", err)
	}
	entries, _ := os.ReadDir(filepath.Join(data, "slices"))
	for _, d := range entries {
		if strings.HasSuffix(d.Name(), "-1-2.gguf") {
			t.Errorf("a slice of the broken range was written: %s", d.Name())
		}
	}
}

// TestKVTypeChecked: KV cache types that would make ggml abort the process
// (a C abort: no recover catches it) are refused with an error, and a
// valid quantized cache runs.
func TestKVTypeChecked(t *testing.T) {
	qwen := writeTiny(t, "qwen3", synth.F32) // head dimension 32
	tests := []struct {
		name    string
		path    string
		kv      ml.DType
		fa      Switch
		wantErr string
	}{
		{"f16", storiesPath, ml.DTypeF16, Off, ""},
		{"q8_0 without flash attention", qwen, ml.DTypeQ80, Off, "needs flash attention"},
		{"q8_0, flash attention auto on the CPU", qwen, ml.DTypeQ80, Auto, "needs flash attention"},
		{"q8_0, head dimension 8", storiesPath, ml.DTypeQ80, On, "multiple of 32"},
		{"q8_0, head dimension 32", qwen, ml.DTypeQ80, On, ""},
		{"i32", storiesPath, ml.DTypeI32, On, "not supported"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			e, err := Open(tt.path, 0, 2, Options{Threads: 1, MaxSeqs: 1, Context: 64, KVType: tt.kv, FlashAttention: tt.fa, Device: "cpu"})
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("err %v, want one saying %q", err, tt.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			defer e.Close()
			if err := e.Open(1); err != nil {
				t.Fatal(err)
			}
			out, err := e.Forward(context.Background(), &stage.Batch{Seqs: []stage.SeqID{1, 1}, Pos: []int32{0, 1}, Tokens: []int32{1, 2}})
			if err != nil {
				t.Fatal(err)
			}
			if out.Hidden == nil {
				t.Fatal("no hidden states")
			}
		})
	}
}
