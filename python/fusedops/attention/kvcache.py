"""Decode attention over a KV cache (contiguous or paged), with an in-place append of new keys."""

from __future__ import annotations

import math
import os

import torch
from torch import Tensor

from fusedops import _ext, dispatch
from fusedops._checks import check_attention_options, check_bool, check_int, is_int
from fusedops.attention import kvcache_backends as _backends  # noqa: F401  (declares them)
from fusedops.attention import kvcache_reference as reference

__all__ = ["attention_with_kvcache"]

OP = "attention_decode"
# Key indices are int32 in the kernels; a split's end (start + one split of the capacity) must
# stay below 2^31 for up to 256 splits of 64-key blocks.
MAX_CAPACITY = 2**31 - 2**15
MAX_GRID_BATCH = 65535  # the kernels' grids have one z index per sequence
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
INFERENCE_ONLY = ("fusedops.attention.attention_with_kvcache is inference only (no backward): "
                  "call it under torch.no_grad() / torch.inference_mode(), or detach {names}")


def _check_tensor(name, t, q, dims: int, layout: str):
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a Tensor, got {type(t).__name__}")
    if t.dtype not in _DTYPES:
        raise TypeError(f"{name} must be float16, bfloat16, float32 or float64, got {t.dtype}")
    if t.dtype != q.dtype:
        raise TypeError(f"{name} dtype {t.dtype} differs from q dtype {q.dtype}")
    if t.device != q.device:
        raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
    if t.dim() != dims:
        raise ValueError(f"{name} must be {layout}, got shape {tuple(t.shape)}")


def _check_int32(name, t, q, shape: tuple, what: str):
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be an int32 Tensor {what}, got {type(t).__name__}")
    if t.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {t.dtype}")
    if t.device != q.device:
        raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {shape} {what}, got {tuple(t.shape)}")


def _check_args(q, k_cache, v_cache, cache_seqlens, k_new, v_new, page_table, window_size,
                softcap, softmax_scale, num_splits):
    if not isinstance(q, Tensor):
        raise TypeError(f"q must be a Tensor, got {type(q).__name__}")
    _check_tensor("q", q, q, 4, "(B, Sq, Hq, D)")
    paged = page_table is not None
    layout = "(num_pages, page_size, Hkv, D) with page_table" if paged else "(B, S_max, Hkv, D)"
    _check_tensor("k_cache", k_cache, q, 4, layout)
    _check_tensor("v_cache", v_cache, q, 4, layout)
    batch, _, hq, head_dim = q.shape
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache must have one shape, got {tuple(k_cache.shape)} "
                         f"and {tuple(v_cache.shape)}")
    if k_cache.shape[-1] != head_dim:
        raise ValueError(f"head dims differ: q has {head_dim}, k_cache and v_cache have "
                         f"{k_cache.shape[-1]}")
    if not 1 <= head_dim <= 256:
        raise ValueError(f"head dim must be in [1, 256], got {head_dim}")
    hkv = k_cache.shape[2]
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"the number of q heads ({hq}) must be a multiple of the number of "
                         f"k_cache/v_cache heads ({hkv})")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last (head) dimension; the cache is "
                             "written in place, so it cannot be copied")
    if paged:
        if k_cache.shape[1] < 1 or k_cache.shape[0] < 1:
            raise ValueError(f"a paged k_cache needs at least one page of at least one slot, got "
                             f"shape {tuple(k_cache.shape)}")
        if not isinstance(page_table, Tensor):
            raise TypeError(f"page_table must be an int32 Tensor (B, max_pages), got "
                            f"{type(page_table).__name__}")
        if page_table.dim() != 2 or page_table.shape[0] != batch:
            raise ValueError(f"page_table must be (B, max_pages) = ({batch}, max_pages), got "
                             f"shape {tuple(page_table.shape)}")
        _check_int32("page_table", page_table, q, tuple(page_table.shape), "(B, max_pages)")
    elif k_cache.shape[0] != batch:
        raise ValueError(f"q has batch {batch}, k_cache and v_cache have batch "
                         f"{k_cache.shape[0]} (a paged cache needs page_table)")
    if not is_int(cache_seqlens):
        _check_int32("cache_seqlens", cache_seqlens, q, (batch,), "(one length per sequence)")
    if (k_new is None) != (v_new is None):
        raise ValueError("pass both k_new and v_new (keys to append) or neither")
    if k_new is not None:
        for name, t in (("k_new", k_new), ("v_new", v_new)):
            _check_tensor(name, t, q, 4, "(B, S_new, Hkv, D)")
            want = (batch, k_new.shape[1], hkv, head_dim)
            if tuple(t.shape) != want:
                raise ValueError(f"{name} must be (B, S_new, Hkv, D) = {want}, got "
                                 f"{tuple(t.shape)}")
        # The append writes the cache in place: in an expanded cache one slot would hold the
        # keys of several sequences (or heads), and every one of them would read the last.
        for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
            shared = [d for d in range(4) if t.stride(d) == 0 and t.shape[d] > 1]
            if shared:
                raise ValueError(f"{name} is expanded (stride 0 in dimension {shared[0]}); "
                                 "appending k_new/v_new writes it in place, so it must own "
                                 "its memory (e.g. .clone() it once)")
    check_attention_options(window_size, softcap, softmax_scale)
    if num_splits is not None:
        check_int("num_splits", num_splits)
        if not 1 <= num_splits <= 256:
            raise ValueError(f"num_splits must be in [1, 256] or None, got {num_splits}")


