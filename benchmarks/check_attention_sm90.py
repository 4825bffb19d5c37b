"""Parity and speed check of the Hopper (sm90) attention forward on an H200, self-judging.

    FUSEDOPS_GIT=<sha> SKIP_TESTS=1 BENCH=check_attention_sm90.py BENCH_TIMEOUT=420 \
        bash benchmarks/gpu_run.sh                  # build, then parity, backward, timing
    python3 benchmarks/check_attention_sm90.py --sanitize-run      # compute-sanitizer x 3 tools
    (options: --schedules serial,ovl-regs, --dims 64 (default 64,128,256), --dtypes bfloat16,
    --no-timing, --no-backward, --no-bwd-timing, --timed auto,poly (the variants timed),
    --baselines cudnn; --sanitize-run takes --dims and --schedules too)

Dispatch runs cuda-sm90 on compute capability 9.0; here the kernel is called directly as
torch.ops.fusedops.attention_fwd_cuda(..., 90), once per variant (VARIANTS below: the launcher's
overrides FUSEDOPS_ATTN_SM90_*, for measurement only; unset, the launcher picks from its measured
table). Rule (docs/CONVENTIONS): against the float64 reference, the sm90 error must be at most 2x
the baseline's error + 1e-3, for out and for lse (finite entries; -inf exactly where the reference
has -inf); no NaN anywhere. This is a screen for one device call, looser than the tests' rule (2x
plain PyTorch's error), which tests/attention applies. The baseline is the sm80 kernel at D=64/128
and Triton's forward at D=256 (no sm80 kernel there). Outputs are poisoned first (a NaN-filled block
of the same size is freed just before the call, so that the caching allocator hands it to the
kernel): an unwritten row shows as NaN. The backward of arch 90 (the sm90 backward,
attention_bwd_kernel_sm90.cuh, in each BWD_VARIANTS setting: its serial and overlapped schedules,
its deterministic mode in both orders of the dQ reductions (run twice: the gradients must be bit-
identical) and FUSEDOPS_ATTN_SM90_BWD=sm80, the sm80 backward; Triton's at D=256, as the op runs it)
is checked from the sm90 forward's out/lse against the baseline backward from the baseline
forward's, all against float64 gradients (error at most 2x the baseline's + 1e-3 x the largest
reference gradient; gradients poisoned as the outputs).

One PASS/FAIL line per variant and group, then a summary; then TFLOP/s of every sm90 variant side by
side with sm80, Triton, SDPA flash and cuDNN (bf16, B*L = 16384, H*D = 2048), rows appended to
<out>/attention.jsonl (method cuda-sm90-fwd = auto, cuda-sm90-<variant>-fwd, triton-fwd); then the
backward's TFLOP/s (2.5x the forward's FLOPs, D=64/128): the sm90 backward (and its overlapped
schedule, its deterministic mode), the sm80 one (and its deterministic dQ pass), SDPA flash and
cuDNN (their (forward + backward) - forward), methods cuda-sm90-bwd, cuda-sm90-overlap-bwd,
cuda-sm80-bwd, cuda-sm90-det-bwd (default order; -det-asc-bwd, -det-desc-bwd the two orders),
cuda-sm80-det-bwd, sdpa_*-bwd (--no-bwd-timing skips it). Exit
status 1 when any parity group fails.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import subprocess
import sys
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

NAN = float("nan")
# The sm90 forward's variants, as the environment overrides that select them
# (attention_launch_sm90.cuh): FUSEDOPS_ATTN_SM90_SCHEDULE (serial / overlap / pingpong; unset:
# the measured table sm90_auto_schedule of attention_config_sm90.h) and
# FUSEDOPS_ATTN_SM90_EPILOGUE (regs: O stored from registers; unset: TMA store), and
# FUSEDOPS_ATTN_SM90_BLOCK_N=176 (176-key tiles, built at D=128 for the overlap and ping-pong
# schedules only; the bn176 variants run at D=128 alone), FUSEDOPS_ATTN_SM90_EXP2 (mufu: every
# softmax exponential by MUFU.EX2; poly: a share of them by the polynomial ex2_poly, built for
# the 128-key tiles of D=64/128 with the overlap and ping-pong schedules; unset: sm90_auto_exp2)
# and FUSEDOPS_ATTN_SM90_TILE (m128: two consumer warpgroups; m192: three, 192 queries, D=64
# only; unset: sm90_consumer_warpgroups), FUSEDOPS_ATTN_SM90_EPILOGUE=qrows (the TMA store
# staged in the Q rows, the path of tile tables without an O buffer) and
# FUSEDOPS_ATTN_SM90_PERSISTENT (0: one CTA per work tile, the non-persistent launch; N: at most
# N CTAs, so that every CTA runs dozens of tiles and the cross-tile pipeline is stressed; unset:
# one CTA per SM; only the 128 x 128 two-warpgroup tiles of D=64/128 loop over work tiles, so
# these variants run at D=64/128 alone). "auto" is what dispatch runs; parity checks the
# explicit ones (auto picks one of them); "poly" is auto's schedule with the polynomial, the
# timing's direct comparison with auto.
SCHED, EXP2, TILE, MC = ("FUSEDOPS_ATTN_SM90_SCHEDULE", "FUSEDOPS_ATTN_SM90_EXP2",
                         "FUSEDOPS_ATTN_SM90_TILE", "FUSEDOPS_ATTN_SM90_MULTICAST")
MUFU_M128 = {EXP2: "mufu", TILE: "m128"}
VARIANTS = {
    "auto": {},
    "overlap": {"FUSEDOPS_ATTN_SM90_SCHEDULE": "overlap", **MUFU_M128},
    "serial": {"FUSEDOPS_ATTN_SM90_SCHEDULE": "serial", **MUFU_M128},
    "pingpong": {"FUSEDOPS_ATTN_SM90_SCHEDULE": "pingpong", **MUFU_M128},
    "ovl-regs": {"FUSEDOPS_ATTN_SM90_SCHEDULE": "overlap", "FUSEDOPS_ATTN_SM90_EPILOGUE": "regs",
                 **MUFU_M128},
    "bn176-ovl": {"FUSEDOPS_ATTN_SM90_SCHEDULE": "overlap", "FUSEDOPS_ATTN_SM90_BLOCK_N": "176"},
    "bn176-pp": {"FUSEDOPS_ATTN_SM90_SCHEDULE": "pingpong", "FUSEDOPS_ATTN_SM90_BLOCK_N": "176"},
    "ovl-poly": {SCHED: "overlap", EXP2: "poly", TILE: "m128"},
    "pp-poly": {SCHED: "pingpong", EXP2: "poly", TILE: "m128"},
    "poly": {EXP2: "poly"},
    "m192-ovl": {SCHED: "overlap", EXP2: "mufu", TILE: "m192"},
    "m192-pp": {SCHED: "pingpong", EXP2: "mufu", TILE: "m192"},
    "m192-ser": {SCHED: "serial", EXP2: "mufu", TILE: "m192"},
    "m192-regs": {SCHED: "pingpong", "FUSEDOPS_ATTN_SM90_EPILOGUE": "regs", EXP2: "mufu",
                  TILE: "m192"},
    "m192-ovl-poly": {SCHED: "overlap", EXP2: "poly", TILE: "m192"},
    "m192-pp-poly": {SCHED: "pingpong", EXP2: "poly", TILE: "m192"},
    "nonpersist": {"FUSEDOPS_ATTN_SM90_PERSISTENT": "0"},
    # The persistent launch's tile order forced (FUSEDOPS_ATTN_SM90_TILES; unset: from the
    # counter where the tiles differ in length, else the round-robin), and the counter's order
    # over 3 CTAs (dozens of tickets each).
    "static": {"FUSEDOPS_ATTN_SM90_TILES": "static"},
    "dynamic": {"FUSEDOPS_ATTN_SM90_TILES": "dynamic"},
    "dyn-3cta": {"FUSEDOPS_ATTN_SM90_TILES": "dynamic", "FUSEDOPS_ATTN_SM90_PERSISTENT": "3",
                 **MUFU_M128},
    "pp-qrows": {SCHED: "pingpong", "FUSEDOPS_ATTN_SM90_EPILOGUE": "qrows", **MUFU_M128},
    "ser-3cta": {SCHED: "serial", "FUSEDOPS_ATTN_SM90_PERSISTENT": "3", **MUFU_M128},
    "ovl-3cta": {SCHED: "overlap", "FUSEDOPS_ATTN_SM90_PERSISTENT": "3", **MUFU_M128},
    "pp-qrows-3cta": {SCHED: "pingpong", "FUSEDOPS_ATTN_SM90_EPILOGUE": "qrows",
                      "FUSEDOPS_ATTN_SM90_PERSISTENT": "3", **MUFU_M128},
    "pp-poly-3cta": {SCHED: "pingpong", EXP2: "poly", TILE: "m128",
                     "FUSEDOPS_ATTN_SM90_PERSISTENT": "3"},
    # The 192-query tiles (three consumer warpgroups) over 3 CTAs, in the default order and the
    # counter's. Tile tables without the loop (TilesSm90::kPersistent false: 176 keys, D=256)
    # must ignore the CTA cap and launch one CTA per tile: a capped grid would leave tiles
    # unwritten (NaN-poisoned outputs). ovl-3cta runs at D=256 for this too.
    "m192-pp-3cta": {SCHED: "pingpong", EXP2: "poly", TILE: "m192",
                     "FUSEDOPS_ATTN_SM90_PERSISTENT": "3"},
    "m192-dyn-3cta": {"FUSEDOPS_ATTN_SM90_TILES": "dynamic", EXP2: "mufu", TILE: "m192",
                      "FUSEDOPS_ATTN_SM90_PERSISTENT": "3"},
    "bn176-ovl-3cta": {SCHED: "overlap", "FUSEDOPS_ATTN_SM90_BLOCK_N": "176",
                       "FUSEDOPS_ATTN_SM90_PERSISTENT": "3"},
    # K/V multicast in clusters of two (FUSEDOPS_ATTN_SM90_MULTICAST; unset: sm90_auto_multicast)
    # where the launch allows it (no mask, equal lengths, an even number of q-blocks; elsewhere
    # the same calls run without): forced on with each schedule, over 3 CTAs (one cluster, many
    # tiles each), one CTA per tile; and forced off (the default for these cases: multicast is
    # on by default only at D=128 from 8192 keys).
    "mc-ovl": {SCHED: "overlap", MC: "1", **MUFU_M128},
    "mc-pp": {SCHED: "pingpong", MC: "1", **MUFU_M128},
    "mc-ser-3cta": {SCHED: "serial", MC: "1", "FUSEDOPS_ATTN_SM90_PERSISTENT": "3", **MUFU_M128},
    "mc-nonpersist": {MC: "1", "FUSEDOPS_ATTN_SM90_PERSISTENT": "0"},
    "no-mc": {MC: "0"},
}
PERSISTENT_VARIANTS = ("nonpersist", "pp-qrows", "ser-3cta", "ovl-3cta", "pp-qrows-3cta",
                       "pp-poly-3cta", "m192-pp-3cta", "m192-dyn-3cta", "bn176-ovl-3cta",
                       "static", "dynamic", "dyn-3cta", "mc-ser-3cta", "mc-nonpersist")
VARIANT_DIMS = {"bn176-ovl": (128,), "bn176-pp": (128,),  # the others: every head dim
                "ovl-poly": (64, 128), "pp-poly": (64, 128), "poly": (64, 128),
                **{n: (64, 128) for n in PERSISTENT_VARIANTS},
                **{n: (64,) for n in VARIANTS if n.startswith("m192")},
                "ovl-3cta": (64, 128, 256), "bn176-ovl-3cta": (128,)}
SCHEDULES = ("overlap", "serial", "pingpong", "ovl-regs", "bn176-ovl", "bn176-pp",  # parity
             "ovl-poly", "pp-poly", "m192-ovl", "m192-pp", "m192-ser", "m192-regs",
             "m192-ovl-poly", "m192-pp-poly", "mc-ovl", "mc-pp", "no-mc", *PERSISTENT_VARIANTS)
# Debugging variants, left out of the timing (the -3cta ones are slow by design: 3 CTAs).
UNTIMED = ("m192-ser", "m192-regs", "ser-3cta", "ovl-3cta", "pp-qrows-3cta", "pp-poly-3cta",
           "m192-pp-3cta", "m192-dyn-3cta", "bn176-ovl-3cta", "dyn-3cta", "mc-ser-3cta")
# The baselines of the timing table (--baselines): column name -> method.
BASELINES = {"sm80": "cuda-sm80-fwd", "triton": "triton-fwd", "flash": "sdpa_flash-fwd",
             "cudnn": "sdpa_cudnn-fwd"}
DIMS = (64, 128, 256)
CUDA_BWD_DIMS = (64, 128)  # the sm80 forward and backward kernels; Triton's elsewhere


def runs_at(variant, d):
    return d in VARIANT_DIMS.get(variant, (d,))


class variant_env:
    """Sets a variant's environment overrides for the duration of a with block."""

    def __init__(self, name):
        self.env = VARIANTS[name]

    def __enter__(self):
        self.saved = {k: os.environ.get(k) for env in VARIANTS.values() for k in env}
        for k in self.saved:
            os.environ.pop(k, None)
        os.environ.update(self.env)

    def __exit__(self, *exc):
        for k, v in self.saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class Watchdog:
    """Ends the process (exit 3) naming the case when one takes longer than `seconds`: a
    deadlocked mbarrier pipeline would otherwise hang the run with no word of where."""

    def __init__(self):
        self.timer = None
        self.seconds = 60.0  # --watchdog-s

    def arm(self, what, seconds=None):
        self.disarm()
        seconds = self.seconds if seconds is None else seconds

        def fire():
            print(f"HANG: {what} did not finish within {seconds:.0f}s (a pipeline deadlock?)",
                  flush=True)
            os._exit(3)
        self.timer = threading.Timer(seconds, fire)
        self.timer.daemon = True
        self.timer.start()

    def disarm(self):
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None


