#!/usr/bin/env bash
# Configures and builds mxflash (C++ library, CUDA kernels when nvcc exists, tools, tests,
# Python module) into ${BUILD_DIR:-build}. Extra arguments go to cmake.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -d /usr/local/cuda/bin ] && export PATH="/usr/local/cuda/bin:$PATH"
BUILD_DIR=${BUILD_DIR:-build}
cmake -S . -B "$BUILD_DIR" -G Ninja -DPython3_EXECUTABLE="$(command -v "${PYTHON:-python3}")" "$@" >/dev/null
cmake --build "$BUILD_DIR" -j "${JOBS:-$(nproc)}"
