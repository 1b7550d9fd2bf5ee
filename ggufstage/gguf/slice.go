package gguf

import (
	"errors"
	"fmt"
	"io"
	"slices"
	"strings"
)

// Metadata keys a slice carries so that it can be recognised and checked.
const (
	KeySliceStart  = "meshnode.slice.start"
	KeySliceEnd    = "meshnode.slice.end"
	KeySliceSource = "meshnode.slice.source_sha256"
	// KeySliceTypes holds ModelTypes of the whole source model, so that a
	// stage can make a choice that must be the same on every stage (a
	// decode path whose rounding differs from ggml's, say) from what the
	// whole model holds, not from its own part.
	KeySliceTypes = "meshnode.slice.model_types"
)

// ModelTypes summarises the tensor types of a whole model: one
// "kind=type" entry per kind of tensor and type it comes in, sorted, where
// a kind is a tensor's name without its "blk.N." prefix and a type is a
// ggml type number ("attn_q.weight=2", "output.weight=14"). A slice
// returns the summary of its source, which it carries.
func ModelTypes(f *File) []string {
	if v, ok := f.Get(KeySliceTypes); ok {
		if s, ok := v.V.([]string); ok {
			return s
		}
	}
	seen := map[string]bool{}
	for _, t := range f.Tensors {
		kind := t.Name
		if rest, ok := strings.CutPrefix(kind, "blk."); ok {
			if _, after, ok := strings.Cut(rest, "."); ok {
				kind = after
			}
		}
		seen[fmt.Sprintf("%s=%d", kind, t.Type)] = true
	}
	out := make([]string, 0, len(seen))
	for k := range seen {
		out = append(out, k)
	}
	slices.Sort(out)
	return out
}

// SliceKVs returns the metadata of a slice of f: f's own, and the slice
// keys. WriteSlice writes it; a slice fetched by byte range must carry the
// same, so that the two are the same bytes.
func SliceKVs(f *File, start, end int, sourceHash string) []KV {
	types := ModelTypes(f)
	sl := &File{KVs: append([]KV(nil), f.KVs...)}
	sl.Set(KeySliceStart, Value{Type: TypeUint32, V: uint32(start)})
	sl.Set(KeySliceEnd, Value{Type: TypeUint32, V: uint32(end)})
	if sourceHash != "" {
		sl.Set(KeySliceSource, Value{Type: TypeString, V: sourceHash})
	}
	sl.Set(KeySliceTypes, Value{Type: TypeArray, ElemType: TypeString, V: types})
	return sl.KVs
}

// Part is one tensor of a slice: where it comes from in the source file and
// the name it is stored under in the slice.
type Part struct {
	Src  TensorInfo
	Name string
}

// BlockCount is "{arch}.block_count".
func (f *File) BlockCount() (int, error) {
	n, ok := f.ArchUint("block_count")
	if !ok || n == 0 || n > 1<<16 {
		return 0, fmt.Errorf("%w: %s.block_count missing or invalid", ErrFormat, f.Arch())
	}
	return int(n), nil
}

