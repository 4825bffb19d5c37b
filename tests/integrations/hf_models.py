"""Tiny random transformers causal LMs for the integration tests, and exact references.

References: transformers' own model code and masks. For float64 runs the reference attention is
transformers' eager formula with the softmax kept in the input dtype ("eager_exact"; stock eager
rounds the softmax to float32) and the reference loss is ForCausalLMLoss's formula kept in
float64 (stock casts the logits to float32), so that agreement can be checked to 1e-10.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from transformers import (
    AttentionInterface,
    CohereConfig,
    CohereForCausalLM,
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GemmaConfig,
    GemmaForCausalLM,
    GraniteConfig,
    GraniteForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Olmo2Config,
    Olmo2ForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)
from transformers.masking_utils import AttentionMaskInterface, eager_mask

VOCAB = 160
SEQ = 24
COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
              initializer_range=0.2, pad_token_id=0, bos_token_id=1, eos_token_id=2)

FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM, dict(tie_word_embeddings=False)),
    "mistral": (MistralConfig, MistralForCausalLM, dict(sliding_window=8, head_dim=8)),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM,
              dict(use_sliding_window=True, sliding_window=8, max_window_layers=1)),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, dict(head_dim=8)),
    "gemma2": (Gemma2Config, Gemma2ForCausalLM,
               dict(head_dim=8, query_pre_attn_scalar=16, sliding_window=8,
                    final_logit_softcapping=4.0, attn_logit_softcapping=3.0)),
    "gemma": (GemmaConfig, GemmaForCausalLM, dict(head_dim=8)),
    "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM,
               dict(head_dim=8, query_pre_attn_scalar=16, sliding_window=8,
                    layer_types=["sliding_attention", "full_attention"],
                    final_logit_softcapping=4.0)),
    "phi3": (Phi3Config, Phi3ForCausalLM, dict(sliding_window=8, tie_word_embeddings=False)),
    "olmo2": (Olmo2Config, Olmo2ForCausalLM, dict(tie_word_embeddings=False)),
    "granite": (GraniteConfig, GraniteForCausalLM,
                dict(logits_scaling=4.0, embedding_multiplier=2.0, residual_multiplier=0.5,
                     attention_multiplier=0.25, tie_word_embeddings=False)),
    "cohere": (CohereConfig, CohereForCausalLM, dict(logit_scale=0.25, use_qk_norm=False)),
    "mixtral": (MixtralConfig, MixtralForCausalLM,
                dict(num_local_experts=4, num_experts_per_tok=2, output_router_logits=True,
                     router_aux_loss_coef=0.05, sliding_window=8)),
    "qwen2_moe": (Qwen2MoeConfig, Qwen2MoeForCausalLM,
                  dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                       shared_expert_intermediate_size=32, output_router_logits=True,
                       router_aux_loss_coef=0.05)),
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM,
                  dict(head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                       output_router_logits=True, router_aux_loss_coef=0.05)),
}
if not getattr(Qwen2MoeForCausalLM, "_supports_attention_backend", False):
    # transformers 4.x: Qwen2-MoE's attention is a fixed class, no AttentionInterface (no
    # "eager_exact" reference, no "fusedops"); test_attention_backend_required covers it.
    del FAMILIES["qwen2_moe"]

#: Mixture-of-experts families (their forward adds the router's load-balancing loss).
MOE = {"mixtral", "qwen2_moe", "qwen3_moe"}
#: Families whose MLPs are gated SiLU modules with gate_proj and up_proj (fusedops.swiglu's).
#: (Qwen2-MoE: its shared expert; one per layer.) In transformers 4.x a mixture's experts are
#: such modules too: see swiglu_mlps.
SWIGLU_MLP = {"llama", "mistral", "qwen2", "qwen3", "olmo2", "granite", "cohere", "qwen2_moe"}


def swiglu_mlps(family: str, model) -> int:
    """How many modules of `model` apply_fusedops(mlp=True) gives swiglu: one MLP per layer in
    SWIGLU_MLP's families, plus each expert where a mixture's experts are gated SiLU modules of
    their own (transformers 4.x; 5.x fuses them into one module of stacked weights)."""
    n = model.config.num_hidden_layers if family in SWIGLU_MLP else 0
    if family in MOE:
        n += sum(type(m).__name__.endswith("MLP") and hasattr(m, "gate_proj")
                 and "shared" not in name for name, m in model.named_modules())
    return n


def _repeat_kv(x, n):
    return x if n == 1 else x.repeat_interleave(n, dim=1)


def eager_exact(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                softcap=None, **kwargs):
    """transformers' eager attention with the softmax in the input dtype."""
    if scaling is None:
        scaling = module.head_dim ** -0.5
    n = module.num_key_value_groups
    scores = query @ _repeat_kv(key, n).transpose(2, 3) * scaling
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if attention_mask is not None:
        scores = scores + attention_mask
    probs = scores.softmax(-1)
    out = probs @ _repeat_kv(value, n)
    return out.transpose(1, 2).contiguous(), probs