WATCHDOG = Watchdog()


class ContextLost(RuntimeError):
    """A CUDA error from the sm90 kernel: the context is unusable, later cases cannot run."""


def cu_of(lens, dev):
    c = [0]
    for n in lens:
        c.append(c[-1] + n)
    return torch.tensor(c, dtype=torch.int32, device=dev)


def make_case(q_lens, k_lens, hq, hkv, d, dt, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(sum(q_lens), hq, d, device="cuda", dtype=dt, generator=g)
    k = torch.randn(max(sum(k_lens), 0), hkv, d, device="cuda", dtype=dt, generator=g)
    v = torch.randn(max(sum(k_lens), 0), hkv, d, device="cuda", dtype=dt, generator=g)
    return q, k, v, cu_of(q_lens, "cuda"), cu_of(k_lens, "cuda")


def poison(*shapes_dtypes):
    """Fills freshly allocated blocks of these shapes with NaN and frees them, so that the next
    allocations of the same sizes (the kernel's outputs) start as NaN."""
    bufs = [torch.full(s, NAN, dtype=t, device="cuda") for s, t in shapes_dtypes]
    del bufs


def fwd(q, k, v, cu_q, cu_k, mq, mk, scale, causal, left, right, softcap, arch):
    poison((q.shape, q.dtype), ((q.shape[1], q.shape[0]), torch.float32))
    return torch.ops.fusedops.attention_fwd_cuda(q, k, v, cu_q, cu_k, mq, mk, scale, causal, left,
                                                 right, softcap, arch)


# Arch 90's backwards at D=64/128, as the environment overrides that select them: the sm90
# kernel (attention_bwd_kernel_sm90.cuh; FUSEDOPS_ATTN_SM90_BWD_SCHEDULE=overlap its overlapped
# schedule, =lagged / lockstep its dQ products a step behind or not,
# FUSEDOPS_ATTN_SM90_BWD_EPILOGUE=regs its dK/dV stores from registers,
# FUSEDOPS_ATTN_SM90_BWD_BM=80|64 its query steps at D=128) and
# FUSEDOPS_ATTN_SM90_BWD=sm80, the sm80 backward; the det variants run the op's
# deterministic mode (the sm90 kernel's ordered dQ reductions, key blocks ascending or
# descending by FUSEDOPS_ATTN_SM90_BWD_DQ_ORDER; "sm90-det" the launcher's default order, the
# rotated one on unmasked calls), which parity also runs twice and requires bit-identical.
BWD_VARIANTS = {
    "sm90": {},
    "sm90-overlap": {"FUSEDOPS_ATTN_SM90_BWD_SCHEDULE": "overlap"},
    "sm90-lagged": {"FUSEDOPS_ATTN_SM90_BWD_SCHEDULE": "lagged"},
    "sm90-lockstep": {"FUSEDOPS_ATTN_SM90_BWD_SCHEDULE": "lockstep"},
    "sm90-bm80": {"FUSEDOPS_ATTN_SM90_BWD_BM": "80"},
    "sm90-bm64": {"FUSEDOPS_ATTN_SM90_BWD_BM": "64"},
    "sm80": {"FUSEDOPS_ATTN_SM90_BWD": "sm80"},
    "sm90-regs": {"FUSEDOPS_ATTN_SM90_BWD_EPILOGUE": "regs"},
    "sm90-det": {},
    "sm90-det-asc": {"FUSEDOPS_ATTN_SM90_BWD_DQ_ORDER": "ascending"},
    "sm90-det-desc": {"FUSEDOPS_ATTN_SM90_BWD_DQ_ORDER": "descending"},
    "sm90-after": {"FUSEDOPS_ATTN_SM90_BWD_CONVERT": "after"},
    "sm90-after-lagged": {"FUSEDOPS_ATTN_SM90_BWD_CONVERT": "after",
                          "FUSEDOPS_ATTN_SM90_BWD_SCHEDULE": "lagged"},
    "sm90-det-after": {"FUSEDOPS_ATTN_SM90_BWD_CONVERT": "after"},
    # the persistent grid capped at 3 CTAs (several tiles per CTA, both K/V buffers), and a CTA
    # per key block
    "sm90-3cta": {"FUSEDOPS_ATTN_SM90_BWD_PERSISTENT": "3"},
    "sm90-lagged-3cta": {"FUSEDOPS_ATTN_SM90_BWD_PERSISTENT": "3",
                         "FUSEDOPS_ATTN_SM90_BWD_SCHEDULE": "lagged"},
    "sm90-lockstep-3cta": {"FUSEDOPS_ATTN_SM90_BWD_PERSISTENT": "3",
                           "FUSEDOPS_ATTN_SM90_BWD_SCHEDULE": "lockstep"},
    "sm90-nonpersistent": {"FUSEDOPS_ATTN_SM90_BWD_PERSISTENT": "0"},
    # the dK/dV store's wait and the K/V buffer's release before the next key block (the
    # persistent kernels at D=128 defer them past its first products)
    "sm90-immediate": {"FUSEDOPS_ATTN_SM90_BWD_EPILOGUE": "immediate"},
    "sm90-3cta-immediate": {"FUSEDOPS_ATTN_SM90_BWD_PERSISTENT": "3",
                            "FUSEDOPS_ATTN_SM90_BWD_EPILOGUE": "immediate"},
}
# Timing also runs the sm80 backward's deterministic mode (its dQ pass).
BWD_TIMED = {"sm80-det": {"FUSEDOPS_ATTN_SM90_BWD": "sm80"}, **BWD_VARIANTS}


def bwd_deterministic(variant):
    return "-det" in variant


class bwd_env:
    """Sets a backward variant's environment overrides for the duration of a with block."""

    def __init__(self, name):
        self.env = BWD_TIMED[name]

    def __enter__(self):
        self.saved = {k: os.environ.pop(k, None)
                      for k in ("FUSEDOPS_ATTN_SM90_BWD", "FUSEDOPS_ATTN_SM90_BWD_SCHEDULE",
                                "FUSEDOPS_ATTN_SM90_BWD_DQ_ORDER",
                                "FUSEDOPS_ATTN_SM90_BWD_EPILOGUE", "FUSEDOPS_ATTN_SM90_BWD_BM",
                                "FUSEDOPS_ATTN_SM90_BWD_CONVERT",
                                "FUSEDOPS_ATTN_SM90_BWD_PERSISTENT")}
        os.environ.update(self.env)

    def __exit__(self, *exc):
        for k, v in self.saved.items():
            os.environ.pop(k, None)
            if v is not None:
                os.environ[k] = v


def bwd(q, k, v, out, lse, do, cu_q, cu_k, mq, mk, scale, causal, left, right, softcap, arch,
        variant="sm90"):
    """The backward the op runs after a forward of `arch`, gradients poisoned: the CUDA one at
    D=64/128 (arch 90: under the BWD_VARIANTS environment `variant`, deterministic for the det
    variants), Triton's at D=256."""
    if q.shape[2] not in CUDA_BWD_DIMS:
        from fusedops.attention import triton as ta
        return ta.attention_bwd(q, k, v, out, lse, do, cu_q, cu_k, mq, mk, scale, causal, left,
                                right, softcap, True)  # the op's default there: separate dQ
    poison((q.shape, q.dtype), (k.shape, k.dtype), (v.shape, v.dtype))
    with bwd_env(variant):
        return torch.ops.fusedops.attention_bwd_cuda(q, k, v, out, lse, do, cu_q, cu_k, mq, mk,
                                                     scale, causal, left, right, softcap,
                                                     bwd_deterministic(variant), arch)


def where_keys(grad, ref, cu_k):
    """Where a dK/dV error is: the largest per 64-key half of the sm90 backward's 128-key blocks
    (a consumer warpgroup's keys), per 16-key warp slice and per 64-wide head-dim block."""
    err = (grad.double() - ref.double()).abs().nan_to_num(nan=1e9)
    starts = cu_k.tolist()
    pos = torch.empty(grad.shape[0], dtype=torch.long, device=grad.device)
    for a, b in zip(starts, starts[1:], strict=False):
        pos[a:b] = torch.arange(b - a, device=grad.device)
    by_half = [f"{err[(pos % 128) // 64 == w].max().item():.1e}" if ((pos % 128) // 64 == w).any()
               else "-" for w in (0, 1)]
    by_warp = [f"{err[(pos % 64) // 16 == w].max().item():.0e}" if ((pos % 64) // 16 == w).any()
               else "-" for w in range(4)]
    by_d = [f"{err[..., c:c + 64].max().item():.1e}" for c in range(0, grad.shape[2], 64)]
    return f"by key half {by_half}, by warp {by_warp}, by d-block {by_d}"


def fwd_baseline(q, k, v, cu_q, cu_k, mq, mk, scale, causal, left, right, softcap):
    """The forward the sm90 one is judged against: sm80's at D=64/128, Triton's at D=256."""
    if q.shape[2] in CUDA_BWD_DIMS:
        return fwd(q, k, v, cu_q, cu_k, mq, mk, scale, causal, left, right, softcap, 80)
    from fusedops.attention import triton as ta
    return ta.attention_fwd(q, k, v, cu_q, cu_k, mq, mk, scale, causal, left, right, softcap)


def max_err(a, ref, mask=None):
    diff = (a.double() - ref.double()).abs()
    if mask is not None:
        diff = diff[mask]
    return diff.max().item() if diff.numel() else 0.0


def where(out, ref, cu_q):
    """Where the output errors are, to tell layout faults apart: the largest error per 64-wide
    head-dim block (a wrong V column-block offset), per 64-query half of the kernel's 128-query
    blocks (a wrong consumer warpgroup offset) and per 16-row warp slice."""
    err = (out.double() - ref.double()).abs().nan_to_num(nan=1e9)  # (total_q, hq, D)
    starts = cu_q.tolist()
    pos = torch.empty(out.shape[0], dtype=torch.long, device=out.device)
    for a, b in zip(starts, starts[1:], strict=False):
        pos[a:b] = torch.arange(b - a, device=out.device)
    by_d = [f"{err[..., c:c + 64].max().item():.1e}" for c in range(0, out.shape[2], 64)]
    by_half = [f"{err[(pos % 128) // 64 == w].max().item():.1e}" if ((pos % 128) // 64 == w).any()
               else "-" for w in (0, 1)]
    by_warp = [f"{err[(pos % 64) // 16 == w].max().item():.0e}" if ((pos % 64) // 16 == w).any()
               else "-" for w in range(4)]
    return f"by d-block {by_d}, by query half {by_half}, by warp {by_warp}"


# (group, name, q_lens, k_lens, hq, hkv, causal, left, right, softcap)
def cases():
    out = []
    for s in (1, 97, 128, 1025, 4096):
        out.append(("dense", f"S={s}", [s, s], [s, s], 4, 4, False, -1, -1, 0.0))
    out += [("sq!=sk", "300x1025", [300, 300], [1025, 1025], 4, 4, False, -1, -1, 0.0),
            ("sq!=sk", "1025x300", [1025, 1025], [300, 300], 4, 4, False, -1, -1, 0.0),
            ("sq!=sk", "1x700", [1, 1], [700, 700], 4, 4, False, -1, -1, 0.0),
            ("gqa", "4:1 S=1025", [1025, 1025], [1025, 1025], 8, 2, False, -1, -1, 0.0),
            ("gqa", "4:1 causal 300x777", [300, 300], [777, 777], 8, 2, True, -1, -1, 0.0),
            ("causal", "S=1025", [1025, 1025], [1025, 1025], 4, 4, True, -1, -1, 0.0),
            ("causal", "S=4096", [4096], [4096], 4, 4, True, -1, -1, 0.0),
            ("causal", "300x1025", [300, 300], [1025, 1025], 4, 4, True, -1, -1, 0.0),
            # bottom-right alignment: the first 725 queries see no key (out 0, lse -inf)
            ("causal", "1025x300 (rows w/o keys)", [1025, 1025], [300, 300], 4, 4, True, -1, -1,
             0.0),
            ("window", "(32,16) S=1025", [1025, 1025], [1025, 1025], 4, 4, False, 32, 16, 0.0),
            ("window", "(64,-1) S=1025", [1025, 1025], [1025, 1025], 4, 4, False, 64, -1, 0.0),
            ("window", "(32,16) 300x1025", [300, 300], [1025, 1025], 4, 4, False, 32, 16, 0.0),
            ("window", "(64,0) causal-band S=700", [700], [700], 4, 4, True, 64, -1, 0.0),
            ("softcap", "20 S=1025", [1025, 1025], [1025, 1025], 4, 4, False, -1, -1, 20.0),
            ("softcap", "20 causal S=1025", [1025, 1025], [1025, 1025], 4, 4, True, -1, -1, 20.0),
            ("varlen", "1,300,1025", [1, 300, 1025], [1, 300, 1025], 4, 4, False, -1, -1, 0.0),
            ("varlen", "q 1,300,1025 k 7,500,900", [1, 300, 1025], [7, 500, 900], 4, 2, False, -1,
             -1, 0.0),
            ("varlen", "causal 1,300,1025", [1, 300, 1025], [1, 300, 1025], 4, 4, True, -1, -1,
             0.0),
            ("varlen", "window+softcap", [1, 300, 1025], [5, 290, 1100], 4, 4, False, 48, 8, 20.0),
            ("nokey", "middle seq has no keys", [70, 33, 200], [90, 0, 260], 4, 4, False, -1, -1,
             0.0),
            ("nokey", "no keys at all", [50, 20], [0, 0], 4, 4, False, -1, -1, 0.0),
            # off = -260: query i sees keys [i - 270, i - 255], none for i < 255
            ("nokey", "window leaves rows empty", [300], [40], 4, 4, False, 10, 5, 0.0),
            # Many work tiles per CTA (>> 132 in the default persistent launch): the K/V and Q
            # barrier phases run on across tiles of different key counts, empty ones included.
            ("persist", "8x16 heads S=1025 gqa 4:1", [1025] * 8, [1025] * 8, 16, 4, False, -1, -1,
             0.0),
            ("persist", "causal 16x 300x1025", [300] * 16, [1025] * 16, 8, 2, True, -1, -1, 0.0),
            # bottom-right causal, lq > lk: blocks 0-4 of each sequence see no key
            ("persist", "causal 8x 1025x300", [1025] * 8, [300] * 8, 8, 8, True, -1, -1, 0.0),
            # window (10, 5) at off = -800: blocks 0-5 see no key, the rest 1-2 key tiles
            ("persist", "window hides blocks 8x 1000x200", [1000] * 8, [200] * 8, 8, 4, False, 10,
             5, 0.0),
            ("persist", "varlen empty/1-row seqs", [0, 1, 129, 0, 1, 700, 1, 300, 64],
             [5, 0, 300, 0, 1, 700, 64, 1, 0], 16, 4, False, -1, -1, 0.0),
            # K/V multicast (where the launch allows it): equal lengths, an even number of
            # q-blocks, with GQA, a partial last q-block and key tile, softcap.
            ("multicast", "4x S=1024 gqa 2:1", [1024] * 4, [1024] * 4, 8, 4, False, -1, -1, 0.0),
            ("multicast", "2x 1000x700 softcap", [1000] * 2, [700] * 2, 4, 4, False, -1, -1,
             20.0),
            ("persist", "varlen empty/1-row causal+window+softcap",
             [0, 1, 129, 0, 1, 700, 1, 300, 64], [5, 0, 300, 0, 1, 700, 64, 1, 0], 16, 4, True, 200,
             -1, 20.0)]
    return out


def check_parity(dtypes, dims, do_bwd, schedules=SCHEDULES):
    from fusedops.attention import reference
    results = {}  # (dtype, d, group) -> list of failure strings (empty = pass)
    bwd_results = {}
    for dt in dtypes:
        for d in dims:
            tag = f"{str(dt).split('.')[-1]} D={d}"
            for ci, (group, name, ql, kl, hq, hkv, causal, left, right, cap) in enumerate(cases()):
                q, k, v, cu_q, cu_k = make_case(ql, kl, hq, hkv, d, dt, seed=1000 + ci)
                mq, mk = max(ql), max(kl)
                scale = 1.0 / math.sqrt(d)
                args = (cu_q, cu_k, mq, mk, scale, causal, left, right, cap)
                o80, l80 = fwd_baseline(q, k, v, *args)  # sm80's (Triton's at D=256)
                q64, k64, v64 = q.double(), k.double(), v.double()
                o64, l64 = reference.attention_fwd(q64, k64, v64, cu_q, cu_k, scale, causal, left,
                                                   right, cap)
                fin = torch.isfinite(l64)
                e80 = max_err(o80, o64)
                le80 = max_err(l80, l64, fin & torch.isfinite(l80))
                outs = {}
                for sched in (s for s in schedules if runs_at(s, d)):
                    key = (f"{tag} {sched}", group)
                    results.setdefault(key, [])
                    WATCHDOG.arm(f"{tag} {sched} {group} {name}")
                    try:
                        with variant_env(sched):
                            o90, l90 = fwd(q, k, v, *args, 90)
                        torch.cuda.synchronize()
                    except Exception as exc:  # noqa: BLE001 - reported as a failure
                        results[key].append(f"{name}: raised {type(exc).__name__}: "
                                            f"{str(exc)[:160]}")
                        if "CUDA" in str(exc) or "cuda" in str(exc):
                            raise ContextLost(f"{tag} {sched} {group} {name}: {exc}") from exc
                        continue
                    finally:
                        WATCHDOG.disarm()
                    outs[sched] = (o90, l90)
                    fails = []
                    if torch.isnan(o90).any() or torch.isnan(l90).any():
                        fails.append("NaN in out/lse (unwritten rows or a NaN path)")
                    if not torch.equal(torch.isneginf(l90), ~fin):
                        n_bad = int((torch.isneginf(l90) != ~fin).sum())
                        fails.append(f"lse -inf pattern differs ({n_bad} entries)")
                    nokey_rows = (~fin).t()  # (total_q, hq)
                    if nokey_rows.any() and o90[nokey_rows].abs().max().item() != 0.0:
                        fails.append("rows that see no key are not exactly 0")
                    e90 = max_err(o90, o64)
                    if not e90 <= 2 * e80 + 1e-3:
                        fails.append(f"out err {e90:.3e} > 2 x baseline {e80:.3e} + 1e-3 "
                                     f"({where(o90, o64, cu_q)})")
                    le90 = max_err(l90, l64, fin & torch.isfinite(l90))
                    if not le90 <= 2 * le80 + 1e-3:
                        fails.append(f"lse err {le90:.3e} > 2 x baseline {le80:.3e} + 1e-3")
                    results[key] += [f"{name}: {f}" for f in fails]
                if not outs:
                    continue
                o90, l90 = next(iter(outs.values()))  # the first schedule feeds the backward

                if do_bwd and max(max(ql), max(kl)) <= 1025 and k.shape[0] > 0:
                    bkey = (tag, "backward")
                    bwd_results.setdefault(bkey, [])
                    g = torch.Generator(device="cuda").manual_seed(7 + ci)
                    do = torch.randn(q.shape, device="cuda", dtype=dt, generator=g)
                    g64 = reference.attention_bwd(q64, k64, v64, o64, l64, do.double(), cu_q,
                                                  cu_k, scale, causal, left, right, cap)
                    g80 = bwd(q, k, v, o80, l80, do, *args, 80)
                    # Arch 90's backwards (the escape hatch too); at D=256 Triton's alone.
                    for which in BWD_VARIANTS if d in CUDA_BWD_DIMS else ("sm90",):
                        WATCHDOG.arm(f"{tag} backward {which} {group} {name}")
                        try:
                            g90 = bwd(q, k, v, o90, l90, do, *args, 90, variant=which)
                            torch.cuda.synchronize()
                        except Exception as exc:  # noqa: BLE001 - reported as a failure
                            bwd_results[bkey].append(f"{name} ({which} bwd): raised "
                                                     f"{type(exc).__name__}: {str(exc)[:160]}")
                            if "CUDA" in str(exc) or "cuda" in str(exc):
                                raise ContextLost(f"{tag} backward {which} {name}: {exc}") from exc
                            continue
                        finally:
                            WATCHDOG.disarm()
                        for nm, a, b, r in zip(("dq", "dk", "dv"), g90, g80, g64, strict=True):
                            slack = 1e-3 * max(1.0, r.abs().max().item())
                            ea, eb = max_err(a, r), max_err(b, r)
                            if torch.isnan(a).any() or not ea <= 2 * eb + slack:
                                at = (where_keys(a, r, cu_k) if nm != "dq" else
                                      where(a, r, cu_q))
                                bwd_results[bkey].append(
                                    f"{name} ({which} bwd): {nm} err {ea:.3e} > 2 x baseline-fwd "
                                    f"path {eb:.3e} + {slack:.1e} ({at})")
                        if bwd_deterministic(which):  # the same bits again
                            WATCHDOG.arm(f"{tag} backward {which} repeat {group} {name}")
                            try:
                                g90b = bwd(q, k, v, o90, l90, do, *args, 90, variant=which)
                                torch.cuda.synchronize()
                            except Exception as exc:  # noqa: BLE001 - reported as a failure
                                bwd_results[bkey].append(f"{name} ({which} bwd, repeat): raised "
                                                         f"{type(exc).__name__}: "
                                                         f"{str(exc)[:160]}")
                                if "CUDA" in str(exc) or "cuda" in str(exc):
                                    raise ContextLost(f"{tag} backward {which} {name}: "
                                                      f"{exc}") from exc
                                continue
                            finally:
                                WATCHDOG.disarm()
                            for nm, a, b in zip(("dq", "dk", "dv"), g90, g90b, strict=True):
                                if not torch.equal(a, b):
                                    bwd_results[bkey].append(
                                        f"{name} ({which} bwd): {nm} not bit-identical on a "
                                        f"second run (max diff "
                                        f"{(a.double() - b.double()).abs().max().item():.3e})")
                del q, k, v, o90, l90, o80, l80, o64, l64, outs
    return results, bwd_results


def report(results):
    n_fail = 0
    for (tag, group), fails in results.items():
        status = "PASS" if not fails else "FAIL"
        n_fail += bool(fails)
        print(f"{status} {tag:<26} {group:<9}" + (f" {len(fails)} failing: " + fails[0]
                                                  if fails else ""))
        for f in fails[1:4]:
            print(f"     {f}")
    return n_fail


def time_config(d, length, causal, rep_ms, timed=None, baselines=tuple(BASELINES)):
    """{method: forward ms} of one shape (bf16, B*L = 16384, H*D = 2048); NaN when a method
    cannot run it. timed: the sm90 variants besides auto (default: every one not UNTIMED);
    baselines: BASELINES' names."""
    import torch.nn.functional as F
    from common import time_ms
    from torch.nn.attention import SDPBackend, sdpa_kernel
    b, h = 16384 // length, 2048 // d
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b * length, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
               for _ in range(3))
    cu = torch.arange(b + 1, device="cuda", dtype=torch.int32) * length
    scale = 1.0 / math.sqrt(d)
    qs, ks, vs = (t.view(b, length, h, d).transpose(1, 2) for t in (q, k, v))

    def ours(arch):
        return lambda: torch.ops.fusedops.attention_fwd_cuda(
            q, k, v, cu, cu, length, length, scale, causal, -1, -1, 0.0, arch)

    def sdpa(backend):
        def fn():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal)
        return fn

    def triton_fwd():
        from fusedops.attention import triton as ta
        return ta.attention_fwd(q, k, v, cu, cu, length, length, scale, causal, -1, -1, 0.0)

    def variant(name):
        fn = ours(90)

        def run():
            with variant_env(name):
                return fn()
        return run

    fns = {"cuda-sm90-fwd": variant("auto")}
    fns.update({f"cuda-sm90-{n}-fwd": variant(n) for n in timed_variants(timed)})
    base = {"cuda-sm80-fwd": ours(80), "triton-fwd": triton_fwd,
            "sdpa_flash-fwd": sdpa(SDPBackend.FLASH_ATTENTION),
            "sdpa_cudnn-fwd": sdpa(SDPBackend.CUDNN_ATTENTION)}
    fns.update({BASELINES[b]: base[BASELINES[b]] for b in baselines})
    times = {}
    for name, fn in fns.items():
        variant_name = name.removeprefix("cuda-sm90-").removesuffix("-fwd")
        if (variant_name in VARIANTS and not runs_at(variant_name, d)) or (
                name == "cuda-sm80-fwd" and d not in CUDA_BWD_DIMS):
            times[name] = float("nan")  # not built at this head dim (the table's tile runs)
            continue
        try:
            with torch.no_grad():
                times[name] = time_ms(fn, rep_ms)
        except Exception as exc:  # noqa: BLE001 - e.g. an SDPA backend missing
            print(f"  {name} D={d} L={length}: {type(exc).__name__}: {str(exc)[:120]}")
            times[name] = float("nan")
    return times


def timed_variants(timed=None):
    """The sm90 variants timed beside auto: `timed` (names of VARIANTS), else every one not in
    UNTIMED."""
    if timed is None:
        return [n for n in VARIANTS if n != "auto" and n not in UNTIMED]
    return [n for n in timed if n != "auto"]


def timing(out_dir, rep_ms, dims=DIMS, timed=None, baselines=tuple(BASELINES)):
    from common import append_rows, run_meta
    meta = run_meta()
    print(f"\ntiming (bf16, TFLOP/s, median of do_bench): {meta['gpu']}, git {meta['git']}, "
          f"run {meta['run']}")
    cols = [("auto", "cuda-sm90-fwd")] + [(n, f"cuda-sm90-{n}-fwd")
                                          for n in timed_variants(timed)]
    cols += [(b, BASELINES[b]) for b in baselines]
    names = [m for _, m in cols]
    print("auto = the measured table (what dispatch runs); overlap/serial/pingpong: forced "
          "schedules with the TMA-store epilogue; ovl-regs: overlap with register stores of O; "
          "bn176-ovl/-pp: 176-key tiles (D=128 only); *-poly: a share of the exponentials by "
          "the polynomial (poly: auto's schedule; D=64/128); m192-*: 192-query tiles (3 "
          "consumer warpgroups, D=64 only); nonpersist: auto with one CTA per work tile; "
          "pp-qrows: ping-pong with O staged in the Q rows (D=64/128); "
          "vs best = auto / max(flash, cudnn); "
          "vs triton = auto / triton (the D=256 auto order in attention/backends.py)")
    width = [max(9, len(c)) for c, _ in cols]
    print(f"{'D':>4} {'L':>6} {'causal':>6} " + " ".join(f"{c:>{w}}" for (c, _), w in
                                                          zip(cols, width, strict=True)) +
          f" {'vs best':>7} {'vs triton':>9}")
    for d in dims:
        for length in (1024, 4096, 16384):
            for causal in (False, True):
                b, h = 16384 // length, 2048 // d
                flops = 4 * b * h * length * length * d / (2 if causal else 1)
                times = time_config(d, length, causal, rep_ms, timed, baselines)
                tf = {n: flops / times[n] / 1e9 for n in names}
                nan = float("nan")
                for n in names:
                    if math.isnan(times[n]):
                        continue
                    row = dict(op="attention", method=n, B=b, H=h, L=length, D=d,
                               causal=causal, dtype="bfloat16", fwd_ms=round(times[n], 4),
                               fwd_tflops=round(tf[n], 1), **meta)
                    append_rows("attention", [row], out_dir)
                best = max((tf[BASELINES[b]] for b in ("flash", "cudnn") if b in baselines
                            and not math.isnan(tf[BASELINES[b]])), default=nan)
                print(f"{d:>4} {length:>6} {str(causal):>6} " +
                      " ".join(f"{tf[n]:>{w}.1f}" for n, w in zip(names, width, strict=True)) +
                      f" {tf['cuda-sm90-fwd'] / best:>7.2f}"
                      f" {tf['cuda-sm90-fwd'] / tf.get('triton-fwd', nan):>9.2f}", flush=True)
                torch.cuda.empty_cache()


def time_bwd_config(d, length, causal, rep_ms):
    """{method: backward ms} of one shape (bf16, B*L = 16384, H*D = 2048): ours by the backward
    op alone (from the sm90 forward's out/lse), SDPA's as (forward + backward) - forward."""
    import torch.nn.functional as F
    from common import time_ms
    from torch.nn.attention import SDPBackend, sdpa_kernel
    b, h = 16384 // length, 2048 // d
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(b * length, h, d, device="cuda", dtype=torch.bfloat16,
                               generator=g) for _ in range(4))
    cu = torch.arange(b + 1, device="cuda", dtype=torch.int32) * length
    scale = 1.0 / math.sqrt(d)
    args = (cu, cu, length, length, scale, causal, -1, -1, 0.0)
    out, lse = torch.ops.fusedops.attention_fwd_cuda(q, k, v, *args, 90)

    def ours(variant):
        def fn():
            with bwd_env(variant):
                return torch.ops.fusedops.attention_bwd_cuda(q, k, v, out, lse, do, *args,
                                                             bwd_deterministic(variant), 90)
        return fn

    times = {"cuda-sm90-bwd": ours("sm90"), "cuda-sm90-overlap-bwd": ours("sm90-overlap"),
             "cuda-sm80-bwd": ours("sm80"), "cuda-sm90-det-bwd": ours("sm90-det"),
             "cuda-sm90-det-asc-bwd": ours("sm90-det-asc"),
             "cuda-sm90-det-desc-bwd": ours("sm90-det-desc"),
             "cuda-sm80-det-bwd": ours("sm80-det")}
    res = {}
    for name, fn in times.items():
        with torch.no_grad():
            res[name] = time_ms(fn, rep_ms)
    qs, ks, vs, dos = (t.view(b, length, h, d).transpose(1, 2) for t in (q, k, v, do))
    qs, ks, vs = (t.detach().requires_grad_() for t in (qs, ks, vs))
    for name, backend in (("sdpa_flash-bwd", SDPBackend.FLASH_ATTENTION),
                          ("sdpa_cudnn-bwd", SDPBackend.CUDNN_ATTENTION)):
        try:
            def fwd_only(backend=backend):
                with sdpa_kernel(backend), torch.no_grad():
                    return F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal)

            def step(backend=backend):
                with sdpa_kernel(backend):
                    F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal).backward(dos)
            res[name] = (time_ms(step, rep_ms, grad_to_none=[qs, ks, vs]) -
                         time_ms(fwd_only, rep_ms))
        except Exception as exc:  # noqa: BLE001 - e.g. an SDPA backend missing
            print(f"  {name} D={d} L={length}: {type(exc).__name__}: {str(exc)[:120]}")
            res[name] = float("nan")
    return res


