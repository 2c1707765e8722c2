#!/usr/bin/env bash
# Builds the full CUDA configuration here (a CPU machine with nvcc; the GPU machines lack the
# CUTLASS and cudnn-frontend headers) and copies the binaries a GPU machine needs into .gpu-bin/
# (git-ignored), to be carried there and run by scripts/gpu_check.sh.
# With EXPERIMENTS=1 it also builds the attention forward with its experiment variants
# (-DMXFLASH_FWD_EXPERIMENTS=1: MXFLASH_FWD_VARIANT picks one at run time, docs/attention.md) into
# .gpu-bin/exp/, for the "ab" section of gpu_check.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
B=${BUILD_DIR:-build}
# Python stays on in the main build dir (scripts/test.sh shares it); the module is not carried.
BUILD_DIR=$B scripts/build.sh -DMXFLASH_PYTHON=ON
rm -rf .gpu-bin && mkdir -p .gpu-bin
cp "$B"/tests/mxflash_tests_gpu "$B"/tests/mxflash_tests_cpu .gpu-bin/
for f in "$B"/tools/*/mxflash-*; do [ -x "$f" ] && cp "$f" .gpu-bin/; done
if [ "${EXPERIMENTS:-0}" = 1 ]; then
  BUILD_DIR=$B-exp scripts/build.sh -DMXFLASH_PYTHON=OFF -DCMAKE_CUDA_FLAGS="-DMXFLASH_FWD_EXPERIMENTS=1"
  mkdir -p .gpu-bin/exp
  cp "$B"-exp/tests/mxflash_tests_gpu "$B"-exp/tools/bench/mxflash-bench .gpu-bin/exp/
fi
strip .gpu-bin/* .gpu-bin/exp/* 2>/dev/null || true
# The cuDNN frontend Python wheel for scripts/peer_cudnn_fe.py (the GPU machine has no package
# registry): carry .whl/ with .gpu-bin/.
if ! ls .whl/nvidia_cudnn_frontend-1.32.0-*.whl > /dev/null 2>&1; then
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 -d .whl nvidia-cudnn-frontend==1.32.0 ||
    echo "stage_gpu_bin: could not download the cuDNN frontend wheel (peer_cudnn_fe.py will be skipped)"
fi
du -sh .gpu-bin; ls -R .gpu-bin
