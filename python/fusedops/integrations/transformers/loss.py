"""The causal-LM loss through fusedops.linear_ce: `*ForCausalLM.forward` without logits.

The LM head is reached only through its own module call, ``self.lm_head(hidden, labels=...)``:
its `forward` is replaced on the instance by :func:`fused_head_forward`, which reads
``self.weight`` inside the call. Forward pre-hooks that gather a sharded weight (FSDP2's
``fully_shard``, DeepSpeed ZeRO-3) therefore run before the weight is read, exactly as for the
stock ``self.lm_head(hidden)``.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers.modeling_outputs import CausalLMOutputWithPast, MoeCausalLMOutputWithPast
from transformers.utils.generic import can_return_tuple

from fusedops.integrations.transformers import models as _models
from fusedops.linear_ce import linear_cross_entropy

__all__ = ["fused_head_forward", "patch_lm_head", "check_lm_head", "fused_causal_lm_forward",
           "MODEL_BUDGET", "MODEL_FILTER"]

_HEAD_FLAG = "_fusedops_fused_head"
_HEAD_BUDGET = "_fusedops_memory_budget_mib"
#: The patched model's attribute holding apply_fusedops' memory_budget_mib.
MODEL_BUDGET = "_fusedops_model_memory_budget_mib"
_HEAD_FILTER = "_fusedops_filter_eps"
#: The patched model's attribute holding apply_fusedops' filter_eps.
MODEL_FILTER = "_fusedops_model_filter_eps"


def fused_head_forward(self: nn.Linear, hidden: Tensor, labels: Tensor | None = None, *,
                       ignore_index: int = -100, softcap: float | None = None,
                       num_items_in_batch: Tensor | int | None = None) -> Tensor:
    """Forward of a patched LM head (an nn.Linear).

    Without labels: the logits, ``hidden @ weight.T + bias``, as nn.Linear. With labels (hidden's
    leading shape, already aligned with hidden: no shift here): the float32 cross-entropy of
    ``softcap * tanh(logits / softcap)`` (no tanh for softcap None) computed by
    fusedops.linear_ce without forming the logits; the mean over tokens whose label is not
    ignore_index, or their sum divided by num_items_in_batch when that is given. The scratch
    budget and filter_eps are the ones patch_lm_head was given.
    """
    if labels is None:
        return type(self).forward(self, hidden)
    labels = labels.to(hidden.device)
    opts = dict(ignore_index=ignore_index, softcap=softcap,
                memory_budget_mib=getattr(self, _HEAD_BUDGET, None),
                filter_eps=getattr(self, _HEAD_FILTER, None))
    if num_items_in_batch is None:
        return linear_cross_entropy(hidden, self.weight, labels, self.bias, reduction="mean",
                                    **opts)
    loss = linear_cross_entropy(hidden, self.weight, labels, self.bias, reduction="sum", **opts)
    if isinstance(num_items_in_batch, Tensor):
        num_items_in_batch = num_items_in_batch.to(loss.device)
    return loss / num_items_in_batch


def _peft_copies(head: nn.Module) -> list | None:
    """The modules a PEFT ModulesToSaveWrapper (``modules_to_save=["lm_head"]``) passes its
    calls to, its original and each adapter's trained copy; None for any other module."""
    original = getattr(head, "original_module", None)
    copies = getattr(head, "modules_to_save", None)
    if isinstance(original, nn.Module) and isinstance(copies, nn.ModuleDict):
        return [original, *copies.values()]
    return None


def check_lm_head(head: nn.Module) -> None:
    """Raises TypeError unless the fused loss can use `head`: an nn.Linear, or PEFT's
    modules_to_save wrapper of nn.Linear copies."""
    for module in _peft_copies(head) or [head]:
        if not isinstance(module, nn.Linear) or type(module).forward is not nn.Linear.forward:
            kind = type(module)
            raise TypeError(
                f"the fused loss needs an nn.Linear LM head, got {kind.__module__}."
                f"{kind.__qualname__} (LoRA or trainable tokens on the LM head change its "
                "product); pass linear_ce=False to keep the model's own head and loss")


def patch_lm_head(head: nn.Module, memory_budget_mib: float | None = None,
                  filter_eps: float | None = None) -> nn.Module:
    """Gives `head` (an nn.Linear) the forward of :func:`fused_head_forward`, whose fused loss
    uses `memory_budget_mib` and `filter_eps` (linear_cross_entropy's options; None: their
    defaults); idempotent, the last call's options apply. A PEFT modules_to_save wrapper has
    each of its copies patched."""
    copies = _peft_copies(head)
    if copies is not None:
        check_lm_head(head)
        for module in copies:
            patch_lm_head(module, memory_budget_mib, filter_eps)
        return head
    if not getattr(head, _HEAD_FLAG, False):
        check_lm_head(head)
        head.forward = types.MethodType(fused_head_forward, head)
        setattr(head, _HEAD_FLAG, True)
    setattr(head, _HEAD_BUDGET, memory_budget_mib)
    setattr(head, _HEAD_FILTER, filter_eps)
    return head


def shifted_labels(labels: Tensor, ignore_index: int) -> Tensor:
    """labels shifted left by one, ignore_index at the last position (transformers' shift)."""
    return F.pad(labels, (0, 1), value=ignore_index)[..., 1:]


