"""Autograd helpers shared by the ops: a clear error where a second derivative is asked for."""

from __future__ import annotations

import torch


class _Refuse(torch.autograd.Function):
    """Identity on the gradients whose own backward raises `message`. The anchors (the inputs
    the gradients depend on) tie the outputs into the graph, so that the error is raised at the
    second backward whichever input it differentiates for."""

    @staticmethod
    def forward(ctx, message, n_anchors, *tensors):
        ctx.message = message
        return tuple(g.view_as(g) for g in tensors[n_anchors:])

    @staticmethod
    def backward(ctx, *unused):
        raise RuntimeError(ctx.message)


def refuse_double_backward(message: str, anchors, grads):
    """Returns `grads`; under create_graph=True (grad mode on inside a backward) they come back
    attached to a node that raises `message` if anything differentiates through them. `anchors`:
    the tensors the gradients depend on (saved inputs, upstream gradients)."""
    if not torch.is_grad_enabled():
        return grads
    anchors = [a for a in anchors if a is not None and a.requires_grad]
    present = [g for g in grads if g is not None]
    if not anchors or not present:
        return grads
    wrapped = iter(_Refuse.apply(message, len(anchors), *anchors, *present))
    return tuple(next(wrapped) if g is not None else None for g in grads)
