"""fusedops for Hugging Face transformers models: fused attention and a logits-free LM loss.

    import fusedops.integrations.transformers as fo_hf
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="fusedops")
    fo_hf.apply_fusedops(model)          # or fo_hf.apply_fusedops(LlamaForCausalLM) beforehand

Importing this module registers ``attn_implementation="fusedops"`` with transformers'
AttentionInterface and its mask function with AttentionMaskInterface, so any model that uses the
attention interface can be loaded with it. :func:`apply_fusedops` also switches a model (or every
model later built from a class) to it and replaces its ``ForCausalLM.forward`` by one that
computes the training loss with fusedops.linear_ce, never forming the (tokens x vocab) logits,
and its gated SiLU MLPs' product by fusedops.swiglu.

Supported (and subclasses): the ``*ForCausalLM`` of Llama, Mistral, Qwen2, Qwen3, Gemma, Gemma-2,
Gemma-3 (text), Phi-3, OLMo-2, Granite, Cohere, Mixtral, Qwen2-MoE and Qwen3-MoE
(:data:`SUPPORTED_MODELS`).
"""

from __future__ import annotations

import functools
import types

from fusedops.integrations.transformers import attention as _attention
from fusedops.integrations.transformers.attention import (
    NAME,
    fusedops_attention_forward,
    fusedops_attention_mask,
)
from fusedops.integrations.transformers.loss import (
    MODEL_BUDGET,
    MODEL_FILTER,
    check_lm_head,
    fused_causal_lm_forward,
    patch_lm_head,
)
from fusedops.integrations.transformers.mlp import patch_mlps
from fusedops.integrations.transformers.models import SUPPORTED_MODELS, family_of

__all__ = ["apply_fusedops", "fusedops_attention_forward", "fusedops_attention_mask",
           "SUPPORTED_MODELS", "NAME"]

_attention.register()

_FORWARD_FLAG = "_fusedops_forward"
_CLASS_OPTIONS = "_fusedops_options"


def _check_supported(cls: type) -> None:
    if family_of(cls) is not None:
        return
    raise TypeError(f"apply_fusedops does not support {cls.__module__}.{cls.__qualname__}; "
                    f"supported: {', '.join(SUPPORTED_MODELS)} and their subclasses")


def _check_flag(name: str, value) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")


def _check_budget(value) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"memory_budget_mib must be a positive number or None, got {value!r}")


def _check_filter_eps(value) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
        raise ValueError(f"filter_eps must be None or a number in [0, 1), got {value!r}")


def _check_forward_free(model) -> None:
    """Raises if something other than fusedops replaced model.forward on the instance (beneath
    an accelerate hook: the forward the hook calls): replacing it again would silently undo
    that (TRL's trainers install their own LM-head forward on the model they train,
    accelerate's prepare() with mixed precision an autocast wrapper)."""
    if getattr(model, _FORWARD_FLAG, False):
        return
    own = model._old_forward if _accelerate_hooked(model) else model.__dict__.get("forward")
    if own is None or getattr(own, "__func__", None) is type(model).forward:
        return  # the class's own forward
    name = getattr(own, "__qualname__", type(own).__name__)
    module = getattr(own, "__module__", None) or "?"
    raise ValueError(
        f"{type(model).__name__}.forward was already replaced on this model by {module}.{name} "
        "(as TRL's trainers and accelerate's prepare() with mixed precision do); apply_fusedops "
        "would undo it. Call apply_fusedops first (before building the trainer or calling "
        "prepare), or pass linear_ce=False to keep that forward")


def _accelerate_hooked(model) -> bool:
    """Whether accelerate's add_hook_to_module wraps model.forward (device_map dispatch): its
    wrapper calls model._old_forward, which is then the forward to replace."""
    return hasattr(model, "_hf_hook") and callable(getattr(model, "_old_forward", None))