def timing_bwd(out_dir, rep_ms, dims=DIMS):
    from common import append_rows, run_meta
    meta = run_meta()
    names = ("cuda-sm90-bwd", "cuda-sm90-overlap-bwd", "cuda-sm80-bwd", "cuda-sm90-det-bwd",
             "cuda-sm90-det-asc-bwd", "cuda-sm90-det-desc-bwd", "cuda-sm80-det-bwd",
             "sdpa_flash-bwd", "sdpa_cudnn-bwd")
    print("\nbackward timing (bf16, TFLOP/s = 2.5 x forward FLOPs / backward time; sm90 = "
          "attention_bwd_kernel_sm90 (overlap: its overlapped schedule), sm80 = "
          "FUSEDOPS_ATTN_SM90_BWD=sm80; det = deterministic (sm90: ordered dQ, default / "
          "ascending / descending key blocks; sm80: its dQ pass); vs best = sm90 / max(flash, "
          "cudnn))")
    heads = ("sm90", "overlap", "sm80", "det", "det-asc", "det-desc", "det80", "flash", "cudnn")
    print(f"{'D':>4} {'L':>6} {'causal':>6} " + " ".join(f"{c:>8}" for c in heads) +
          f" {'vs best':>7}")
    for d in (d for d in dims if d in CUDA_BWD_DIMS):
        for length in (1024, 4096, 16384):
            for causal in (False, True):
                b, h = 16384 // length, 2048 // d
                flops = 2.5 * 4 * b * h * length * length * d / (2 if causal else 1)
                times = time_bwd_config(d, length, causal, rep_ms)
                tf = {n: flops / times[n] / 1e9 for n in names}
                for n in names:
                    if math.isnan(times[n]):
                        continue
                    row = dict(op="attention", method=n, B=b, H=h, L=length, D=d,
                               causal=causal, dtype="bfloat16", bwd_ms=round(times[n], 4),
                               bwd_tflops=round(tf[n], 1), **meta)
                    append_rows("attention", [row], out_dir)
                best = max(tf["sdpa_flash-bwd"], tf["sdpa_cudnn-bwd"])
                print(f"{d:>4} {length:>6} {str(causal):>6} " +
                      " ".join(f"{tf[n]:>8.1f}" for n in names) +
                      f" {tf['cuda-sm90-bwd'] / best:>7.2f}", flush=True)
                torch.cuda.empty_cache()


