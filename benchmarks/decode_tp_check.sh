#!/usr/bin/env bash
# One GPU call that validates the GPU side of decode attention over a KV cache
# (attention_with_kvcache) and of the vocab-parallel linear cross-entropy: build (sm_80 + sm_90a,
# ptxas registers and spills of the decode kernels), the decode GPU tests (torch, Triton, and
# the CUDA kernel enabled by FUSEDOPS_ATTN_DECODE_CUDA=1), compute-sanitizer memcheck (and
# racecheck) on small cases of every CUDA decode instantiation, the vocab-parallel GPU tests
# (each rank's shard by the CUDA path on the one GPU, statistics combined by gloo; NCCL with one
# GPU per rank when two are visible), bench_linear_ce_tp.py (--simulate on one GPU, the NCCL run
# on two), and bench_decode.py against SDPA and FlashAttention-4 (last: it takes what is left).
# Every step runs under `timeout` within one overall budget (BUDGET_S, default 570 s); logs go
# to $OUT and a short summary table is printed last ($OUT/summary.txt).
# Usage (repository root, on the GPU machine): FUSEDOPS_GIT=<sha> bash benchmarks/decode_tp_check.sh
# FlashAttention-4 is compared only where it is installed: carried as wheels (see
# ../shared/anchors/wheels.sh), `.whl/install.sh` is sourced here when present; else its rows
# are skipped with a message.
# Env: SKIP_BUILD=1 (the extension is already built and installed, e.g. by a script run before
#   in the same call), BUDGET_S, SKIP_SANITIZE=1, SKIP_RACECHECK=1, SKIP_BENCH=1,
#   BENCH_BATCHES (default 1,8,64), BENCH_CONTEXTS (default 1024,4096,8192,32768,131072: five
#   points of the 1k-128k range that fit the budget after the tests; every power of two in a call
#   of its own: SKIP_BUILD=1 SKIP_TESTS=1 SKIP_SANITIZE=1 BENCH_CONTEXTS=1024,2048,...,131072),
#   BENCH_REP_MS (50), BENCH_METHODS (bench_decode.py's default list), BENCH_ARGS (more
#   arguments, e.g. "--cuda-splits 16,33,66"), SKIP_TESTS=1 (neither the decode nor the
#   vocab-parallel tests), SKIP_VP=1 (no vocab-parallel tests or bench).
set -uo pipefail
OUT=${OUT:-/tmp/decode_tp_out}; mkdir -p "$OUT"
LOG=$OUT/log.txt SUM=$OUT/summary.txt
: > "$SUM"
export PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-16} FUSEDOPS_CUDA_ARCHS=${FUSEDOPS_CUDA_ARCHS:-8.0;9.0a}
export NVCC_APPEND_FLAGS=${NVCC_APPEND_FLAGS:---threads 4 -Xptxas -v}
export FUSEDOPS_GIT=${FUSEDOPS_GIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
# NVLink multicast stays off (the device rules), also for the processes spawned here.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
START=$(date +%s) BUDGET=${BUDGET_S:-570}

say() { echo "== $* (+$(( $(date +%s) - START ))s)" | tee -a "$LOG"; }
note() { echo "$*" | tee -a "$SUM" >> "$LOG"; }
# Seconds for a step: at most $1, leaving $2 for the steps after it; 0 when too little is left.
limit() {
  local left=$(( START + BUDGET - $(date +%s) - $2 ))
  local t=$(( left < $1 ? left : $1 ))
  echo $(( t < 15 ? 0 : t ))
}
# After a step that failed (rc $1 != 0): the last lines of its log ($2) in the summary.
tail_if_failed() { [ "$1" = 0 ] || tail -5 "$2" | sed 's/^/    | /' | tee -a "$SUM" >> "$LOG"; }
XD=""; python3 -c "import xdist" 2>/dev/null && XD="-n 3"
# shellcheck disable=SC1091  # carried by the caller when wanted
[ -f .whl/install.sh ] && . .whl/install.sh >> "$LOG" 2>&1

nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv | tee -a "$LOG"
NGPU=$(nvidia-smi -L 2>/dev/null | wc -l)
note "decode_tp_check git $FUSEDOPS_GIT, budget ${BUDGET}s, $NGPU GPU(s)"

# ---- 1. build (about 120-150 s with 16 jobs; SKIP_BUILD=1: 0) ----
if [ "${SKIP_BUILD:-0}" != "1" ]; then
  say build
  t0=$(date +%s)
  timeout "$(limit 300 300)" python3 -m pip install --no-build-isolation --no-deps -v . \
    > "$OUT/build.log" 2>&1
  rc=$?
  note "build: rc=$rc $(( $(date +%s) - t0 ))s"
  if [ "$rc" != 0 ]; then tail -40 "$OUT/build.log" | tee -a "$LOG"; cat "$SUM"; exit 1; fi
  grep -E "Compiling entry function|registers|spill" "$OUT/build.log" > "$OUT/ptxas.txt" 2>/dev/null
  # The decode kernels: 4 per arch (dtype x head dim), 0 spills expected (nvcc 13.0 on the
  # CPU machine: 106-171 registers).
  grep -A2 "decode_" "$OUT/ptxas.txt" \
    | grep -oE "decode_kernel[^ ]* for '[a-z_0-9]+'|[0-9]+ bytes spill stores|Used [0-9]+ registers" \
    | paste - - - > "$OUT/decode_ptxas.txt"
  note "build: decode kernels $(wc -l < "$OUT/decode_ptxas.txt"), with spill stores > 0:" \
    "$(grep -cE "[^0-9][1-9][0-9]* bytes spill stores" "$OUT/decode_ptxas.txt") (expected 8 and 0);" \
    "registers $(grep -oE "Used [0-9]+" "$OUT/decode_ptxas.txt" | awk '{print $2}' | sort -n | uniq | tr '\n' ' ')"
else
  note "build: skipped (SKIP_BUILD=1)"
fi
(cd /tmp && FUSEDOPS_ATTN_DECODE_CUDA=1 python3 -m fusedops.info --dtype bfloat16 --head-dim 128) \
  >> "$LOG" 2>&1

# ---- 2. decode GPU tests: torch, Triton and the CUDA kernel (about 120 s) ----
say decode-tests
t=$(limit 240 300)
if [ "${SKIP_TESTS:-0}" = "1" ]; then note "decode tests: skipped (SKIP_TESTS=1)"
elif [ "$t" = 0 ]; then note "decode tests: SKIPPED (budget)"; else
  t0=$(date +%s)
  # shellcheck disable=SC2086  # XD holds words
  FUSEDOPS_ATTN_DECODE_CUDA=1 timeout "$t" python3 -m pytest -q -rs -p no:cacheprovider $XD \
    -m gpu tests/attention/test_kvcache.py > "$OUT/decode_tests.log" 2>&1
  note "decode tests (${t}s limit): rc=$? $(( $(date +%s) - t0 ))s $(tail -1 "$OUT/decode_tests.log")"
  grep -E "^(FAILED|ERROR)" "$OUT/decode_tests.log" | head -15 | tee -a "$SUM" >> "$LOG"
fi

# ---- 3. compute-sanitizer on the CUDA decode kernels (about 60 + 40 s) ----
if [ "${SKIP_SANITIZE:-0}" != "1" ]; then
  say sanitize
  t=$(limit 150 250)
  if [ "$t" = 0 ]; then note "memcheck: SKIPPED (budget)"; else
    t0=$(date +%s)
    FUSEDOPS_ATTN_DECODE_CUDA=1 PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout "$t" \
      compute-sanitizer --tool memcheck --error-exitcode 9 python3 benchmarks/sanitize_decode.py \
      > "$OUT/memcheck.log" 2>&1
    rc=$?
    note "memcheck (${t}s limit): rc=$rc $(( $(date +%s) - t0 ))s" \
      "$(grep -E 'ERROR SUMMARY|cases ran' "$OUT/memcheck.log" | tr '\n' ' ')"
    tail_if_failed "$rc" "$OUT/memcheck.log"
  fi
  t=$(limit 100 220)
  if [ "${SKIP_RACECHECK:-0}" = "1" ] || [ "$t" = 0 ]; then note "racecheck: SKIPPED"; else
    t0=$(date +%s)
    FUSEDOPS_ATTN_DECODE_CUDA=1 timeout "$t" compute-sanitizer --tool racecheck \
      --error-exitcode 9 python3 benchmarks/sanitize_decode.py --quick > "$OUT/racecheck.log" 2>&1
    rc=$?
    note "racecheck (${t}s limit): rc=$rc $(( $(date +%s) - t0 ))s" \
      "$(grep -E 'RACECHECK SUMMARY|ERROR SUMMARY|cases ran' "$OUT/racecheck.log" | tr '\n' ' ')"
    tail_if_failed "$rc" "$OUT/racecheck.log"
  fi
fi

# ---- 4. vocab-parallel GPU tests: two gloo ranks' CUDA shards on the one GPU (about 90 s) ----
say vocab-parallel-tests
t=$(limit 200 170)
if [ "${SKIP_TESTS:-0}" = "1" ] || [ "${SKIP_VP:-0}" = "1" ]; then note "vocab-parallel tests: skipped (SKIP_TESTS=1)"
elif [ "$t" = 0 ]; then note "vocab-parallel tests: SKIPPED (budget)"; else
  t0=$(date +%s)
  timeout "$t" python3 -m pytest -q -rs -p no:cacheprovider -m gpu \
    tests/linear_ce/test_vocab_parallel.py > "$OUT/vp_tests.log" 2>&1
  note "vocab-parallel tests (${t}s limit): rc=$? $(( $(date +%s) - t0 ))s $(tail -1 "$OUT/vp_tests.log")"
  grep -E "^(FAILED|ERROR|SKIPPED)" "$OUT/vp_tests.log" | head -10 | tee -a "$SUM" >> "$LOG"
fi

# ---- 5. bench_linear_ce_tp.py: one rank simulated on one GPU; NCCL on two (about 30 s) ----
say tp-bench
t=$(limit 90 140)
if [ "${SKIP_VP:-0}" = "1" ]; then note "tp bench: skipped (SKIP_VP=1)"
elif [ "$t" = 0 ]; then note "tp bench: SKIPPED (budget)"; else
  t0=$(date +%s)
  if [ "$NGPU" -ge 2 ]; then TP_ARGS=""; else TP_ARGS="--simulate"; fi
  # shellcheck disable=SC2086  # TP_ARGS holds words
  timeout "$t" python3 benchmarks/bench_linear_ce_tp.py $TP_ARGS --out "$OUT" \
    > "$OUT/tp_bench.log" 2>&1
  rc=$?
  note "tp bench ${TP_ARGS:-(NCCL, 2 GPUs)} (${t}s limit): rc=$rc $(( $(date +%s) - t0 ))s"
  grep -E "^(shape|llama3)" "$OUT/tp_bench.log" | tee -a "$SUM" >> "$LOG"
  tail_if_failed "$rc" "$OUT/tp_bench.log"
fi

# ---- 6. bench_decode.py against SDPA and FlashAttention-4 (about 100-150 s; what is left) ----
if [ "${SKIP_BENCH:-0}" != "1" ]; then
  say decode-bench
  t=$(limit 420 10)
  if [ "$t" = 0 ]; then note "decode bench: SKIPPED (budget)"; else
    t0=$(date +%s)
    # shellcheck disable=SC2086  # BENCH_ARGS holds words
    FUSEDOPS_ATTN_DECODE_CUDA=1 timeout "$t" python3 benchmarks/bench_decode.py --check \
      --out "$OUT" --batches "${BENCH_BATCHES:-1,8,64}" ${BENCH_ARGS:-} \
      ${BENCH_METHODS:+--methods "$BENCH_METHODS"} \
      --contexts "${BENCH_CONTEXTS:-1024,4096,8192,32768,131072}" \
      --rep-ms "${BENCH_REP_MS:-50}" > "$OUT/decode_bench.log" 2> "$OUT/decode_bench.err"
    rc=$?
    note "decode bench (${t}s limit): rc=$rc $(( $(date +%s) - t0 ))s (rows: $OUT/attention_decode.jsonl)"
    tail_if_failed "$rc" "$OUT/decode_bench.err"
    grep -E "skipped|dropped|check |device copy" "$OUT/decode_bench.log" "$OUT/decode_bench.err" \
      | sed 's/^[^:]*://' | head -12 | tee -a "$SUM" >> "$LOG"
    # The table from the rows written so far (a bench cut short by its limit still has them):
    # GB/s per method at each B and ctx, contiguous / paged, and the fraction of the copy.
    python3 - "$OUT/attention_decode.jsonl" >> "$SUM" 2>&1 <<'EOF'
import json, sys
try:
    rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
except OSError:
    sys.exit("decode bench: no rows")
run = rows[-1]["run"]
rows = [r for r in rows if r["run"] == run]
methods = list(dict.fromkeys(r["method"] for r in rows))
print(f"decode GB/s (K/V bytes read per s / 1e9; device copy {rows[0]['copy_gbps']:.0f} GB/s "
      "in the same run), contiguous/paged:")
print(f"{'B':>3} {'ctx':>7} " + " ".join(f"{m:>15}" for m in methods))
by = {(r["method"], r["B"], r["ctx"], r["paged"]): r for r in rows}
for b, ctx in dict.fromkeys((r["B"], r["ctx"]) for r in rows):
    cells = []
    for m in methods:
        c, p = by.get((m, b, ctx, False)), by.get((m, b, ctx, True))
        cells.append(f"{round(c['gbps']) if c else '-':>6}/{round(p['gbps']) if p else '-':<6}")
    print(f"{b:>3} {ctx:>7} " + " ".join(f"{x:>15}" for x in cells))
for m in methods:
    if m.startswith(("triton", "cuda")):
        low = [r for r in rows if r["method"] == m and r["ctx"] >= 8192
               and r["frac_of_copy"] < 0.85]
        print(f"{m}: rows at ctx >= 8192 below 85% of the copy: {len(low)}")
EOF
  fi
fi

say done
echo
echo "==== SUMMARY (git $FUSEDOPS_GIT, $(( $(date +%s) - START ))s) ===="
cat "$SUM"
