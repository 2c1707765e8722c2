#!/usr/bin/env bash
# Builds the full CUDA configuration here (a CPU machine with nvcc) and copies the binaries a GPU
# machine needs into .gpu-bin/ (git-ignored), to be carried there and run by scripts/gpu_check.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build} scripts/build.sh -DMXFLASH_PYTHON=OFF
B=${BUILD_DIR:-build}
rm -rf .gpu-bin && mkdir -p .gpu-bin
cp "$B"/tests/mxflash_tests_gpu "$B"/tests/mxflash_tests_cpu .gpu-bin/
for f in "$B"/tools/*/mxflash-*; do [ -x "$f" ] && cp "$f" .gpu-bin/; done
strip .gpu-bin/* 2>/dev/null || true
du -sh .gpu-bin; ls .gpu-bin