// StageParts returns the tensors a stage running layers [start,end) needs:
// its blocks, the token embedding on the first stage, the output norm and
// head on the last, and the small global tensors (rope factors) everywhere.
//
// A model whose head is tied to the embedding stores no output.weight; a
// last stage that is not also the first then stores the embedding under the
// name output.weight, so that it holds one copy and not two.
func StageParts(f *File, start, end int) ([]Part, error) {
	layers, err := f.BlockCount()
	if err != nil {
		return nil, err
	}
	if start < 0 || end > layers || start >= end {
		return nil, fmt.Errorf("layer range [%d,%d) is not inside the model's %d layers", start, end, layers)
	}
	first, last := start == 0, end == layers
	_, hasOutput := f.Tensor("output.weight")

	seen := make([]bool, layers)
	var parts []Part
	for _, t := range f.Tensors {
		name := t.Name
		if b := Block(name); b >= 0 {
			if b >= layers {
				return nil, fmt.Errorf("%w: tensor %q is in block %d but the model has %d blocks", ErrFormat, name, b, layers)
			}
			seen[b] = true
			if b >= start && b < end {
				parts = append(parts, Part{Src: t, Name: name})
			}
			continue
		}
		switch root, _, _ := strings.Cut(name, "."); root {
		case "token_embd", "position_embd", "token_types", "token_embd_norm":
			if first {
				parts = append(parts, Part{Src: t, Name: name})
			} else if last && !hasOutput && name == "token_embd.weight" {
				parts = append(parts, Part{Src: t, Name: "output.weight"})
			}
		case "output", "output_norm":
			if last {
				parts = append(parts, Part{Src: t, Name: name})
			}
		default:
			parts = append(parts, Part{Src: t, Name: name})
		}
	}
	for b := start; b < end; b++ {
		if !seen[b] {
			return nil, fmt.Errorf("%w: the file has no tensors for block %d", ErrFormat, b)
		}
	}
	return parts, nil
}

// PartsSize is the number of tensor bytes in parts.
func PartsSize(parts []Part) uint64 {
	var n uint64
	for _, p := range parts {
		n += p.Src.Size()
	}
	return n
}

// WriteSlice writes a GGUF holding only parts, with f's metadata plus the
// slice keys, reading tensor data from src (the source file, or anything
// that serves its bytes). progress, if set, is called with bytes copied.
func WriteSlice(dst io.WriterAt, f *File, src io.ReaderAt, parts []Part, start, end int, sourceHash string, progress func(done, total uint64)) error {
	sl := &File{KVs: SliceKVs(f, start, end, sourceHash), Alignment: f.Alignment}
	infos := make([]TensorInfo, len(parts))
	for i, p := range parts {
		infos[i] = TensorInfo{Name: p.Name, Shape: p.Src.Shape, Type: p.Src.Type}
	}
	hw := &offsetWriter{w: dst}
	dataOff, err := Write(hw, sl.KVs, infos, f.Alignment)
	if err != nil {
		return fmt.Errorf("writing slice header: %w", err)
	}
	total := PartsSize(parts)
	var done uint64
	buf := make([]byte, 4<<20)
	for i, p := range parts {
		srcOff, n := f.Range(&p.Src)
		dstOff := dataOff + infos[i].Offset
		for n > 0 {
			chunk := buf[:min(uint64(len(buf)), n)]
			if _, err := src.ReadAt(chunk, int64(srcOff)); err != nil && !(errors.Is(err, io.EOF) && len(chunk) > 0) {
				return fmt.Errorf("reading tensor %q: %w", p.Src.Name, err)
			}
			if _, err := dst.WriteAt(chunk, int64(dstOff)); err != nil {
				return fmt.Errorf("writing tensor %q: %w", p.Name, err)
			}
			srcOff += uint64(len(chunk))
			dstOff += uint64(len(chunk))
			n -= uint64(len(chunk))
			done += uint64(len(chunk))
			if progress != nil {
				progress(done, total)
			}
		}
	}
	// Pad the file to the aligned end so that readers that check the last
	// tensor's padding are satisfied.
	if len(infos) > 0 {
		lastEnd := dataOff + infos[len(infos)-1].Offset + infos[len(infos)-1].Size()
		if pad := align(lastEnd, f.Alignment) - lastEnd; pad > 0 {
			if _, err := dst.WriteAt(make([]byte, pad), int64(lastEnd)); err != nil {
				return fmt.Errorf("padding slice: %w", err)
			}
		}
	}
	return nil
}

type offsetWriter struct {
	w   io.WriterAt
	off int64
}

func (o *offsetWriter) Write(p []byte) (int, error) {
	n, err := o.w.WriteAt(p, o.off)
	o.off += int64(n)
	return n, err
}
