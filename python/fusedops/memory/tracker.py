"""CPU measurement: a TorchDispatchMode that sees every ATen op's output storages, and when each
storage is freed.

What it counts: the bytes of every tensor storage an ATen op returns while it is active (a new
storage, not a view of an input), from that op until the storage is freed (a finalizer on the
storage object, which PyTorch keeps alive exactly as long as the storage), plus the storages that
existed when it started and that the step is told about (parameters, gradients, optimizer
state, buffers, the batch). Custom ops with a Python implementation (torch.library.custom_op,
as fusedops' own) are run op by op under the tracker, so their internal scratch is counted too.

What it cannot see: workspace that a kernel allocates and frees inside one ATen op (oneDNN or
BLAS packing buffers, reductions' temporaries), the allocator's own overhead (glibc, caching),
storages made without an ATen op (torch.from_numpy) and Python objects. Its peak is therefore a
lower bound of the process's real peak, exact at the level of tensors.
"""

from __future__ import annotations

import sys
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fusedops.memory.classify import BEFORE, Block, python_stack_facts

_KIND_RANK = {None: 0, "input": 1, "buffer": 1, "optimizer_state": 2, "gradients": 3,
              "parameters": 4}
_PLAIN_NAMESPACES = ("aten", "prims", "prim", "_c10d_functional", "c10d", "profiler")


def _custom_impl(func):
    """The Python implementation of a torch.library.custom_op, or None."""
    if func.namespace in _PLAIN_NAMESPACES:
        return None
    try:
        from torch._library.custom_ops import OPDEFS
    except ImportError:
        return None
    opdef = OPDEFS.get(func._schema.name)
    if opdef is None:
        return None
    fns = getattr(opdef, "_backend_fns", {}) or {}
    return fns.get("cpu") or getattr(opdef, "_init_fn", None)


class CpuTracker(TorchDispatchMode):
    """Follows the live CPU storages of the ops run under it. `events` is the ordered list of
    (+1 | -1, Block); `base` the blocks that existed when it started."""

    def __init__(self, probe=None):
        super().__init__()
        self.probe = probe
        self.seq = 0
        self.live: dict[int, tuple[Block, weakref.finalize]] = {}
        self.base: list[Block] = []
        self.events: list[tuple[int, Block]] = []

    # --- storages --------------------------------------------------------------------------
    def _freed(self, key: int, block: Block):
        entry = self.live.get(key)
        if entry is not None and entry[0] is block:
            del self.live[key]
            self.events.append((-1, block))

    def _watch(self, storage, block: Block):
        key = id(storage)
        fin = weakref.finalize(storage, self._freed, key, block)
        fin.atexit = False
        self.live[key] = (block, fin)

    def add_existing(self, tensor: torch.Tensor, kind: str | None):
        """A storage that exists before the step (counted from the start)."""
        if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu":
            return
        storage = tensor.untyped_storage()
        if storage.nbytes() == 0:
            return
        entry = self.live.get(id(storage))
        if entry is not None:
            self._set_kind(entry[0], kind)
            return
        block = Block(size=storage.nbytes(), seq=0, phase=BEFORE, kind=kind)
        self.base.append(block)
        self._watch(storage, block)

    @staticmethod
    def _set_kind(block: Block, kind):
        if _KIND_RANK.get(kind, 0) > _KIND_RANK.get(block.kind, 0):
            block.kind = kind

    def mark(self, tensor: torch.Tensor, kind: str):
        if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu":
            return
        entry = self.live.get(id(tensor.untyped_storage()))
        if entry is not None:
            self._set_kind(entry[0], kind)

    def stop(self):
        for _block, fin in self.live.values():
            fin.detach()
        self.live.clear()

    # --- the mode --------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        impl = _custom_impl(func)
        if impl is not None:
            with self:  # run the custom op's own ops under the tracker
                return impl(*args, **kwargs)
        inputs = {id(t.untyped_storage()) for t in _leaves((args, kwargs))
                  if isinstance(t, torch.Tensor) and t.device.type == "cpu"}
        out = func(*args, **kwargs)
        fresh = []
        for t in _leaves(out):
            if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
                continue
            storage = t.untyped_storage()
            key = id(storage)
            if key in inputs or key in self.live:
                entry = self.live.get(key)
                if entry is not None and entry[0].size != storage.nbytes():  # resized in place
                    self._resized(key, storage, entry[0])
                continue
            if storage.nbytes() == 0:
                continue
            fresh.append(storage)
        if fresh:
            probe = self.probe
            region, recompute, where = python_stack_facts(sys._getframe(1))
            for storage in fresh:
                self.seq += 1
                block = Block(size=storage.nbytes(), seq=self.seq,
                              phase=probe.phase if probe else "step",
                              region=probe.region() if probe else "",
                              frame_region=region, recompute=recompute, where=where)
                self._watch(storage, block)
                self.events.append((1, block))
        return out

    def _resized(self, key, storage, old: Block):
        self.events.append((-1, old))
        self.seq += 1
        block = Block(size=storage.nbytes(), seq=self.seq, phase=old.phase, region=old.region,
                      frame_region=old.frame_region, recompute=old.recompute, kind=old.kind,
                      where=old.where)
        self.live[key][1].detach()
        self._watch(storage, block)
        self.events.append((1, block))


def _leaves(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _leaves(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from _leaves(o)
