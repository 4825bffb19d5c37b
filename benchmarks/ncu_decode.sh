#!/usr/bin/env bash
# Nsight Compute report of one decode call per method and case (benchmarks/profile_decode.py):
# throughput, occupancy, warp stall reasons, memory tables, appended to $OUT/ncu_decode.txt.
# Run on the GPU machine after the extension is installed.
# Env: OUT, NCU_METHODS (default triton,cuda-sm90,cuda-sm80), NCU_CASES (batch:ctx[:paged],
# default 1:32768 64:32768), NCU_SECTIONS (space-separated section names).
set -uo pipefail
OUT=${OUT:-/tmp/ncu_out}; mkdir -p "$OUT"
sections=${NCU_SECTIONS:-SpeedOfLight Occupancy WarpStateStats LaunchStats MemoryWorkloadAnalysis}
section_args=()
for s in $sections; do section_args+=(--section "$s"); done
for case in ${NCU_CASES:-1:32768 64:32768}; do
  IFS=: read -r b ctx paged <<< "$case"
  for m in $(echo "${NCU_METHODS:-triton,cuda-sm90,cuda-sm80}" | tr , " "); do
    FUSEDOPS_ATTN_DECODE_CUDA=1 ncu --clock-control none --profile-from-start off \
      "${section_args[@]}" python3 "$(dirname "$0")/profile_decode.py" --method "$m" --batch "$b" \
      --ctx "$ctx" ${paged:+--paged} 2>&1 | sed "s/^/[$m B=$b ctx=$ctx${paged:+ paged}] /" \
      >> "$OUT/ncu_decode.txt"
  done
done