def _scaled_logits(model, logits: Tensor) -> Tensor:
    """The model's own transform of its LM head's logits: scale (Granite, Cohere), softcap."""
    scale = _models.scale_of(model)
    if scale is not None:
        how, value = scale
        logits = logits / value if how == "divide" else logits * value
    softcap = getattr(model.config, "final_logit_softcapping", None)
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return logits


@can_return_tuple
def fused_causal_lm_forward(self, input_ids: torch.LongTensor | None = None,
                            attention_mask: Tensor | None = None,
                            position_ids: torch.LongTensor | None = None,
                            past_key_values=None, inputs_embeds: Tensor | None = None,
                            labels: torch.LongTensor | None = None, use_cache: bool | None = None,
                            logits_to_keep: int | Tensor = 0, skip_logits: bool | None = None,
                            **kwargs) -> CausalLMOutputWithPast:
    """``*ForCausalLM.forward`` whose loss is fused with the LM head (fusedops.linear_ce).

    Arguments as the model's own forward, plus `skip_logits`:

    * With labels (or ``shift_labels``) in training, or with ``skip_logits=True``: the loss of
      the next-token prediction (labels shifted left by one, the last position ignored; or
      ``shift_labels`` as given), ``ignore_index`` (default -100) ignored, the mean over the
      other tokens, or their sum divided by ``num_items_in_batch`` when given (what Trainer
      passes for gradient accumulation). The logits are never formed: the output's ``logits``
      is None. The model's transform of the logits goes into the fused loss: Granite's and
      Cohere's scale (applied to the hidden states, which is the same product) and Gemma-2's
      and Gemma-3's final_logit_softcapping.
    * Otherwise (no labels, eval mode, or ``skip_logits=False``): logits for the last
      ``logits_to_keep`` positions (0 = all) as the stock forward, and with labels the stock
      loss from them (e.g. for Trainer's evaluation with compute_metrics).

    Mixture-of-experts models (Mixtral, Qwen2-MoE, Qwen3-MoE) add the router's load-balancing
    loss times ``router_aux_loss_coef`` when ``output_router_logits`` (default: the config's)
    is on, and return a MoeCausalLMOutputWithPast with ``aux_loss`` and ``router_logits``, as
    their own forward does.

    ``logits_to_keep`` also limits the fused loss to the kept positions. past_key_values,
    hidden_states and attentions pass through.
    """
    family = _models.family_of(type(self))
    moe = family is not None and family.moe
    router = {}
    if moe:
        output_router_logits = kwargs.pop("output_router_logits", None)
        if output_router_logits is None:
            output_router_logits = self.config.output_router_logits
        router = dict(output_router_logits=output_router_logits)
    outputs = self.model(input_ids=input_ids, attention_mask=attention_mask,
                         position_ids=position_ids, past_key_values=past_key_values,
                         inputs_embeds=inputs_embeds, use_cache=use_cache, **kwargs, **router)
    hidden_states = outputs.last_hidden_state
    if isinstance(logits_to_keep, int):
        slice_indices = slice(-logits_to_keep, None)
    else:
        slice_indices = logits_to_keep
    shift_labels = kwargs.get("shift_labels")
    has_labels = labels is not None or shift_labels is not None
    if skip_logits is None:
        skip_logits = self.training and has_labels
    if skip_logits and not has_labels:
        raise ValueError("skip_logits=True needs labels or shift_labels")

    loss = logits = None
    if skip_logits:
        ignore_index = kwargs.get("ignore_index", -100)
        if shift_labels is None:
            shift_labels = shifted_labels(labels, ignore_index)
        hidden = hidden_states[:, slice_indices, :]
        if shift_labels.shape[-1] != hidden.shape[1]:
            shift_labels = shift_labels[:, slice_indices]
        scale = _models.logit_scale(self)
        if scale is not None:  # (h W^T) s = (s h) W^T: the scale goes on the smaller operand
            hidden = hidden * scale
        # Patched by apply_fusedops; patched here when replaced since (a resized vocabulary,
        # PEFT's modules_to_save wrapper, which may have gained an adapter's copy).
        head = self.lm_head
        if not getattr(head, _HEAD_FLAG, False):
            patch_lm_head(head, getattr(self, MODEL_BUDGET, None),
                          getattr(self, MODEL_FILTER, None))
        loss = head(hidden, shift_labels, ignore_index=ignore_index,
                    softcap=getattr(self.config, "final_logit_softcapping", None),
                    num_items_in_batch=kwargs.get("num_items_in_batch"))
    else:
        logits = _scaled_logits(self, self.lm_head(hidden_states[:, slice_indices, :]))
        if has_labels:
            loss = self.loss_function(logits=logits, labels=labels,
                                      vocab_size=self.config.vocab_size, **kwargs)

    if not moe:
        return CausalLMOutputWithPast(loss=loss, logits=logits,
                                      past_key_values=outputs.past_key_values,
                                      hidden_states=outputs.hidden_states,
                                      attentions=outputs.attentions)
    aux_loss = None
    if output_router_logits:
        aux_loss = _models.load_balancing_loss(self, outputs.router_logits, attention_mask)
        if loss is not None:
            loss = loss + self.router_aux_loss_coef * aux_loss.to(loss.device)
    return MoeCausalLMOutputWithPast(loss=loss, aux_loss=aux_loss, logits=logits,
                                     past_key_values=outputs.past_key_values,
                                     hidden_states=outputs.hidden_states,
                                     attentions=outputs.attentions,
                                     router_logits=outputs.router_logits)
