"""Attention parity suite against the float64 oracle, bad input, op registration."""

import os

import attn_oracle as A
import pytest
import torch

from fusedops import _ext, dispatch
from fusedops.attention import Attention, attention

HAS_GPU = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
try:
    import triton  # noqa: F401
    HAS_TRITON = True
except ImportError:
    HAS_TRITON = False

# (B, Sq, Sk, Hq, Hkv, D): seqlens 1, 97, 128, 1025, 4096; Sq != Sk both ways; GQA 1, 4, 8;
# head dims 32, 64, 96, 128, 256 (at 256: key tiles of 80, so 1025 keys wrap the 2-stage
# pipeline; Sq > Sk leaves causal rows that see no key).
GPU_SHAPES = [(2, 1, 1, 4, 4, 64), (2, 97, 97, 4, 1, 64), (1, 128, 128, 8, 1, 128),
              (2, 1025, 1025, 4, 4, 128), (1, 4096, 4096, 2, 2, 64), (2, 97, 211, 4, 2, 64),
              (2, 211, 97, 4, 2, 128), (1, 97, 97, 2, 2, 32), (1, 97, 97, 2, 2, 96),
              (1, 211, 97, 2, 1, 256), (2, 1025, 1025, 4, 2, 256), (2, 97, 300, 4, 4, 256)]
CPU_SHAPES = [(1, 1, 1, 2, 2, 16), (2, 19, 23, 4, 2, 16), (1, 23, 19, 4, 1, 32)]
FEATURES = {
    "plain": {},
    "causal": dict(causal=True),
    "window": dict(window=(32, 16)),
    "softcap": dict(softcap=20.0),
    "causal_window": dict(causal=True, window=(64, -1)),
    "varlen_causal": dict(varlen=True, causal=True),
    "varlen_everything": dict(varlen=True, causal=True, window=(40, -1), softcap=15.0),
}
_CACHE = {}
# Head dims with kernels of each CUDA backend (cuda-sm90 at 256: its forward, Triton's backward);
# the others must be refused with a reason.
CUDA_DIMS = {"cuda-sm90": (64, 128, 256), "cuda-sm80": (64, 128)}
NEEDS_EXT = pytest.mark.skipif(not _ext.available(), reason="fusedops._C not built")


def _params():
    out = []
    for lead in CPU_SHAPES:
        for f in FEATURES:
            out.append(pytest.param("torch", "cpu", torch.float32, lead, f,
                                    id=f"torch-cpu-{'x'.join(map(str, lead))}-{f}"))
            if INTERPRET and HAS_TRITON and not HAS_GPU:
                out.append(pytest.param("triton", "cpu", torch.float32, lead, f,
                                        id=f"triton-cpu-{'x'.join(map(str, lead))}-{f}"))
    for backend in ("cuda-sm90", "cuda-sm80", "triton", "torch"):
        for dtype in (torch.bfloat16, torch.float16):
            for lead in GPU_SHAPES:
                if backend.startswith("cuda") and lead[-1] not in CUDA_DIMS[backend]:
                    continue
                marks = [pytest.mark.gpu] + ([NEEDS_EXT] if backend.startswith("cuda") else [])
                for f in FEATURES:
                    # The torch backend is the oracle's own code (tested on the CPU too): on the GPU
                    # only bf16 and the smaller shapes.
                    big = lead[1] * lead[2] > 10**6
                    if backend == "torch" and (big or dtype != torch.bfloat16):
                        continue
                    out.append(pytest.param(
                        backend, "cuda", dtype, lead, f, marks=marks,
                        id=f"{backend}-cuda-{str(dtype)[6:]}-{'x'.join(map(str, lead))}-{f}"))
    return out


@pytest.mark.parametrize("backend,device,dtype,shape,feature", _params())
def test_parity(backend, device, dtype, shape, feature):
    case = A.Case(*shape, dtype, device, **FEATURES[feature])
    A.check(case, backend, _CACHE)


@pytest.mark.gpu
@pytest.mark.parametrize("backend,head_dim", [
    ("triton", 128), pytest.param("cuda-sm80", 128, marks=NEEDS_EXT),
    pytest.param("cuda-sm90", 128, marks=NEEDS_EXT), pytest.param("cuda-sm90", 64, marks=NEEDS_EXT),
    pytest.param("cuda-sm90", 256, marks=NEEDS_EXT, id="cuda-sm90-256-triton-backward")])
@pytest.mark.parametrize("feature", ["plain", "causal_window", "varlen_everything"])
def test_deterministic_backward_is_bitwise_repeatable(feature, backend, head_dim):
    """Under torch.use_deterministic_algorithms(True) dQ comes from the separate pass (no
    atomics) or, in cuda-sm90's backward at D=64/128, from reductions in a fixed order: correct,
    and bit-identical run to run (cuda-sm90 at D=256: the Triton backward's separate pass)."""
    case = A.Case(2, 1025, 1025, 8, 2, head_dim, torch.bfloat16, "cuda", **FEATURES[feature])
    inp = A.make_inputs(case)
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        A.check(case, backend, _CACHE)
        runs = [A.run(lambda *a, **k: attention(*a, **k, return_lse=True, backend=backend), inp,
                      case, case.dtype) for _ in range(2)]
    finally:
        torch.use_deterministic_algorithms(False)
    for name in ("dq", "dk", "dv"):
        assert torch.equal(runs[0][name], runs[1][name]), name


# Work-tile sequences of the persistent sm90 forward: (batch, Sq, Sk, Hq, Hkv, D, features). Each
# call has far more (q-block, head, sequence) tiles than a GPU has SMs, so that every CTA runs
# several, of different key counts; some blocks see no key at all.
SM90_PERSIST_CASES = {
    "dense-gqa-1152tiles": (8, 1025, 1025, 16, 4, 128, {}),
    "causal-300x1025": (16, 300, 1025, 8, 2, 64, dict(causal=True)),
    # bottom-right causal, Sq > Sk: blocks 0-4 of every sequence see no key
    "causal-1025x300": (8, 1025, 300, 8, 8, 128, dict(causal=True)),
    # window (10, 5) at lk - lq = -800: blocks 0-5 see no key
    "window-hides-blocks": (8, 1000, 200, 8, 4, 64, dict(window=(10, 5))),
    # empty and 1-row sequences (q and k), a sequence without keys
    "varlen-empty-1row": (1, 700, 700, 16, 4, 128, dict(
        varlen=True, lens=((0, 1, 129, 0, 1, 700, 1, 300, 64), (5, 0, 300, 0, 1, 700, 64, 1, 0)))),
    "varlen-empty-1row-causal-window-softcap": (1, 700, 700, 16, 4, 64, dict(
        varlen=True, causal=True, window=(200, -1), softcap=20.0,
        lens=((0, 1, 129, 0, 1, 700, 1, 300, 64), (5, 0, 300, 0, 1, 700, 64, 1, 0)))),
    # D=256: a tile table without the loop (TilesSm90::kPersistent false), one CTA per tile
    # whatever the overrides say
    "d256-causal-300x1025": (4, 300, 1025, 8, 2, 256, dict(causal=True)),
}
# Launcher overrides (attention_launch_sm90.cuh): the default persistent launch (one CTA per
# SM; tiles from the counter where they differ in length, else the round-robin), both tile
# orders forced, 3 CTAs (dozens of tiles each) with each schedule, the polynomial exponentials
# and the 192-query tiles, O staged in the Q rows (the path of tile tables without an O
# buffer), the non-persistent launch, and the cap over tile tables without the loop.
SM90_PERSIST_ENVS = {
    "persistent": {},
    "static-order": dict(FUSEDOPS_ATTN_SM90_TILES="static"),
    "dynamic-order": dict(FUSEDOPS_ATTN_SM90_TILES="dynamic"),
    "3cta-dynamic": dict(FUSEDOPS_ATTN_SM90_PERSISTENT="3", FUSEDOPS_ATTN_SM90_TILES="dynamic"),
    "3cta-serial": dict(FUSEDOPS_ATTN_SM90_PERSISTENT="3", FUSEDOPS_ATTN_SM90_SCHEDULE="serial"),
    "3cta-overlap": dict(FUSEDOPS_ATTN_SM90_PERSISTENT="3",
                         FUSEDOPS_ATTN_SM90_SCHEDULE="overlap"),
    "3cta-pingpong": dict(FUSEDOPS_ATTN_SM90_PERSISTENT="3",
                          FUSEDOPS_ATTN_SM90_SCHEDULE="pingpong"),
    "3cta-pingpong-qrows": dict(FUSEDOPS_ATTN_SM90_PERSISTENT="3",
                                FUSEDOPS_ATTN_SM90_SCHEDULE="pingpong",
                                FUSEDOPS_ATTN_SM90_EPILOGUE="qrows"),
    "3cta-overlap-regs": dict(FUSEDOPS_ATTN_SM90_PERSISTENT="3",
                              FUSEDOPS_ATTN_SM90_SCHEDULE="overlap",
                              FUSEDOPS_ATTN_SM90_EPILOGUE="regs"),
    "nonpersistent": dict(FUSEDOPS_ATTN_SM90_PERSISTENT="0"),
    "3cta-pingpong-poly": dict(FUSEDOPS_ATTN_SM90_PERSISTENT="3",
                               FUSEDOPS_ATTN_SM90_SCHEDULE="pingpong",
                               FUSEDOPS_ATTN_SM90_EXP2="poly"),
    # The 192-query tiles (D=64; three consumer warpgroups) over 3 CTAs in either order (at the
    # other head dims these are the 3-CTA runs of the 128-query tiles).
    "3cta-m192-pingpong": dict(FUSEDOPS_ATTN_SM90_PERSISTENT="3",
                               FUSEDOPS_ATTN_SM90_SCHEDULE="pingpong",
                               FUSEDOPS_ATTN_SM90_TILE="m192"),
    "3cta-m192-dynamic": dict(FUSEDOPS_ATTN_SM90_PERSISTENT="3", FUSEDOPS_ATTN_SM90_TILES="dynamic",
                              FUSEDOPS_ATTN_SM90_TILE="m192"),
    "3cta-m192-static-overlap": dict(FUSEDOPS_ATTN_SM90_PERSISTENT="3",
                                     FUSEDOPS_ATTN_SM90_TILES="static",
                                     FUSEDOPS_ATTN_SM90_SCHEDULE="overlap",
                                     FUSEDOPS_ATTN_SM90_TILE="m192"),
    # The 176-key tiles (D=128) have no loop: they must ignore the cap and launch one CTA per
    # tile.
    "3cta-bn176-overlap": dict(FUSEDOPS_ATTN_SM90_PERSISTENT="3",
                               FUSEDOPS_ATTN_SM90_SCHEDULE="overlap",
                               FUSEDOPS_ATTN_SM90_BLOCK_N="176"),
    # K/V multicast asked for everywhere: none of these cases allows it (masks, unequal lengths
    # or an odd number of q-blocks), so the launch must fall back to the plain one.
    "multicast-where-allowed": dict(FUSEDOPS_ATTN_SM90_MULTICAST="1"),
}

