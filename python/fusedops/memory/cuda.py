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
    stats = torch.cuda.memory_stats(device)
    return int(stats.get("allocation.all.allocated", 0))


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
    blocks = {}
    for seg in snapshot.get("segments", []):
        if seg.get("device", device_index) != device_index:
            continue
        for b in seg.get("blocks", []):
            if b.get("state") == "active_allocated":
                blocks[int(b["address"])] = Block(size=int(b["size"]), seq=0, phase=BEFORE)
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