def check_values(cache_seqlens: Tensor, page_table: Tensor | None, n_new: int, cap: int,
                 num_pages: int, page_size: int) -> None:
    """Value checks of cache_seqlens and page_table (one host synchronisation)."""
    lens = cache_seqlens.tolist()
    for b, n in enumerate(lens):
        if n < 0:
            raise ValueError(f"cache_seqlens[{b}] = {n} is negative")
        if n + n_new > cap:
            what = (f"page_table holds {cap // page_size} pages of {page_size}"
                    if page_table is not None else f"the cache holds {cap} keys per sequence")
            raise ValueError(f"cache_seqlens[{b}] + S_new = {n} + {n_new} = {n + n_new} keys, "
                             f"past the capacity: {what}")
    if page_table is None:
        return
    rows = page_table.tolist()
    for b, n in enumerate(lens):
        used = rows[b][:-(-(n + n_new) // page_size)]
        bad = [(p, x) for p, x in enumerate(used) if not 0 <= x < num_pages]
        if bad:
            p, x = bad[0]
            raise ValueError(f"page_table[{b}, {p}] = {x} is not a page of k_cache (0 to "
                             f"{num_pages - 1}); sequence {b} uses its first {len(used)} pages")


def append_kv(k_cache, v_cache, k_new, v_new, cache_seqlens, page_table) -> None:
    """Writes k_new/v_new (B, S_new, Hkv, D) at positions cache_seqlens + t, in place, with no
    host synchronisation (an index_put_ of positions computed on the device). Positions past the
    capacity are clamped into range (no memory fault; check=True refuses them first)."""
    batch, n_new = k_new.shape[:2]
    if batch == 0 or n_new == 0:
        return
    dev = k_cache.device
    cap = reference.capacity(k_cache, page_table)
    pos = cache_seqlens.to(torch.long)[:, None] + torch.arange(n_new, device=dev)[None, :]
    pos = pos.clamp_(0, cap - 1)
    if page_table is None:
        rows = torch.arange(batch, device=dev)[:, None].expand_as(pos)
        slots = pos
    else:
        page_size = k_cache.shape[1]
        rows = page_table.gather(1, pos // page_size).long().clamp_(0, k_cache.shape[0] - 1)
        slots = pos % page_size
    k_cache.index_put_((rows, slots), k_new)
    v_cache.index_put_((rows, slots), v_new)


# Fake (meta) implementation of the compiled op, so that torch.compile traces a decode step on
# the CUDA backends; the op allocates a contiguous output.
if _ext.available():

    @torch.library.register_fake("fusedops::attention_decode_cuda")
    def _(q, k_cache, v_cache, seqlens_k, page_table, scale, causal, left, right, softcap,
          num_splits, arch):
        return (q.new_empty(q.shape),
                q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32))


_SMS: dict = {}


@torch.compiler.assume_constant_result
def _sm_count_of(index: int) -> int:
    if index not in _SMS:
        _SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SMS[index]


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of the device (asked once per device, a constant for
    torch.compile; 4 off the GPU, so that the CPU tests under the Triton interpreter see several
    splits)."""
    if device.type != "cuda":
        return 4
    return _sm_count_of(device.index if device.index is not None
                        else torch.cuda.current_device())


def num_splits_heuristic(batch: int, heads_kv: int, capacity: int, num_sms: int,
                         block_n: int, per_sm: int = 4) -> int:
    """Splits per sequence from static sizes only (no lengths: they stay on the device).

    One wave: as many programs (batch * Hkv * splits; heads_kv counts every program row of a
    sequence) as fit on the GPU at once, `per_sm` on each SM (the Triton kernel's: 4 with two
    stages of 64-key blocks, 2 with three; kvcache_triton._per_sm), each
    split at least four key blocks of the capacity, at most 64; one split once batch * Hkv
    programs fill half the wave or more. A second, partial wave costs more than the splits
    gain: from the H200 sweeps (benchmarks/results/attention_decode.jsonl, rows with
    num_splits; 8 KV heads, 8k-32k keys, two stages) at batch 8, 8 splits (512 programs) read
    at 0.90-0.98 of the copy bandwidth, 5 at 0.85-0.93, 12 (1.45 waves) at 0.76-0.81; paged,
    8 splits 0.89-0.97 and 17 0.86-0.93; at batch 16 paged, 4 splits 0.95-1.01 and 9
    0.87-0.89; at batch 32, 2 splits 1.01-1.08 (paged 0.93-1.00) and 1 0.88-0.95 (0.91-0.96).
    """
    work = batch * heads_kv
    want = max(1, per_sm * num_sms // work)
    most = max(1, -(-capacity // block_n) // 4)
    return max(1, min(want, most, 64))


def cuda_num_splits(batch: int, heads_kv: int, capacity: int, num_sms: int) -> int:
    """Splits per sequence for the CUDA kernel, from static sizes only: two CTAs fit an SM
    (106 KiB of shared memory each at head dim 128), so about one wave of 2 * num_sms CTAs
    (batch * Hkv * splits), each split at least two 64-key tiles of the capacity, at most 128;
    one split when batch * Hkv already fills the SMs."""
    work = batch * heads_kv
    if work >= num_sms:
        return 1
    return max(1, min(2 * num_sms // work, -(-capacity // 64) // 2, 128))


def _requested(backend: str | None) -> str:
    request = backend if backend is not None else os.environ.get("FUSEDOPS_BACKEND", "auto")
    return request.lower() if isinstance(request, str) else request


def select_backend(q: Tensor, heads_kv: int, backend: str | None, causal: bool) -> str:
    """The backend for these inputs. Dispatch sees the head dim only; the CUDA kernels also
    need (Hq / Hkv) * Sq <= CUDA_MAX_ROWS query rows per KV head, so for a larger group the
    automatic choice moves on to Triton (from static shapes: torch.compile can fold it) while
    an explicit CUDA request gets an error naming the limit."""
    name = dispatch.select(OP, q, q.shape[-1], backend, causal=causal)
    rows = q.shape[2] // max(heads_kv, 1) * q.shape[1]
    if name in _backends.CUDA_NAMES and rows > _backends.CUDA_MAX_ROWS:
        if _requested(backend) == "auto":
            return dispatch.select(OP, q, q.shape[-1], "triton", causal=causal)
        raise ValueError(f"the CUDA decode kernel ({name}) takes (Hq / Hkv) * Sq <= "
                         f"{_backends.CUDA_MAX_ROWS} query rows per KV head, got {rows} "
                         f"(Hq {q.shape[2]}, Hkv {heads_kv}, Sq {q.shape[1]}); use "
                         "backend='triton'")
    return name


def _run(q, k_cache, v_cache, seqlens_k, page_table, scale, causal, left, right, softcap,
         num_splits, backend):
    if backend in _backends.CUDA_NAMES:
        if num_splits is None:
            cap = reference.capacity(k_cache, page_table)
            num_splits = cuda_num_splits(q.shape[0], k_cache.shape[2], cap, sm_count(q.device))
        return torch.ops.fusedops.attention_decode_cuda(
            q, k_cache, v_cache, seqlens_k, page_table, scale, causal, left, right, softcap,
            num_splits, dispatch.cuda_arch(OP, backend))
    if backend == "torch":
        return reference.decode_fwd(q, k_cache, v_cache, seqlens_k, page_table, scale, causal,
                                    left, right, softcap)
    if backend == "triton":
        from fusedops.attention import kvcache_triton
        return kvcache_triton.decode_fwd(q, k_cache, v_cache, seqlens_k, page_table, scale,
                                         causal, left, right, softcap, num_splits)
    raise ValueError(f"unknown {OP} backend {backend!r}")


def attention_with_kvcache(q: Tensor, k_cache: Tensor, v_cache: Tensor,
                           cache_seqlens: Tensor | int, *, k_new: Tensor | None = None,
                           v_new: Tensor | None = None, page_table: Tensor | None = None,
                           causal: bool = True, window_size: tuple[int, int] = (-1, -1),
                           softcap: float | None = None, softmax_scale: float | None = None,
                           return_lse: bool = False, num_splits: int | None = None,
                           check: bool | None = None, backend: str | None = None):
    """Attention of a few new queries over a KV cache (decode and speculative steps).

    q (B, Sq, Hq, D); k_cache and v_cache either contiguous (B, S_max, Hkv, D) or paged
    (num_pages, page_size, Hkv, D) with an int32 page_table (B, max_pages) (row b lists the pages
    of sequence b in order); cache_seqlens int32 (B,) (or an int for all) the keys each sequence
    holds. k_new and v_new (B, S_new, Hkv, D), when given, are first written into the cache in
    place at positions cache_seqlens .. cache_seqlens + S_new - 1; the sequence then has
    cache_seqlens + S_new keys (cache_seqlens itself is not changed). Hq a multiple of Hkv.

    Semantics of FlashAttention's flash_attn_with_kvcache: causal is aligned bottom-right, query
    i of Sq at position L - Sq + i where L is the sequence's key count after the append (query i
    sees keys j <= L - Sq + i); window_size=(left, right) limits it to keys in
    [L - Sq + i - left, L - Sq + i + right] (-1 = unlimited); softcap applies
    softcap * tanh(s / softcap); softmax_scale defaults to 1 / sqrt(D). A query that sees no
    key returns zeros and lse -inf. Returns out (B, Sq, Hq, D) and, with return_lse, lse
    (B, Hq, Sq) float32 (float64 for float64 inputs; natural log).

    num_splits: how many parts each sequence's keys are split into (flash-decoding), None for a
    heuristic of B * Hkv against the GPU's SMs and the cache capacity (no host synchronisation:
    the lengths stay on the device). check: validate cache_seqlens and page_table values
    (lengths in [0, capacity - S_new], used pages in [0, num_pages)), which synchronises with
    the host; None checks CPU tensors in eager mode (no cost) and not CUDA ones (nor anything
    under torch.compile), whose kernels clamp indices
    into range instead (no memory fault; wrong values give undefined results). Inference only: a
    RuntimeError if a gradient could be asked for (an input requires grad under grad mode).
    """
    check_bool("causal", causal)
    check_bool("return_lse", return_lse)
    if check is not None:
        check_bool("check", check)
    _check_args(q, k_cache, v_cache, cache_seqlens, k_new, v_new, page_table, window_size,
                softcap, softmax_scale, num_splits)
    inputs = (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("k_new", k_new),
              ("v_new", v_new))
    if torch.is_grad_enabled():
        grads = [n for n, t in inputs if t is not None and t.requires_grad]
        if grads:
            raise RuntimeError(INFERENCE_ONLY.format(names=", ".join(grads)))
    batch, sq, hq, head_dim = q.shape
    n_new = 0 if k_new is None else k_new.shape[1]
    name = select_backend(q, k_cache.shape[2], backend, causal)
    if name != "torch" and batch > MAX_GRID_BATCH:
        raise ValueError(f"q has {batch} sequences; the {name} kernels take at most "
                         f"{MAX_GRID_BATCH} a call (one grid row each): split the batch")
    lens_int = None
    if is_int(cache_seqlens):
        lens_int = check_int("cache_seqlens", cache_seqlens)
    cap = reference.capacity(k_cache, page_table)
    if cap > MAX_CAPACITY:
        raise ValueError(f"the cache holds {cap} keys per sequence (page_table's max_pages x "
                         f"page_size, or S_max); at most {MAX_CAPACITY} are supported")
    if n_new > cap:
        raise ValueError(f"S_new = {n_new} keys cannot fit a cache of {cap} keys per sequence")
    if isinstance(lens_int, int) and not 0 <= lens_int <= cap - n_new:
        # A Python int is checked whatever `check` says: it costs no synchronisation.
        raise ValueError(f"cache_seqlens = {lens_int} with S_new = {n_new} must lie in [0, "
                         f"{cap - n_new}] (the cache holds {cap} keys per sequence)")
    if lens_int is not None:  # made after the range check: int32 cannot hold every int
        cache_seqlens = torch.full((batch,), lens_int, dtype=torch.int32, device=q.device)
    if check or (check is None and q.device.type == "cpu"
                 and not torch.compiler.is_compiling()):
        check_values(cache_seqlens, page_table, n_new, cap, k_cache.shape[0], k_cache.shape[1])
    if k_new is not None:
        # (empty tensors all have data_ptr 0: nothing to overwrite there)
        same = (k_cache is v_cache if torch.compiler.is_compiling()
                else k_cache.numel() > 0 and k_cache.data_ptr() == v_cache.data_ptr())
        if same:
            raise ValueError("k_cache and v_cache are one tensor: appending k_new and v_new "
                             "would overwrite each other")
        append_kv(k_cache, v_cache, k_new, v_new, cache_seqlens, page_table)
    # The kernels index the lengths and the page table's rows as contiguous (small copies if not)
    cache_seqlens = cache_seqlens.contiguous()
    if page_table is not None and page_table.stride(-1) != 1:
        page_table = page_table.contiguous()
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
    seqlens_k = cache_seqlens + n_new if n_new else cache_seqlens
    if q.numel() == 0:  # no sequence, query or query head
        out = q.new_zeros(q.shape)
        lse = q.new_full((batch, hq, sq), float("-inf"), dtype=reference.compute_dtype(q.dtype))
    else:
        q = q if q.stride(-1) == 1 else q.contiguous()
        # A window side of capacity + Sq keys or more sees every key: unlimited (-1), which
        # keeps the kernels' index arithmetic within int32.
        cap = page_table.shape[1] * k_cache.shape[1] if page_table is not None else k_cache.shape[1]
        left, right = (-1 if int(w) >= cap + sq else int(w) for w in window_size)
        out, lse = _run(q, k_cache, v_cache, seqlens_k, page_table, scale, causal, left, right,
                        float(softcap or 0.0), num_splits, name)
    return (out, lse) if return_lse else out