# Calls that K/V multicast in clusters of two serves (no mask, equal lengths, an even number of
# q-blocks per sequence): with GQA and a partial last q-block and key tile; softcap at D=64
# (six 192-query blocks, eight of 128; the last key tile's second half lies wholly past the
# tensor's end); MQA over 12 key tiles in fp16 (the others bf16). (batch, Sq, Sk, Hq, Hkv, D,
# features), as SM90_PERSIST_CASES.
SM90_MC_CASES = {
    "gqa-1024x1000": (4, 1024, 1000, 16, 4, 128, {}),
    "softcap-1000x700-d64": (4, 1000, 700, 8, 8, 64, dict(softcap=20.0)),
    "mqa-1536-fp16": (2, 1536, 1536, 4, 1, 128, {}),
    # From 8192 keys at D=128 the default multicasts ("auto" below).
    "8192-d128": (1, 8192, 8192, 2, 2, 128, {}),
}
# "require": the launcher raises where it cannot multicast, so a fallback cannot pass for it.
# The persistent launch with each schedule, over 3 CTAs (one cluster of two, many tiles each),
# over 4 with O stored from registers, one CTA per tile, the 128-query tiles at D=64; off; and
# the default ("auto": multicast at D=128 from 8192 keys, sm90_auto_multicast).
SM90_MC_ENVS = {
    "multicast": dict(FUSEDOPS_ATTN_SM90_MULTICAST="require"),
    "overlap": dict(FUSEDOPS_ATTN_SM90_MULTICAST="require", FUSEDOPS_ATTN_SM90_SCHEDULE="overlap"),
    "3cta-pingpong": dict(FUSEDOPS_ATTN_SM90_MULTICAST="require",
                          FUSEDOPS_ATTN_SM90_PERSISTENT="3",
                          FUSEDOPS_ATTN_SM90_SCHEDULE="pingpong"),
    "4cta-serial-regs": dict(FUSEDOPS_ATTN_SM90_MULTICAST="require",
                             FUSEDOPS_ATTN_SM90_PERSISTENT="4",
                             FUSEDOPS_ATTN_SM90_SCHEDULE="serial",
                             FUSEDOPS_ATTN_SM90_EPILOGUE="regs"),
    "nonpersistent": dict(FUSEDOPS_ATTN_SM90_MULTICAST="require",
                          FUSEDOPS_ATTN_SM90_PERSISTENT="0"),
    "m128": dict(FUSEDOPS_ATTN_SM90_MULTICAST="require", FUSEDOPS_ATTN_SM90_TILE="m128"),
    "off": dict(FUSEDOPS_ATTN_SM90_MULTICAST="0"),
    "auto": {},
}
# The long case with the default launch, multicast required and off only.
SM90_MC_PARAMS = [(case, env) for case in SM90_MC_CASES for env in SM90_MC_ENVS
                  if case != "8192-d128" or env in ("multicast", "auto", "off")]


