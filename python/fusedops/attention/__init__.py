"""Exact tiled attention (FlashAttention-style online softmax), forward and backward."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from fusedops import dispatch
from fusedops._checks import check_attention_options, check_bool, is_int
from fusedops.attention import backends as _backends  # noqa: F401  (declares the backends)

__all__ = ["attention", "Attention", "attention_with_kvcache"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_MAX_TOKENS = 2**31 - 1


def _check(q, k, v, varlen, cu_q, cu_k, max_q, max_k):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a Tensor, got {type(t).__name__}")
        if t.dtype not in _DTYPES:
            raise TypeError(f"{name} must be float16, bfloat16, float32 or float64, got "
                            f"{t.dtype}")
        if t.dtype != q.dtype:
            raise TypeError(f"{name} dtype {t.dtype} differs from q dtype {q.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
    want = 3 if varlen else 4
    layout = "(total, H, D) with cu_seqlens" if varlen else "(B, S, H, D)"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != want:
            raise ValueError(f"{name} must be {layout}, got shape {tuple(t.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have one shape, got {tuple(k.shape)} and "
                         f"{tuple(v.shape)}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"head dims differ: q has {q.shape[-1]}, k and v have {k.shape[-1]}")
    if not 1 <= q.shape[-1] <= 256:
        raise ValueError(f"head dim must be in [1, 256], got {q.shape[-1]}")
    hq, hkv = q.shape[-2], k.shape[-2]
    if hq == 0 or hkv == 0 or hq % hkv != 0:  # (no head: the backward cannot split 0 groups)
        raise ValueError(f"the number of q heads ({hq}) must be a positive multiple of the "
                         f"number of k/v heads ({hkv})")
    if not varlen and q.shape[0] != k.shape[0]:
        raise ValueError(f"q has batch {q.shape[0]}, k and v have batch {k.shape[0]}")
    if varlen:
        for name, cu in (("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k)):
            if not isinstance(cu, Tensor):
                raise TypeError(f"{name} must be an int32 Tensor, got {type(cu).__name__}")
            if cu.dtype != torch.int32 or cu.dim() != 1 or cu.shape[0] < 1:
                raise ValueError(f"{name} must be a 1-D int32 tensor of length batch + 1, got "
                                 f"{cu.dtype} of shape {tuple(cu.shape)}")
            if cu.device != q.device:
                raise ValueError(f"{name} is on {cu.device} but q is on {q.device}")
            if not cu.is_contiguous():
                raise ValueError(f"{name} must be contiguous")
        if cu_q.shape != cu_k.shape:
            raise ValueError(f"cu_seqlens_q and cu_seqlens_k must have one length (batch + 1), "
                             f"got {cu_q.shape[0]} and {cu_k.shape[0]}")
        for name, m in (("max_seqlen_q", max_q), ("max_seqlen_k", max_k)):
            if not is_int(m):
                raise TypeError(f"{name} must be an int with cu_seqlens, got "
                                f"{type(m).__name__} {m!r}")
            if m < 0:
                raise ValueError(f"{name} must be >= 0, got {m}")
    elif cu_q is not None or cu_k is not None:
        raise ValueError("pass both cu_seqlens_q and cu_seqlens_k (packed q, k, v) or neither")
    else:
        if max_q is not None or max_k is not None:
            raise ValueError("max_seqlen_q and max_seqlen_k go with cu_seqlens_q/cu_seqlens_k "
                             "(packed q, k, v); dense (B, S, H, D) inputs take their lengths "
                             "from the shapes")
        # dense inputs get int32 cu_seqlens (arange(B + 1) * S)
        for name, t in (("q", q), ("k", k)):
            tokens = t.shape[0] * t.shape[1]
            if tokens > _MAX_TOKENS:
                raise ValueError(f"{name} holds B * S = {t.shape[0]} * {t.shape[1]} = {tokens} "
                                 f"tokens; at most 2^31 - 1 are supported (int32 offsets)")


_AUTOCAST_CAST = (torch.float32, torch.float16, torch.bfloat16)  # autocast leaves float64 alone


def _autocast_dtype(t: Tensor) -> torch.dtype | None:
    """The dtype torch.autocast gives t's device now, or None when autocast is off there."""
    device = t.device.type
    if device == "meta" or not torch.is_autocast_enabled(device):
        return None
    return torch.get_autocast_dtype(device)


def _check_options(causal, return_lse, window_size, softcap, softmax_scale):
    """The checks of attention's plain options; Attention runs them at construction."""
    check_bool("causal", causal)
    check_bool("return_lse", return_lse)
    check_attention_options(window_size, softcap, softmax_scale)


_CU_SEQLENS: dict = {}


def _dense_cu_seqlens(batch: int, sq: int, sk: int, device: torch.device):
    """cu_seqlens of a dense batch (arange(B + 1) * S), kept per shape in eager mode: three small
    kernel launches fewer per call. Not kept under torch.compile or CUDA graph capture; made
    outside inference mode, so that autograd may save them."""
    keep = not (torch.compiler.is_compiling()
                or (device.type == "cuda" and torch.cuda.is_current_stream_capturing()))
    key = (device, batch, sq, sk)
    cu = _CU_SEQLENS.get(key) if keep else None
    if cu is None:
        with torch.inference_mode(False):
            steps = torch.arange(batch + 1, device=device, dtype=torch.int32)
            cu = steps * sq, steps * sk
        if keep:
            if len(_CU_SEQLENS) >= 64:
                _CU_SEQLENS.clear()
            _CU_SEQLENS[key] = cu
    return cu


def attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False,
              softmax_scale: float | None = None, window_size: tuple[int, int] = (-1, -1),
              softcap: float | None = None, cu_seqlens_q: Tensor | None = None,
              cu_seqlens_k: Tensor | None = None, max_seqlen_q: int | None = None,
              max_seqlen_k: int | None = None, return_lse: bool = False,
              backend: str | None = None):
    """Exact attention softmax(scale * q k^T (+ masks, softcap)) v without the score matrix.

    Dense: q (B, Sq, Hq, D), k and v (B, Sk, Hkv, D), Hq a multiple of Hkv (MHA, GQA, MQA);
    returns out (B, Sq, Hq, D) and, with return_lse, lse (B, Hq, Sq) float32 (float64 for
    float64 inputs).
    Packed variable-length: q (total_q, Hq, D), k and v (total_k, Hkv, D), int32 cu_seqlens_q and
    cu_seqlens_k (batch + 1) and the maximum lengths; lse (Hq, total_q).
    causal is aligned to the bottom-right corner (query i sees key j <= i + Sk - Sq);
    window_size=(left, right) limits query i to keys in [i + Sk - Sq - left, i + Sk - Sq + right]
    (-1 = unlimited); softcap applies softcap * tanh(s / softcap) to the scaled scores;
    softmax_scale defaults to 1 / sqrt(D). A query that sees no key returns zeros and lse -inf,
    with zero gradients. lse is not differentiable. dQ: by default the faster mode of each
    backend, fp32 atomics (not bit-reproducible) for CUDA, a separate pass (bit-identical run to
    run) for Triton (and after cuda-sm90 at head dim 256, whose backward is Triton's).
    FUSEDOPS_ATTN_DQ=separate or =atomic chooses, and
    torch.use_deterministic_algorithms(True) always gives the deterministic mode ("separate":
    cuda-sm90's backward at head dim 64/128 adds the same fp32 partials in a fixed order instead
    of running a separate pass).

    Under torch.autocast (for q's device) float32, float16 and bfloat16 q, k and v are first
    cast to the autocast dtype, as scaled_dot_product_attention's are (float64 stays), so
    float32 queries and keys (rotary embeddings in float32) with a bfloat16 value are
    accepted; the kernels then run with autocast off and the output is in the autocast dtype.
    """
    dtype = _autocast_dtype(q) if isinstance(q, Tensor) else None
    if dtype is not None:
        q, k, v = (t.to(dtype) if isinstance(t, Tensor) and t.dtype in _AUTOCAST_CAST else t
                   for t in (q, k, v))
        with torch.autocast(q.device.type, enabled=False):
            return attention(q, k, v, causal=causal, softmax_scale=softmax_scale,
                             window_size=window_size, softcap=softcap,
                             cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                             max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                             return_lse=return_lse, backend=backend)
    _check_options(causal, return_lse, window_size, softcap, softmax_scale)
    varlen = cu_seqlens_q is not None or cu_seqlens_k is not None
    _check(q, k, v, varlen, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    head_dim = q.shape[-1]
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
    if varlen:
        q3, k3, v3 = q, k, v
        cu_q, cu_k = cu_seqlens_q, cu_seqlens_k
        # no sequence is longer than its packed tensor: a larger maximum is clamped, so that
        # it sizes no launch grid and hides no window bound below
        max_q, max_k = min(int(max_seqlen_q), q.shape[0]), min(int(max_seqlen_k), k.shape[0])
    else:
        batch, sq, hq, _ = q.shape
        sk = k.shape[1]
        q3 = q.reshape(batch * sq, hq, head_dim)
        k3 = k.reshape(batch * sk, k.shape[2], head_dim)
        v3 = v.reshape(batch * sk, v.shape[2], head_dim)
        cu_q, cu_k = _dense_cu_seqlens(batch, sq, sk, q.device)
        max_q, max_k = sq, sk
    q3, k3, v3 = (t if t.is_contiguous() else t.contiguous() for t in (q3, k3, v3))
    name = dispatch.select("attention", q, head_dim, backend, causal=bool(causal))
    # A window side of Sq + Sk keys or more sees every key: unlimited (-1), so that any int the
    # user passes fits the ops' int64 arguments and the kernels' int32 index arithmetic.
    left, right = (-1 if int(w) >= max_q + max_k else int(w) for w in window_size)
    out, lse = _ops.forward(q3, k3, v3, cu_q, cu_k, int(max_q), int(max_k), scale, bool(causal),
                            left, right, float(softcap or 0.0), varlen, name)
    if varlen:
        return (out, lse) if return_lse else out
    out = out.view(q.shape)
    if not return_lse:
        return out
    return out, lse.view(q.shape[2], q.shape[0], q.shape[1]).permute(1, 0, 2)


class Attention(nn.Module):
    """Module form of :func:`attention`: options at construction, forward(q, k, v, **varlen)."""

    def __init__(self, *, causal: bool = False, softmax_scale: float | None = None,
                 window_size: tuple[int, int] = (-1, -1), softcap: float | None = None,
                 return_lse: bool = False, backend: str | None = None):
        super().__init__()
        # Bad options raise here, with attention()'s messages, not at the first forward.
        _check_options(causal, return_lse, window_size, softcap, softmax_scale)
        if backend is not None:
            dispatch.check_backend(backend)
        self.options = dict(causal=causal, softmax_scale=softmax_scale, window_size=window_size,
                            softcap=softcap, return_lse=return_lse, backend=backend)

    def forward(self, q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                max_seqlen_k=None):
        return attention(q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                         max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, **self.options)

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self.options.items())


from fusedops.attention import ops as _ops  # noqa: E402,F401  (registers torch.ops.fusedops.*)
from fusedops.attention.kvcache import attention_with_kvcache  # noqa: E402,F401
