"""The probe: hooks that follow a training step's phase (forward, backward, optimizer) and
region (loss, attention), and mark which storages are parameters, gradients and optimizer state.

It serves both measurements. On CUDA every change of phase or region is written to a timeline
keyed by the allocator's allocation count, so that each allocation of the snapshot's trace can
be given the label that held when it was made; on the CPU the tracker reads the probe's state
at each allocation directly.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from fusedops.memory.classify import (
    AFTER,
    ATTENTION,
    BACKWARD,
    FORWARD,
    LOSS,
    NONE,
    OPTIMIZER,
    SETUP,
    node_region,
    python_stack_facts,
)

_NODE_KEY = "fusedops.memory.region"
# Torch functions whose whole call (and the autograd nodes it makes) is one region.
_SPECIAL = {
    F.cross_entropy: LOSS,
    F.nll_loss: LOSS,
    F.scaled_dot_product_attention: ATTENTION,
}


def output_embedding(model) -> torch.nn.Module | None:
    """The LM head: transformers' get_output_embeddings(), else a submodule named lm_head."""
    get = getattr(model, "get_output_embeddings", None)
    if callable(get):
        try:
            head = get()
        except Exception:  # some models raise instead of returning None
            head = None
        if isinstance(head, torch.nn.Module):
            return head
    for name, mod in model.named_modules():
        if name.rsplit(".", 1)[-1] == "lm_head":
            return mod
    return None