AttentionInterface.register("eager_exact", eager_exact)
AttentionMaskInterface.register("eager_exact", eager_mask)


def config(family: str, attn: str = "eager", **overrides):
    cfg_cls, _, extra = FAMILIES[family]
    cfg = cfg_cls(**{**COMMON, **extra, **overrides})
    cfg._attn_implementation = attn
    if "num_experts_per_tok" in extra:  # grouped_mm (the default) has no float64
        cfg._experts_implementation = "eager"
    return cfg


def model_pair(family: str, dtype=torch.float64, ref_attn: str | None = None, seed: int = 0,
               **overrides):
    """(reference, candidate): one random init, separate configs; the candidate not patched."""
    _, model_cls, _ = FAMILIES[family]
    ref_attn = ref_attn or ("eager_exact" if dtype == torch.float64 else "eager")
    torch.manual_seed(seed)
    ref = model_cls(config(family, ref_attn, **overrides)).to(dtype)
    cand = model_cls(config(family, "eager", **overrides)).to(dtype)
    cand.load_state_dict(copy.deepcopy(ref.state_dict()))
    return ref, cand


def batch(kind: str, seed: int = 1, batch_size: int = 2, seq: int = SEQ):
    """Model inputs and labels of one batch kind: unpadded, right, left or packed."""
    g = torch.Generator().manual_seed(seed)
    if kind == "packed":
        lengths = [10, 8, 6]
        ids = torch.randint(3, VOCAB, (1, sum(lengths)), generator=g)
        position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
        labels = ids.clone()
        labels[0, torch.tensor([0, 10, 18])] = -100  # no label across a sequence boundary
        labels[0, 5] = -100
        return dict(input_ids=ids, position_ids=position_ids), labels
    ids = torch.randint(3, VOCAB, (batch_size, seq), generator=g)
    labels = ids.clone()
    labels[0, 3] = -100
    labels[-1, seq // 2] = -100
    if kind == "unpadded":
        return dict(input_ids=ids), labels
    mask = torch.ones(batch_size, seq, dtype=torch.long)
    if kind == "right":
        mask[-1, seq - 7:] = 0
    elif kind == "left":
        mask[-1, :7] = 0
    else:
        raise ValueError(kind)
    ids = ids.masked_fill(mask == 0, 0)
    labels = labels.masked_fill(mask == 0, -100)
    inputs = dict(input_ids=ids, attention_mask=mask)
    if kind == "left":
        inputs["position_ids"] = (mask.cumsum(-1) - 1).clamp(min=0)
        # The first real token would be predicted from the last padding position, whose output
        # differs (eager attends to every key from a fully masked row, fusedops gives zeros, as
        # flash-attention does): a left-padded batch labels it -100.
        labels[-1, 7] = -100
    return inputs, labels


def reference_loss(logits, labels, num_items_in_batch=None, ignore_index=-100):
    """ForCausalLMLoss in the logits' dtype: shift, ignore_index, mean or sum / num_items."""
    shift = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    logits = logits.reshape(-1, logits.shape[-1])
    if num_items_in_batch is None:
        return F.cross_entropy(logits, shift.reshape(-1), ignore_index=ignore_index)
    loss = F.cross_entropy(logits, shift.reshape(-1), ignore_index=ignore_index, reduction="sum")
    return loss / num_items_in_batch


def rel_err(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    scale = b.norm().item()
    diff = (a - b).norm().item()
    return diff if scale == 0 else diff / scale
