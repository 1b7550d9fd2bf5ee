package mlxstage

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"github.com/meshnode/meshnode/mlxstage/safetensors"
)

// ManifestFormat names the manifest's encoding, so that a change of it
// gives other model IDs rather than misread ones.
const ManifestFormat = "meshnode.safetensors/v1"

// MaxManifest bounds an encoded manifest: a model of thousands of shards
// stays far below it, and a peer cannot make a reader allocate freely.
const MaxManifest = 1 << 20

// Manifest lists the files of a safetensors model that serving it reads
// (config, tokenizer, index, shards) with their sizes and SHA-256. A mesh
// names the model by the SHA-256 of its encoding (ID), and peers fetch the
// files by their hashes: a directory is content-addressed as a GGUF file is.
type Manifest struct {
	Format string         `json:"format"`
	Files  []ManifestFile `json:"files"` // sorted by name
}

// ManifestFile is one file of a Manifest.
type ManifestFile struct {
	Name   string `json:"name"` // slash-separated, relative to the model directory
	Size   int64  `json:"size"`
	SHA256 string `json:"sha256"` // lowercase hex
}

// Weights reports whether the file holds tensors (a shard), as opposed to
// a small side file (JSON) that is read whole.
func (f ManifestFile) Weights() bool { return strings.HasSuffix(f.Name, ".safetensors") }

// sideFiles are read when present; config.json and tokenizer.json are
// required (an engine needs the first, serving the second).
var sideFiles = []string{"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"}

// ModelFiles lists the files of the model in dir that serving it reads:
// config.json, the tokenizer's files, generation_config.json, and the
// weights (model.safetensors, or the index and every shard it names).
// Anything else in the directory (README, original checkpoints) is left out.
func ModelFiles(dir string) ([]string, error) {
	var names []string
	for _, n := range sideFiles {
		switch _, err := os.Stat(filepath.Join(dir, n)); {
		case err == nil:
			names = append(names, n)
		case errors.Is(err, fs.ErrNotExist) && n != "config.json" && n != "tokenizer.json":
		default:
			return nil, fmt.Errorf("listing the files of %s: %w", dir, err)
		}
	}
	idx, err := os.ReadFile(filepath.Join(dir, safetensors.IndexName))
	switch {
	case err == nil:
		ix, err := safetensors.ParseIndex(idx)
		if err != nil {
			return nil, fmt.Errorf("listing the files of %s: %w", dir, err)
		}
		names = append(names, safetensors.IndexName)
		var shards []string
		for _, f := range ix.WeightMap {
			shards = append(shards, f)
		}
		slices.Sort(shards)
		names = append(names, slices.Compact(shards)...)
	case errors.Is(err, fs.ErrNotExist):
		names = append(names, safetensors.SingleName)
	default:
		return nil, fmt.Errorf("listing the files of %s: %w", dir, err)
	}
	slices.Sort(names)
	return names, nil
}

// BuildManifest lists the model in dir (ModelFiles) with each file's size
// and hash, as hash computes it from the file's path (a caller that caches
// hashes of large files passes its own; nil hashes every file).
func BuildManifest(dir string, hash func(path string) (string, error)) (*Manifest, error) {
	if hash == nil {
		hash = hashFile
	}
	names, err := ModelFiles(dir)
	if err != nil {
		return nil, err
	}
	m := &Manifest{Format: ManifestFormat}
	for _, n := range names {
		p := filepath.Join(dir, filepath.FromSlash(n))
		st, err := os.Stat(p)
		if err != nil {
			return nil, fmt.Errorf("listing the files of %s: %w", dir, err)
		}
		if !st.Mode().IsRegular() {
			return nil, fmt.Errorf("listing the files of %s: %s is not a regular file", dir, n)
		}
		sum, err := hash(p)
		if err != nil {
			return nil, fmt.Errorf("hashing %s: %w", p, err)
		}
		m.Files = append(m.Files, ManifestFile{Name: n, Size: st.Size(), SHA256: sum})
	}
	return m, m.check()
}

func hashFile(path string) (string, error) {
	f, err := os.Open(path)
	if err != nil {
		return "", err
	}
	defer f.Close()
	h := sha256.New()
	if _, err := io.Copy(h, f); err != nil {
		return "", err
	}
	return hex.EncodeToString(h.Sum(nil)), nil
}

// Encode is the manifest's canonical bytes: what ID hashes and what peers
// serve.
func (m *Manifest) Encode() []byte {
	b, _ := json.Marshal(m) // strings and numbers only: cannot fail
	return b
}

// ID is the model's content ID: the hex SHA-256 of Encode.
func (m *Manifest) ID() string {
	sum := sha256.Sum256(m.Encode())
	return hex.EncodeToString(sum[:])
}

// ParseManifest reads an encoded manifest and checks it: the format, file
// names that stay inside the model directory, each listed once and in
// order, hashes that are hashes, and config.json among them.
func ParseManifest(b []byte) (*Manifest, error) {
	if len(b) > MaxManifest {
		return nil, fmt.Errorf("model manifest of %d bytes is over the %d limit", len(b), MaxManifest)
	}
	var m Manifest
	if err := json.Unmarshal(b, &m); err != nil {
		return nil, fmt.Errorf("decoding the model manifest: %w", err)
	}
	return &m, m.check()
}

func (m *Manifest) check() error {
	if m.Format != ManifestFormat {
		return fmt.Errorf("model manifest format %q, want %q", m.Format, ManifestFormat)
	}
	hasConfig := false
	for i, f := range m.Files {
		switch {
		case !safetensors.ValidName(f.Name):
			return fmt.Errorf("model manifest: bad file name %q", f.Name)
		case i > 0 && m.Files[i-1].Name >= f.Name:
			return fmt.Errorf("model manifest: %q is out of order or listed twice", f.Name)
		case f.Size < 0:
			return fmt.Errorf("model manifest: %s has size %d", f.Name, f.Size)
		case !isSHA256(f.SHA256):
			return fmt.Errorf("model manifest: %s has hash %q, want 64 lowercase hex digits", f.Name, f.SHA256)
		}
		hasConfig = hasConfig || f.Name == "config.json"
	}
	if !hasConfig {
		return errors.New("model manifest lists no config.json")
	}
	return nil
}

func isSHA256(s string) bool {
	if len(s) != 64 {
		return false
	}
	for _, c := range s {
		if !('0' <= c && c <= '9' || 'a' <= c && c <= 'f') {
			return false
		}
	}
	return true
}

// File finds a file by name.
func (m *Manifest) File(name string) (ManifestFile, bool) {
	i, ok := slices.BinarySearchFunc(m.Files, name, func(f ManifestFile, n string) int { return strings.Compare(f.Name, n) })
	if !ok {
		return ManifestFile{}, false
	}
	return m.Files[i], true
}

// Opener opens the manifest's files through open (which may read them from
// anywhere: a local copy, a peer), refusing the names the manifest does not
// list, as missing ones, and a source whose size is not the listed one.
func (m *Manifest) Opener(open func(ManifestFile) (safetensors.Source, error)) safetensors.Opener {
	return func(name string) (safetensors.Source, error) {
		f, ok := m.File(name)
		if !ok {
			return nil, fmt.Errorf("model file %s: %w", name, fs.ErrNotExist)
		}
		src, err := open(f)
		if err != nil {
			return nil, err
		}
		if src.Size() != f.Size {
			if c, ok := src.(io.Closer); ok {
				c.Close()
			}
			return nil, fmt.Errorf("model file %s is %d bytes, the manifest says %d", name, src.Size(), f.Size)
		}
		return src, nil
	}
}
