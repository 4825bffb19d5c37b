"""profile_step: one training step, and what held its peak memory."""

from __future__ import annotations

import gc
import time
from collections.abc import Callable

import torch

from fusedops.memory import classify
from fusedops.memory.classify import Block, breakdown
from fusedops.memory.probe import Probe, optimizer_tensors, tensors_in
from fusedops.memory.report import MemoryReport
from fusedops.memory.tracker import _KIND_RANK, CpuTracker

CPU_NOTES = (
    "CPU: measured by a TorchDispatchMode tracker of tensor storages (fusedops.memory.tracker): "
    "exact for what ATen ops return, blind to workspace inside single kernels and to allocator "
    "overhead, so the peak is a lower bound of the process's; storages that existed before the "
    "step count only when they are parameters, gradients, optimizer state, buffers or the batch."
)


def default_step(model, batch, optimizer) -> None:
    """model(**batch).loss.backward(); optimizer.step(); optimizer.zero_grad(set_to_none=True)."""
    model(**batch).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def model_device(model) -> torch.device:
    for p in model.parameters():
        return p.device
    for b in model.buffers():
        return b.device
    return torch.device("cpu")


def _to_device(batch, device):
    if isinstance(batch, dict):
        return {k: _to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to_device(v, device) for v in batch)
    if isinstance(batch, torch.Tensor) and batch.device != device:
        return batch.to(device)
    return batch


def _replay(base, events):
    """(peak bytes, index of the allocation that reached it, or -1 when it is the start)."""
    cur = sum(b.size for b in base)
    best, best_i = cur, -1
    for i, (sign, b) in enumerate(events):
        cur += sign * b.size
        if sign > 0 and cur > best:
            best, best_i = cur, i
    return best, best_i


def _live_after(base, events, upto):
    live = dict.fromkeys(base)
    for sign, b in events[: upto + 1]:
        if sign > 0:
            live[b] = None
        else:
            live.pop(b, None)
    return list(live)


def _totals(model, probe: Probe) -> dict:
    seen = set()
    params = 0
    for p in model.parameters():
        key = (p.untyped_storage().data_ptr(), p.device)
        if key not in seen and probe.owns(p):
            seen.add(key)
            params += p.untyped_storage().nbytes()
    return dict(parameters=params, gradients=sum(probe.grad_bytes.values()),
                optimizer_state=probe.state_bytes)


def _report(base, events, forward_end_seq, *, device, method, label, seconds, totals,
            notes, max_allocated=None, snapshot=None) -> MemoryReport:
    peak, peak_i = _replay(base, events)
    live = _live_after(base, events, peak_i)
    cats, details = breakdown(live)
    at_peak: Block | None = events[peak_i][1] if peak_i >= 0 else None
    phase = "start of the step" if at_peak is None else at_peak.phase
    if at_peak is not None and (at_peak.frame_region or at_peak.region):
        phase += f" ({at_peak.frame_region or at_peak.region})"
    fwd = {}
    if forward_end_seq is not None:  # just before the first allocation after the forward
        end = next((i for i, (sign, b) in enumerate(events)
                    if sign > 0 and b.seq > forward_end_seq), len(events))
        fwd, _ = breakdown(_live_after(base, events, end - 1))
    largest = [dict(bytes=b.size, category=b.category(), phase=b.phase,
                    region=b.frame_region or b.region, where=b.where)
               for b in sorted(live, key=lambda b: -b.size)[:12]]
    return MemoryReport(**cats, peak_bytes=peak, peak_phase=phase, device=str(device),
                        method=method, label=label, step_seconds=seconds,
                        max_allocated_bytes=max_allocated, details=details,
                        at_forward_end=fwd, totals=totals, notes=list(notes),
                        largest=largest, snapshot=snapshot)