def poison_cuda_outputs(monkeypatch):
    """For the rest of the test the CUDA attention ops' outputs (and the backward's dQ
    accumulator, which its preprocess zeroes) start as NaN: a NaN-filled block of each one's
    size is freed just before the call, so that the caching allocator hands it to the op (as
    benchmarks/check_attention_sm90.py does). A row that a kernel leaves unwritten
    (a work tile skipped, a CTA cap obeyed by a table without the loop) then fails the oracle,
    instead of holding the values that the previous test -- often the same case under another
    launcher setting -- left in the block the allocator gives back."""
    ops = torch.ops.fusedops
    fwd, bwd = ops.attention_fwd_cuda, ops.attention_bwd_cuda

    def poison(device, *shapes_dtypes):
        blocks = [torch.full(s, float("nan"), dtype=dt, device=device) for s, dt in shapes_dtypes]
        del blocks

    def fwd_poisoned(q, k, v, *args):  # out, then lse (Hq, total_q), as the op allocates them
        poison(q.device, (q.shape, q.dtype), ((q.shape[1], q.shape[0]), torch.float32))
        return fwd(q, k, v, *args)

    def bwd_poisoned(q, k, v, *args):  # dq, dk, dv, then the float32 dQ accumulator
        acc = ((q.shape[0] + 7) // 8 * 8, *q.shape[1:])
        poison(q.device, (q.shape, q.dtype), (k.shape, k.dtype), (v.shape, v.dtype),
               (acc, torch.float32))
        return bwd(q, k, v, *args)
    monkeypatch.setattr(ops, "attention_fwd_cuda", fwd_poisoned)
    monkeypatch.setattr(ops, "attention_bwd_cuda", bwd_poisoned)


@pytest.mark.gpu
@NEEDS_EXT
@pytest.mark.parametrize("env", list(SM90_PERSIST_ENVS))
@pytest.mark.parametrize("case", list(SM90_PERSIST_CASES))
def test_sm90_persistent_work_tiles(case, env, monkeypatch):
    """The persistent sm90 forward (forward and the backward fed by its lse) against the float64
    oracle where CTAs run many work tiles: the pipeline's barrier phases continue across tiles
    with different key counts, tiles without keys, skipped blocks of short sequences. Outputs
    start as NaN, so that a tile left unwritten fails."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the sm90 forward needs compute capability 9.0")
    poison_cuda_outputs(monkeypatch)
    for name, value in SM90_PERSIST_ENVS[env].items():
        monkeypatch.setenv(name, value)
    *shape, features = SM90_PERSIST_CASES[case]
    dtype = torch.float16 if "causal" in case else torch.bfloat16
    A.check(A.Case(*shape, dtype, "cuda", **features), "cuda-sm90", _CACHE)


@pytest.mark.gpu
@NEEDS_EXT
@pytest.mark.parametrize("case, env", SM90_MC_PARAMS)
def test_sm90_kv_multicast(case, env, monkeypatch):
    """The sm90 forward with K and V shared by TMA multicast between the two CTAs of a cluster
    (each loads half of every tile's rows into both) against the float64 oracle, forward and
    the backward fed by its lse; outputs start as NaN."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the sm90 forward needs compute capability 9.0")
    poison_cuda_outputs(monkeypatch)
    for name, value in SM90_MC_ENVS[env].items():
        monkeypatch.setenv(name, value)
    *shape, features = SM90_MC_CASES[case]
    dtype = torch.float16 if case.endswith("fp16") else torch.bfloat16
    A.check(A.Case(*shape, dtype, "cuda", **features), "cuda-sm90", _CACHE)


@pytest.mark.gpu
@NEEDS_EXT
@pytest.mark.parametrize("d, causal", [(128, True), (256, False)])
def test_sm90_kv_multicast_require_refuses(d, causal):
    """Where the launch cannot multicast (a causal mask: the two q-blocks of a cluster would see
    different keys; D=256, whose tile table has no multicast code), "require" raises instead of
    falling back."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the sm90 forward needs compute capability 9.0")
    q = torch.randn(1, 256, 2, d, device="cuda", dtype=torch.bfloat16)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FUSEDOPS_ATTN_SM90_MULTICAST", "require")
        with pytest.raises(RuntimeError, match="not supported"):
            attention(q, q, q, causal=causal, backend="cuda-sm90")


@pytest.mark.gpu
@NEEDS_EXT
@pytest.mark.parametrize("order", ["default", "ascending", "descending"])
@pytest.mark.parametrize("case", [c for c, s in SM90_PERSIST_CASES.items() if s[5] != 256])
def test_sm90_deterministic_backward_beyond_one_wave(case, order, monkeypatch):
    """The sm90 backward's ordered dQ reductions on grids of up to 288 CTAs (key blocks x KV
    heads x sequences: 192-288 in all but the window case; in the varlen ones many CTAs have no
    keys and exit at once), more than one wave of an H200's 132 SMs: CTAs wait for the turns of
    CTAs that started before them, not all of them resident together ("default": the rotated
    order on the unmasked cases, whose CTAs also wait for later tickets of their own sequence
    and head). Against the oracle, and bit-identical on a second run."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the sm90 backward runs on compute capability 9.0")
    for name in SM90_BWD_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("FUSEDOPS_ATTN_DQ", "separate")
    if order != "default":
        monkeypatch.setenv("FUSEDOPS_ATTN_SM90_BWD_DQ_ORDER", order)
    poison_cuda_outputs(monkeypatch)
    *shape, features = SM90_PERSIST_CASES[case]
    dtype = torch.float16 if "causal" in case else torch.bfloat16  # the oracle cached above
    c = A.Case(*shape, dtype, "cuda", **features)
    A.check(c, "cuda-sm90", _CACHE)
    inp = A.make_inputs(c)
    runs = [A.run(lambda *a, **k: attention(*a, **k, return_lse=True, backend="cuda-sm90"), inp,
                  c, c.dtype) for _ in range(2)]
    for name in ("dq", "dk", "dv"):
        assert torch.equal(runs[0][name], runs[1][name]), name



@pytest.mark.gpu
@NEEDS_EXT
@pytest.mark.parametrize("convert", ["after", "tail"])
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_sm90_backward_replays_in_a_cuda_graph(causal, deterministic, convert, monkeypatch):
    """The sm90 backward captured in a CUDA graph (its preprocess, the main kernel and the dQ
    conversion; "tail": the conversion launched as a programmatic dependent that waits on
    per-block counts) replays to eager's gradients on new inputs: exactly in the deterministic
    mode, within float32 reordering of the dQ additions otherwise."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the sm90 backward needs compute capability 9.0")
    for name in SM90_BWD_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("FUSEDOPS_ATTN_SM90_BWD_CONVERT", convert)
    lens = [700, 1, 300]
    cu = torch.tensor([0, 700, 701, 1001], dtype=torch.int32, device="cuda")
    q, k, v, do = (torch.randn(sum(lens), 8, 128, device="cuda", dtype=torch.bfloat16)
                   for _ in range(4))
    k, v = k[:, :2].contiguous(), v[:, :2].contiguous()
    args = (cu, cu, max(lens), max(lens), 128 ** -0.5, causal, -1, -1, 0.0)
    out, lse = torch.ops.fusedops.attention_fwd_cuda(q, k, v, *args, 90)

    def bwd():
        return torch.ops.fusedops.attention_bwd_cuda(q, k, v, out, lse, do, *args,
                                                     deterministic, 90)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        bwd()  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=torch.cuda.Stream()):
        grads = bwd()
    for seed in (1, 2):
        g = torch.Generator(device="cuda").manual_seed(seed)
        for t in (q, k, v, do):
            t.copy_(torch.randn(t.shape, device="cuda", generator=g))
        out.copy_(torch.ops.fusedops.attention_fwd_cuda(q, k, v, *args, 90)[0])
        lse.copy_(torch.ops.fusedops.attention_fwd_cuda(q, k, v, *args, 90)[1])
        graph.replay()
        ref = bwd()
        torch.cuda.synchronize()
        for name, a, b in zip(("dq", "dk", "dv"), grads, ref, strict=True):
            if deterministic or name != "dq":  # dK, dV: registers, a fixed order
                assert torch.equal(a, b), name
            else:  # dQ: float32 atomics in another order, then one bf16 rounding
                torch.testing.assert_close(a, b, atol=1e-3, rtol=1e-2, msg=name)


@pytest.mark.gpu
@NEEDS_EXT
@pytest.mark.parametrize("bm", ["64", "80"])
@pytest.mark.parametrize("deterministic", [False, True])
def test_sm90_tail_conversion_runs_its_kernel(bm, deterministic, monkeypatch):
    """The default (FUSEDOPS_ATTN_SM90_BWD_CONVERT=tail) replaces the dQ conversion after the
    backward (=after) by dq_convert_tail_kernel, at 64- and 80-query steps and in the
    deterministic mode."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the sm90 backward needs compute capability 9.0")
    for name in SM90_BWD_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("FUSEDOPS_ATTN_SM90_BWD_BM", bm)
    case = A.Case(1, 300, 300, 4, 4, 128, torch.bfloat16, "cuda")
    inp = A.make_inputs(case)
    run = lambda: A.run(lambda *a, **k: attention(*a, **k, return_lse=True,  # noqa: E731
                                                  backend="cuda-sm90"), inp, case, case.dtype)
    names = {}
    if deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        for convert in ("after", "tail"):
            monkeypatch.setenv("FUSEDOPS_ATTN_SM90_BWD_CONVERT", convert)
            names[convert] = _kernel_names(run)
    finally:
        torch.use_deterministic_algorithms(False)
    if not any(names.values()):
        pytest.skip("the profiler recorded no CUDA kernels (CUPTI unavailable)")
    assert any("dq_convert_tail_kernel" in n for n in names["tail"]), sorted(names["tail"])
    assert not any("dq_convert" in n and "tail" not in n for n in names["tail"]), names["tail"]
    assert not any("dq_convert_tail_kernel" in n for n in names["after"]), names["after"]