def _patch_instance(model, attention: bool, linear_ce: bool, memory_budget_mib=None,
                    mlp: bool = False, filter_eps=None):
    if linear_ce:  # refusals before anything is changed
        _check_forward_free(model)
        check_lm_head(model.lm_head)
    if attention and model.config._attn_implementation != NAME:
        model.set_attn_implementation(NAME)
        if model.config._attn_implementation != NAME:  # transformers only logs a warning
            raise TypeError(
                f"{type(model).__name__} does not take its attention from transformers' "
                "AttentionInterface in this transformers version, so attn_implementation="
                f'"{NAME}" cannot be set (Qwen2-MoE before transformers 5); pass '
                "attention=False to use the fused loss and MLP alone")
    if mlp:
        patch_mlps(model)
    if linear_ce:
        patch_lm_head(model.lm_head, memory_budget_mib, filter_eps)
        setattr(model, MODEL_BUDGET, memory_budget_mib)
        setattr(model, MODEL_FILTER, filter_eps)
        if not getattr(model, _FORWARD_FLAG, False):
            forward = types.MethodType(fused_causal_lm_forward, model)
            if _accelerate_hooked(model):
                model._old_forward = forward
            else:
                model.forward = forward
            setattr(model, _FORWARD_FLAG, True)
    return model


def _patch_class(cls: type) -> None:
    if "__init__" in cls.__dict__ and getattr(cls.__init__, _FORWARD_FLAG, False):
        return
    original = cls.__init__

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        options = getattr(cls, _CLASS_OPTIONS, None)
        if options is not None and isinstance(self, cls):
            _patch_instance(self, *options)

    setattr(__init__, _FORWARD_FLAG, True)
    cls.__init__ = __init__


def apply_fusedops(model_or_class, *, attention: bool = True, linear_ce: bool = True,
                   memory_budget_mib: float | None = None, mlp: bool = True,
                   filter_eps: float | None = None):
    """Uses fusedops in a transformers causal LM; returns what it was given.

    model_or_class: a built model (an instance of a supported ``*ForCausalLM``, or a PEFT model
    wrapping one, whose base model is then patched), patched in place; or such a class, before
    ``from_pretrained`` / construction, so that every model built from it afterwards is patched
    (as if apply_fusedops were called on it; the class's methods are not changed, and models
    built before are not touched).

    attention=True sets the model's attention implementation to "fusedops" (with
    ``model.set_attn_implementation``; for a class, on each new model, whatever
    attn_implementation it was loaded with). linear_ce=True gives the model a forward that
    computes the loss with fusedops.linear_ce when it is given labels in training: the output's
    ``logits`` is then None (see :func:`fused_causal_lm_forward` for the exact contract; without
    labels, or in eval mode, logits are computed as usual). The LM head stays the model's own
    module, called for the loss, so FSDP2 and DeepSpeed ZeRO-3 gather its weight as before.

    mlp=True computes the gated MLP's silu(gate) * up with fusedops.swiglu (in every module
    with gate_proj, up_proj, down_proj and a SiLU act_fn; not Gemma's tanh-GELU MLPs): it keeps
    gate and up but not silu(gate) for the backward, which recomputes it and writes the
    gradients over gate and up. Per decoder layer that is one [tokens, intermediate] tensor
    less kept and two less allocated in the MLP's backward. mlp=False leaves the MLPs as they
    are.

    memory_budget_mib: the fused loss's scratch (linear_cross_entropy's memory_budget_mib; None:
    its default, 512 MiB or FUSEDOPS_LCE_MEMORY_MIB). Lower it when the loss's chunk sets the
    step's peak: for Llama-3.2-1B at 8192 tokens the peak is the last decoder layer's MLP
    backward once the budget is at most 128 MiB (benchmarks/results/train_step.jsonl).

    filter_eps: the fused loss's gradient filtering (linear_cross_entropy's filter_eps; None, the
    default: exact gradients). Faster on a trained model's peaked outputs, at a cost in the
    accuracy of the hidden states' gradient that linear_cross_entropy's docstring quantifies.

    Patching again is harmless; for a class the last call's flags apply to models built later.
    Raises TypeError naming the class for an unsupported model.
    """
    _check_flag("attention", attention)
    _check_flag("linear_ce", linear_ce)
    _check_flag("mlp", mlp)
    _check_budget(memory_budget_mib)
    _check_filter_eps(filter_eps)
    if isinstance(model_or_class, type):
        _check_supported(model_or_class)
        setattr(model_or_class, _CLASS_OPTIONS, (attention, linear_ce, memory_budget_mib, mlp,
                                                  filter_eps))
        _patch_class(model_or_class)
        return model_or_class
    model = model_or_class
    if family_of(type(model)) is None and callable(getattr(model, "get_base_model", None)):
        model = model.get_base_model()  # a PEFT model: patch the transformers model inside
    _check_supported(type(model))
    _patch_instance(model, attention, linear_ce, memory_budget_mib, mlp, filter_eps)
    return model_or_class
