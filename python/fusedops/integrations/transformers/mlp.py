"""The gated MLP of Llama-style models through fusedops.swiglu (one activation fewer kept)."""

from __future__ import annotations

import types

import torch

from fusedops.swiglu import swiglu

_PATCHED = "_fusedops_mlp"


def _silu_types() -> tuple[type, ...]:
    kinds = [torch.nn.SiLU]
    try:
        from transformers.activations import SiLUActivation
        kinds.append(SiLUActivation)
    except ImportError:
        pass
    return tuple(kinds)


def fused_mlp_forward(self, x):
    """down_proj(silu(gate_proj(x)) * up_proj(x)), the stock forward's math, with the product by
    swiglu: its backward recomputes silu and writes the gradients over the two projections'
    outputs, which only this product reads."""
    gate, up = self.gate_proj(x), self.up_proj(x)
    inplace = torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad)
    return self.down_proj(swiglu(gate, up, inplace_backward=inplace))


def patch_mlps(model) -> int:
    """Gives every gated SiLU MLP of `model` (a module with gate_proj, up_proj, down_proj and a
    SiLU act_fn) the fused forward; returns how many. Other activations (Gemma-2's tanh GELU)
    keep their forward."""
    silu, count = _silu_types(), 0
    for module in model.modules():
        if not all(hasattr(module, n) for n in ("gate_proj", "up_proj", "down_proj", "act_fn")):
            continue
        if not isinstance(module.act_fn, silu):
            continue
        if not getattr(module, _PATCHED, False):
            module.forward = types.MethodType(fused_mlp_forward, module)
            setattr(module, _PATCHED, True)
        count += 1
    return count
