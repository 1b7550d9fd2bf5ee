// Package weights finds and fetches model files: the default model, and
// the byte ranges of a stage's slice from peers or Hugging Face.
package weights

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"time"
)

// The default model: karpathy's stories260K, a 1.2 MB llama trained on
// TinyStories (MIT), as published in ggml-org's model collection.
const (
	DefaultModelName   = "stories260K.gguf"
	DefaultModelRepo   = "ggml-org/models"
	DefaultModelFile   = "tinyllamas/stories260K.gguf"
	DefaultModelSHA256 = "270cba1bd5109f42d03350f60406024560464db173c0e387d91f0426d3bd256d"
)

// HFEndpoint is the Hugging Face base URL: $HF_ENDPOINT (as the hub's own
// tools read it) or the public hub.
func HFEndpoint() string {
	if e := strings.TrimRight(os.Getenv("HF_ENDPOINT"), "/"); e != "" {
		return e
	}
	return "https://huggingface.co"
}

// CacheDir is where downloaded models live: $MESHNODE_CACHE, else the
// user cache dir (~/.cache/meshnode on Linux).
func CacheDir() string {
	if d := os.Getenv("MESHNODE_CACHE"); d != "" {
		return d
	}
	if d, err := os.UserCacheDir(); err == nil {
		return filepath.Join(d, "meshnode")
	}
	return filepath.Join(os.TempDir(), "meshnode-cache")
}

// LocalModelDirs are searched for the default model before any download:
// the shared models folder beside a checkout (../shared/models, as the
// project's machines lay it out) and $MESHNODE_MODELS.
func LocalModelDirs() []string {
	var dirs []string
	if d := os.Getenv("MESHNODE_MODELS"); d != "" {
		dirs = append(dirs, d)
	}
	return append(dirs, filepath.Join("..", "shared", "models"))
}

// Progress reports a download: bytes done of total (total 0 if unknown).
type Progress func(what string, done, total uint64)

// DefaultModel returns the path of the default model: a local copy if one
// is present, else the cached download, else it downloads it once into
// cacheDir, verifying its SHA-256.
func DefaultModel(ctx context.Context, cacheDir string, progress Progress) (string, error) {
	for _, d := range LocalModelDirs() {
		p := filepath.Join(d, DefaultModelName)
		if st, err := os.Stat(p); err == nil && st.Mode().IsRegular() {
			return p, nil
		}
	}
	dst := filepath.Join(cacheDir, "models", DefaultModelName)
	if ok, _ := fileHasSHA256(dst, DefaultModelSHA256); ok {
		return dst, nil
	}
	url := fmt.Sprintf("%s/%s/resolve/main/%s", HFEndpoint(), DefaultModelRepo, DefaultModelFile)
	if err := Download(ctx, url, dst, DefaultModelSHA256, progress); err != nil {
		return "", fmt.Errorf("fetching the default model (%s): %w; pass --model PATH.gguf to use a local file", url, err)
	}
	return dst, nil
}

func fileHasSHA256(path, want string) (bool, error) {
	f, err := os.Open(path)
	if err != nil {
		return false, err
	}
	defer f.Close()
	h := sha256.New()
	if _, err := io.Copy(h, f); err != nil {
		return false, err
	}
	return hex.EncodeToString(h.Sum(nil)) == want, nil
}

// Download fetches url into dst through a temporary file, checks the
// SHA-256 when want is set, and only then puts the file in place. It sends
// $HF_TOKEN as a bearer token to the Hugging Face endpoint.
func Download(ctx context.Context, url, dst, want string, progress Progress) error {
	if err := os.MkdirAll(filepath.Dir(dst), 0o700); err != nil {
		return err
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return err
	}
	if tok := os.Getenv("HF_TOKEN"); tok != "" && strings.HasPrefix(url, HFEndpoint()) {
		req.Header.Set("Authorization", "Bearer "+tok)
	}
	client := &http.Client{Timeout: 30 * time.Minute}
	resp, err := client.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("GET %s: %s", url, resp.Status)
	}
	tmp, err := os.CreateTemp(filepath.Dir(dst), ".download-*")
	if err != nil {
		return err
	}
	defer os.Remove(tmp.Name())
	h := sha256.New()
	total := uint64(max(resp.ContentLength, 0))
	var done uint64
	buf := make([]byte, 1<<20)
	for {
		n, rerr := resp.Body.Read(buf)
		if n > 0 {
			if _, err := tmp.Write(buf[:n]); err != nil {
				tmp.Close()
				return err
			}
			h.Write(buf[:n])
			done += uint64(n)
			if progress != nil {
				progress("downloading "+filepath.Base(dst), done, total)
			}
		}
		if errors.Is(rerr, io.EOF) {
			break
		}
		if rerr != nil {
			tmp.Close()
			return rerr
		}
	}
	if err := tmp.Close(); err != nil {
		return err
	}
	if got := hex.EncodeToString(h.Sum(nil)); want != "" && got != want {
		return fmt.Errorf("downloaded file has SHA-256 %s, want %s", got, want)
	}
	return os.Rename(tmp.Name(), dst)
}
