#!/usr/bin/env bash
# Nsight Compute report of one attention forward + backward (bf16, L=4096, non-causal) for the
# CUDA backend and for SDPA flash (FlashAttention-2), per head dim: throughput, warp stall
# reasons, instruction mix, shared-memory bank conflicts, all in $OUT/ncu_attention.txt. Run on
# the GPU machine after the extension is installed.
# Env: OUT (report folder), NCU_DIMS (default 64,128), NCU_BACKENDS (default
# cuda-sm80,sdpa_flash), NCU_CAUSAL=1.
set -uo pipefail
OUT=${OUT:-/tmp/ncu_out}; mkdir -p "$OUT"
causal=${NCU_CAUSAL:+--causal}
for d in $(echo "${NCU_DIMS:-64,128}" | tr , " "); do
  for backend in $(echo "${NCU_BACKENDS:-cuda-sm80,sdpa_flash}" | tr , " "); do
    ncu --clock-control none --profile-from-start off \
      --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
      --section InstructionStats --section Occupancy --section LaunchStats \
      --section MemoryWorkloadAnalysis_Tables --section ComputeWorkloadAnalysis \
      python3 benchmarks/profile_attention.py --ncu --backend "$backend" --dims "$d" $causal \
      2>&1 | sed "s/^/[${backend} D=${d}] /" >> "$OUT/ncu_attention.txt"
  done
done
