package main

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// fakeTool writes an executable shell script named name into dir.
func fakeTool(t *testing.T, dir, name, body string) {
	t.Helper()
	if err := os.WriteFile(filepath.Join(dir, name), []byte("#!/bin/sh\n"+body), 0o755); err != nil {
		t.Fatal(err)
	}
}

// TestGPUBundle packs deploy/gpu/bundle.sh's tarball for a GPU host without
// Go, unpacks it, and runs the bundle's build-cuda.sh there with stand-ins
// for nvcc and cmake that record their arguments and write the files the
// real ones would. It checks that the bundle carries the binary, the
// scripts, the kernels and the ollama module's ggml sources, that
// build-cuda.sh finds those sources in the bundle with no --src and no Go,
// and that it installs the libraries where OLLAMA_LIBRARY_PATH must point.
// The real nvcc and cmake ran the same steps on the GPU machine.
func TestGPUBundle(t *testing.T) {
	for _, tool := range []string{"bash", "tar", "go"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Skipf("no %s", tool)
		}
	}
	dir := t.TempDir()
	binary := writeFile(t, "meshnode", "not really meshnode\n")
	tgz := filepath.Join(dir, "out", "meshnode-gpu.tgz")
	out, err := exec.Command("bash", filepath.Join(deployDir, "gpu", "bundle.sh"), "--binary", binary, "--out", tgz).CombinedOutput()
	if err != nil {
		t.Fatalf("bundle.sh: %v\n%s", err, out)
	}
	host := filepath.Join(dir, "host")
	if err := os.MkdirAll(host, 0o755); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command("tar", "-C", host, "-xzf", tgz).CombinedOutput(); err != nil {
		t.Fatalf("tar: %v\n%s", err, out)
	}
	b := filepath.Join(host, "meshnode-gpu")
	for _, f := range []string{
		"bin/meshnode", "deploy/gpu/build-cuda.sh", "deploy/gpu/ktrace.c", "ggufstage/cuda/fused.cu", "ggufstage/cuda/fused.h",
		"ggufstage/cuda/fused_check.cu", "ollama/CMakeLists.txt", "ollama/ml/backend/ggml/ggml/src/ggml-cuda/CMakeLists.txt",
	} {
		if _, err := os.Stat(filepath.Join(b, f)); err != nil {
			t.Errorf("the bundle lacks %s: %v", f, err)
		}
	}
	if got, err := os.ReadFile(filepath.Join(b, "bin", "meshnode")); err != nil || string(got) != "not really meshnode\n" {
		t.Errorf("bin/meshnode is not the binary given: %q, %v", got, err)
	}

	// The host: nvcc and cmake stand-ins, no Go on PATH.
	tools := filepath.Join(dir, "tools")
	if err := os.MkdirAll(tools, 0o755); err != nil {
		t.Fatal(err)
	}
	log := filepath.Join(dir, "calls")
	fakeTool(t, tools, "nvcc", `echo "nvcc $*" >> `+log+`
while [ $# -gt 0 ]; do [ "$1" = -o ] && : > "$2"; shift; done
`)
	fakeTool(t, tools, "cmake", `echo "cmake $*" >> `+log+`
if [ "$1" = --build ]; then mkdir -p "$2/lib/ollama" && : > "$2/lib/ollama/libggml-cuda.so" && : > "$2/lib/ollama/libggml-base.so.0"; fi
`)
	for _, tool := range []string{"bash", "sh", "tar", "mkdir", "cp", "sed", "dirname", "find", "grep", "head", "nproc", "rm", "mktemp"} {
		p, err := exec.LookPath(tool)
		if err != nil {
			t.Skipf("no %s", tool)
		}
		if err := os.Symlink(p, filepath.Join(tools, tool)); err != nil {
			t.Fatal(err)
		}
	}
	cmd := exec.Command("bash", filepath.Join(b, "deploy", "gpu", "build-cuda.sh"), "--arch", "90")
	cmd.Dir = b
	cmd.Env = append(os.Environ(), "PATH="+tools, "BUILD_DIR="+filepath.Join(dir, "build"))
	out, err = cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("the bundle's build-cuda.sh: %v\n%s", err, out)
	}
	calls, err := os.ReadFile(log)
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{
		"-gencode arch=compute_90,code=sm_90",
		filepath.Join(b, "ggufstage", "cuda", "fused.cu"),
		"cmake -S " + filepath.Join(b, "ollama") + " ",
		"-DCMAKE_CUDA_ARCHITECTURES=90",
		"-DCMAKE_INSTALL_RPATH=$ORIGIN",
		"--target ggml-cuda",
	} {
		if !strings.Contains(string(calls), want) {
			t.Errorf("the tools were not called with %q:\n%s", want, calls)
		}
	}
	for _, f := range []string{"libmeshnode-fused.so", "libggml-cuda.so", "libggml-base.so.0"} {
		if _, err := os.Stat(filepath.Join(b, "bin", "lib", "ollama", f)); err != nil {
			t.Errorf("bin/lib/ollama lacks %s: %v\n%s", f, err, out)
		}
	}
}