@pytest.mark.gpu
@NEEDS_EXT
@pytest.mark.parametrize("causal", [False, True])
def test_sm90_forward_replays_in_a_cuda_graph(causal):
    """The persistent sm90 forward's tile counters (dynamic order here: the sequences differ in
    length) are zeroed by a captured graph and left at zero by every launch: two graphs captured
    one after the other on one stream, replayed in either order and between eager calls on new
    inputs, match eager calls exactly."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the sm90 forward needs compute capability 9.0")
    lens = [700, 1, 300]
    cu = torch.tensor([0, 700, 701, 1001], dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(sum(lens), 8, 128, device="cuda", dtype=torch.bfloat16)
               for _ in range(3))
    k, v = k[:, :2].contiguous(), v[:, :2].contiguous()
    args = (cu, cu, max(lens), max(lens), 128 ** -0.5, causal, -1, -1, 0.0, 90)
    fwd = torch.ops.fusedops.attention_fwd_cuda
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fwd(q, k, v, *args)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graphs, outs = [], []
    capture_stream = torch.cuda.Stream()
    for _ in range(2):
        graphs.append(torch.cuda.CUDAGraph())
        with torch.cuda.graph(graphs[-1], stream=capture_stream):
            outs.append(fwd(q, k, v, *args))
    for seed, order in ((1, (0, 1)), (2, (1, 0)), (3, (1, 1))):
        g = torch.Generator(device="cuda").manual_seed(seed)
        for t in (q, k, v):
            t.copy_(torch.randn(t.shape, device="cuda", generator=g))
        for i in order:
            graphs[i].replay()
            ref_out, ref_lse = fwd(q, k, v, *args)
            torch.cuda.synchronize()
            out, lse = outs[i]
            assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)


def _other_dq_mode_params():
    """Each backend's non-default dQ mode (the parity suite runs the defaults: Triton separate,
    CUDA atomic)."""
    out = []
    for feature in ("plain", "causal", "causal_window", "varlen_everything", "softcap"):
        out.append(pytest.param("triton", "atomic", torch.bfloat16, (2, 1025, 1025, 8, 2, 128),
                                feature, id=f"triton-atomic-bfloat16-D128-{feature}"))
        # cuda-sm90 at D=256: the Triton backward, whose default is the separate pass
        out.append(pytest.param("cuda-sm90", "atomic", torch.bfloat16, (2, 300, 300, 4, 2, 256),
                                feature, marks=NEEDS_EXT,
                                id=f"cuda-sm90-atomic-bfloat16-D256-{feature}"))
        for cuda in ("cuda-sm80", "cuda-sm90"):
            for dtype in (torch.bfloat16, torch.float16):
                for shape in ((2, 1025, 1025, 8, 2, 128), (2, 97, 211, 4, 2, 64),
                              (2, 211, 97, 4, 1, 64)):
                    out.append(pytest.param(
                        cuda, "separate", dtype, shape, feature, marks=NEEDS_EXT,
                        id=f"{cuda}-separate-{str(dtype)[6:]}-{'x'.join(map(str, shape))}-"
                           f"{feature}"))
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("backend,mode,dtype,shape,feature", _other_dq_mode_params())
def test_other_dq_mode(backend, mode, dtype, shape, feature, monkeypatch):
    """FUSEDOPS_ATTN_DQ selects the backend's other dQ mode, which stays correct."""
    monkeypatch.setenv("FUSEDOPS_ATTN_DQ", mode)
    case = A.Case(*shape, dtype, "cuda", **FEATURES[feature])
    A.check(case, backend, _CACHE)


@pytest.mark.gpu
@NEEDS_EXT
@pytest.mark.parametrize("schedule", ["overlap", "pingpong"])
@pytest.mark.parametrize("feature", ["plain", "causal", "softcap", "varlen_everything"])
def test_cuda_sm90_176_key_tiles(schedule, feature, monkeypatch):
    """FUSEDOPS_ATTN_SM90_BLOCK_N=176 (a measurement option at D=128) stays correct."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the sm90 forward runs on compute capability 9.0")
    monkeypatch.setenv("FUSEDOPS_ATTN_SM90_BLOCK_N", "176")
    monkeypatch.setenv("FUSEDOPS_ATTN_SM90_SCHEDULE", schedule)
    poison_cuda_outputs(monkeypatch)
    for shape in ((2, 1025, 1025, 4, 2, 128), (2, 97, 400, 4, 4, 128)):
        A.check(A.Case(*shape, torch.bfloat16, "cuda", **FEATURES[feature]), "cuda-sm90", _CACHE)


# cuda-sm90's backward variants, as the environment that selects them.
SM90_BWD_VARIANTS = {
    "sm90-bwd": {},
    "sm90-bwd-overlap": {"FUSEDOPS_ATTN_SM90_BWD_SCHEDULE": "overlap"},
    "sm90-bwd-lagged": {"FUSEDOPS_ATTN_SM90_BWD_SCHEDULE": "lagged"},
    "sm90-bwd-lockstep": {"FUSEDOPS_ATTN_SM90_BWD_SCHEDULE": "lockstep"},
    # the persistent grid capped at 3 CTAs (several tiles per CTA through both K/V buffers, the
    # key blocks past a sequence's end passed over), and a CTA per key block instead
    "sm90-bwd-3cta": {"FUSEDOPS_ATTN_SM90_BWD_PERSISTENT": "3"},
    "sm90-bwd-3cta-lagged": {"FUSEDOPS_ATTN_SM90_BWD_PERSISTENT": "3",
                             "FUSEDOPS_ATTN_SM90_BWD_SCHEDULE": "lagged"},
    "sm90-bwd-3cta-lockstep": {"FUSEDOPS_ATTN_SM90_BWD_PERSISTENT": "3",
                               "FUSEDOPS_ATTN_SM90_BWD_SCHEDULE": "lockstep"},
    "sm90-bwd-nonpersistent": {"FUSEDOPS_ATTN_SM90_BWD_PERSISTENT": "0"},
    "sm90-bwd-3cta-overlap": {"FUSEDOPS_ATTN_SM90_BWD_PERSISTENT": "3",
                              "FUSEDOPS_ATTN_SM90_BWD_SCHEDULE": "overlap"},
    # the dK/dV store's wait and the K/V buffer's release before the next tile (the default
    # defers them past the next tile's first products)
    "sm90-bwd-immediate": {"FUSEDOPS_ATTN_SM90_BWD_EPILOGUE": "immediate"},
    "sm90-bwd-3cta-immediate": {"FUSEDOPS_ATTN_SM90_BWD_PERSISTENT": "3",
                                "FUSEDOPS_ATTN_SM90_BWD_EPILOGUE": "immediate"},
    "sm90-bwd-3cta-immediate-lagged": {"FUSEDOPS_ATTN_SM90_BWD_PERSISTENT": "3",
                                       "FUSEDOPS_ATTN_SM90_BWD_EPILOGUE": "immediate",
                                       "FUSEDOPS_ATTN_SM90_BWD_SCHEDULE": "lagged"},
    # 80-query steps at D=128 (the transposed dQ product) under masks too, and 64-query ones
    # where 80 is the default (unmasked, no softcap).
    "sm90-bwd-bm80": {"FUSEDOPS_ATTN_SM90_BWD_BM": "80"},
    "sm90-bwd-bm64": {"FUSEDOPS_ATTN_SM90_BWD_BM": "64"},
    "sm80-bwd": {"FUSEDOPS_ATTN_SM90_BWD": "sm80"},
    # The deterministic mode (ordered dQ reductions): the default order (rotated on unmasked
    # calls, else one of the other two) and both linear orders.
    "sm90-bwd-ordered": {"FUSEDOPS_ATTN_DQ": "separate"},
    "sm90-bwd-ordered-asc": {"FUSEDOPS_ATTN_DQ": "separate",
                             "FUSEDOPS_ATTN_SM90_BWD_DQ_ORDER": "ascending"},
    "sm90-bwd-ordered-desc": {"FUSEDOPS_ATTN_DQ": "separate",
                              "FUSEDOPS_ATTN_SM90_BWD_DQ_ORDER": "descending"},
    # dQ converted after the backward (the default converts each block as its count completes)
    "sm90-bwd-after": {"FUSEDOPS_ATTN_SM90_BWD_CONVERT": "after"},
    "sm90-bwd-after-lagged": {"FUSEDOPS_ATTN_SM90_BWD_CONVERT": "after",
                             "FUSEDOPS_ATTN_SM90_BWD_SCHEDULE": "lagged"},
    "sm90-bwd-after-lockstep": {"FUSEDOPS_ATTN_SM90_BWD_CONVERT": "after",
                               "FUSEDOPS_ATTN_SM90_BWD_SCHEDULE": "lockstep"},
    "sm90-bwd-after-bm64": {"FUSEDOPS_ATTN_SM90_BWD_CONVERT": "after",
                           "FUSEDOPS_ATTN_SM90_BWD_BM": "64"},
    "sm90-bwd-after-bm80": {"FUSEDOPS_ATTN_SM90_BWD_CONVERT": "after",
                           "FUSEDOPS_ATTN_SM90_BWD_BM": "80"},
    "sm90-bwd-after-overlap": {"FUSEDOPS_ATTN_SM90_BWD_CONVERT": "after",
                              "FUSEDOPS_ATTN_SM90_BWD_SCHEDULE": "overlap"},
    "sm90-bwd-ordered-after": {"FUSEDOPS_ATTN_DQ": "separate",
                               "FUSEDOPS_ATTN_SM90_BWD_CONVERT": "after"},
    "sm90-bwd-ordered-asc-after": {"FUSEDOPS_ATTN_DQ": "separate",
                                   "FUSEDOPS_ATTN_SM90_BWD_DQ_ORDER": "ascending",
                                   "FUSEDOPS_ATTN_SM90_BWD_CONVERT": "after"},
}
SM90_BWD_ENV = ("FUSEDOPS_ATTN_SM90_BWD", "FUSEDOPS_ATTN_SM90_BWD_SCHEDULE", "FUSEDOPS_ATTN_DQ",
                "FUSEDOPS_ATTN_SM90_BWD_DQ_ORDER", "FUSEDOPS_ATTN_SM90_BWD_BM",
                "FUSEDOPS_ATTN_SM90_BWD_CONVERT", "FUSEDOPS_ATTN_SM90_BWD_PERSISTENT",
                "FUSEDOPS_ATTN_SM90_BWD_EPILOGUE")


@pytest.mark.gpu
@pytest.mark.parametrize("variant", list(SM90_BWD_VARIANTS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("shape", [(2, 1025, 1025, 8, 2, 128), (2, 97, 211, 4, 2, 64),
                                   (2, 211, 97, 4, 1, 64), (1, 300, 300, 4, 4, 128)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("feature", list(FEATURES))
@NEEDS_EXT
def test_cuda_sm90_backward_and_its_sm80_switch(feature, shape, dtype, variant, monkeypatch):
    """cuda-sm90's backward is the sm90 kernel (serial schedule with its dQ products a step
    behind or not, or overlapped, by FUSEDOPS_ATTN_SM90_BWD_SCHEDULE; or deterministic in
    either order of its dQ reductions); FUSEDOPS_ATTN_SM90_BWD=sm80 takes the sm80 one. All
    pass the oracle."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the sm90 kernels run on compute capability 9.0")
    for name in SM90_BWD_ENV:
        monkeypatch.delenv(name, raising=False)
    for name, value in SM90_BWD_VARIANTS[variant].items():
        monkeypatch.setenv(name, value)
    poison_cuda_outputs(monkeypatch)
    case = A.Case(*shape, dtype, "cuda", **FEATURES[feature])
    A.check(case, "cuda-sm90", _CACHE)


