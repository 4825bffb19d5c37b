"""CUDA measurement: the caching allocator's memory history, replayed.

`torch.cuda.memory._record_memory_history` records every allocation and free with its Python
stack; a snapshot taken when recording starts gives the blocks that existed before. Allocations
are numbered by the allocator's own counter (memory_stats "allocation.all.allocated"), which
the probe reads at each change of phase or region and at each tensor it identifies, so that the
k-th allocation of the trace gets the label that held when it was made and the identified
tensors are matched to the allocation that held them at that moment (an address alone is
ambiguous: the caching allocator reuses addresses within the step).
"""

from __future__ import annotations

import bisect

import torch

from fusedops.memory.classify import BEFORE, NONE, SETUP, Block, snapshot_stack_facts


def alloc_count(device: torch.device) -> int:
    """Allocations made so far on `device` (the allocator's cumulative counter)."""
    raw = getattr(torch._C, "_cuda_memoryStats", None)
    if raw is not None:  # the nested dict, without memory_stats' flattening (called often)
        try:
            return int(raw(device.index)["allocation"]["all"]["allocated"])
        except (KeyError, TypeError, RuntimeError):
            pass
    return int(torch.cuda.memory_stats(device).get("allocation.all.allocated", 0))


class CudaRecorder:
    """The allocator's memory history on one CUDA device: start() enables recording and returns
    the snapshot of what exists, stop() returns the snapshot whose trace holds what happened
    since, close() disables recording."""

    def __init__(self, device: torch.device, max_entries: int):
        self.device = device
        self.index = device.index
        self.max_entries = max_entries

    def owns(self, t: torch.Tensor) -> bool:
        return t.is_cuda and t.device.index == self.index

    def sync(self):
        torch.cuda.synchronize(self.device)

    def allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def max_allocated(self) -> int:
        return torch.cuda.max_memory_allocated(self.device)

    def count(self) -> int:
        return alloc_count(self.device)

    def start(self) -> dict:
        torch.cuda.reset_peak_memory_stats(self.device)
        record = torch.cuda.memory._record_memory_history
        with torch.cuda.device(self.device):
            try:
                record(enabled="all", context="all", stacks="python",
                       max_entries=self.max_entries, clear_history=True)
            except TypeError:  # a torch without clear_history
                record(enabled="all", context="all", stacks="python",
                       max_entries=self.max_entries)
            return torch.cuda.memory._snapshot()

    def stop(self) -> dict:
        with torch.cuda.device(self.device):
            return torch.cuda.memory._snapshot()

    def close(self):
        with torch.cuda.device(self.device):
            torch.cuda.memory._record_memory_history(enabled=None)


class Timeline:
    """(seq, phase, region) changes; the label of allocation k is the last change at a seq < k."""

    def __init__(self):
        self.seqs: list[int] = []
        self.labels: list[tuple[str, str]] = []

    def add(self, seq: int, phase: str, region: str):
        self.seqs.append(seq)
        self.labels.append((phase, region))

    def label(self, seq: int) -> tuple[str, str]:
        i = bisect.bisect_left(self.seqs, seq) - 1
        return self.labels[i] if i >= 0 else (SETUP, NONE)


def _initial_blocks(snapshot: dict, device_index: int) -> dict[int, Block]:
    """The allocated blocks of a snapshot's segments, by address (a segment's blocks lie one
    after the other from the segment's address)."""
    blocks = {}
    for seg in snapshot.get("segments", []):
        if seg.get("device", device_index) != device_index:
            continue
        addr = int(seg["address"])
        for b in seg.get("blocks", []):
            addr = int(b.get("address", addr))
            if b.get("state") == "active_allocated":
                blocks[addr] = Block(size=int(b["size"]), seq=0, phase=BEFORE)
            addr += int(b["size"])
    return blocks


def _resolve(live: dict[int, Block], ptr: int, nbytes: int) -> Block | None:
    b = live.get(ptr)
    if b is not None:
        return b
    for addr, blk in live.items():  # a view into a larger allocation
        if addr <= ptr < addr + blk.size:
            return blk
    return None


def events_from_trace(initial: dict, final: dict, device_index: int, timeline: Timeline,
                      marks, kinds_rank) -> tuple[list[Block], list[tuple[int, Block]], int, dict]:
    """(base blocks, [(+1 | -1, Block)], number of allocations, facts) from the snapshot taken when
    recording started (`initial`) and the one taken at the end (`final`, whose trace holds the
    step). marks: (seq, ptr, nbytes, kind) of identified tensors, seq = allocations made before
    the mark."""
    live = _initial_blocks(initial, device_index)
    base = list(live.values())
    marks = sorted(marks, key=lambda m: m[0])
    mi = 0

    def resolve_upto(seq):
        nonlocal mi
        while mi < len(marks) and marks[mi][0] <= seq:
            _, ptr, nbytes, kind = marks[mi]
            blk = _resolve(live, ptr, nbytes)
            if blk is not None and kinds_rank.get(kind, 0) > kinds_rank.get(blk.kind, 0):
                blk.kind = kind
            mi += 1

    resolve_upto(0)
    traces = final.get("device_traces", [])
    trace = traces[device_index] if device_index < len(traces) else []
    before = initial.get("device_traces", [])
    skip = len(before[device_index]) if device_index < len(before) else 0
    trace = trace[skip:]  # history from before the start, when it could not be cleared
    events: list[tuple[int, Block]] = []
    seq = 0
    for e in trace:
        action = e.get("action")
        if action == "alloc":
            seq += 1
            phase, region = timeline.label(seq)
            frame_region, recompute, where = snapshot_stack_facts(e.get("frames"))
            blk = Block(size=int(e["size"]), seq=seq, phase=phase, region=region,
                        frame_region=frame_region, recompute=recompute, where=where)
            live[int(e["addr"])] = blk
            events.append((1, blk))
            resolve_upto(seq)
        elif action in ("free_requested", "free_completed"):
            blk = live.pop(int(e["addr"]), None)
            if blk is not None:
                events.append((-1, blk))
    resolve_upto(float("inf"))
    facts = dict(trace_entries=len(trace))
    return base, events, seq, facts
