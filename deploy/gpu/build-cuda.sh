#!/usr/bin/env bash
# Builds ggml's CUDA backend from the ggml sources of the ollama module that
# meshnode pins (github.com/ollama/ollama v0.17.4), for the local GPU, and
# installs it beside the meshnode binary, where it is loaded at run time.
#
#   deploy/gpu/build-cuda.sh                     # sources from the Go module cache (or a bundle's ollama/), GPU arch "native"
#   deploy/gpu/build-cuda.sh --src DIR --arch 90 --out /opt/meshnode
#   deploy/gpu/build-cuda.sh --fused-only --arch 90 --out DIR   # only meshnode's own kernels
#
# It also builds meshnode's fused decode kernels (ggufstage/cuda/fused.cu)
# into libmeshnode-fused.so beside them (seconds); a stage on an NVIDIA GPU
# uses them for one-token decode steps (serve --fused-decode, default auto).
# They need sm_80 (Ampere) or newer; on older GPUs the script says so and
# builds the rest, and stages decode through ggml's kernels.
#
# Needs cmake (>= 3.21), a C/C++ compiler and the CUDA toolkit (nvcc). It
# builds only the ggml-cuda target (a few minutes on 16 cores) and installs
# libggml-cuda.so and libggml-base.so into OUT/lib/ollama. Then:
#
#   export OLLAMA_LIBRARY_PATH=OUT/lib/ollama
#   meshnode serve --device cuda ...
#
# (the path must contain "lib/ollama"; meshnode's ggml loads every backend
# library it finds there and picks the GPU with --device auto or cuda).
set -euo pipefail

src="" arch="native" out="" jobs="$(nproc)" fused_only=""
while [ $# -gt 0 ]; do
  case "$1" in
    --src) src="$2"; shift 2 ;;
    --arch) arch="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    -j) jobs="$2"; shift 2 ;;
    --fused-only) fused_only=1; shift ;;
    -h|--help) sed -n '2,/^set -euo pipefail$/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
command -v nvcc >/dev/null || [ -x /usr/local/cuda/bin/nvcc ] || { echo "nvcc not found: install the CUDA toolkit" >&2; exit 2; }
export PATH="$PATH:/usr/local/cuda/bin"
root="$(cd "$(dirname "$0")/../.." && pwd)"
[ -n "$out" ] || out="$root/bin"
mkdir -p "$out/lib/ollama"
# The fused decode kernels: one file, sm_XX from --arch ("native" asks nvcc).
# They need sm_80 (Ampere) or newer, and use Hopper's PDL and thread block
# clusters where built for sm_90 or newer. Where they cannot be built, the
# CUDA backend is still built: stages then decode through ggml's kernels.
if [ "$arch" = native ]; then gencode=(-arch=native); else gencode=(-gencode "arch=compute_$arch,code=sm_$arch"); fi
if [[ "$arch" =~ ^[0-9]+$ ]] && [ "$arch" -lt 80 ]; then
  echo "not building meshnode's fused decode kernels: they need sm_80 or newer, not sm_$arch; stages will decode through ggml's CUDA kernels" >&2
  [ -z "$fused_only" ] || exit 2
elif ! nvcc -O3 -std=c++17 -shared -Xcompiler -fPIC "${gencode[@]}" -cudart shared \
  -o "$out/lib/ollama/libmeshnode-fused.so" "$root/ggufstage/cuda/fused.cu"; then
  echo "building meshnode's fused decode kernels failed (they need sm_80 or newer); stages will decode through ggml's CUDA kernels" >&2
  rm -f "$out/lib/ollama/libmeshnode-fused.so"
  [ -z "$fused_only" ] || exit 1
else
  echo "installed fused decode kernels in $out/lib/ollama/libmeshnode-fused.so"
fi
[ -z "$fused_only" ] || exit 0

if [ -z "$src" ]; then
  if [ -f "$root/ollama/CMakeLists.txt" ]; then # a bundle (deploy/gpu/bundle.sh)
    src="$root/ollama"
  elif command -v go >/dev/null; then
    src="$(cd "$(dirname "$0")/../.." && go list -m -f '{{.Dir}}' github.com/ollama/ollama)"
  else
    echo "no Go here: pass --src with a copy of the ollama module (CMakeLists.txt and ml/backend/ggml/ggml), or run deploy/gpu/bundle.sh where Go is and build from its tarball" >&2
    exit 2
  fi
fi
[ -f "$src/CMakeLists.txt" ] && [ -d "$src/ml/backend/ggml/ggml/src/ggml-cuda" ] || { echo "$src does not hold the ollama ggml sources" >&2; exit 2; }
build="${BUILD_DIR:-$(mktemp -d)}"

# The module cache is read-only; CMake writes only into $build.
cmake -S "$src" -B "$build" \
  -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_CUDA_ARCHITECTURES="$arch" \
  -DCMAKE_DISABLE_FIND_PACKAGE_Vulkan=TRUE \
  -DCMAKE_BUILD_WITH_INSTALL_RPATH=ON \
  '-DCMAKE_INSTALL_RPATH=$ORIGIN' >/dev/null
cmake --build "$build" --target ggml-cuda -j "$jobs"
mkdir -p "$out/lib/ollama"
cp -a "$build"/lib/ollama/libggml-cuda.so* "$build"/lib/ollama/libggml-base.so* "$out/lib/ollama/"
echo "installed CUDA backend in $out/lib/ollama"

# ktrace.c, where the toolkit has CUPTI: GPU time kernel by kernel, without a
# profiler (see the file's header).
cuda_root="$(dirname "$(dirname "$(command -v nvcc)")")"
cupti_h="$(find -L "$cuda_root" /usr/local/cuda*/extras -name cupti.h -path '*include*' 2>/dev/null | head -1 || true)"
cupti_so="$(find -L "$cuda_root" /usr/local/cuda*/extras -name 'libcupti.so*' 2>/dev/null | head -1 || true)"
if [ -n "$cupti_h" ] && [ -n "$cupti_so" ]; then
  krec="$(grep -rho 'CUpti_ActivityKernel[0-9]*;' "$(dirname "$cupti_h")" | tr -d ';' | sort -V | tail -1)"
  if gcc -O2 -shared -fPIC -DKREC="$krec" -I"$(dirname "$cupti_h")" -I"$cuda_root/include" \
    "$(dirname "$0")/ktrace.c" -o "$out/lib/libmeshnode-ktrace.so" \
    -L"$(dirname "$cupti_so")" -lcupti -lpthread -Wl,-rpath,"$(dirname "$cupti_so")"; then
    echo "kernel tracer: CUDA_INJECTION64_PATH=$out/lib/libmeshnode-ktrace.so (deploy/gpu/ktrace.c)"
  else
    echo "kernel tracer not built: gcc failed on deploy/gpu/ktrace.c"
  fi
else
  echo "kernel tracer not built: no CUPTI in $cuda_root"
fi
echo "export OLLAMA_LIBRARY_PATH=$out/lib/ollama"