@pytest.mark.gpu
@NEEDS_EXT
@pytest.mark.parametrize("schedule", ["default", "other"])
@pytest.mark.parametrize("feature", ["plain", "causal", "window", "varlen_everything"])
@pytest.mark.parametrize("shape", [(3, 1100, 1100, 8, 8, 64), (4, 2100, 2100, 8, 4, 128)],
                         ids=lambda s: "x".join(map(str, s)))
def test_sm90_persistent_backward_runs_many_tiles_per_cta(shape, feature, schedule, monkeypatch):
    """The persistent sm90 backward (the default: at most one CTA per SM, taking key blocks from
    a counter) on calls of more key blocks that hold keys than the GPU has SMs, so that CTAs run
    several through both K/V buffers, in the default schedule of the head dim and the other
    serial one (lagged / lockstep dQ products); varlen passes over the key blocks past a
    sequence's end and, under its window, runs key blocks that no query sees. The oracle rule
    holds, and dK and dV equal bit for bit those of a CTA per key block
    (FUSEDOPS_ATTN_SM90_BWD_PERSISTENT=0) and of a single CTA running every key block (=1): the
    same products in the same order; dQ within float32 reordering of its additions."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the sm90 backward needs compute capability 9.0")
    for name in SM90_BWD_ENV:
        monkeypatch.delenv(name, raising=False)
    if schedule == "other":
        monkeypatch.setenv("FUSEDOPS_ATTN_SM90_BWD_SCHEDULE",
                           "lockstep" if shape[-1] == 64 else "lagged")
    kw = dict(FEATURES[feature])
    if kw.get("varlen"):  # three sequences, two of them long
        sq, sk = shape[1], shape[2]
        kw["lens"] = ((sq, sq // 2, 1), (sk, sk, 5))
    case = A.Case(*shape, torch.bfloat16, "cuda", **kw)
    lens_k = case.lens[1] if case.varlen else (case.seq_k,) * case.batch
    blocks_with_keys = case.heads_kv * sum(-(-n // 128) for n in lens_k)
    assert blocks_with_keys > torch.cuda.get_device_properties(0).multi_processor_count
    poison_cuda_outputs(monkeypatch)
    A.check(case, "cuda-sm90", _CACHE)
    inp = A.make_inputs(case)
    grads = {}
    for ctas in (None, "0", "1"):
        if ctas is None:
            monkeypatch.delenv("FUSEDOPS_ATTN_SM90_BWD_PERSISTENT", raising=False)
        else:
            monkeypatch.setenv("FUSEDOPS_ATTN_SM90_BWD_PERSISTENT", ctas)
        grads[ctas] = A.run(lambda *a, **k: attention(*a, **k, return_lse=True,
                                                      backend="cuda-sm90"), inp, case, case.dtype)
    for ctas in ("0", "1"):
        for name in ("out", "dk", "dv"):
            assert torch.equal(grads[None][name], grads[ctas][name]), (ctas, name)
        torch.testing.assert_close(grads[None]["dq"], grads[ctas]["dq"], atol=2e-3, rtol=1e-2)


@pytest.mark.gpu
@NEEDS_EXT
def test_cuda_sm90_backward_switch_changes_the_kernel(monkeypatch):
    """The switch really selects another kernel: the two backwards round differently."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the sm90 kernels run on compute capability 9.0")
    case = A.Case(2, 1025, 1025, 8, 2, 128, torch.bfloat16, "cuda", causal=True)
    inp = A.make_inputs(case)
    monkeypatch.delenv("FUSEDOPS_ATTN_DQ", raising=False)
    grads = []
    for value in (None, "sm80"):
        if value is None:
            monkeypatch.delenv("FUSEDOPS_ATTN_SM90_BWD", raising=False)
        else:
            monkeypatch.setenv("FUSEDOPS_ATTN_SM90_BWD", value)
        grads.append(A.run(lambda *a, **k: attention(*a, **k, return_lse=True,
                                                     backend="cuda-sm90"), inp, case, case.dtype))
    assert torch.equal(grads[0]["out"], grads[1]["out"])
    assert not torch.equal(grads[0]["dk"], grads[1]["dk"])


def _kernel_names(fn):
    """Names of the CUDA kernels fn() launches (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return {e.key for e in prof.key_averages()}


@pytest.mark.gpu
@NEEDS_EXT
@pytest.mark.parametrize("head_dim", [64, 128])
def test_sm90_deterministic_backward_runs_the_sm90_kernel(head_dim, monkeypatch):
    """Deterministic on cuda-sm90 runs the sm90 backward kernel (its ordered-dQ mode), not the
    sm80 dQ pass; FUSEDOPS_ATTN_SM90_BWD=sm80 still takes the sm80 backward (its dQ pass). The
    two round differently, and each repeats bit for bit."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the sm90 backward runs on compute capability 9.0")
    for name in SM90_BWD_ENV:
        monkeypatch.delenv(name, raising=False)
    case = A.Case(2, 1025, 1025, 8, 2, head_dim, torch.bfloat16, "cuda", causal=True)
    inp = A.make_inputs(case)
    run = lambda: A.run(lambda *a, **k: attention(*a, **k, return_lse=True,  # noqa: E731
                                                  backend="cuda-sm90"), inp, case, case.dtype)
    grads, names = {}, {}
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        for value in (None, "sm80"):
            if value is not None:
                monkeypatch.setenv("FUSEDOPS_ATTN_SM90_BWD", value)
            names[value] = _kernel_names(lambda v=value: grads.setdefault(v, run()))
            assert torch.equal(run()["dq"], grads[value]["dq"]), value
    finally:
        torch.use_deterministic_algorithms(False)
    if not any(names.values()):
        pytest.skip("the profiler recorded no CUDA kernels (CUPTI unavailable)")
    sm90, sm80 = names[None], names["sm80"]

    def dq_pass(n):  # the sm80 dQ kernel, demangled or not (not dq_convert_kernel)
        return "::dq_kernel<" in n or "9dq_kernelI" in n
    assert any("bwd_kernel_sm90" in n for n in sm90), sorted(sm90)
    assert not any(dq_pass(n) for n in sm90), sorted(sm90)
    assert not any("bwd_kernel_sm90" in n for n in sm80), sorted(sm80)
    assert any(dq_pass(n) for n in sm80), sorted(sm80)
    assert not torch.equal(grads[None]["dq"], grads["sm80"]["dq"])


@pytest.mark.gpu
@NEEDS_EXT
@pytest.mark.parametrize("bm", [None, "64", "80"])
@pytest.mark.parametrize("feature", ["plain", "plain1024", "short", "causal", "short_causal",
                                     "softcap"])
