#!/usr/bin/env bash
# One device call for the Hopper GEMMs of the linear cross-entropy: build, their GPU tests
# (tests/linear_ce/test_gemm_sm90.py, test_lce_fused_sm90.py, test_lce_dz_sm90.py),
# compute-sanitizer (memcheck, racecheck, synccheck) on the tiny cases of every instantiation,
# bench_gemm_sm90.py against cuBLAS, and bench_linear_ce.py's whole loss with
# FUSEDOPS_LCE_GEMM=sm90 / sm90-fused / sm90-fused2 next to the default at Llama-3's shape (N =
# 8192 and 4096). Logs go to $OUT (log.txt, build.log, tests.log, sanitize.log, bench.log,
# bench.err, lce_bench.log, lce_bench.err); rows to $OUT/lce_gemm.jsonl and $OUT/linear_ce.jsonl.
# Each step has a time limit, so that a hang costs minutes, not the call.
# Env: FUSEDOPS_GIT (sha for the rows); STANDALONE=1 builds the GEMM op alone
#   (lce_gemm_sm90_standalone.py, about a minute; the chunked.py switch tests then skip) instead
#   of installing fusedops for FUSEDOPS_CUDA_ARCHS (default here 9.0a); TESTS (a pytest -k
#   expression; "none" skips the tests), SANITIZE=0, BENCH_ARGS (e.g. "--shapes llama3-2048"),
#   SKIP_BENCH=1, SKIP_LCE_BENCH=1 (the bench_linear_ce.py step; skipped with STANDALONE=1),
#   LCE_BENCH_ARGS (default: the two Llama-3 shapes and the five methods below),
#   SKIP_BUILD=1 (fusedops already installed by an earlier call).
set -uo pipefail
OUT=${OUT:-/tmp/lce_gemm_out}; mkdir -p "$OUT"; LOG=$OUT/log.txt
export PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-16} FUSEDOPS_CUDA_ARCHS=${FUSEDOPS_CUDA_ARCHS:-9.0a}
say() { echo "== $* ($(date +%T))" | tee -a "$LOG"; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv | tee -a "$LOG"
TEST_ARGS="-q -rs -p no:cacheprovider -m gpu tests/linear_ce/test_gemm_sm90.py"
TEST_ARGS="$TEST_ARGS tests/linear_ce/test_lce_fused_sm90.py tests/linear_ce/test_lce_dz_sm90.py"
if [ -n "${TESTS:-}" ] && [ "$TESTS" != "none" ]; then TEST_ARGS="$TEST_ARGS -k '$TESTS'"; fi
say build
t0=$(date +%s)
if [ "${STANDALONE:-0}" = "1" ]; then
  # Every step runs in a process that loads the library (the build is a no-op after the first).
  SA=(env PYTHONPATH=python python3 benchmarks/lce_gemm_sm90_standalone.py --build /tmp/lce_gemm_build)
  timeout 300 "${SA[@]}" > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log" | tee -a "$LOG"; exit 1; }
  TESTS_CMD=("${SA[@]}" "--pytest=$TEST_ARGS")
  SAN_CMD=("${SA[@]}" --bench=--sanitize-run)
  BENCH_CMD=("${SA[@]}" "--bench=--out $OUT ${BENCH_ARGS:-}")
else
  if [ "${SKIP_BUILD:-0}" = "1" ]; then
    echo "build skipped (SKIP_BUILD=1: fusedops installed by an earlier call)" | tee -a "$LOG"
  else
    timeout 480 python3 -m pip install --no-build-isolation --no-deps -v . > "$OUT/build.log" \
      2>&1 || { tail -40 "$OUT/build.log" | tee -a "$LOG"; exit 1; }
  fi
  (cd /tmp && python3 -m fusedops.info) >> "$LOG" 2>&1
  # From the repository root the tests import the installed fusedops (the package is under python/).
  TESTS_CMD=(bash -c "python3 -m pytest $TEST_ARGS")
  SAN_CMD=(python3 benchmarks/bench_gemm_sm90.py --sanitize-run)
  # shellcheck disable=SC2206  # BENCH_ARGS holds words
  BENCH_CMD=(python3 benchmarks/bench_gemm_sm90.py --out "$OUT" ${BENCH_ARGS:-})
fi
echo "build: $(( $(date +%s) - t0 )) s" | tee -a "$LOG"
if [ "${TESTS:-}" != "none" ]; then
  say tests
  timeout 240 "${TESTS_CMD[@]}" > "$OUT/tests.log" 2>&1
  echo "tests rc=$?" | tee -a "$LOG"
  grep -E "FAILED|Error|passed|failed" "$OUT/tests.log" | tail -20 | tee -a "$LOG"
fi
if [ "${SANITIZE:-1}" = "1" ]; then
  say sanitize
  timeout 300 "${SAN_CMD[@]}" > "$OUT/sanitize.log" 2>&1
  echo "sanitize rc=$?" | tee -a "$LOG"
  grep -E "PASS|FAIL" "$OUT/sanitize.log" | tail -8 | tee -a "$LOG"
fi
if [ "${SKIP_BENCH:-0}" != "1" ]; then
  say bench
  timeout 240 "${BENCH_CMD[@]}" > "$OUT/bench.log" 2> "$OUT/bench.err"
  echo "bench rc=$?" | tee -a "$LOG"
  tail -30 "$OUT/bench.log" | tee -a "$LOG"
fi
if [ "${SKIP_LCE_BENCH:-0}" != "1" ] && [ "${STANDALONE:-0}" != "1" ]; then
  say lce bench
  LCE_METHODS=fusedops,fusedops-sm90,fusedops-sm90-fused,fusedops-520,fusedops-sm90-fused-520
  LCE_METHODS=$LCE_METHODS,fusedops-sm90-fused2,fusedops-sm90-fused2-520
  LCE_ARGS=${LCE_BENCH_ARGS:-"--shapes llama3,llama3-4k --methods $LCE_METHODS"}
  # shellcheck disable=SC2086  # LCE_ARGS holds words
  timeout 300 python3 benchmarks/bench_linear_ce.py --out "$OUT" $LCE_ARGS \
    > "$OUT/lce_bench.log" 2> "$OUT/lce_bench.err"
  echo "lce bench rc=$?" | tee -a "$LOG"
  tail -20 "$OUT/lce_bench.log" | tee -a "$LOG"
  grep -E "failed|route" "$OUT/lce_bench.err" | tail -5 | tee -a "$LOG"
fi
say done
