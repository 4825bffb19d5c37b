#!/usr/bin/env bash
# Nsight Compute report of one attention forward + backward (bf16, L=4096) for the CUDA backend
# and for SDPA flash (FlashAttention-2), per head dim: throughput, warp stall reasons, instruction
# mix, shared-memory bank conflicts, all appended to $OUT/ncu_attention.txt. Run on the GPU
# machine after the extension is installed.
# Env: OUT (report folder), NCU_DIMS (default 64,128), NCU_BACKENDS (default
# cuda-sm80,sdpa_flash; also cuda-sm90, triton, sdpa_cudnn, fa4), NCU_CAUSAL=1, NCU_SECTIONS (space-separated section names),
# NCU_ARGS (more ncu options, e.g. --print-details all --kernel-name regex:bwd).
set -uo pipefail
OUT=${OUT:-/tmp/ncu_out}; mkdir -p "$OUT"
causal=${NCU_CAUSAL:+--causal}
sections=${NCU_SECTIONS:-SpeedOfLight WarpStateStats SchedulerStats InstructionStats Occupancy \
LaunchStats MemoryWorkloadAnalysis_Tables ComputeWorkloadAnalysis}
section_args=()
for s in $sections; do section_args+=(--section "$s"); done
for d in $(echo "${NCU_DIMS:-64,128}" | tr , " "); do
  for backend in $(echo "${NCU_BACKENDS:-cuda-sm80,sdpa_flash}" | tr , " "); do
    # shellcheck disable=SC2086
    ncu --clock-control none --profile-from-start off "${section_args[@]}" ${NCU_ARGS:-} \
      python3 benchmarks/profile_attention.py --ncu --backend "$backend" --dims "$d" $causal \
      2>&1 | sed "s/^/[${backend} D=${d}${causal:+ causal}] /" >> "$OUT/ncu_attention.txt"
  done
done