def test_sm90_backward_query_step_selection(feature, bm, monkeypatch):
    """At D=128 the sm90 backward takes 80-query steps (its kernel's template argument 80, dQ
    converted from column-major tiles by dq_convert_t_kernel) on calls without a sliding window
    or softcap of at least 1024 queries, 4096 under a causal mask, 64-query steps otherwise
    ("short": 1000 queries, "short_causal": 2048 causal);
    FUSEDOPS_ATTN_SM90_BWD_BM=64|80 forces either, except that softcap always takes 64."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the sm90 backward runs on compute capability 9.0")
    for name in SM90_BWD_ENV:
        monkeypatch.delenv(name, raising=False)
    # The conversion after the backward names the step (dq_convert_t_kernel at 80 queries);
    # test_sm90_tail_conversion_runs_its_kernel checks the default's overlapped conversion.
    monkeypatch.setenv("FUSEDOPS_ATTN_SM90_BWD_CONVERT", "after")
    if bm is not None:
        monkeypatch.setenv("FUSEDOPS_ATTN_SM90_BWD_BM", bm)
    opts = {"plain": {}, "plain1024": {}, "short": {}, "causal": {"causal": True},
            "short_causal": {"causal": True}, "softcap": {"softcap": 30.0}}[feature]
    n = {"short": 1000, "plain1024": 1024, "short_causal": 2048}.get(feature, 4096)
    case = A.Case(1, n, n, 2, 1, 128, torch.bfloat16, "cuda", **opts)
    inp = A.make_inputs(case)
    names = _kernel_names(lambda: A.run(lambda *a, **k: attention(*a, **k, return_lse=True,
                                                                  backend="cuda-sm90"),
                                        inp, case, case.dtype))
    if not names:
        pytest.skip("the profiler recorded no CUDA kernels (CUPTI unavailable)")
    want80 = feature != "softcap" and (bm == "80" or
                                       (bm is None and feature in ("plain", "plain1024",
                                                                   "causal")))
    conv_t = any("dq_convert_t_kernel" in n for n in names)
    main80 = any("bwd_kernel_sm90" in n and ("128, false, false, false, 80>" in n or
                                              "Li128ELb0ELb0ELb0ELi80E" in n) for n in names)
    assert any("bwd_kernel_sm90" in n for n in names), sorted(names)
    assert conv_t == want80 and main80 == want80, sorted(names)


def test_dq_mode_selection(monkeypatch):
    from fusedops.attention.ops import dq_mode
    monkeypatch.delenv("FUSEDOPS_ATTN_DQ", raising=False)
    assert dq_mode("triton", 128) == "separate" and dq_mode("cuda-sm80", 128) == "atomic"
    assert dq_mode("cuda-sm80", 64) == "atomic"
    # cuda-sm90's backward at D=256 is Triton's, and takes Triton's default
    assert dq_mode("cuda-sm90", 128) == "atomic" and dq_mode("cuda-sm90", 256) == "separate"
    monkeypatch.setenv("FUSEDOPS_ATTN_DQ", "separate")
    assert dq_mode("cuda-sm80", 128) == "separate" and dq_mode("cuda-sm80", 64) == "separate"
    monkeypatch.setenv("FUSEDOPS_ATTN_DQ", "atomic")
    assert dq_mode("triton", 64) == "atomic" and dq_mode("cuda-sm80", 64) == "atomic"
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        assert dq_mode("cuda-sm80", 128) == "separate" and dq_mode("triton", 64) == "separate"
    finally:
        torch.use_deterministic_algorithms(False)
    monkeypatch.setenv("FUSEDOPS_ATTN_DQ", "fast")
    with pytest.raises(ValueError, match="FUSEDOPS_ATTN_DQ"):
        dq_mode("cuda-sm80", 128)


def test_reference_matches_materialised_float64():
    for f in ("plain", "causal_window", "varlen_everything", "softcap"):
        case = A.Case(2, 23, 19, 4, 2, 16, torch.float64, "cpu", **FEATURES[f])
        inp = A.make_inputs(case)
        ref = A.run(lambda *a, **k: attention(*a, **k, return_lse=True, backend="torch"), inp,
                    case, torch.float64)
        direct = A.run(A.eager_attention, inp, case, torch.float64)
        for name in ref:
            assert A.rel_err(ref[name], direct[name]) < 1e-12, (f, name)


def test_row_that_sees_no_key_is_zero_with_lse_minus_inf():
    q = torch.randn(1, 8, 2, 16, requires_grad=True)
    k = torch.randn(1, 3, 2, 16, requires_grad=True)
    v = torch.randn(1, 3, 2, 16, requires_grad=True)
    out, lse = attention(q, k, v, causal=True, return_lse=True, backend="torch")
    # Sq=8 > Sk=3, bottom-right causal: query i sees keys j <= i - 5, so rows 0-4 see nothing.
    assert torch.all(out[0, :5] == 0) and torch.all(lse[0, :, :5] == float("-inf"))
    assert torch.isfinite(lse[0, :, 5:]).all()
    out.sum().backward()
    assert torch.all(q.grad[0, :5] == 0) and torch.isfinite(k.grad).all()


def test_checker_rejects_wrong_scale():
    case = A.Case(2, 19, 23, 4, 2, 16, torch.float32, "cpu", causal=True)
    inp = A.make_inputs(case)
    ref = A.run(lambda *a, **k: attention(*a, **k, return_lse=True, backend="torch"), inp, case,
                torch.float64)
    wrong = A.run(lambda *a, **k: attention(*a, **k, return_lse=True, backend="torch",
                                            softmax_scale=0.26), inp, case, torch.float32)
    eager = A.run(A.eager_attention, inp, case, torch.float32)
    assert A.rel_err(wrong["out"], ref["out"]) > 2 * A.rel_err(eager["out"], ref["out"]) + 2e-6


def test_module():
    m = Attention(causal=True, backend="torch")
    q = torch.randn(1, 5, 2, 16)
    torch.testing.assert_close(m(q, q, q), attention(q, q, q, causal=True, backend="torch"))
    assert "causal=True" in repr(m)


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(causal=1), TypeError, "causal"),
    (dict(return_lse="yes"), TypeError, "return_lse"),
    (dict(window_size=4), TypeError, "window_size"),
    (dict(window_size=(4, 2, 1)), TypeError, "window_size"),
    (dict(window_size=(-2, 0)), ValueError, "window_size"),
    (dict(window_size=(1.5, 0)), TypeError, "window_size"),
    (dict(softcap=0.0), ValueError, "softcap"),
    (dict(softcap=-1.0), ValueError, "softcap"),
    (dict(softcap="30"), TypeError, "softcap"),
    (dict(softmax_scale=float("inf")), ValueError, "softmax_scale"),
    (dict(softmax_scale=float("nan")), ValueError, "softmax_scale"),
    (dict(backend="flash"), ValueError, "backend"),
    (dict(backend=0), TypeError, "backend"),
])
def test_module_refuses_bad_options_at_construction(kwargs, exc, match):
    """Attention raises when built, with the error attention() gives at its first call."""
    with pytest.raises(exc, match=match) as built:
        Attention(**kwargs)
    q = torch.randn(1, 5, 2, 16)
    with pytest.raises(exc) as called:
        attention(q, q, q, **{"backend": "torch", **kwargs})
    assert str(built.value) == str(called.value)


def test_module_with_every_option_valid_constructs_and_runs():
    opts = dict(causal=True, softmax_scale=0.3, window_size=(2, 0), softcap=20.0,
                return_lse=True, backend="torch")
    m = Attention(**opts)
    q, k, v = _qkv()
    for a, b in zip(m(q, k, v), attention(q, k, v, **opts), strict=True):
        torch.testing.assert_close(a, b)


def _qkv(b=1, s=5, hq=4, hkv=2, d=16, sk=None):
    return (torch.randn(b, s, hq, d), torch.randn(b, sk or s, hkv, d),
            torch.randn(b, sk or s, hkv, d))


@pytest.mark.parametrize("make,kwargs,exc,match", [
    (lambda: (lambda q, k, v: (q, k[..., :8], v[..., :8]))(*_qkv()), {}, ValueError,
     "head dims differ"),
    (lambda: _qkv(hq=3, hkv=2), {}, ValueError, "multiple of the number of k/v heads"),
    (lambda: _qkv(hq=0, hkv=2), {}, ValueError, r"number of q heads \(0\) must be a positive"),
    (lambda: (lambda q, k, v: (q, k, v[:, :3]))(*_qkv()), {}, ValueError, "k and v must have"),
    (lambda: (lambda q, k, v: (q[0], k[0], v[0]))(*_qkv()), {}, ValueError,
     r"must be \(B, S, H, D\)"),
    (lambda: (lambda q, k, v: (q.half(), k, v))(*_qkv()), {}, TypeError, "dtype"),
    (lambda: (lambda q, k, v: (q.long(), k, v))(*_qkv()), {}, TypeError, "q must be float"),
    (lambda: _qkv(b=1), dict(window_size=(-2, 0)), ValueError, "window_size"),
    (lambda: _qkv(b=1), dict(softcap=-1.0), ValueError, "softcap"),
    (lambda: _qkv(d=300), {}, ValueError, "head dim must be"),
])
def test_bad_dense_input(make, kwargs, exc, match):
    q, k, v = make()
    with pytest.raises(exc, match=match):
        attention(q, k, v, backend="torch", **kwargs)


def _packed():
    q = torch.randn(10, 2, 16)
    k = torch.randn(12, 2, 16)
    cu_q = torch.tensor([0, 4, 10], dtype=torch.int32)
    cu_k = torch.tensor([0, 5, 12], dtype=torch.int32)
    return q, k, k.clone(), cu_q, cu_k


@pytest.mark.parametrize("mutate,match", [
    (lambda a: {**a, "cu_seqlens_q": a["cu_seqlens_q"].long()}, "1-D int32"),
    (lambda a: {**a, "cu_seqlens_k": torch.tensor([0, 12], dtype=torch.int32)}, "one length"),
    (lambda a: {**a, "cu_seqlens_q": torch.tensor([0, 6, 4], dtype=torch.int32)},
     r"cu_seqlens_q\[-1\] must equal"),
    (lambda a: {**a, "cu_seqlens_q": torch.tensor([0, 11, 10], dtype=torch.int32)},
     "non-decreasing"),
    (lambda a: {**a, "cu_seqlens_k": torch.tensor([1, 5, 12], dtype=torch.int32)},
     r"cu_seqlens_k\[0\] must be 0"),
    (lambda a: {**a, "max_seqlen_q": 3}, "length 6 > the given maximum 3"),
    (lambda a: {**a, "max_seqlen_k": None}, "max_seqlen_k must be an int"),
    (lambda a: {k: v for k, v in a.items() if k != "cu_seqlens_k"}, "cu_seqlens_k must be"),
])
def test_bad_varlen_input(mutate, match):
    q, k, v, cu_q, cu_k = _packed()
    args = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=6, max_seqlen_k=7)
    with pytest.raises((ValueError, TypeError), match=match):
        attention(q, k, v, backend="torch", **mutate(args))


def test_opcheck_and_compile():
    q, k, v, cu_q, cu_k = _packed()
    q.requires_grad_()
    torch.library.opcheck(torch.ops.fusedops.attention_fwd.default,
                          (q, k, v, cu_q, cu_k, 6, 7, 0.25, True, -1, -1, 0.0, True, "torch"))
    out, lse = torch.ops.fusedops.attention_fwd(q, k, v, cu_q, cu_k, 6, 7, 0.25, True, 3, -1,
                                                5.0, False, "torch")
    torch.library.opcheck(torch.ops.fusedops.attention_bwd.default,
                          (q.detach(), k, v, out.detach(), lse, torch.randn_like(out), cu_q, cu_k,
                           6, 7, 0.25, True, 3, -1, 5.0, False, "torch"))

    def f(q, k, v):
        return attention(q, k, v, causal=True, softcap=10.0).float().square().sum()

    q, k, v = (t.requires_grad_() for t in _qkv(b=2, s=7))
    eager = torch.autograd.grad(f(q, k, v), (q, k, v))
    compiled = torch.autograd.grad(torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v),
                                   (q, k, v))
    for a, b in zip(eager, compiled, strict=True):
        torch.testing.assert_close(a, b)


def test_compiled_graph_holds_the_custom_ops():
    """Eager calls take an autograd.Function (no custom-op dispatch); torch.compile must still see
    fusedops::attention_fwd (and its backward op) in the graph, not trace into the kernels."""
    targets = []

    def record(gm, example_inputs):
        targets.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    q, k, v = (t.requires_grad_() for t in _qkv(b=2, s=7))
    out = torch.compile(lambda q, k, v: attention(q, k, v, causal=True), fullgraph=True,
                        backend=record)(q, k, v)
    assert any("fusedops.attention_fwd" in t for t in targets), targets
    torch.testing.assert_close(out, attention(q, k, v, causal=True))


def test_dense_seqlens_kept_from_inference_mode_work_with_autograd():
    """The dense cu_seqlens are kept per shape; one first made under inference_mode must still be
    savable for backward by a later call with gradients."""
    q, k, v = _qkv(b=3, s=5)
    with torch.inference_mode():
        ref = attention(q, k, v, causal=True)
    q.requires_grad_()
    out = attention(q, k, v, causal=True)
    out.sum().backward()
    torch.testing.assert_close(out.detach(), ref)
    assert q.grad is not None and torch.isfinite(q.grad).all()


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", pytest.param("cuda-sm80", marks=NEEDS_EXT),
                                     pytest.param("cuda-sm90", marks=NEEDS_EXT)])
def test_compile_gpu(backend):
    def f(q, k, v):
        return attention(q, k, v, causal=True, backend=backend).float().square().sum()

    q, k, v = (t.cuda().bfloat16().requires_grad_() for t in _qkv(b=2, s=300, d=64))
    eager = torch.autograd.grad(f(q, k, v), (q, k, v))
    compiled = torch.autograd.grad(torch.compile(f, fullgraph=True)(q, k, v), (q, k, v))
    for a, b in zip(eager, compiled, strict=True):
        torch.testing.assert_close(a, b)
    q, k, v = (t.detach() for t in (q, k, v))
    torch.library.opcheck(torch.ops.fusedops.attention_fwd.default,
                          (q.reshape(600, 4, 64), k.reshape(600, 2, 64), v.reshape(600, 2, 64),
                           torch.tensor([0, 300, 600], dtype=torch.int32, device="cuda"),
                           torch.tensor([0, 300, 600], dtype=torch.int32, device="cuda"),
                           300, 300, 0.125, True, -1, -1, 0.0, False, backend))


@pytest.mark.parametrize("backend,head_dim,runs", [
    ("cuda-sm80", 32, False), ("cuda-sm80", 96, False), ("cuda-sm80", 256, False),
    ("cuda-sm90", 32, False), ("cuda-sm90", 96, False), ("cuda-sm90", 256, True),
    ("cuda-sm90", 64, True), ("cuda-sm80", 128, True)])
def test_cuda_head_dims_per_backend(backend, head_dim, runs):
    """Each CUDA backend's head dims (static limits, so this holds on any machine): cuda-sm90
    also takes 256, cuda-sm80 does not; a refusal names the head dim and the built ones."""
    sig = dispatch.InputSig("attention", "cuda", 0, torch.bfloat16, head_dim)
    why = dispatch.why_not(backend, sig) or ""
    if runs:
        assert "head dim" not in why, why
    else:
        built = "64, 128 and 256" if backend == "cuda-sm90" else "64 and 128"
        assert f"head dim {head_dim}" in why and built in why, why


@NEEDS_EXT
@pytest.mark.parametrize("head_dim", [32, 96, 256])
def test_cuda_refuses_other_head_dims_with_a_reason(head_dim):
    """Head dims without sm80 kernels: dispatch names the reason; auto falls back to Triton, but
    at 256 on Hopper it picks cuda-sm90 (the sm90 forward is built for 256)."""
    sig = dispatch.InputSig("attention", "cuda", 0, torch.bfloat16, head_dim)
    assert f"head dim {head_dim}" in dispatch.why_not("cuda-sm80", sig)
    if HAS_GPU:
        q = torch.randn(1, 8, 2, head_dim, device="cuda", dtype=torch.bfloat16)
        with pytest.raises(RuntimeError, match=f"head dim {head_dim}"):
            attention(q, q, q, backend="cuda-sm80")
        sm90 = head_dim == 256 and torch.cuda.get_device_capability() == (9, 0)
        assert dispatch.select("attention", q, head_dim) == ("cuda-sm90" if sm90 else "triton")
        if sm90:
            assert dispatch.select("attention", q, head_dim, backend="cuda") == "cuda-sm90"


def test_backward_of_sm90_at_256_is_tritons(monkeypatch):
    """cuda-sm90 has no backward at D=256: the op hands it to the Triton backward (same lse
    layout), with Triton's default dQ mode (the deterministic separate pass) unless asked."""
    import sys

    import fusedops.attention as fa
    from fusedops.attention import ops

    assert dispatch.bwd_backend("attention", "cuda-sm90", 256) == "triton"
    assert dispatch.bwd_backend("attention", "cuda-sm90", 128) == "cuda-sm90"
    assert dispatch.bwd_backend("attention", "cuda-sm80", 256) == "cuda-sm80"
    assert dispatch.bwd_backend("attention", "triton", 256) == "triton"
    calls = []

    class FakeTriton:
        @staticmethod
        def attention_bwd(*args):
            calls.append(args)
            return args[0], args[1], args[2]

    pytest.importorskip("triton")
    monkeypatch.setitem(sys.modules, "fusedops.attention.triton", FakeTriton)
    monkeypatch.setattr(fa, "triton", FakeTriton, raising=False)
    monkeypatch.delenv("FUSEDOPS_ATTN_DQ", raising=False)
    q = torch.randn(10, 2, 256)
    cu = torch.tensor([0, 10], dtype=torch.int32)
    deterministic = ops.dq_mode("cuda-sm90", 256) == "separate"
    ops._bwd_impl(q, q, q, q, torch.zeros(2, 10), q, cu, cu, 10, 10, 0.0625, True, -1, -1, 0.0,
                  deterministic, "cuda-sm90")
    assert len(calls) == 1 and calls[0][-1] is True  # deterministic: the separate dQ pass


