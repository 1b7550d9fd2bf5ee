#!/usr/bin/env bash
# Syntax- and type-checks meshnode's CUDA sources (host and device side,
# sm_90) with clang's CUDA front end against the declarations in
# deploy/gpu/cudastub, on a machine without the CUDA toolkit: a typo or a
# wrong type in a kernel shows here, not only after a copy to a GPU
# machine. It builds nothing and says nothing about how the code runs;
# deploy/gpu/build-cuda.sh builds it with nvcc.
#
#   deploy/gpu/cuda-syntax.sh        # clang++ from PATH (clang++-16, -15, -14 or clang++)
#
# Without clang it says so and exits 0, unless CI is set (then 1).
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
cxx=""
for c in clang++-16 clang++-15 clang++-14 clang++; do
  if command -v "$c" >/dev/null; then cxx="$c"; break; fi
done
if [ -z "$cxx" ]; then
  echo "cuda-syntax: no clang++ here (apt install clang-16); the CUDA sources were not checked" >&2
  [ -z "${CI:-}" ] || exit 1
  exit 0
fi
files=(ggufstage/cuda/fused.cu ggufstage/cuda/fused_check.cu deploy/gpu/bandwidth.cu deploy/gpu/handover.cu deploy/gpu/chain.cu deploy/gpu/ipc.cu)
bad=0
for f in "${files[@]}"; do
  for side in --cuda-host-only --cuda-device-only; do
    if ! "$cxx" -x cuda "$side" --cuda-gpu-arch=sm_90 -nocudainc -nocudalib -fsyntax-only -std=c++17 \
      -I"$root/deploy/gpu/cudastub" "$root/$f"; then
      echo "cuda-syntax: $f ($side) does not parse" >&2
      bad=1
    fi
  done
done
[ "$bad" = 0 ] && echo "cuda-syntax: ${#files[@]} files parse for sm_90 (host and device, $cxx)"
exit "$bad"
