#!/usr/bin/env bash
# One device call: install fusedops (building the CUDA extension), run the GPU tests, run one
# bench script. Logs (gpu.txt, build.log, info.txt, tests.log, bench.err) go to $OUT; the bench
# appends its rows to $OUT/<op>.jsonl (--out $OUT), which is appended to
# benchmarks/results/<op>.jsonl once copied back.
# Usage (on the GPU machine): FUSEDOPS_GIT=<sha> bash benchmarks/gpu_run.sh
#   PYTEST_ARGS (default "-n 3 -m gpu tests": three pytest-xdist workers; the float64 oracles of
#   the largest linear-CE cases hold about 33 GiB each, so eight workers exhaust the H200), TEST_TIMEOUT (s), BENCH (default bench_linear_ce.py),
#   BENCH_ARGS, BENCH_TIMEOUT (s), SKIP_TESTS=1, SKIP_BENCH=1, RUN_DEMO=1,
#   FUSEDOPS_SKIP_CUDA_BUILD=1 (Triton/torch work only)
set -uo pipefail
OUT=${OUT:-/tmp/fusedops_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-16}
export FUSEDOPS_CUDA_ARCHS=${FUSEDOPS_CUDA_ARCHS:-8.0;9.0a}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv | tee "$OUT/gpu.txt"
t0=$(date +%s)
python3 -m pip install --no-build-isolation --no-deps -v . > "$OUT/build.log" 2>&1 \
  || { tail -40 "$OUT/build.log"; exit 1; }
echo "build: $(( $(date +%s) - t0 )) s"
(cd /tmp && python3 -m fusedops.info) | tee "$OUT/info.txt"
if [ "${SKIP_TESTS:-0}" != "1" ]; then
  t0=$(date +%s)
  # The package lives under python/, so from the repository root the tests import the
  # installed fusedops, the one with the extension just built.
  timeout "${TEST_TIMEOUT:-400}" python3 -m pytest -q -rs -p no:cacheprovider \
    ${PYTEST_ARGS:--n 3 -m gpu tests} > "$OUT/tests.log" 2>&1
  rc=$?
  tail -25 "$OUT/tests.log"
  echo "tests: rc=$rc, $(( $(date +%s) - t0 )) s"
fi
if [ "${SKIP_BENCH:-0}" != "1" ]; then
  timeout "${BENCH_TIMEOUT:-300}" python3 "benchmarks/${BENCH:-bench_linear_ce.py}" --out "$OUT" \
    ${BENCH_ARGS:-} 2> "$OUT/bench.err"
  tail -5 "$OUT/bench.err"
fi
if [ "${RUN_DEMO:-0}" = "1" ]; then
  (cd /tmp && python3 "$OLDPWD/examples/demo.py") 2>&1 | tee "$OUT/demo.log"
fi
