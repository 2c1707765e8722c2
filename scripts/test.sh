#!/usr/bin/env bash
# Runs every test: C++ (ctest: CPU tests, then GPU tests, which skip without a GPU and say so)
# and Python (pytest). Builds first if needed. Exits non-zero when any test fails.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build}
scripts/build.sh
status=0
(cd "$BUILD_DIR" && ctest --output-on-failure -j "$(nproc)") || status=1
PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}" "${PYTHON:-python3}" -m pytest -q tests/python || status=1
exit $status
