#!/usr/bin/env bash
# Packs what an NVIDIA GPU host without Go or internet needs to run meshnode
# on its GPU into one tarball, written on a machine that has Go and the
# module cache (the portable x86-64-v3 binary is built here):
#
#   deploy/gpu/bundle.sh                          # writes bin/meshnode-gpu.tgz
#   deploy/gpu/bundle.sh --out F.tgz --binary bin/meshnode   # a binary built already
#
# The tarball holds meshnode-gpu/: bin/meshnode, deploy/gpu (build-cuda.sh
# and the tools it builds), ggufstage/cuda (meshnode's decode kernels), and
# ollama/, the CMake build and ggml sources of the pinned ollama module
# (CMakeLists.txt and ml/backend/ggml/ggml, about 1 MB compressed). On the
# GPU host (Linux, the CUDA toolkit and cmake; a few minutes on 16 cores):
#
#   tar -xzf meshnode-gpu.tgz && cd meshnode-gpu
#   deploy/gpu/build-cuda.sh                      # or --arch 90 for one target
#   export OLLAMA_LIBRARY_PATH=$PWD/bin/lib/ollama
#   bin/meshnode serve --device cuda
set -euo pipefail

out="" binary=""
while [ $# -gt 0 ]; do
  case "$1" in
    --out) out="$2"; shift 2 ;;
    --binary) binary="$2"; shift 2 ;;
    -h|--help) sed -n '2,/^set -euo pipefail$/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
root="$(cd "$(dirname "$0")/../.." && pwd)"
[ -n "$out" ] || out="$root/bin/meshnode-gpu.tgz"
command -v go >/dev/null || { echo "bundle.sh needs Go and the module cache (run it where meshnode builds)" >&2; exit 2; }
src="$(cd "$root" && go list -m -f '{{.Dir}}' github.com/ollama/ollama)" || { echo "cannot find the ollama module: run 'go mod download' in $root" >&2; exit 2; }
[ -f "$src/CMakeLists.txt" ] && [ -d "$src/ml/backend/ggml/ggml/src/ggml-cuda" ] || { echo "$src does not hold the ollama ggml sources" >&2; exit 2; }

stage="$(mktemp -d)"
trap 'rm -rf "$stage"' EXIT
b="$stage/meshnode-gpu"
mkdir -p "$b/bin" "$b/deploy" "$b/ggufstage" "$b/ollama/ml/backend/ggml"
if [ -n "$binary" ]; then
  [ -f "$binary" ] || { echo "no binary at $binary" >&2; exit 2; }
  cp "$binary" "$b/bin/meshnode"
else
  echo "building the portable binary (x86-64-v3; minutes on a cold cache)" >&2
  make -s -C "$root" portable BIN="$b/bin/meshnode" >&2
fi
cp -R "$root/deploy/gpu" "$b/deploy/gpu"
cp -R "$root/ggufstage/cuda" "$b/ggufstage/cuda"
cp "$src/CMakeLists.txt" "$b/ollama/"
cp -R "$src/ml/backend/ggml/ggml" "$b/ollama/ml/backend/ggml/ggml"
chmod -R u+w "$b" # the module cache's files are read-only
mkdir -p "$(dirname "$out")"
tar -C "$stage" -czf "$out" meshnode-gpu
echo "wrote $out ($(du -h "$out" | cut -f1)); on the GPU host: tar -xzf $(basename "$out") && cd meshnode-gpu && deploy/gpu/build-cuda.sh"
