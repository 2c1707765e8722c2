#!/usr/bin/env bash
# On a Hopper GPU machine: ncu profile of our forward (WORKLOAD=bwd: backward) on one preset (default llm-long), for each
# binary directory given (default .gpu-bin and .gpu-bin/lean when present). Prints per kernel the
# duration, tensor-pipe (GMMA) activity, issue activity, warp stall reasons, registers and spills.
# Logs go to ${OUT:-gpu-logs}/ncu_<name>.log.
#   PRESET=llm scripts/gpu_profile.sh .gpu-bin
# IMPL=mxfp8-exec profiles the forward on quantizer-written operands; SOURCE=1 adds a per-SASS-
# instruction CSV of warp stall samples of the main kernel.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-logs}
mkdir -p "$OUT"
PRESET=${PRESET:-llm-long}
WORKLOAD=${WORKLOAD:-fwd}
export PATH="/usr/local/cuda/bin:$PATH"
dirs=("$@")
if [ ${#dirs[@]} -eq 0 ]; then
  dirs=(.gpu-bin)
  [ -x .gpu-bin/lean/mxflash-bench ] && dirs+=(.gpu-bin/lean)
fi
for d in "${dirs[@]}"; do
  name=$(echo "$d" | tr '/.' '__' | sed 's/^_*//')
  log="$OUT/ncu_${name}_${PRESET}.log"
  echo "== ncu $d ($PRESET $WORKLOAD)" | tee "$log"
  # One forward (prepare kernels + main kernel): durations.
  ncu --kernel-name regex:"${DURATION_KERNELS:-prepare|attention_fwd|attention_bwd}" --launch-skip ${NCU_SKIP:-0} --launch-count ${NCU_KERNELS:-5} \
      --section SpeedOfLight --section LaunchStats \
      "$d/mxflash-bench" --preset "$PRESET" --workload "$WORKLOAD" --impl ${IMPL:-mxfp8} --warmup-s 0 --window-s 0.001 --launches 1 \
      >> "$log" 2>&1
  # The main kernel in detail.
  ncu --kernel-name regex:"${DETAIL_KERNELS:-attention_fwd_kernel|attention_bwd_dkdv|attention_bwd_dq}" --launch-count ${DETAIL_COUNT:-1} \
      --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
      --section SchedulerStats --section WarpStateStats --section LaunchStats --section Occupancy \
      --metrics sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active,smsp__inst_executed.sum,lts__t_bytes.sum.per_second \
      "$d/mxflash-bench" --preset "$PRESET" --workload "$WORKLOAD" --impl ${IMPL:-mxfp8} --warmup-s 0 --window-s 0.001 --launches 1 \
      >> "$log" 2>&1
  # SOURCE=1: per-SASS-instruction warp stall samples of the main kernel (CSV, for the hot loop).
  if [ "${SOURCE:-0}" = 1 ]; then
    ncu --kernel-name regex:"${DETAIL_KERNELS:-attention_fwd_kernel|attention_bwd_dkdv|attention_bwd_dq}" --launch-count 1 \
        --section SourceCounters --section WarpStateStats -f -o "$OUT/ncu_src_${name}_${PRESET}" \
        "$d/mxflash-bench" --preset "$PRESET" --workload "$WORKLOAD" --impl ${IMPL:-mxfp8} --warmup-s 0 --window-s 0.001 --launches 1 \
        >> "$log" 2>&1
    ncu -i "$OUT/ncu_src_${name}_${PRESET}.ncu-rep" --page source --csv --print-source sass \
        > "$OUT/ncu_src_${name}_${PRESET}.csv" 2>> "$log"
  fi
  grep -E "attention_|prepare_|Duration|Registers Per|Throughput|gmma|pipe_xu|Issue Slots Busy|Issued Warp|No Eligible|Stall|inst_executed.sum|lts__t_bytes|Local" "$log" | head -80
done