def test_backward_of_sm90_at_256_without_triton_is_the_reference(monkeypatch):
    """Where Triton is not importable, the backward that cuda-sm90 hands over at D=256 runs the
    torch reference (same lse contract) instead of failing after the forward has run."""
    import sys

    from fusedops.attention import ops, reference

    calls = []
    monkeypatch.setitem(sys.modules, "triton", None)  # import triton -> ImportError
    monkeypatch.setattr(reference, "attention_bwd", lambda *a: calls.append(a) or a[:3])
    q = torch.randn(10, 2, 256)
    cu = torch.tensor([0, 10], dtype=torch.int32)
    out = ops._bwd_impl(q, q, q, q, torch.zeros(2, 10), q, cu, cu, 10, 10, 0.0625, True, -1, -1,
                        0.0, True, "cuda-sm90")
    assert len(calls) == 1 and out[0] is q


def _bad_op_call(case):
    q = torch.randn(16, 4, 64, device="cuda", dtype=torch.bfloat16)
    k = v = q
    cu = torch.tensor([0, 16], dtype=torch.int32, device="cuda")
    cu_q = cu_k = cu
    if case == "dtype":
        q = k = v = q.float()
    elif case == "cu_dtype":
        cu_q = cu_k = cu.long()
    elif case == "k_strides":
        k = q.transpose(0, 1).contiguous().transpose(0, 1)
    elif case == "head_dim":
        q = k = v = torch.randn(16, 4, 96, device="cuda", dtype=torch.bfloat16)
    elif case == "gqa":
        k = v = q[:, :3]
    elif case == "sm90_overlap":  # rows 64 elements apart over 4 x 64: the sm80 kernels take it
        k = v = torch.as_strided(q, (16, 4, 64), (64, 64, 1))
    elif case in ("head_dim_256_sm80", "head_dim_256_bwd"):  # only arch 90's forward takes 256
        q = k = v = torch.randn(16, 4, 256, device="cuda", dtype=torch.bfloat16)
    if case == "head_dim_256_bwd":
        lse = torch.zeros(4, 16, device="cuda")
        return torch.ops.fusedops.attention_bwd_cuda(q, k, v, q, lse, q, cu_q, cu_k, 16, 16,
                                                     0.0625, False, -1, -1, 0.0, False, 90)
    arch = {"sm90_overlap": 90, "arch": 70}.get(case, 80)
    return torch.ops.fusedops.attention_fwd_cuda(q, k, v, cu_q, cu_k, 16, 16, 0.125, False, -1,
                                                 -1, 0.0, arch)