def sanitize_cases(dims=DIMS, schedules=SCHEDULES, do_bwd=True,
                   dtypes=(torch.bfloat16, torch.float16)):
    """Tiny runs of each instantiation (bf16/fp16 x D 64/128/256 x every schedule, the
    epilogues, the 176-key tiles at D=128, persistence): dense with a tail tile, varlen with an
    empty-key sequence, causal + window + softcap, enough key tiles (5 of 128, 8 of 80) to wrap
    the pipeline, empty and 1-row sequences, a key whose scores jump far above the others;
    forward by arch 90, then the CUDA backward from its out/lse (not at D=256, whose backward is
    Triton's)."""
    for dt in dtypes:
        for d in dims:
            for ql, kl, hq, hkv, causal, left, right, cap in (
                    ([77, 130], [93, 600], 4, 2, False, -1, -1, 0.0),
                    ([70, 1, 33], [90, 0, 40], 2, 2, True, 30, -1, 20.0),
                    ([129], [645], 2, 1, False, -1, -1, 0.0),
                    # equal lengths, two q-blocks a sequence: K/V multicast where enabled
                    ([256, 256], [700, 700], 2, 1, False, -1, -1, 0.0),
                    # empty and 1-row sequences, blocks without keys (the -3cta variants run
                    # these with several tiles per CTA)
                    ([0, 1, 129, 0, 1, 70], [5, 0, 300, 0, 1, 0], 4, 2, True, 100, -1, 0.0)):
                q, k, v, cu_q, cu_k = make_case(ql, kl, hq, hkv, d, dt, seed=3)
                # Key 300 of each long sequence 40x the others: the forward's speculative
                # exponentials fail in its third key tile and S is computed again.
                for start, n in zip(cu_k[:-1].tolist(), kl, strict=True):
                    if n > 300:
                        k[start + 300] *= 40
                args = (cu_q, cu_k, max(ql), max(kl), d ** -0.5, causal, left, right, cap)
                ran = False
                for sched in (s for s in schedules if runs_at(s, d)):
                    with variant_env(sched):
                        o, lse = torch.ops.fusedops.attention_fwd_cuda(q, k, v, *args, 90)
                    ran = True
                if ran and do_bwd and d in CUDA_BWD_DIMS:
                    do = torch.randn_like(q)
                    # SANITIZE_BWD_VARIANTS: a comma list of BWD_VARIANTS names (default all)
                    for variant in os.environ.get("SANITIZE_BWD_VARIANTS",
                                                  ",".join(BWD_VARIANTS)).split(","):
                        bwd(q, k, v, o, lse, do, *args, 90, variant=variant)
    torch.cuda.synchronize()
    print("sanitize cases ran")


