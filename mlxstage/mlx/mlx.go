// Package mlx implements the ops.Backend interface on Apple's MLX, through
// the mlx-c C API and cgo. It is built only on darwin/arm64 with the build
// tag "mlx"; everywhere else New returns ErrUnavailable.
//
// # Building on a Mac
//
// Install mlx-c (which brings MLX itself):
//
//	brew install mlx-c
//
// or build a release of https://github.com/ml-explore/mlx-c with CMake and
// install it (cmake -B build -DCMAKE_INSTALL_PREFIX=$HOME/.local && cmake
// --build build && cmake --install build). Then build with the tag, telling
// cgo where the headers are when they are not under /opt/homebrew:
//
//	CGO_CFLAGS="-I$(brew --prefix mlx-c)/include" go build -tags mlx ./cmd/meshnode
//	CGO_CFLAGS="-I$(brew --prefix mlx-c)/include" go test -tags mlx ./mlxstage/...
//
// Only the headers are needed at build time: libmlxc is opened with dlopen
// when the first backend is made, so a binary built with the tag still runs
// (with the ggml engine) on a Mac without mlx-c, and says clearly what is
// missing when MLX is asked for. The library is looked for at $MLXC_LIBRARY,
// then as libmlxc.dylib under /opt/homebrew/lib, /usr/local/lib and the
// dynamic linker's default paths.
package mlx

import "errors"

// ErrUnavailable is returned by New where MLX cannot be used.
var ErrUnavailable = errors.New("MLX is unavailable on this machine (it needs Apple Silicon and a build with -tags mlx): use a GGUF of the model, which the ggml engine runs, instead")

// ErrLibrary is returned by New when this binary has the binding but
// libmlxc cannot be loaded.
var ErrLibrary = errors.New("MLX: libmlxc could not be loaded")

// Available reports whether this binary was built with the MLX binding. It
// does not load the library; New does, and says why it cannot.
func Available() bool { return built }
