#!/usr/bin/env bash
# Installs everything mxflash needs on a fresh Debian machine (idempotent). Nothing is vendored:
# GoogleTest from Debian; CUTLASS/CuTe and cudnn-frontend headers, nanobind and the Python test
# stack from PyPI. The CUDA toolkit (nvcc 13, cuDNN 9.19) is expected in /usr/local/cuda.
set -euo pipefail

need_apt=()
dpkg -s libgtest-dev >/dev/null 2>&1 || need_apt+=(libgtest-dev)
command -v cmake >/dev/null 2>&1 || need_apt+=(cmake)
command -v ninja >/dev/null 2>&1 || need_apt+=(ninja-build)
if ((${#need_apt[@]})); then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq "${need_apt[@]}"
fi

PY=${PYTHON:-python3}
pip_q() { "$PY" -m pip install -q --disable-pip-version-check --root-user-action=ignore "$@"; }
# Header-only packages: their Python dependencies are not needed for the headers.
pip_q --no-deps "nvidia-cutlass==4.2.0.0" "nvidia-cudnn-frontend==1.32.0"
# cuobjdump / nvdisasm for tests/sass (the CUDA install here has neither).
pip_q "nvidia-cuda-cuobjdump==13.5.37" "nvidia-cuda-nvdisasm==13.5.37"
pip_q "nanobind==3.1.0" "scikit-build-core>=0.10" "numpy>=1.26" "ml_dtypes>=0.5" "pytest>=8"

if [ -x /usr/local/cuda/bin/nvcc ] && ! command -v nvcc >/dev/null 2>&1; then
  echo "setup: nvcc is in /usr/local/cuda/bin; add it to PATH (scripts/build.sh does)"
fi
echo "setup: done"