def tensors_in(obj):
    """The tensors in nested tuples, lists and dicts (and ModelOutput-like mappings)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from tensors_in(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from tensors_in(o)


def optimizer_tensors(optimizer):
    for state in optimizer.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor):
                yield v


class Probe:
    """Phase/region state of the step being measured, and the hooks that keep it.

    seq_now() gives the current allocation number (CUDA: the allocator's count since the start;
    CPU: the tracker's). on_change(seq, phase, region) is called at each change (CUDA timeline),
    mark(tensor, kind) for each tensor whose identity is known (parameters, gradients, optimizer
    state); owns(tensor) says whether a tensor is on the measured device (the totals count
    those only: AdamW's step counters stay on the CPU when the model is on a GPU).
    """

    def __init__(self, model, optimizer, *, seq_now: Callable[[], int],
                 mark: Callable[[torch.Tensor, str], None],
                 on_change: Callable[[int, str, str], None] | None = None,
                 owns: Callable[[torch.Tensor], bool] = lambda t: True):
        self.model = model
        self.owns = owns
        self.optimizer = optimizer
        self.seq_now = seq_now
        self.mark = mark
        self.on_change = on_change
        self.phase = SETUP
        self.node_region = NONE
        self.fwd_depth = 0
        self.head_depth = 0
        self.special: list[str] = []
        self.forward_end_seq: int | None = None
        self.active = False
        self.grad_bytes: dict[int, int] = {}
        self.state_bytes = 0
        self._handles = []
        self._last = (self.phase, self.region())
        self._prehooks: dict[str, Callable] = {}
        self._mode = _NodeTagger(self)

    # --- state -----------------------------------------------------------------------------
    def region(self) -> str:
        if self.head_depth:
            return LOSS
        if self.special:
            return self.special[-1]
        return self.node_region if self.phase == BACKWARD else NONE

    def _changed(self):
        now = (self.phase, self.region())
        if now != self._last:
            self._last = now
            if self.on_change is not None:
                self.on_change(self.seq_now(), *now)

    def set_phase(self, phase: str):
        self.phase = phase
        self._changed()

    def push_special(self, region: str):
        self.special.append(region)
        self._changed()

    def pop_special(self):
        self.special.pop()
        self._changed()

    # --- hooks -----------------------------------------------------------------------------
    def _fwd_pre(self, module, args):
        if not self.active:
            return
        self.fwd_depth += 1
        if self.fwd_depth == 1:
            self.set_phase(FORWARD)

    def _fwd_post(self, module, args, output):
        if not self.active:
            return
        self.fwd_depth = max(0, self.fwd_depth - 1)
        if self.fwd_depth == 0:
            if self.forward_end_seq is None:
                self.forward_end_seq = self.seq_now()
            self.set_phase(AFTER)

    def _head_pre(self, module, args):
        if self.active:
            self.head_depth += 1
            self._changed()

    def _head_post(self, module, args, output):
        if self.active:
            self.head_depth = max(0, self.head_depth - 1)
            self._changed()

    def _grad_hook(self, param):
        if self.active and param.grad is not None:
            if self.owns(param.grad):
                self.grad_bytes[id(param)] = param.grad.untyped_storage().nbytes()
            self.mark(param.grad, "gradients")

    def _opt_pre(self, optimizer, args, kwargs):
        if self.active:
            self.set_phase(OPTIMIZER)

    def _opt_post(self, optimizer, args, kwargs):
        if not self.active:
            return
        seen = set()
        total = 0
        for t in optimizer_tensors(optimizer):
            self.mark(t, "optimizer_state")
            key = (t.untyped_storage().data_ptr(), t.device)
            if key not in seen and self.owns(t):
                seen.add(key)
                total += t.untyped_storage().nbytes()
        self.state_bytes = total
        self.set_phase(AFTER)

    def enter_backward(self, region: str):
        if not self.active:
            return
        if self.phase != BACKWARD:
            self.phase = BACKWARD
            try:  # back to AFTER once this backward pass ends
                torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)
            except RuntimeError:
                pass
        self.node_region = region
        self._changed()

    def _backward_done(self):
        if self.active and self.phase == BACKWARD:
            self.set_phase(AFTER)

    def prehook(self, region: str) -> Callable:
        hook = self._prehooks.get(region)
        if hook is None:
            def hook(grad_outputs, _region=region):
                self.enter_backward(_region)
            self._prehooks[region] = hook
        return hook

    def install(self):
        m = self.model
        self._handles.append(m.register_forward_pre_hook(self._fwd_pre))
        self._handles.append(m.register_forward_hook(self._fwd_post, always_call=True))
        head = output_embedding(m)
        if head is not None:
            self._handles.append(head.register_forward_pre_hook(self._head_pre))
            self._handles.append(head.register_forward_hook(self._head_post, always_call=True))
        for p in m.parameters():
            if p.requires_grad:
                self._handles.append(p.register_post_accumulate_grad_hook(self._grad_hook))
        if self.optimizer is not None:
            self._handles.append(self.optimizer.register_step_pre_hook(self._opt_pre))
            self._handles.append(self.optimizer.register_step_post_hook(self._opt_post))

    def remove(self):
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def mark_known(self, batch=None):
        """Marks what is known now: parameters, existing gradients, optimizer state."""
        for p in self.model.parameters():
            self.mark(p, "parameters")
            if p.grad is not None:
                self.mark(p.grad, "gradients")
        if self.optimizer is not None:
            for t in optimizer_tensors(self.optimizer):
                self.mark(t, "optimizer_state")

    def __enter__(self):
        self.install()
        self.active = True
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        try:
            self._mode.__exit__(*exc)
        finally:
            self.active = False
            self.remove()
        return False


class _NodeTagger(TorchFunctionMode):
    """Gives each autograd node made while it is active the region the step was in, and a
    pre-hook that switches the probe to that region when the backward pass reaches the node;
    keeps the probe's region for the calls of _SPECIAL functions."""

    def __init__(self, probe: Probe):
        super().__init__()
        self.probe = probe

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        probe = self.probe
        special = _SPECIAL.get(func) if probe.active else None
        if special is not None:
            probe.push_special(special)
        try:
            out = func(*args, **kwargs)
        finally:
            if special is not None:
                probe.pop_special()
        if probe.active and torch.is_grad_enabled():
            new = [t.grad_fn for t in tensors_in(out)
                   if t.grad_fn is not None and _NODE_KEY not in t.grad_fn.metadata]
            if new:
                region = special or probe.region()
                if probe.phase != BACKWARD and region == NONE:
                    region = python_stack_facts(sys._getframe(1))[0] or NONE
                self._tag(new, region)
        return out

    def _tag(self, nodes, region):
        probe = self.probe
        stack = list(nodes)
        while stack:
            node = stack.pop()
            if node is None:
                continue
            md = node.metadata
            if _NODE_KEY in md:
                continue
            r = node_region(node, region)
            md[_NODE_KEY] = r
            node.register_prehook(probe.prehook(r))
            stack.extend(n for n, _ in node.next_functions)
