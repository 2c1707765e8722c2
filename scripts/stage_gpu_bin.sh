#!/usr/bin/env bash
# Builds the full CUDA configuration here (a CPU machine with nvcc; the GPU machines lack the
# CUTLASS and cudnn-frontend headers) and copies the binaries a GPU machine needs into .gpu-bin/
# (git-ignored), to be carried there and run by scripts/gpu_check.sh.
# With LEAN=1 it also builds the kernel variants that wait for a GPU run (docs/attention.md,
# docs/performance.md) into .gpu-bin/lean/, for the "ab" section of gpu_check.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
B=${BUILD_DIR:-build}
BUILD_DIR=$B scripts/build.sh -DMXFLASH_PYTHON=OFF
rm -rf .gpu-bin && mkdir -p .gpu-bin
cp "$B"/tests/mxflash_tests_gpu "$B"/tests/mxflash_tests_cpu .gpu-bin/
for f in "$B"/tools/*/mxflash-*; do [ -x "$f" ] && cp "$f" .gpu-bin/; done
if [ "${LEAN:-0}" = 1 ]; then
  BUILD_DIR=$B-lean scripts/build.sh -DMXFLASH_PYTHON=OFF \
    -DCMAKE_CUDA_FLAGS="-DMXFLASH_LEAN_SOFTMAX=1 -DMXFLASH_LEAN_HDIM_SEQ=1"
  mkdir -p .gpu-bin/lean
  cp "$B"-lean/tests/mxflash_tests_gpu "$B"-lean/tools/bench/mxflash-bench .gpu-bin/lean/
fi
strip .gpu-bin/* .gpu-bin/lean/* 2>/dev/null || true
du -sh .gpu-bin; ls -R .gpu-bin
