#!/usr/bin/env bash
# One H200 call for the Hopper forward's tile scheduler: build, the sm90 attention GPU tests, the
# decode CUDA tests (they share the per-stream counters), compute-sanitizer memcheck / racecheck /
# synccheck on the tile-order variants, and a short interleaved timing of the tile orders.
# Logs under $OUT (tests.log, kvcache.log, sanitize_<tool>.log, bench.err), rows in
# $OUT/attention.jsonl, a summary last. Usage (repository root, on the GPU machine):
#   FUSEDOPS_GIT=<sha> bash benchmarks/sm90_tiles_check.sh     (SKIP_BUILD=1: already installed)
set -uo pipefail
OUT=${OUT:-/tmp/sm90_tiles_out}; mkdir -p "$OUT"; SUM=$OUT/summary.txt; : > "$SUM"
export PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-16} FUSEDOPS_CUDA_ARCHS=${FUSEDOPS_CUDA_ARCHS:-8.0;9.0a}
note() { echo "$*" | tee -a "$SUM"; }
if [ "${SKIP_BUILD:-0}" != "1" ]; then
  python3 -m pip install --no-build-isolation --no-deps -v . > "$OUT/build.log" 2>&1 \
    || { tail -30 "$OUT/build.log"; exit 1; }
fi
note "git ${FUSEDOPS_GIT:-?}"
timeout 200 python3 -m pytest -q -rs -p no:cacheprovider -n 3 -m gpu tests/attention \
  -k "sm90 or cuda_graph" > "$OUT/tests.log" 2>&1
note "sm90 tests rc=$? $(tail -1 "$OUT/tests.log")"
FUSEDOPS_ATTN_DECODE_CUDA=1 timeout 200 python3 -m pytest -q -rs -p no:cacheprovider -n 4 -m gpu \
  tests/attention/test_kvcache.py -k cuda > "$OUT/kvcache.log" 2>&1
note "decode cuda tests rc=$? $(tail -1 "$OUT/kvcache.log")"
for tool in memcheck racecheck synccheck; do
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 120 python3 benchmarks/check_attention_sm90.py \
    --sanitize-run --sanitize-tools $tool --dims 64,128 --dtypes bfloat16 \
    --schedules auto,static,dynamic,dyn-3cta --no-backward --sanitize-timeout 110 > "$OUT/sanitize_$tool.log" 2>&1
  note "$tool rc=$? $(grep -E 'SUMMARY|FAIL|PASS' "$OUT/sanitize_$tool.log" | tail -3 | tr '\n' ' ')"
done
timeout 150 python3 benchmarks/bench_attention.py --out "$OUT" --dims 64,128 --lengths 4096,16384 \
  --methods "${BENCH_METHODS:-cuda-sm90,cuda-sm90-dynamic,sdpa_cudnn}" --rep-ms 40 --rounds 3 \
  2> "$OUT/bench.err" | tail -20
cat "$SUM"