def profile_step(model, batch, optimizer=None, *, step_fn: Callable | None = None,
                 device=None, warmup: int = 1, label: str = "",
                 max_entries: int = 2_000_000) -> MemoryReport:
    """Runs one training step of `model` on `batch` and reports its peak memory by category.

    * batch: the keyword arguments of the model (a dict; tensors are moved to the device), or
      whatever `step_fn` takes.
    * optimizer: default AdamW(lr=1e-4) over the parameters that require grad.
    * step_fn(model, batch, optimizer): the step; default `default_step`:
      ``model(**batch).loss.backward(); optimizer.step(); optimizer.zero_grad(set_to_none=True)``.
    * warmup: steps run first, unmeasured, so that the measured one is a steady-state step (the
      optimizer state exists, caches are warm). warmup=0 measures the first step, whose forward
      and backward run before AdamW has allocated its state. Every step, warm-up included,
      updates the model's parameters.
    * device: where the step runs (default: the device of the model's parameters).

    Measurement. On CUDA the caching allocator's memory history is recorded
    (`torch.cuda.memory._record_memory_history`, Python stacks, at most `max_entries` events)
    and replayed from the blocks that existed at the start; the peak is the largest sum of live
    blocks (torch.cuda.max_memory_allocated of the step is kept beside it as a check) and the
    report keeps the snapshot (`report.save_snapshot(path)`, for pytorch.org/memory_viz). On
    the CPU a TorchDispatchMode follows the storages that ATen ops return
    (fusedops.memory.tracker says what it cannot see).

    Classification of the blocks live at the peak (fusedops.memory.classify has the rules), the
    first that fits:

    1. parameters, gradients, optimizer state: by identity, matched through the data pointers
       of the model's parameters, of each `.grad` when a post-accumulate-grad hook sees it (so a
       gradient computed early, like the fused loss's d_weight, counts from its allocation) and
       of `optimizer.state` after the step. On CUDA each pointer is matched to the allocation
       live at the moment it was read (the allocator's allocation counter numbers the trace),
       since addresses are reused within a step.
    2. logits/loss scratch: allocated in the loss region: under the output embedding module,
       inside F.cross_entropy / F.nll_loss, or with a stack frame in fusedops/linear_ce,
       transformers/loss (ForCausalLMLoss) or Liger's cross-entropy.
    3. attention scratch: allocated in the attention region: inside
       F.scaled_dot_product_attention, or with a frame in fusedops/attention, transformers'
       sdpa/flash/flex attention integrations or a function named `*attention_forward`
       (eager_attention_forward). Whatever the attention function allocates counts, its output
       and softmax statistics included.
    4. activations: everything else allocated during the model's forward (and recomputed
       under activation checkpointing).
    5. other: the rest (backward and optimizer temporaries, the batch, buffers, a KV cache).

    In the backward pass allocations carry no useful Python stack (on CUDA they come from
    autograd's device thread): a TorchFunctionMode gives each autograd node created in the
    forward the region it was created in, and a pre-hook on the node switches the region when
    the backward reaches it, so the loss's and the attention's backward temporaries land in
    their categories.

    Known limits: the regions come from hooks and names: a loss computed outside the model and
    outside F.cross_entropy, or attention outside the functions named above, counts as
    activations (backward: other). With tied embeddings the LM head's weight gradient waits in
    autograd's input buffer for the embedding's and is counted where it was allocated (loss)
    until the two are summed. A gradient that never reaches a parameter's .grad (a wrapper
    that reduces into flat buffers) counts as other. On CUDA the labels assume one thread
    allocates at a time (true for a plain step: the main thread waits while autograd's device
    thread runs the backward); block sizes are the allocator's (rounded up to 512 bytes);
    recording slows the step, so `step_seconds` is no benchmark.
    """

    device = torch.device(device) if device is not None else model_device(model)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    batch = _to_device(batch, device)
    if optimizer is None:
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad],
                                      lr=1e-4)
    step = step_fn or default_step
    for _ in range(warmup):
        step(model, batch, optimizer)
    gc.collect()
    if device.type == "cuda":
        return _profile_cuda(model, batch, optimizer, step, device, label, max_entries)
    return _profile_cpu(model, batch, optimizer, step, device, label)


