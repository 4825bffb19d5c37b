"""`attn_implementation="fusedops"`: transformers' attention interface on fusedops.attention.

transformers calls an attention function with q, k, v in its (B, H, S, D) layout and a mask made
by the mask function registered for the same name. fusedops registers a mask function of the
flash-attention kind: it returns None (no padding) or the 2-D padding mask (B, Sk), never a 4-D
mask, and the attention function turns each batch into one fusedops call:

* no padding: one dense call, (B, S, H, D), causal aligned bottom-right (what a KV cache needs:
  the Sq new queries are the last Sq positions of the Sk keys);
* padding (a 2-D mask with zeros, left or right, also while generating with a cache): the
  valid tokens are packed into a variable-length batch (cu_seqlens from the mask; the queries are
  the valid ones among the last Sq positions), run, and scattered back, zeros at padded query
  positions;
* packed sequences (no mask, position_ids that restart, e.g. from DataCollatorWithFlattening):
  each run of consecutive positions is one sequence, cu_seqlens from position_ids; or the
  cu_seq_lens_q / cu_seq_lens_k / max_length_q / max_length_k keyword arguments, when given.

* a decode step (at most DECODE_MAX_Q new queries after cached keys, no gradient needed, no
  padding): :func:`fusedops.attention.attention_with_kvcache` on transformers' cache tensors as
  they are (already appended to by the cache's update; nothing is appended again), the split-KV
  decode kernels, cache_seqlens = the number of keys (a static cache's filled slots).

Sliding windows follow transformers' masks: a causal query sees itself and the
`sliding_window - 1` keys before it; softcap (Gemma-2's attn_logit_softcapping) and the module's
`scaling` go to fusedops as they are, grouped-query heads need no repeat.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch import Tensor

from fusedops.attention import attention, attention_with_kvcache

__all__ = ["fusedops_attention_forward", "fusedops_attention_mask", "register", "NAME"]

NAME = "fusedops"
#: Steps with at most this many new queries over cached keys take the decode kernels.
DECODE_MAX_Q = 16


def fusedops_attention_mask(batch_size: int, q_length: int | None = None,
                            kv_length: int | None = None, q_offset: int = 0,
                            kv_offset: int = 0, mask_function=None,
                            attention_mask: Tensor | None = None, **kwargs):
    """The mask that transformers passes to :func:`fusedops_attention_forward`.

    None when no key is padding, else the 2-D padding mask of the keys, (batch, kv_length), True
    at real tokens. Causality, sliding windows and packed sequences are not part of it: the
    attention function applies them itself (as with transformers' flash-attention path).
    transformers 4.x passes ``cache_position`` (the new tokens' positions) instead of q_length
    and q_offset.
    """
    if q_length is None:
        cache_position = kwargs.get("cache_position")
        if cache_position is None or kv_length is None:
            raise TypeError("fusedops_attention_mask needs q_length and kv_length (transformers "
                            "5) or cache_position and kv_length (transformers 4)")
        q_length = cache_position.shape[0]
        q_offset = cache_position[:1]  # read below only when there is no padding mask
        kwargs.setdefault("device", cache_position.device)
    if attention_mask is None:
        # No padding, but a static cache longer than what it holds: the first q_offset +
        # q_length slots are keys, the rest are empty and must not be attended to.
        if isinstance(q_offset, Tensor):  # (transformers 5 may pass a 0-d tensor too)
            q_offset = int(q_offset.reshape(-1)[0]) if q_offset.numel() else 0
        used = int(q_offset) + int(q_length)
        if kv_length <= used:
            return None
        return torch.ones(batch_size, used, dtype=torch.bool, device=kwargs.get("device", "cpu"))
    # The last kv_length positions are the keys (sliding-window caches keep fewer than all).
    attention_mask = attention_mask[:, -kv_length:]
    # A shorter mask (a static cache longer than what was seen) must stay: it says how many
    # cache slots hold keys.
    if attention_mask.shape[1] == kv_length and bool(attention_mask.all()):
        return None
    return attention_mask


class _Memo:
    """Unpadding indices per mask / position_ids tensor, shared by the layers of one forward.

    Every layer sees the same mask object; computing its cu_seqlens once saves a host
    synchronisation per layer. Entries hold weak references and the tensor's version, so a
    freed or modified tensor is never matched.
    """

    def __init__(self, size: int = 4):
        self.size = size
        self.entries: list = []

    def get(self, tensor: Tensor, key, compute):
        if torch.compiler.is_compiling():
            return compute()
        full_key = (key, tensor._version, torch.is_inference_mode_enabled())
        for ref, k, value in self.entries:
            if ref() is tensor and k == full_key:
                return value
        value = compute()
        self.entries = [e for e in self.entries if e[0]() is not None][-(self.size - 1):]
        self.entries.append((weakref.ref(tensor), full_key, value))
        return value


_MEMO = _Memo()


def _cu_seqlens(lengths: Tensor) -> Tensor:
    return F.pad(torch.cumsum(lengths, 0, dtype=torch.int32), (1, 0))


def _padding_meta(mask: Tensor, q_length: int):
    """(indices_q, cu_q, max_q, indices_k, cu_k, max_k) of a (B, Sk) padding mask."""
    mask = mask.bool()
    q_mask = mask[:, -q_length:]
    len_k = mask.sum(-1, dtype=torch.int32)
    len_q = q_mask.sum(-1, dtype=torch.int32)
    idx_k = mask.reshape(-1).nonzero().reshape(-1)
    idx_q = q_mask.reshape(-1).nonzero().reshape(-1)
    max_q, max_k = torch.stack([len_q.max(), len_k.max()]).tolist()
    return idx_q, _cu_seqlens(len_q), int(max_q), idx_k, _cu_seqlens(len_k), int(max_k)


def _packed_meta(position_ids: Tensor, batch: int):
    """cu_seqlens of packed sequences in position_ids (B or 1, S), or None when none restarts.

    A sequence starts at each row's first token and wherever a position is not the previous one
    plus one, as in the masks transformers builds for packed sequences.
    """
    if position_ids.shape[0] != batch:
        position_ids = position_ids.expand(batch, -1)
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids.diff(dim=-1) != 1
    starts = starts.reshape(-1)
    begin = starts.nonzero().reshape(-1)
    if begin.numel() == batch:
        return None
    total = torch.tensor([starts.numel()], dtype=begin.dtype, device=begin.device)
    cu = torch.cat([begin, total]).to(torch.int32)
    return cu, int(cu.diff().max())


def _check_mask(attention_mask) -> None:
    if not isinstance(attention_mask, Tensor) or attention_mask.dim() != 2:
        shape = tuple(attention_mask.shape) if hasattr(attention_mask, "shape") else None
        raise ValueError(
            f'attn_implementation="{NAME}" takes no mask or a 2-D padding mask (batch, keys) of '
            f"0/1; got {type(attention_mask).__name__} of shape {shape}. A 4-D or arbitrary "
            "mask cannot be expressed by causal/sliding-window attention over packed sequences; "
            'use attn_implementation="sdpa" or "eager" for it.')
    if attention_mask.is_floating_point() or attention_mask.is_complex():
        raise ValueError(
            f'attn_implementation="{NAME}" takes a bool or integer 2-D padding mask (1 = token, '
            f"0 = padding), got dtype {attention_mask.dtype}")


def fusedops_attention_forward(module: torch.nn.Module, query: Tensor, key: Tensor,
                               value: Tensor, attention_mask: Tensor | None,
                               dropout: float = 0.0, scaling: float | None = None,
                               sliding_window: int | None = None, softcap: float | None = None,
                               is_causal: bool | None = None, **kwargs):
    """transformers attention function: q (B, Hq, Sq, D), k and v (B, Hkv, Sk, D).

    Returns (attn_output (B, Sq, Hq, D), None); attention weights are never formed. causal comes
    from `is_causal` when given, else `module.is_causal`. Raises NotImplementedError for
    dropout > 0 in training and for attention sinks (`s_aux`), ValueError for a mask other than
    None or a 2-D padding mask.
    """
    if dropout and dropout > 0 and getattr(module, "training", False):
        raise NotImplementedError(
            f'attn_implementation="{NAME}" has no attention dropout (got dropout={dropout} in '
            "training): set the config's attention_dropout to 0.0")
    if kwargs.get("s_aux") is not None:
        raise NotImplementedError(f'attn_implementation="{NAME}" has no attention sinks (s_aux)')
    if value.shape[-1] != query.shape[-1]:
        raise ValueError(f'attn_implementation="{NAME}" needs one head dim for q, k and v, got '
                         f"{query.shape[-1]} and {value.shape[-1]}")
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    if sliding_window is None or sliding_window <= 0:
        window = (-1, -1)
    elif causal:
        window = (int(sliding_window) - 1, 0)
    else:  # transformers' bidirectional window: |i - j| <= sliding_window
        window = (int(sliding_window), int(sliding_window))
    opts = dict(causal=causal, softmax_scale=scaling, window_size=window, softcap=softcap)

    q = query.transpose(1, 2)
    k = key.transpose(1, 2)
    v = value.transpose(1, 2)
    batch, q_len, q_heads, head_dim = q.shape
    decode = (q_len <= DECODE_MAX_Q and q_len < k.shape[1]
              and not any(kwargs.get(n) is not None for n in ("cu_seq_lens_q", "cu_seq_lens_k"))
              and not (torch.is_grad_enabled()
                       and (query.requires_grad or key.requires_grad or value.requires_grad)))

    if attention_mask is not None:
        _check_mask(attention_mask)
        mask_len = attention_mask.shape[1]
        if (decode and q_len < mask_len <= k.shape[1]
                and _MEMO.get(attention_mask, ("full",), lambda: bool(attention_mask.all()))):
            # No padding, a static cache whose first mask_len slots hold keys.
            return _decode(q, k, v, mask_len, opts), None
        if k.shape[1] > mask_len:  # a static cache: only the first mask_len slots hold keys
            k, v = k[:, :mask_len], v[:, :mask_len]
        k_len = k.shape[1]
        if attention_mask.shape != (batch, k_len) or q_len > k_len:
            raise ValueError(
                f"the padding mask has shape {tuple(attention_mask.shape)}, expected "
                f"({batch}, {k_len}) for {q_len} queries over {k_len} keys")
        idx_q, cu_q, max_q, idx_k, cu_k, max_k = _MEMO.get(
            attention_mask, ("pad", q_len), lambda: _padding_meta(attention_mask, q_len))
        q3 = q.reshape(batch * q_len, q_heads, head_dim).index_select(0, idx_q)
        k3 = k.reshape(batch * k_len, k.shape[2], head_dim).index_select(0, idx_k)
        v3 = v.reshape(batch * k_len, v.shape[2], head_dim).index_select(0, idx_k)
        out = attention(q3, k3, v3, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q,
                        max_seqlen_k=max_k, **opts)
        full = out.new_zeros(batch * q_len, q_heads, head_dim).index_copy(0, idx_q, out)
        return full.view(batch, q_len, q_heads, head_dim), None

    cu_kw = [kwargs.get(n) for n in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q",
                                     "max_length_k")]
    packed = None
    if all(x is not None for x in cu_kw):
        cu_q, cu_k, max_q, max_k = cu_kw
        packed = (cu_q.to(torch.int32).contiguous(), cu_k.to(torch.int32).contiguous(),
                  int(max_q), int(max_k))
    else:
        position_ids = kwargs.get("position_ids")
        if (isinstance(position_ids, Tensor) and position_ids.dim() == 2
                and position_ids.shape[-1] == q_len == k.shape[1]
                and position_ids.shape[0] in (1, batch)):
            meta = _MEMO.get(position_ids, ("pos", batch),
                             lambda: _packed_meta(position_ids, batch))
            if meta is not None:
                packed = (meta[0], meta[0], meta[1], meta[1])
    if packed is not None:
        cu_q, cu_k, max_q, max_k = packed
        out = attention(q.reshape(-1, q_heads, head_dim),
                        k.reshape(-1, k.shape[2], head_dim),
                        v.reshape(-1, v.shape[2], head_dim),
                        cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q,
                        max_seqlen_k=max_k, **opts)
        return out.view(batch, q_len, q_heads, head_dim), None

    if decode:
        return _decode(q, k, v, k.shape[1], opts), None
    return attention(q, k, v, **opts), None


def _decode(q: Tensor, k: Tensor, v: Tensor, n_keys: int, opts: dict) -> Tensor:
    """A decode step on the cache tensors (B, S_cache, Hkv, D), the first n_keys of each
    sequence being keys (the last q_len of them the new tokens' own)."""
    if k.stride(-1) != 1 or v.stride(-1) != 1:  # read only (nothing is appended): a copy is fine
        k, v = k.contiguous(), v.contiguous()
    lens = torch.full((q.shape[0],), n_keys, dtype=torch.int32, device=q.device)
    return attention_with_kvcache(q, k, v, lens, check=False, **opts)


def register() -> None:
    """Registers "fusedops" with transformers' AttentionInterface and AttentionMaskInterface."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, fusedops_attention_forward)
    AttentionMaskInterface.register(NAME, fusedops_attention_mask)