def sanitize_run(dims=DIMS, schedules=SCHEDULES, do_bwd=True,
                 tools=("memcheck", "racecheck", "synccheck"), timeout_s=600,
                 dtypes="bfloat16,float16"):
    from common import find_sanitizer, sanitizer_verdict

    exe = find_sanitizer()
    if exe is None:
        print("FAIL sanitize: compute-sanitizer not found (PATH, $CUDA_HOME/bin, /usr/local/cuda)")
        return 1
    bad = 0
    for tool in tools:
        env = dict(os.environ, PYTORCH_NO_CUDA_MEMORY_CACHING="1")
        t0 = time.time()
        cmd = [exe, "--tool", tool, "--error-exitcode", "3", sys.executable,
               os.path.abspath(__file__), "--sanitize", "--dims", ",".join(map(str, dims)),
               "--schedules", ",".join(schedules), "--dtypes", dtypes] + (
                   [] if do_bwd else ["--no-backward"])
        # Its own process group, so that a timeout ends the sanitized python too.
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
        try:
            text, _ = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            text, _ = proc.communicate()
            bad += 1
            print(f"FAIL sanitize {tool:<9} timed out after {timeout_s:.0f}s")
            print("\n".join((text or "").splitlines()[-10:]))
            continue
        bad += not sanitizer_verdict(tool, proc.returncode, text, time.time() - t0)
    return bad


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT") or None,
                    help="folder of attention.jsonl (default $OUT, else benchmarks/results)")
    ap.add_argument("--no-timing", action="store_true")
    ap.add_argument("--no-backward", action="store_true")
    ap.add_argument("--no-bwd-timing", action="store_true")
    ap.add_argument("--rep-ms", type=int, default=60)
    ap.add_argument("--dims", default=",".join(map(str, DIMS)))
    ap.add_argument("--dtypes", default="bfloat16,float16")
    ap.add_argument("--schedules", default=",".join(SCHEDULES),
                    help="sm90 variants to check (VARIANTS: overlap, serial, pingpong, ovl-regs, "
                    "bn176-ovl, bn176-pp (D=128 only), ovl-poly, pp-poly, poly (D=64/128), "
                    "m192-ovl, m192-pp, m192-ser, m192-regs, m192-ovl-poly, m192-pp-poly (D=64 "
                    "only), nonpersist, pp-qrows, ser-3cta, ovl-3cta, pp-qrows-3cta, pp-poly-3cta "
                    "(D=64/128), m192-pp-3cta (D=64), bn176-ovl-3cta (D=128), auto)")
    ap.add_argument("--timed", default=None,
                    help="sm90 variants timed beside auto (default: every one but the debugging "
                    "variants, UNTIMED)")
    ap.add_argument("--baselines", default=",".join(BASELINES),
                    help="baselines of the timing table (sm80, triton, flash, cudnn)")
    ap.add_argument("--sanitize", action="store_true", help="only the tiny sanitizer cases")
    ap.add_argument("--sanitize-run", action="store_true",
                    help="run --sanitize under compute-sanitizer memcheck, racecheck, synccheck")
    ap.add_argument("--sanitize-tools", default="memcheck,racecheck,synccheck")
    ap.add_argument("--sanitize-timeout", type=float, default=600,
                    help="seconds per compute-sanitizer tool")
    ap.add_argument("--no-parity", action="store_true",
                    help="skip the parity checks (timing only)")
    ap.add_argument("--watchdog-s", type=float, default=60.0,
                    help="seconds a parity call may take before the run ends as HANG (exit 3)")
    args = ap.parse_args()
    WATCHDOG.seconds = args.watchdog_s
    dims = tuple(int(d) for d in args.dims.split(","))
    schedules = tuple(args.schedules.split(","))
    timed = None if args.timed is None else tuple(t for t in args.timed.split(",") if t)
    baselines = tuple(b for b in args.baselines.split(",") if b)
    for what, names, known in (("--schedules", schedules, VARIANTS),
                               ("--timed", timed or (), VARIANTS),
                               ("--baselines", baselines, BASELINES)):
        unknown = [n for n in names if n not in known]
        if unknown:
            ap.error(f"{what}: unknown {', '.join(unknown)} (known: {', '.join(known)})")
    from fusedops import _ext  # loads fusedops._C, which registers the ops
    if not _ext.available():
        print(f"FAIL: fusedops._C is not loaded ({_ext.EXT_ERROR}); pip install "
              "--no-build-isolation . on a machine with nvcc")
        return 1
    if args.sanitize:
        sanitize_cases(dims, schedules, not args.no_backward,
                       tuple(getattr(torch, t) for t in args.dtypes.split(",")))
        return 0
    if args.sanitize_run:
        tools = tuple(t for t in args.sanitize_tools.split(",") if t)
        return 1 if sanitize_run(dims, schedules, not args.no_backward, tools,
                                 args.sanitize_timeout, args.dtypes) else 0
    print(f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}, built archs "
          f"{';'.join(_ext.built_archs())}")
    t0 = time.time()
    n_fail = 0
    try:
        dtypes = tuple(getattr(torch, t) for t in args.dtypes.split(","))
        res, bres = ({}, {}) if args.no_parity else check_parity(dtypes, dims,
                                                                 not args.no_backward, schedules)
    except ContextLost as exc:
        print(f"FAIL the sm90 forward raised a CUDA error, the context is lost: {str(exc)[:400]}")
        print("SUMMARY parity: 0 passed, 1 failed (stopped at the first CUDA error; try "
              "--schedules serial, --dims 64, and --sanitize-run)")
        return 1
    if not args.no_parity:
        n_fail = report(res) + report(bres)
        total = len(res) + len(bres)
        print(f"SUMMARY parity: {total - n_fail} passed, {n_fail} failed "
              f"({time.time() - t0:.0f}s)")
    if not args.no_timing:
        timing(args.out, args.rep_ms, dims, timed, baselines)
    if not args.no_bwd_timing:
        timing_bwd(args.out, args.rep_ms, dims)
    return 1 if n_fail else 0


if __name__ == "__main__":
    sys.exit(main())
