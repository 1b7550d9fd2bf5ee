package mlxstage

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/meshnode/meshnode/mlxstage/safetensors"
)

func names(m *Manifest) []string {
	var out []string
	for _, f := range m.Files {
		out = append(out, f.Name)
	}
	return out
}

// TestManifest lists the files serving a model reads, and only those, for
// a single-file and a sharded model, with their sizes and hashes.
func TestManifest(t *testing.T) {
	_, sharded := writeTwin(t, "qwen2", 3)
	// Files the engine never reads stay out of the manifest.
	if err := os.WriteFile(filepath.Join(sharded, "README.md"), []byte("# model"), 0o644); err != nil {
		t.Fatal(err)
	}
	shardNames, err := filepath.Glob(filepath.Join(sharded, "*.safetensors"))
	if err != nil || len(shardNames) != 3 {
		t.Fatalf("shards %v %v", shardNames, err)
	}
	var wantSharded []string
	for _, p := range shardNames {
		wantSharded = append(wantSharded, filepath.Base(p))
	}
	for _, n := range []string{"config.json", "tokenizer.json", safetensors.IndexName, "tokenizer_config.json", "generation_config.json"} {
		if _, err := os.Stat(filepath.Join(sharded, n)); err == nil {
			wantSharded = append(wantSharded, n)
		}
	}
	slices.Sort(wantSharded)
	if !slices.Contains(wantSharded, safetensors.IndexName) {
		t.Fatalf("the sharded twin has no %s", safetensors.IndexName)
	}

	cases := []struct {
		name string
		dir  string
		want []string
	}{
		{"stories260K-hf", storiesHF, []string{"config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"}},
		{"sharded", sharded, wantSharded},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			m, err := BuildManifest(c.dir, nil)
			if err != nil {
				t.Fatal(err)
			}
			if got := names(m); !slices.Equal(got, c.want) {
				t.Fatalf("files %v, want %v", got, c.want)
			}
			for _, f := range m.Files {
				b, err := os.ReadFile(filepath.Join(c.dir, f.Name))
				if err != nil {
					t.Fatal(err)
				}
				if sum := sha256.Sum256(b); f.Size != int64(len(b)) || f.SHA256 != hex.EncodeToString(sum[:]) {
					t.Errorf("%s: size %d hash %s, want %d %x", f.Name, f.Size, f.SHA256, len(b), sum)
				}
				if f.Weights() != strings.HasSuffix(f.Name, ".safetensors") {
					t.Errorf("%s: Weights() = %v", f.Name, f.Weights())
				}
			}
			enc := m.Encode()
			back, err := ParseManifest(enc)
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(back.Encode(), enc) || back.ID() != m.ID() {
				t.Error("a parsed manifest encodes differently")
			}
			if sum := sha256.Sum256(enc); m.ID() != hex.EncodeToString(sum[:]) {
				t.Errorf("ID %s is not the hash of the encoding", m.ID())
			}
			// Through its Opener the model loads as from the directory.
			open := m.Opener(func(f ManifestFile) (safetensors.Source, error) { return safetensors.Dir(c.dir)(f.Name) })
			if _, err := ReadInfo(open, QuantNone); err != nil {
				t.Errorf("ReadInfo through the manifest: %v", err)
			}
		})
	}
}

func TestManifestErrors(t *testing.T) {
	good, err := BuildManifest(storiesHF, nil)
	if err != nil {
		t.Fatal(err)
	}
	edit := func(f func(m *Manifest)) []byte {
		m := *good
		m.Files = slices.Clone(good.Files)
		f(&m)
		return m.Encode()
	}
	cases := []struct {
		name string
		enc  []byte
		want string
	}{
		{"not json", []byte("{"), "decoding the model manifest"},
		{"other format", edit(func(m *Manifest) { m.Format = "meshnode.safetensors/v0" }), "format"},
		{"escaping name", edit(func(m *Manifest) { m.Files[0].Name = "../config.json" }), "bad file name"},
		{"absolute name", edit(func(m *Manifest) { m.Files[0].Name = "/etc/passwd" }), "bad file name"},
		{"listed twice", edit(func(m *Manifest) { m.Files[1] = m.Files[0] }), "out of order or listed twice"},
		{"out of order", edit(func(m *Manifest) { m.Files[0], m.Files[1] = m.Files[1], m.Files[0] }), "out of order"},
		{"negative size", edit(func(m *Manifest) { m.Files[0].Size = -1 }), "size -1"},
		{"not a hash", edit(func(m *Manifest) { m.Files[0].SHA256 = strings.ToUpper(m.Files[0].SHA256) }), "64 lowercase hex"},
		{"no config", edit(func(m *Manifest) { m.Files = m.Files[1:] }), "no config.json"},
		{"too large", bytes.Repeat([]byte(" "), MaxManifest+1), "over the"},
	}
	for _, c := range cases {
		if _, err := ParseManifest(c.enc); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: err = %v, want one saying %q", c.name, err, c.want)
		}
	}

	// The Opener refuses what the manifest does not list, and a source of
	// another size than listed.
	open := good.Opener(func(f ManifestFile) (safetensors.Source, error) {
		if f.Name == "tokenizer.json" {
			return safetensors.Dir(storiesHF)("config.json")
		}
		return safetensors.Dir(storiesHF)(f.Name)
	})
	if _, err := open("README.md"); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("opening an unlisted file: %v, want fs.ErrNotExist", err)
	}
	if _, err := open("tokenizer.json"); err == nil || !strings.Contains(err.Error(), "the manifest says") {
		t.Errorf("opening a file of the wrong size: %v", err)
	}

	if _, err := BuildManifest(t.TempDir(), nil); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("a directory without config.json: %v", err)
	}
	noTok := t.TempDir()
	for _, n := range []string{"config.json", "model.safetensors"} {
		if err := os.Symlink(filepath.Join(mustAbs(t, storiesHF), n), filepath.Join(noTok, n)); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := BuildManifest(noTok, nil); !errors.Is(err, fs.ErrNotExist) || !strings.Contains(err.Error(), "tokenizer.json") {
		t.Errorf("a directory without tokenizer.json: %v", err)
	}
}

func mustAbs(t *testing.T, p string) string {
	t.Helper()
	a, err := filepath.Abs(p)
	if err != nil {
		t.Fatal(err)
	}
	return a
}
