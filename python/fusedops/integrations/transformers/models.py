"""The causal LMs that apply_fusedops supports, and what each one's head does after the LM head.

Every supported ``*ForCausalLM.forward`` is "decoder, LM head, optional logit transform, loss";
:func:`fusedops.integrations.transformers.loss.fused_causal_lm_forward` replaces it and needs to
know the transform (a scale: Granite divides the logits by ``logits_scaling``, Cohere multiplies
them by ``logit_scale``; a tanh softcap: Gemma-2 and Gemma-3's ``final_logit_softcapping``) and
whether the model adds a mixture-of-experts router's load-balancing loss (Mixtral, Qwen2-MoE,
Qwen3-MoE).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

__all__ = ["Family", "SUPPORTED_MODELS", "family_of", "scale_of", "logit_scale",
           "load_balancing_loss"]


@dataclass(frozen=True)
class Family:
    """module: where transformers defines the class. scale: how its forward scales the logits,
    "divide:" or "multiply:" and where it reads the factor ("config.<attribute>" or
    "model.<attribute>"), or None. moe: whether its forward adds the router's load-balancing
    loss (``load_balancing_loss_func`` of `module`)."""
    module: str
    scale: str | None = None
    moe: bool = False


def _m(name: str) -> str:
    return f"transformers.models.{name}.modeling_{name}"


#: Model classes apply_fusedops accepts (they and their subclasses).
SUPPORTED_MODELS = {
    "LlamaForCausalLM": Family(_m("llama")),
    "MistralForCausalLM": Family(_m("mistral")),
    "Qwen2ForCausalLM": Family(_m("qwen2")),
    "Qwen3ForCausalLM": Family(_m("qwen3")),
    "GemmaForCausalLM": Family(_m("gemma")),
    "Gemma2ForCausalLM": Family(_m("gemma2")),
    "Gemma3ForCausalLM": Family(_m("gemma3")),
    "Phi3ForCausalLM": Family(_m("phi3")),
    "Olmo2ForCausalLM": Family(_m("olmo2")),
    "GraniteForCausalLM": Family(_m("granite"), scale="divide:config.logits_scaling"),
    "CohereForCausalLM": Family(_m("cohere"), scale="multiply:model.logit_scale"),
    "MixtralForCausalLM": Family(_m("mixtral"), moe=True),
    "Qwen2MoeForCausalLM": Family(_m("qwen2_moe"), moe=True),
    "Qwen3MoeForCausalLM": Family(_m("qwen3_moe"), moe=True),
}


def family_of(cls: type) -> Family | None:
    """The Family of `cls` (a supported class or a subclass of one), or None."""
    for base in cls.__mro__:
        family = SUPPORTED_MODELS.get(base.__name__)
        if family is not None and family.module == base.__module__:
            return family
    return None


def scale_of(model) -> tuple[str, object] | None:
    """("divide" or "multiply", the factor as the model's forward reads it), or None."""
    family = family_of(type(model))
    if family is None or family.scale is None:
        return None
    how, where = family.scale.split(":")
    owner, attr = where.split(".")
    return how, getattr(model.config if owner == "config" else model, attr)


def logit_scale(model) -> float | None:
    """The factor the model's forward applies to its LM head's logits, or None for none."""
    scale = scale_of(model)
    if scale is None:
        return None
    how, value = scale
    return 1.0 / float(value) if how == "divide" else float(value)


def load_balancing_loss(model, router_logits, attention_mask):
    """The router's auxiliary loss as the model's own forward computes it."""
    family = family_of(type(model))
    func = importlib.import_module(family.module).load_balancing_loss_func
    return func(router_logits, model.num_experts, model.num_experts_per_tok, attention_mask)
