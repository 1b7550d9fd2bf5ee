package bench

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
)

// LlamaCppEngine names llama.cpp's engine in rows.
const LlamaCppEngine = "llama.cpp"

// FindLlamaCpp returns the llamacpp-ref program beside the running
// executable (where `make llamacpp-ref` puts it), or "" when there is none.
func FindLlamaCpp() string {
	exe, err := os.Executable()
	if err != nil {
		return ""
	}
	p := filepath.Join(filepath.Dir(exe), "llamacpp-ref")
	if st, err := os.Stat(p); err == nil && st.Mode().IsRegular() && st.Mode()&0o111 != 0 {
		return p
	}
	return ""
}

// measureLlamaCpp runs one measurement of llama.cpp's engine in a process of
// its own: the same prompt and decode lengths and the same pass shapes as
// measure (each prompt in a pass of its own, then every stream in each
// decode pass), timed inside that process around its passes only.
func measureLlamaCpp(ctx context.Context, cfg Config, n int, seed uint64) (prefill, decode float64, err error) {
	threads := cfg.Threads
	if threads <= 0 {
		threads = runtime.NumCPU()
	}
	cmd := exec.CommandContext(ctx, cfg.LlamaCpp, "bench", cfg.Model, strconv.Itoa(threads),
		strconv.Itoa(cfg.PromptTokens), strconv.Itoa(cfg.DecodeTokens), strconv.Itoa(n), strconv.FormatUint(seed+1, 10))
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return 0, 0, fmt.Errorf("running %s: %w: %s", cfg.LlamaCpp, err, strings.TrimSpace(stderr.String()))
	}
	f := strings.Fields(string(out))
	if len(f) != 2 {
		return 0, 0, fmt.Errorf("%s printed %q, want two rates", cfg.LlamaCpp, out)
	}
	if prefill, err = strconv.ParseFloat(f[0], 64); err == nil {
		decode, err = strconv.ParseFloat(f[1], 64)
	}
	if err != nil || prefill <= 0 || decode <= 0 {
		return 0, 0, errors.Join(fmt.Errorf("%s printed %q, want two positive rates", cfg.LlamaCpp, out), err)
	}
	return prefill, decode, nil
}