@pytest.mark.gpu
@NEEDS_EXT
@pytest.mark.parametrize("case,exc,match", [
    ("dtype", TypeError, "float16 or bfloat16"),
    ("cu_dtype", TypeError, "cu_seqlens must be int32"),
    ("k_strides", ValueError, "k must have contiguous heads"),
    ("head_dim", ValueError, "head dim 64 or 128"),
    ("head_dim_256_sm80", ValueError, "head dim 256: only the sm90 forward"),
    ("head_dim_256_bwd", ValueError, "head dim 256: only the sm90 forward"),
    ("gqa", ValueError, "multiple of Hkv"),
    # The Hopper forward's TMA maps cannot express overlapping rows (elsewhere than cc 9.0 it
    # refuses the GPU first).
    ("sm90_overlap", ValueError, "do not overlap|compute capability 9.0"),
    ("arch", ValueError, "arch must be 80 or 90, got 70"),
])
def test_cuda_op_checks_its_inputs(case, exc, match):
    """The C++ op names the argument it refuses (callers going around the Python API)."""
    with pytest.raises(exc, match=match):
        _bad_op_call(case)


def test_select_is_kept_per_inputs_and_override_variables(monkeypatch):
    """dispatch.select keeps its answers, but a changed FUSEDOPS_BACKEND is still obeyed."""
    monkeypatch.delenv("FUSEDOPS_BACKEND", raising=False)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    x = torch.randn(2, 4)
    assert dispatch.select("attention", x, 16) == "torch"
    monkeypatch.setenv("FUSEDOPS_BACKEND", "triton")
    with pytest.raises(RuntimeError, match="backend='triton'"):
        dispatch.select("attention", x, 16)
    monkeypatch.delenv("FUSEDOPS_BACKEND")
    assert dispatch.select("attention", x, 16) == "torch"


@pytest.mark.parametrize("cap,forced,head_dim,causal,first", [
    ((9, 0), False, 64, False, "cuda-sm90"), ((9, 0), False, 64, True, "cuda-sm90"),
    ((9, 0), False, 128, False, "cuda-sm90"), ((9, 0), False, 96, True, "triton"),
    ((9, 0), False, 256, False, "cuda-sm90"), ((9, 0), False, 256, True, "cuda-sm90"),
    ((9, 0), True, 64, False, "cuda-sm80"), ((8, 0), False, 64, False, "cuda-sm90")])
def test_auto_dispatch_order_for_attention(cap, forced, head_dim, causal, first, monkeypatch):
    """On Hopper, auto tries the sm90 kernels first at head dims 64, 128 and 256 and Triton first
    at the others (no CUDA kernels there), unless the Ampere path is forced; elsewhere the CUDA
    backends come first (cuda-sm90 is then refused for the capability)."""
    monkeypatch.setattr(dispatch, "capability", lambda sig: cap)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the GPU this case describes
    if forced:
        monkeypatch.setenv("FUSEDOPS_CUDA_ARCH", "sm80")
    else:
        monkeypatch.delenv("FUSEDOPS_CUDA_ARCH", raising=False)
    sig = dispatch.InputSig("attention", "cuda", 0, torch.bfloat16, head_dim, causal)
    order = dispatch.candidates("auto", sig)
    assert order[0] == first and order[-1] == "torch" and "cuda-sm80" in order
    lce = dispatch.candidates("auto", dispatch.InputSig("linear_ce", "cuda", 0, torch.bfloat16, 64))
    assert lce[0].startswith("cuda")


def test_hopper_256_order_and_cuda_request(monkeypatch):
    """On Hopper at D=256 auto and a "cuda" request both try cuda-sm90 first (its limits let 256
    through), then cuda-sm80 (which refuses 256), then Triton."""
    monkeypatch.setattr(dispatch, "capability", lambda sig: (9, 0))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv("FUSEDOPS_CUDA_ARCH", raising=False)
    sig = dispatch.InputSig("attention", "cuda", 0, torch.bfloat16, 256, True)
    assert dispatch.candidates("cuda", sig)[0] == "cuda-sm90"
    assert dispatch.op_backends("attention").by_name["cuda-sm90"].limits(sig) is None
    order = dispatch.candidates("auto", sig)
    assert order[:2] == ["cuda-sm90", "cuda-sm80"] and order[2] == "triton"
    monkeypatch.setenv("FUSEDOPS_CUDA_ARCH", "sm80")  # forced Ampere path: no cuda-sm90 at all
    assert "cuda-sm90" not in dispatch.candidates("auto", sig)
