#!/usr/bin/env bash
# Development runs on the GPU machine, every step under a timeout (a hung kernel costs one step,
# not the session): STEPS from "tests bwdmem bwdbench fwdab bwdab bwddiag quantab power energy python" (default
# "tests bwdmem bwdbench fwdab python"). Binaries from .gpu-bin (scripts/stage_gpu_bin.sh,
# EXPERIMENTS=1 for fwdab, bwdab and bwddiag). Logs in ${OUT:-gpu-logs}.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-logs}; mkdir -p "$OUT"; B=${BIN:-.gpu-bin}
STEPS=${STEPS:-"tests bwdmem bwdbench fwdab python"}
want() { [[ " $STEPS " == *" $1 "* ]]; }
T() { local s=$1; shift; timeout -k 5 "$s" "$@"; }
CUDNN_LIB=$(python3 -c "import os, torch; print(os.path.realpath(os.path.join(os.path.dirname(torch.__file__), '..', 'nvidia', 'cudnn', 'lib')))" 2>/dev/null || true)
[ -n "$CUDNN_LIB" ] && export LD_LIBRARY_PATH="$CUDNN_LIB:${LD_LIBRARY_PATH:-}"
export PATH="/usr/local/cuda/bin:$PATH"
if want tests; then
  T 240 "$B/mxflash_tests_gpu" --gtest_brief=1 ${TEST_FILTER:+--gtest_filter=$TEST_FILTER} > "$OUT/tests.log" 2>&1; echo "== tests rc=$?"
  grep -E "fast d|FAILED|PASSED|Failure|Expected|Which is|actual" "$OUT/tests.log" | head -80
fi
if want bwdmem; then
  T 240 compute-sanitizer --tool memcheck --error-exitcode 9 "$B/mxflash_tests_gpu" --gtest_brief=1 \
    --gtest_filter='AttentionBwdGpu.JaggedMultiTileBothSides:AttentionBwdGpu.BroadcastQMultiTile' > "$OUT/memcheck.log" 2>&1
  echo "== memcheck rc=$?"; grep -E "ERROR SUMMARY|Invalid|FAILED" "$OUT/memcheck.log" | head -10
fi
if want bwdbench; then
  T 300 "$B/mxflash-bench" --preset ${PRESETS:-all} --workload ${WORKLOAD:-bwd} --impl ${IMPLS:-mxfp8,cudnn-fp8,cudnn-bf16} --check \
    --warmup-s ${WARM:-0.3} --window-s ${WIN:-1} --json "$OUT/bench.json" > "$OUT/bench.log" 2> "$OUT/bench.err"
  echo "== bench rc=$?"; cat "$OUT/bench.log"; grep -E "check|error" "$OUT/bench.err" | head -30
fi
if want fwdab; then
  for v in ${AB_VARIANTS:-49 17}; do
    # Variants with bit 64 (per-tile V scales) run on quantizer-written operands (mxfp8-exec).
    if (( v >= 0 && (v & 64) )); then impl=mxfp8-exec; filt='AttentionFwdOperandsGpu.*'; else impl=mxfp8; filt='AttentionFwdGpu.*'; fi
    MXFLASH_FWD_VARIANT=$v T 120 "$B/exp/mxflash_tests_gpu" --gtest_brief=1 --gtest_filter="$filt" > "$OUT/ab_$v.log" 2>&1
    echo "== fwd variant $v tests rc=$?"; grep -E "SQNR" "$OUT/ab_$v.log" | head -3; tail -n 2 "$OUT/ab_$v.log"
    MXFLASH_FWD_VARIANT=$v T 120 "$B/exp/mxflash-bench" --preset ${PRESETS:-all} --workload fwd --impl $impl --warmup-s ${WARM:-0.3} --window-s ${WIN:-1} 2>/dev/null | grep -E "^(llm|cross|jagged)"
  done
fi
if want bwdab; then
  for v in ${BWD_VARIANTS:-0 1 2}; do
    MXFLASH_BWD_VARIANT=$v T 200 "$B/exp/mxflash_tests_gpu" --gtest_brief=1 --gtest_filter='AttentionBwdGpu.*' > "$OUT/bwdab_$v.log" 2>&1
    echo "== bwd variant $v tests rc=$?"; tail -n 1 "$OUT/bwdab_$v.log"
    MXFLASH_BWD_VARIANT=$v T 120 "$B/exp/mxflash-bench" --preset ${PRESETS:-all} --workload bwd --impl mxfp8 --warmup-s 0.3 --window-s 1 2>/dev/null | grep -E "^(llm|cross|jagged)"
  done
