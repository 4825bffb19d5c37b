#!/usr/bin/env bash
# One device call for the Hopper attention kernels: build, check_attention_sm90.py (parity of every
# sm90 variant and of the backward, then timing side by side), compute-sanitizer on its tiny
# cases, the attention GPU tests, and bench_attention.py against SDPA flash / cuDNN, FlexAttention
# and FlashAttention-4 (installed beforehand by `. .whl/install.sh`, see ../shared/anchors).
# Logs go to $OUT (log.txt, build.log, check.log, sanitize.log, tests.log, bench.err); rows to
# $OUT/attention.jsonl. Each step has a time limit, so that a hang costs minutes, not the call.
# Env: FUSEDOPS_GIT (sha for the rows), CHECK_ARGS (extra check_attention_sm90.py arguments; SKIP_CHECK=1),
#   SANITIZE=0 to skip the sanitizers, SANITIZE_ARGS (e.g. "--dims 256"), TESTS (pytest -k expression over tests/attention, default all
#   GPU attention tests; "none" skips), BENCH_METHODS, BENCH_DIMS, BENCH_LENGTHS, BENCH_REP_MS,
#   BENCH_ROUNDS (interleaved rounds per shape, default 1),
#   SKIP_BENCH=1, EXTRA (a command run last, its output in the log), SKIP_BUILD=1 (fusedops
#   already installed by an earlier call on the same machine).
set -uo pipefail
OUT=${OUT:-/tmp/attn_out}; mkdir -p "$OUT"; LOG=$OUT/log.txt
export PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-16} FUSEDOPS_CUDA_ARCHS=${FUSEDOPS_CUDA_ARCHS:-8.0;9.0a}
say() { echo "== $* ($(date +%T))" | tee -a "$LOG"; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv | tee -a "$LOG"
if [ "${SKIP_BUILD:-0}" != "1" ]; then
  say build
  python3 -m pip install --no-build-isolation --no-deps -v . > "$OUT/build.log" 2>&1 \
    || { tail -40 "$OUT/build.log" | tee -a "$LOG"; exit 1; }
  grep -E "registers|spill" "$OUT/build.log" > "$OUT/ptxas.txt" 2>/dev/null
fi
(cd /tmp && python3 -m fusedops.info) >> "$LOG" 2>&1
if [ "${SKIP_CHECK:-0}" != "1" ]; then
  say check
  # shellcheck disable=SC2086  # CHECK_ARGS holds words
  timeout 400 python3 benchmarks/check_attention_sm90.py --out "$OUT" ${CHECK_ARGS:-} \
    > "$OUT/check.log" 2>&1
  echo "check rc=$?" | tee -a "$LOG"
  grep -E "FAIL|HANG|summary|passed|failed" "$OUT/check.log" | tail -25 | tee -a "$LOG"
fi
if [ "${SANITIZE:-1}" = "1" ]; then
  say sanitize
  # shellcheck disable=SC2086  # SANITIZE_ARGS holds words
  timeout 400 python3 benchmarks/check_attention_sm90.py --sanitize-run ${SANITIZE_ARGS:-} \
    > "$OUT/sanitize.log" 2>&1
  echo "sanitize rc=$?" | tee -a "$LOG"
  tail -8 "$OUT/sanitize.log" | tee -a "$LOG"
fi
if [ "${TESTS:-}" != "none" ]; then
  say tests
  timeout "${TESTS_TIMEOUT:-400}" python3 -m pytest -q -rs -p no:cacheprovider -n 3 -m gpu tests/attention \
    ${TESTS:+-k "$TESTS"} > "$OUT/tests.log" 2>&1
  echo "tests rc=$?" | tee -a "$LOG"
  tail -4 "$OUT/tests.log" | tee -a "$LOG"
fi
if [ "${SKIP_BENCH:-0}" != "1" ]; then
  say bench
  timeout "${BENCH_TIMEOUT:-420}" python3 benchmarks/bench_attention.py --out "$OUT" \
    --lengths "${BENCH_LENGTHS:-1024,4096,16384}" --dims "${BENCH_DIMS:-64,128}" \
    --methods "${BENCH_METHODS:-cuda-sm90,cuda-sm90-deterministic,sdpa_flash,sdpa_cudnn,flex,fa4}" \
    --rep-ms "${BENCH_REP_MS:-50}" --rounds "${BENCH_ROUNDS:-1}" 2> "$OUT/bench.err" | tee -a "$LOG"
  tail -5 "$OUT/bench.err" | tee -a "$LOG"
fi
if [ -n "${EXTRA:-}" ]; then say extra; bash -c "$EXTRA" 2>&1 | tee -a "$LOG"; fi
say done