def _profile_cpu(model, batch, optimizer, step, device, label) -> MemoryReport:
    tracker = CpuTracker()
    probe = Probe(model, optimizer, seq_now=lambda: tracker.seq, mark=tracker.mark,
                  owns=lambda t: t.device.type == "cpu")
    tracker.probe = probe
    for p in model.parameters():
        tracker.add_existing(p, "parameters")
        if p.grad is not None:
            tracker.add_existing(p.grad, "gradients")
    for t in optimizer_tensors(optimizer):
        tracker.add_existing(t, "optimizer_state")
    for b in model.buffers():
        tracker.add_existing(b, "buffer")
    for t in tensors_in(batch):
        tracker.add_existing(t, "input")
    try:
        with probe, tracker:
            t0 = time.perf_counter()
            step(model, batch, optimizer)
            seconds = time.perf_counter() - t0
        probe.mark_known()
    finally:
        tracker.stop()
    notes = [CPU_NOTES]
    if probe.forward_end_seq is None:
        notes.append("no forward pass of the model was seen (the hooks sit on the model passed)")
    return _report(tracker.base, tracker.events, probe.forward_end_seq, device=device,
                   method="cpu-dispatch-tracker", label=label, seconds=seconds,
                   totals=_totals(model, probe), notes=notes)


def _profile_cuda(model, batch, optimizer, step, device, label, max_entries,
                  recorder=None) -> MemoryReport:
    """The CUDA measurement; `recorder` (default CudaRecorder) provides the allocator's memory
    history, so that the replay can be exercised without a GPU."""
    from fusedops.memory.cuda import CudaRecorder, Timeline, events_from_trace

    rec = recorder or CudaRecorder(device, max_entries)
    timeline = Timeline()
    marks = []
    state = {"count0": 0}

    def seq_now():
        return rec.count() - state["count0"]

    def mark(t, kind):
        if isinstance(t, torch.Tensor) and rec.owns(t):
            s = t.untyped_storage()
            marks.append((seq_now(), s.data_ptr(), s.nbytes(), kind))

    probe = Probe(model, optimizer, seq_now=seq_now, mark=mark, on_change=timeline.add,
                  owns=rec.owns)
    rec.sync()
    start_allocated = rec.allocated()
    try:
        initial = rec.start()
        state["count0"] = rec.count()
        timeline.add(0, classify.SETUP, classify.NONE)
        probe.mark_known()
        for t in tensors_in(batch):
            mark(t, "input")
        for b in model.buffers():
            mark(b, "buffer")
        with probe:
            t0 = time.perf_counter()
            step(model, batch, optimizer)
            rec.sync()
            seconds = time.perf_counter() - t0
        probe.mark_known()
        count = rec.count() - state["count0"]
        final = rec.stop()
    finally:
        rec.close()
    base, events, n_alloc, facts = events_from_trace(initial, final, rec.index, timeline, marks,
                                                     _KIND_RANK)
    notes = []
    if facts["trace_entries"] >= max_entries:
        notes.append(f"the trace reached max_entries={max_entries} and lost its oldest events: "
                     "the breakdown is unreliable; pass a larger max_entries")
    if n_alloc != count:
        notes.append(f"the trace holds {n_alloc} allocations but the allocator counted {count}: "
                     "phase and region labels may be shifted (stack frames still apply)")
    base_bytes = sum(b.size for b in base)
    if base_bytes != start_allocated:
        notes.append(f"blocks at the start ({base_bytes} B) differ from memory_allocated "
                     f"({start_allocated} B)")
    report = _report(base, events, probe.forward_end_seq, device=device, method="cuda-snapshot",
                     label=label, seconds=seconds, totals=_totals(model, probe), notes=notes,
                     max_allocated=rec.max_allocated(), snapshot=final)
    if report.max_allocated_bytes and abs(report.max_allocated_bytes - report.peak_bytes) > \
            0.01 * report.max_allocated_bytes:
        report.notes.append(f"the replayed peak ({report.peak_bytes} B) differs from "
                            f"max_memory_allocated ({report.max_allocated_bytes} B) by more "
                            "than 1%")
    return report
