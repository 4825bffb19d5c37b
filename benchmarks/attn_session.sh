#!/usr/bin/env bash
# One device call for the CUDA attention kernels: build, the cuda-sm80 tests (default dQ mode,
# then the parity cases again with the separate dQ pass), an optional Triton test subset, then
# bench_attention.py (cuda-sm80, its deterministic mode and SDPA flash at L=4096 by default).
# Optional variants: a sed script applied to csrc/attention/ of a copy of the tree, built
# alongside the main build and benched as cuda-sm80 in the same call. Everything printed goes to
# $OUT/log.txt; the bench rows to $OUT/attention.jsonl, each variant's to
# $OUT/variant{,2}/attention.jsonl with "variant" naming its sed script (and environment).
# Env: FUSEDOPS_GIT (sha for the bench rows), TRITON_K (pytest -k for a Triton subset, run in
# the background while the CUDA tests run), VARIANT_SED and VARIANT2_SED (the sed scripts),
# VARIANT_DIMS, VARIANT_METHODS, VARIANT_ENV (e.g. FUSEDOPS_ATTN_DQ=atomic, for the variants'
# bench; VARIANT2_ENV for the second only), BENCH_METHODS, BENCH_DIMS, BENCH_LENGTHS, EXTRA (a
# command run at the end, its output in the log).
set -uo pipefail
OUT=${OUT:-/tmp/attn_out}; mkdir -p "$OUT"; LOG=$OUT/log.txt
export PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-16} FUSEDOPS_CUDA_ARCHS=${FUSEDOPS_CUDA_ARCHS:-8.0;9.0a}
say() { echo "== $* ($(date +%T))" | tee -a "$LOG"; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv | tee -a "$LOG"
say build
build_variant() {  # $1: suffix ("" or 2), $2: sed script
  local src=/tmp/variant$1_src
  rm -rf "$src" && cp -r . "$src" && rm -rf "$src/build"
  (cd "$src" && for f in csrc/attention/*; do sed -i "$2" "$f"; done &&
   python3 -m pip install -q --no-build-isolation --no-deps --target "/tmp/variant$1_site" . \
     > "$OUT/variant$1_build.log" 2>&1 || echo "variant$1 build FAILED" >> "$LOG")
}
[ -n "${VARIANT_SED:-}" ] && build_variant "" "$VARIANT_SED" &
[ -n "${VARIANT2_SED:-}" ] && build_variant 2 "$VARIANT2_SED" &
python3 -m pip install --no-build-isolation --no-deps -v . > "$OUT/build.log" 2>&1 \
  || { tail -40 "$OUT/build.log" | tee -a "$LOG"; exit 1; }
wait
say tests
if [ -n "${TRITON_K:-}" ]; then
  python3 -m pytest -q -p no:cacheprovider tests/test_attention.py -k "$TRITON_K" \
    > "$OUT/triton_tests.log" 2>&1 &
  tpid=$!
fi
python3 -m pytest -q -p no:cacheprovider tests/test_attention.py \
  -k "cuda-sm80 or test_cuda or auto_dispatch or dq_mode" 2>&1 | tail -5 | tee -a "$LOG"
# The parity suite again with the CUDA backend's non-default dQ mode (the separate pass).
FUSEDOPS_ATTN_DQ=separate python3 -m pytest -q -p no:cacheprovider tests/test_attention.py \
  -k "test_parity and cuda-sm80" 2>&1 | tail -3 | sed 's/^/[separate dQ parity] /' | tee -a "$LOG"
if [ -n "${TRITON_K:-}" ]; then
  wait $tpid; tail -3 "$OUT/triton_tests.log" | sed 's/^/[triton subset] /' | tee -a "$LOG"
fi
say bench
python3 benchmarks/bench_attention.py --out "$OUT" --lengths "${BENCH_LENGTHS:-4096}" \
  --dims "${BENCH_DIMS:-64,128}" --methods "${BENCH_METHODS:-cuda-sm80,cuda-sm80-deterministic,sdpa_flash}" --rep-ms 50 \
  2>>"$LOG" | tee -a "$LOG"
for i in "" 2; do
  sed_var=VARIANT${i}_SED env_var=VARIANT${i}_ENV
  if [ -n "${!sed_var:-}" ] && [ -d "/tmp/variant${i}_site/fusedops" ]; then
    variant_env=${!env_var:-${VARIANT_ENV:-}}
    say "bench variant$i (${!sed_var})"
    # shellcheck disable=SC2086  # variant_env holds VAR=value words
    env $variant_env "FUSEDOPS_BENCH_VARIANT=${!sed_var}${variant_env:+ [env: $variant_env]}" \
      "PYTHONPATH=/tmp/variant${i}_site" python3 benchmarks/bench_attention.py \
      --out "$OUT/variant$i" --lengths "${BENCH_LENGTHS:-4096}" --dims "${VARIANT_DIMS:-64,128}" \
      --methods "${VARIANT_METHODS:-cuda-sm80}" --rep-ms 50 2>>"$LOG" | tee -a "$LOG"
  fi
done
if [ -n "${EXTRA:-}" ]; then say extra; bash -c "$EXTRA" 2>&1 | tee -a "$LOG"; fi
say done
