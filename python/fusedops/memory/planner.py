"""plan: the peak memory of one training step of a Llama-style decoder, estimated from its config.

The estimate models what PyTorch eager autograd keeps for transformers' Llama decoder layer
(Mistral and Qwen2 have the same one), in the categories of MemoryReport. Not modelled: Qwen3's
q/k norms, Gemma2's four norms per layer and soft-capping, sliding-window masks (which keep
SDPA off its flash kernel). Sizes per token (N = batch * seq tokens; e = bytes per element of
`dtype`; h hidden, I intermediate, L layers, nq / nkv query / key-value heads of head dim d, V
vocabulary):

Activations saved for the backward pass (checked against the CPU tracker, tests/memory):

* each RMSNorm (2 per layer and the final one) saves its float32 input (4h: the upcast copy,
  or, in float32, the input itself), the normalised value before the weight (e*h), the output
  (e*h, kept by the next linears) and 1/rms (4): ``4h + 2eh + 4``;
* q and k after the rotary embedding and v (kept by the attention): ``e*(nq + 2*nkv)*d``;
* the MLP: gate_proj's output (kept by SiLU), SiLU's output and up_proj's output (kept by the
  product), the product (kept by down_proj): ``4*e*I``; with fused_mlp (fusedops.swiglu) gate,
  up and the product: ``3*e*I``;
* once per model: the rotary cos and sin (``2*e*d`` per position) and, with activation
  checkpointing, the position ids (8 per position).

  Llama-3.2-1B (h 2048, I 8192, 32/8 heads of 64) in bf16: 108,680 bytes per token per layer.
  With activation checkpointing only each layer's input (``e*h``) is kept, and one layer's
  activations are recomputed at a time in the backward pass.

Attention scratch (what the attention function allocates, its output included):

* tiled (SDPA's flash / memory-efficient kernels, fusedops.attention): the output (``e*nq*d``)
  and the log-sum-exp (``4*nq``) per token, kept for the backward; in one layer's backward dq,
  dk, dv (dk and dv per query head first under GQA) and a float32 dq accumulator:
  ``e*(nq + 2*nkv)*d + 2*e*nq*d + 4*nq*d``. attention_impl="fusedops" on the CPU adds its torch
  backend's float32 blocks (six of nq x min(256, S) x S per sequence).
* eager (transformers' eager_attention_forward): per layer the float32 softmax (``4*nq*S`` per
  token, i.e. B*nq*S*S*4 bytes) and its copy in `dtype` (``e*nq*S``, not in float32), the copies
  the matmuls keep (q laid out for the batched matmul, k and v repeated for GQA or laid out, the
  output made contiguous: ``4*e*nq*d``; with batch 1 q, and without GQA k and v, need no copy
  and stay in activations); the q/k/v above are then not kept outside attention. Transient:
  the scores in `dtype` and their float32 upcast beside the softmax (forward), the softmax's
  gradient in `dtype` and in float32 (backward): ``(e + 4)*nq*S`` per token.

Logits/loss scratch:

* stock (lm_head then transformers' ForCausalLMLoss): in the forward the logits (``e*V``), their
  float32 upcast (``4V``, not in float32) and log-softmax's output (``4V``, kept); in the
  backward the kept log-softmax, its incoming gradient and its input gradient, all float32:
  ``12V`` per token, the peak of a stock step for large vocabularies.
* fused (fusedops.linear_ce, mean/sum path): the logits chunk that chunked.plan_chunks picks for
  the memory budget (default 512 MiB), d_hidden (``e*h``, kept until the backward) and small
  per-token arrays (64 bytes); the torch backend (CPU) adds float32 row temporaries. d_weight is
  computed in the forward and counted as a gradient from there.
* with tied embeddings the LM head's weight gradient (stock: from lm_head's backward; fused:
  d_weight) waits in autograd's input buffer for the embedding's until the end of the backward
  pass. Stock: counted where it was allocated, in logits/loss scratch, as the report does; fused:
  in gradients from the forward on (the report finds d_weight's block becoming the .grad).

Parameters, gradients, optimizer state (P = number of parameters):

* mixed_precision=False: parameters and gradients in `dtype`, AdamW's two moments in the
  parameters' dtype (what torch.optim.AdamW keeps for bf16 parameters): ``(2 + 2 + 4) * P`` bytes
  in bf16.
* mixed_precision=True (or "master"), the convention of Megatron / DeepSpeed style training:
  `dtype` parameters and gradients plus a float32 master copy of the parameters and two float32
  moments kept by the optimizer: ``2 + 2 + 12 = 16`` bytes per parameter in bf16. (AMP, float32
  parameters under autocast, has the same 16 bytes split 4 + 4 + 8; its activations are not
  modelled.)
* optimizer temporaries (other): foreach AdamW (the CUDA default) holds one state-sized
  sqrt(v) buffer; the single-tensor loop (CPU) two copies of the largest parameter.
* shard: "zero1" divides the optimizer state by world_size, "zero2" also the gradients,
  "zero3"/"fsdp" also the parameters and adds two layers of gathered parameters (the one in use
  and the prefetched one) to other.

The backward of one MLP holds the gradients of its gate, SiLU and up outputs and the incoming
d_hidden (``3*e*I + e*h`` per token) once down_proj's saved input is freed; with fused_mlp the
product's incoming gradient and d_hidden (``e*I + e*h``: swiglu writes d_gate and d_up over gate
and up; on the CPU its torch backend adds three float32 slices of min(tokens*I, 2^22) elements,
six for half-precision inputs).

The peak is the largest of these moments of a steady-state step (optimizer state allocated,
gradients freed before the forward): the loss's forward; the loss's backward; the last decoder
layer's MLP backward and attention backward (all activations still kept); the first layer's
backward (most gradients made); the embedding's backward; the optimizer step; with eager
attention also the last layer's attention forward. `MemoryPlan.candidates` holds them all.

Not modelled: the KV cache (set use_cache=False for training: a DynamicCache copies k and v of
every layer in the forward), dropout masks, padding masks, allocator fragmentation and cuBLAS
workspaces (tens of MiB), and communication buffers of sharded training.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field

from fusedops.memory.report import CATEGORIES, LABELS, Breakdown, format_bytes

_DTYPE_BYTES = {"float32": 4, "float": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2,
                "half": 2, "fp16": 2}
_SHARDS = ("none", "zero1", "zero2", "zero3", "fsdp")
_OPTIMIZERS = {"adamw": 2, "adam": 2, "sgd": 0, "sgd-momentum": 1}


def _get(config, name, default=None):
    if isinstance(config, dict):
        v = config.get(name, default)
    else:
        v = getattr(config, name, default)
    return default if v is None else v


def _size(config, name, default=None) -> int:
    """A positive integer entry of the config (a whole-valued float too), named when it is
    missing or bad."""
    v = _get(config, name, default)
    if v is None:
        raise ValueError(f"config has no {name}")
    if isinstance(v, bool) or not isinstance(v, numbers.Real) or v != int(v) or v < 1:
        raise ValueError(f"config's {name} must be a positive integer, got {v!r}")
    return int(v)


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    attention_bias: bool = False
    mlp_bias: bool = False

    @classmethod
    def from_config(cls, config) -> ModelShape:
        if isinstance(config, str) or config is None:
            raise TypeError(f"config must be a transformers config or a dict of its sizes, got "
                            f"{config!r} (a named shape: fusedops.memory.configs."
                            f"model_config(name))")
        h = _size(config, "hidden_size")
        nq = _size(config, "num_attention_heads")
        return cls(hidden=h, intermediate=_size(config, "intermediate_size"),
                   layers=_size(config, "num_hidden_layers"), heads=nq,
                   kv_heads=_size(config, "num_key_value_heads", nq),
                   head_dim=_size(config, "head_dim", h // nq),
                   vocab=_size(config, "vocab_size"),
                   tied=bool(_get(config, "tie_word_embeddings", False)),
                   attention_bias=bool(_get(config, "attention_bias", False)),
                   mlp_bias=bool(_get(config, "mlp_bias", False)))

    def layer_params(self) -> int:
        h, d, nq, nkv, i = self.hidden, self.head_dim, self.heads, self.kv_heads, self.intermediate
        attn = h * nq * d + 2 * h * nkv * d + nq * d * h
        if self.attention_bias:
            attn += nq * d + 2 * nkv * d + h
        mlp = 3 * h * i + (2 * i + h if self.mlp_bias else 0)
        return attn + mlp + 2 * h

    def head_params(self) -> int:
        return self.vocab * self.hidden

    def params(self) -> int:
        """Number of parameters (the embedding counted once when tied)."""
        n = self.vocab * self.hidden + self.layers * self.layer_params() + self.hidden
        return n if self.tied else n + self.head_params()

    def param_tensors(self) -> int:
        per_layer = 9 + (4 if self.attention_bias else 0) + (3 if self.mlp_bias else 0)
        return 2 + self.layers * per_layer + (0 if self.tied else 1)

    def largest_param(self) -> int:
        return max(self.vocab * self.hidden, self.hidden * self.intermediate)


@dataclass
class MemoryPlan(Breakdown):
    """Estimated peak memory of one training step (bytes), in MemoryReport's categories, at the
    moment `peak_phase`; `candidates` has the totals at each moment considered and `settings`
    the arguments of plan()."""

    label: str = "planner"
    settings: dict = field(default_factory=dict)
    candidates: dict = field(default_factory=dict)
    per_token_layer_bytes: int = 0

    def to_dict(self) -> dict:
        return dict(label=self.label, peak_bytes=int(self.peak_bytes),
                    peak_phase=self.peak_phase, categories=self.categories(),
                    candidates={k: int(v["total"]) for k, v in self.candidates.items()},
                    per_token_layer_bytes=self.per_token_layer_bytes,
                    settings=dict(self.settings))

    def table(self) -> str:
        s = self.settings
        lines = [f"planned peak of one training step ({self.label}): B={s.get('batch')} "
                 f"S={s.get('seq')} {s.get('dtype')}, fused_loss={s.get('fused_loss')}, "
                 f"tiled_attention={s.get('tiled_attention')}, fused_mlp={s.get('fused_mlp')}, "
                 f"checkpointing={s.get('activation_checkpointing')}, shard={s.get('shard')}"
                 f" x{s.get('world_size')}, mixed_precision={s.get('mixed_precision')}"]
        for k, v in self.categories().items():
            share = 100.0 * v / self.peak_bytes if self.peak_bytes else 0.0
            lines.append(f"  {LABELS[k]:20}{format_bytes(v):>12}{share:6.1f}%")
        lines.append(f"  {'total at peak':20}{format_bytes(self.peak_bytes):>12}  (during "
                     f"{self.peak_phase})")
        return "\n".join(lines)

    def loss_budget(self) -> float | None:
        """With the fused loss at the peak (phase "loss forward"): the largest memory budget
        (whole MiB) at which the loss's forward no longer sets the planned peak, i.e. the step
        peaks elsewhere; None when the loss is not the peak (or no budget moves it)."""
        s = dict(self.settings)
        if not s["fused_loss"] or self.peak_phase != "loss forward":
            return None
        from fusedops.linear_ce import chunked

        config = s.pop("config")
        hi = chunked.budget_bytes(s["memory_budget_mib"]) // chunked.MIB
        lo = 3  # the loss's fixed part (chunked.plan_chunks) is 2 MiB and the per-token arrays
        if hi <= lo or plan(config, **{**s, "memory_budget_mib": lo}).peak_phase == "loss forward":
            return None
        while hi - lo > 1:  # lo: not the peak; hi: the peak
            mid = (lo + hi) // 2
            if plan(config, **{**s, "memory_budget_mib": mid}).peak_phase == "loss forward":
                hi = mid
            else:
                lo = mid
        return float(lo)

    def best_switch(self) -> Switch | None:
        """The single change of setting (fused_loss, tiled_attention, activation_checkpointing,
        fused_mlp, shard="zero3" over world_size > 1, or a smaller memory_budget_mib of the fused
        loss when its chunk sets the peak, see loss_budget) that lowers the peak most, or None
        when none does."""
        s = dict(self.settings)
        config = s.pop("config")
        if s["attention_impl"] == "eager":
            s["attention_impl"] = None
        trials = []
        budget = self.loss_budget()
        if budget is not None:
            trials.append(("memory_budget_mib", budget))
        if not s["fused_loss"]:
            trials.append(("fused_loss", True))
        if not s["tiled_attention"]:
            trials.append(("tiled_attention", True))
        if not s["activation_checkpointing"]:
            trials.append(("activation_checkpointing", True))
        if not s.get("fused_mlp", False):
            trials.append(("fused_mlp", True))
        if s["world_size"] > 1 and s["shard"] not in ("zero3", "fsdp"):
            trials.append(("shard", "zero3"))
        best = None
        for name, value in trials:
            other = plan(config, **{**s, name: value})
            saving = self.peak_bytes - other.peak_bytes
            if saving > 0 and (best is None or saving > best.saving_bytes):
                best = Switch(name, value, self.peak_bytes, other.peak_bytes, saving, other)
        return best


@dataclass(frozen=True)
class Switch:
    """A change of one setting and what it gives: the new peak and the saving (bytes)."""

    name: str
    value: object
    peak_before: int
    peak_bytes: int
    saving_bytes: int
    plan: MemoryPlan

    def __str__(self) -> str:
        return (f"{self.name}={self.value!r} saves {format_bytes(self.saving_bytes)} "
                f"(peak {format_bytes(self.peak_before)} -> {format_bytes(self.peak_bytes)})")


def _fused_scratch(n_tokens, hidden, vocab, e, budget_mib, device) -> int:
    """Logits-chunk scratch of fusedops.linear_ce's mean/sum path, as chunked.py plans it."""
    from fusedops.linear_ce import chunked

    budget = chunked.budget_bytes(budget_mib)
    try:
        p = chunked.plan_chunks(n_tokens, hidden, vocab, e, budget, True)
    except ValueError:
        return budget
    scratch = p.rows * p.cols * e
    if not p.full_rows:
        scratch += p.rows * hidden * (4 + (e if e != 4 else 0))  # d_hidden accumulator, partial
    if device == "cpu":  # the torch row functions: float32 temporaries of <= 1M elements each
        rows = min(p.rows, max(1, (1 << 20) // max(p.cols, 1)))
        scratch += (2 if e == 4 else 3) * rows * p.cols * 4
    return scratch


def plan(config, *, batch: int, seq: int, dtype: str = "bfloat16",
         mixed_precision: bool | str = True, activation_checkpointing: bool = False,
         shard: str = "none", world_size: int = 1, fused_loss: bool = True,
         tiled_attention: bool = True, optimizer: str = "adamw", device: str = "cuda",
         attention_impl: str | None = None, memory_budget_mib: float | None = None,
         fused_mlp: bool = False, label: str = "planner") -> MemoryPlan:
    """Estimates the peak memory of one training step of a Llama-style decoder (see the module
    docstring for every formula and convention).

    config: a transformers config or a dict with hidden_size, intermediate_size,
    num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim, vocab_size,
    tie_word_embeddings. batch, seq: per device. dtype: parameters' and activations' dtype.
    mixed_precision: True/"master" (float32 master weights and moments, 16 bytes per parameter
    with bf16) or False (everything in dtype, as torch.optim.AdamW with bf16 parameters); moot
    for float32. device "cuda" or "cpu" (optimizer and fused-loss temporaries differ).
    attention_impl: "sdpa" (the default when tiled_attention), "eager" (the default otherwise) or
    "fusedops" (tiled; on the CPU its torch backend's backward holds float32 blocks of
    nq x 256 x S per sequence, which the estimate adds). "sdpa" is transformers 5's call: no
    mask for an unpadded batch, grouped-query heads not repeated (transformers 4.57 passes a
    mask and repeats K and V to every head, which this estimate does not count).
    fused_mlp: the MLP's silu(gate) * up by fusedops.swiglu with its in-place backward
    (apply_fusedops's default, mlp=True).
    """
    import torch

    from fusedops._checks import check_bool, check_budget_mib, check_int

    try:
        device = torch.device(device).type
    except (TypeError, RuntimeError) as exc:
        raise ValueError(f"device must be 'cuda' or 'cpu' (or a torch.device), got "
                         f"{device!r}") from exc
    if device not in ("cuda", "cpu"):
        raise ValueError(f"device must be 'cuda' or 'cpu' (or a torch.device), got {device!r}")
    for name, value in (("batch", batch), ("seq", seq), ("world_size", world_size)):
        if check_int(name, value) < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    for name, value in (("activation_checkpointing", activation_checkpointing),
                        ("fused_loss", fused_loss), ("tiled_attention", tiled_attention),
                        ("fused_mlp", fused_mlp)):
        check_bool(name, value)
    check_budget_mib("memory_budget_mib", memory_budget_mib)
    if attention_impl in ("sdpa", "fusedops") and not tiled_attention:
        raise ValueError(f"attention_impl={attention_impl!r} is tiled; tiled_attention=False "
                         "contradicts it (pass one of the two)")
    dtype = str(dtype).removeprefix("torch.")
    if dtype not in _DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPE_BYTES)}, got {dtype!r}")
    if shard not in _SHARDS:
        raise ValueError(f"shard must be one of {_SHARDS}, got {shard!r}")
    if optimizer not in _OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {sorted(_OPTIMIZERS)}, got {optimizer!r}")
    if mixed_precision not in (True, False, "master", "none"):
        raise ValueError(f"mixed_precision must be True, False, 'master' or 'none', got "
                         f"{mixed_precision!r}")
    if attention_impl is None:
        attention_impl = "sdpa" if tiled_attention else "eager"
    if attention_impl not in ("sdpa", "eager", "fusedops"):
        raise ValueError(f"attention_impl must be 'sdpa', 'eager' or 'fusedops', got "
                         f"{attention_impl!r}")
    tiled_attention = attention_impl != "eager"
    settings = dict(config=config, batch=batch, seq=seq, dtype=dtype,
                    mixed_precision=mixed_precision,
                    activation_checkpointing=activation_checkpointing, shard=shard,
                    world_size=world_size, fused_loss=fused_loss,
                    tiled_attention=tiled_attention, optimizer=optimizer, device=device,
                    attention_impl=attention_impl, memory_budget_mib=memory_budget_mib,
                    fused_mlp=fused_mlp)
    m = ModelShape.from_config(config)
    e = _DTYPE_BYTES[dtype]
    master = mixed_precision in (True, "master") and e != 4
    n = batch * seq
    h, i_, nq, nkv, d, v, L = (m.hidden, m.intermediate, m.heads, m.kv_heads, m.head_dim,
                               m.vocab, m.layers)

    # --- parameters, gradients, optimizer state -----------------------------------------------
    p_count = m.params()
    w = world_size
    p_div = w if shard in ("zero3", "fsdp") else 1
    g_div = w if shard in ("zero2", "zero3", "fsdp") else 1
    o_div = w if shard != "none" else 1
    n_moments = _OPTIMIZERS[optimizer]
    state_elem = 4 if master else e
    params = p_count * e // p_div
    grads_total = p_count * e // g_div
    opt_state = p_count * (n_moments * state_elem + (4 if master else 0)) // o_div
    if device == "cpu" and n_moments:  # AdamW's float32 step counters, on the CPU
        opt_state += 4 * m.param_tensors()
    head_grad = m.head_params() * e // g_div  # lm_head / tied embedding gradient
    gathered = 2 * m.layer_params() * e if shard in ("zero3", "fsdp") and w > 1 else 0
    if n_moments == 0:
        opt_tmp = 0
    elif device == "cuda":
        opt_tmp = p_count * state_elem // o_div  # foreach: sqrt(v) for every parameter
    else:
        opt_tmp = 2 * m.largest_param() * state_elem  # single-tensor: sqrt(v) and its quotient
    batch_bytes = 2 * 8 * n  # input_ids and labels, int64

    # --- activations -------------------------------------------------------------------------
    norm = 4 * h + 2 * e * h + 4
    qkv = e * (nq + 2 * nkv) * d
    mlp = (3 if fused_mlp else 4) * e * i_
    if tiled_attention:
        attn_saved = e * nq * d + 4 * nq
        qkv_outside = qkv
        attn_fwd_tmp = 0
        gqa_expand = 2 * e * nq * d if nkv < nq else 0  # dk, dv per query head, then summed
        attn_bwd_tmp = e * (nq + 2 * nkv) * d + gqa_expand + 4 * nq * d
        if attention_impl == "fusedops" and device == "cpu":  # float32 blocks, per sequence
            attn_bwd_tmp += 6 * nq * min(256, seq) * seq * 4 // n
    else:
        s_ = seq
        # matmul keeps copies of q, k, v (repeated for GQA, or laid out for the batched matmul;
        # with batch 1 q and, without GQA, k and v need no copy) and of the output
        copies = e * nq * d * (1 if batch == 1 else 2) + (2 * e * nq * d if nkv < nq or
                                                           batch > 1 else 0)
        attn_saved = 4 * nq * s_ + (e * nq * s_ if e != 4 else 0) + copies
        qkv_outside = qkv - (0 if batch == 1 else e * nq * d) - (
            0 if batch == 1 and nkv == nq else 2 * e * nkv * d)
        attn_fwd_tmp = (e + 4) * nq * s_  # scores in dtype and the float32 upcast beside softmax
        attn_bwd_tmp = (e + 4) * nq * s_  # the softmax's gradient in dtype and in float32
    per_layer = 2 * norm + qkv_outside + mlp  # activations of one layer, per token
    per_token_layer = per_layer + attn_saved
    rope = 2 * e * d * seq
    if activation_checkpointing:
        acts = L * e * h * n + norm * n + rope + 8 * seq
        attn_all = 0
        recomputed, recomputed_attn = per_layer * n, attn_saved * n
    else:
        acts = L * per_layer * n + norm * n + rope
        attn_all = L * attn_saved * n
        recomputed = recomputed_attn = 0
    # the MLP's backward: the gradients of gate, SiLU and up outputs and the incoming d_hidden,
    # once down_proj's saved input is freed (fused: the product's gradient and d_hidden)
    mlp_bwd_tmp = (1 if fused_mlp else 3) * e * i_ * n + e * h * n
    if fused_mlp and device == "cpu":  # the torch backend's float32 (float64) slices
        c = 8 if e == 8 else 4
        mlp_bwd_tmp += (3 if e == c else 6) * c * min(i_ * n, 1 << 22)
    mlp_grads = (3 * h * i_ + h) * e // g_div

    # --- logits / loss -------------------------------------------------------------------------
    # With tied embeddings the LM head's weight gradient waits in autograd's input buffer for the
    # embedding's until the end of the backward pass. Stock: counted where it is allocated
    # (loss). Fused: the report finds d_weight's block as the parameter's .grad from the forward
    # on (it becomes the .grad), so it is a gradient there.
    head_in_loss = head_grad if m.tied and not fused_loss else 0
    head_waits = head_grad if m.tied and fused_loss else 0  # counted in gradients
    head_as_grad = head_grad - head_in_loss
    if fused_loss:
        chunk = _fused_scratch(n, h, v, e, memory_budget_mib, device)
        kept = e * h * n + 64 * n  # d_hidden, per-token arrays (d_weight: gradients)
        loss_fwd = chunk + kept
        loss_bwd = kept
        grad_in_fwd = head_as_grad  # d_weight is computed in the forward
    else:
        loss_fwd = e * v * n + (4 * v * n if e != 4 else 0) + 4 * v * n + 16 * n
        loss_bwd = 12 * v * n + 16 * n
        grad_in_fwd = 0

    # --- the moments ---------------------------------------------------------------------------
    base = dict(parameters=params, optimizer_state=opt_state, other=batch_bytes + gathered)

    def moment(**cats):
        c = dict.fromkeys(CATEGORIES, 0)
        for k, val in {**base, **cats}.items():
            c[k] += int(val)
        c["total"] = sum(c[k] for k in CATEGORIES)
        return c

    acts_bwd = acts - norm * n + recomputed  # the final norm is done; one layer recomputed
    after_mlp = (mlp + norm) * n  # the layer's MLP and post-attention norm, freed
    cands = {
        "loss forward": moment(gradients=grad_in_fwd, activations=acts, attention=attn_all,
                               logits_loss=loss_fwd),
        "loss backward": moment(gradients=grad_in_fwd, activations=acts, attention=attn_all,
                                logits_loss=loss_bwd),
        "backward, last layer's MLP": moment(
            gradients=head_as_grad, logits_loss=head_in_loss, activations=acts_bwd - e * i_ * n,
            attention=attn_all + recomputed_attn, other=mlp_bwd_tmp),
        "backward, last layer's attention": moment(
            gradients=head_as_grad + mlp_grads, logits_loss=head_in_loss,
            activations=acts_bwd - after_mlp,
            attention=attn_all + recomputed_attn + attn_bwd_tmp * n),
        "backward, first layer": moment(
            gradients=grads_total - head_grad + head_waits, logits_loss=head_in_loss,
            activations=(per_layer - e * i_) * n + rope +
            (e * h * n if activation_checkpointing else 0),
            attention=attn_saved * n, other=mlp_bwd_tmp),
        "backward, embedding": moment(gradients=grads_total + head_waits,
                                      logits_loss=head_in_loss),
        "optimizer step": moment(gradients=grads_total, other=opt_tmp),
    }
    if attn_fwd_tmp:  # eager attention's forward transient in the last layer
        cands["attention forward"] = moment(activations=acts - norm * n - after_mlp,
                                            attention=attn_all + attn_fwd_tmp * n)
    phase = max(cands, key=lambda k: cands[k]["total"])
    peak = cands[phase]
    return MemoryPlan(**{k: peak[k] for k in CATEGORIES}, peak_bytes=peak["total"],
                      peak_phase=phase, label=label, settings=settings, candidates=cands,
                      per_token_layer_bytes=per_token_layer)


def replace_settings(p: MemoryPlan, **changes) -> MemoryPlan:
    """plan() again with some settings changed."""
    s = dict(p.settings)
    config = s.pop("config")
    if "tiled_attention" in changes and "attention_impl" not in changes:
        s["attention_impl"] = None  # the default of the new tiled_attention
    s.update(changes)
    return plan(config, **s)


__all__ = ["MemoryPlan", "ModelShape", "Switch", "plan", "replace_settings"]