fi
if want bwddiag; then
  # The dK/dV kernel with parts of its consumers' work left out (kDiag, MXFLASH_BWD_VARIANT bits
  # 20-23 of experiments builds; dK, dV garbage), or with DIAG_SHIFT=24 the dQ kernel's (bits 24-27,
  # DIAGS from 0 1 2 8 5 10), or with DIAG_SHIFT=0 whole variant values (bits 28-29: the dK/dV
  # math without its exponentials / conversions; docs/backward.md): the whole backward's time, then
  # both kernels' durations and instruction counts at the benchmark's clocks (ncu --clock-control none).
  for d in ${DIAGS:-0 1 2 4 8 12 5 10}; do
    echo "== bwd diag $d << ${DIAG_SHIFT:-20}"
    MXFLASH_BWD_VARIANT=$((d << ${DIAG_SHIFT:-20})) T 60 "$B/exp/mxflash-bench" --preset ${PRESETS:-llm-long,cross} --workload bwd --impl mxfp8-exec \
      --warmup-s ${WARM:-0.3} --window-s ${WIN:-0.8} 2>/dev/null | grep -E "^(llm|cross|jagged)"
    [ "${NCU:-1}" = 1 ] || continue  # NCU=0: the bench rows alone (their board W and pJ/FLOP columns)
    MXFLASH_BWD_VARIANT=$((d << ${DIAG_SHIFT:-20})) T 90 ncu --clock-control none --kernel-name regex:"attention_bwd_dkdv|attention_bwd_dq" \
      --launch-skip 2 --launch-count 2 --metrics gpu__time_duration.sum,smsp__inst_executed.sum \
      "$B/exp/mxflash-bench" --preset llm-long --workload bwd --impl mxfp8-exec --warmup-s 0 --window-s 0.001 --launches 3 2>&1 |
      grep -E "attention_bwd|duration|inst_executed" | sed 's/(CUtensorMap.*//'
  done
fi
if want quantab; then
  # Quantize kernel variants (MXFLASH_QUANT_VARIANT bits, src/cuda/quantize/quantize_launch.cuh):
  # their GPU tests (byte for byte against the CPU reference), then GB/s beside the copy.
  for v in ${QUANT_VARIANTS:-0 8 7 15}; do
    MXFLASH_QUANT_VARIANT=$v T 200 "$B/mxflash_tests_gpu" --gtest_brief=1 --gtest_filter='QuantizeGpu.*' > "$OUT/quantab_$v.log" 2>&1
    echo "== quantize variant $v tests rc=$?"; tail -n 1 "$OUT/quantab_$v.log"
    MXFLASH_QUANT_VARIANT=$v T 120 "$B/mxflash-bench" --workload quantize --warmup-s ${QWARM:-0.5} --window-s ${QWIN:-2} 2>/dev/null | grep -E "GB/s|copy|hdim|seq|square"
  done
fi
if want power; then
  # SM clock and board power while one implementation runs (nvidia-smi every 50 ms through a long
  # window; medians of the samples taken in its middle): is a kernel's speed set by a power cap?
  for wl in ${POWER_WORKLOADS:-fwd bwd}; do
    for impl in ${POWER_IMPLS:-mxfp8-exec cudnn-fp8 cudnn-bf16}; do
      nvidia-smi --query-gpu=clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active --format=csv,noheader,nounits -lms 50 > "$OUT/power_${wl}_${impl}.csv" &
      smi=$!
      T 60 "$B/mxflash-bench" --preset ${POWER_PRESET:-llm-long} --workload $wl --impl $impl --warmup-s 1 --window-s ${POWER_WIN:-4} 2>/dev/null | grep -E "^(llm|cross|jagged)"
      kill $smi; wait $smi 2>/dev/null
      python3 - "$OUT/power_${wl}_${impl}.csv" "$wl" "$impl" <<'PY'
import sys, statistics
rows = [l.split(', ') for l in open(sys.argv[1]) if l.strip()]
n = len(rows); mid = rows[n // 4: 3 * n // 4] or rows
clk = statistics.median(float(r[0]) for r in mid); pw = statistics.median(float(r[1]) for r in mid)
tmp = statistics.median(float(r[2]) for r in mid); thr = sorted(set(r[3].strip() for r in mid))
print(f"== power {sys.argv[2]} {sys.argv[3]}: {n} samples, SM clock {clk:.0f} MHz, {pw:.0f} W, {tmp:.0f} C, throttle {thr}")
PY
    done
  done
fi
if want energy; then
  # Energy per unit of work: mxflash-bench's board W / SM MHz / pJ per FLOP columns (NVML's energy
  # counter around each window) for every preset, ours beside cuDNN's; first how finely that counter
  # moves under load (scripts/nvml_energy_resolution.py beside a bench window).
  T 60 "$B/mxflash-bench" --preset llm-long --workload fwd --impl cudnn-fp8 --warmup-s 0.5 --window-s 3 > /dev/null 2>&1 &
  bench=$!
  sleep 1.5
  T 20 python3 scripts/nvml_energy_resolution.py --seconds 2
  wait $bench
  T 400 "$B/mxflash-bench" --preset ${PRESETS:-all} --workload ${WORKLOAD:-fwd,bwd} --impl ${IMPLS:-mxfp8-exec,cudnn-fp8,cudnn-bf16} \
    --warmup-s ${WARM:-1} --window-s ${EWIN:-3} --json "$OUT/energy.json" > "$OUT/energy.log" 2> "$OUT/energy.err"
  echo "== energy bench rc=$?"; cat "$OUT/energy.log"
fi
if want python; then
  if T 300 cmake -S . -B build-gpu-py -G Ninja -DMXFLASH_TESTS=OFF -DPython3_EXECUTABLE="$(command -v python3)" > "$OUT/build_py.log" 2>&1 &&
     T 300 cmake --build build-gpu-py --target _mxflash -j "$(nproc)" >> "$OUT/build_py.log" 2>&1; then
    PYTHONPATH="$PWD/python" MXFLASH_REQUIRE_CUDA=1 T 300 python3 -m pytest -q -rs -x tests/python > "$OUT/pytest.log" 2>&1
    echo "== pytest rc=$?"; tail -15 "$OUT/pytest.log"
  else
    echo "== python build failed"; tail -20 "$OUT/build_py.log"
  fi
fi
