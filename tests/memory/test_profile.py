"""profile_step and its parts on plain torch modules (no transformers): the CPU tracker, the
classification rules, the CUDA trace replay on a synthetic snapshot, and MemoryReport."""

import json
import sys
import types
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from fusedops.memory import CATEGORIES, MemoryReport, default_step, profile_step
from fusedops.memory.classify import (
    ATTENTION,
    BACKWARD,
    FORWARD,
    LOSS,
    OPTIMIZER,
    Block,
    frame_region,
    stack_facts,
)
from fusedops.memory.cuda import Timeline, events_from_trace
from fusedops.memory.probe import optimizer_tensors
from fusedops.memory.profile import _profile_cuda
from fusedops.memory.tracker import _KIND_RANK, CpuTracker


class TinyLM(nn.Module):
    """Embedding -> MLP -> attention (SDPA) -> LM head; forward(input_ids, labels) returns an
    object with .loss like a transformers model."""

    def __init__(self, vocab=256, hidden=32, heads=4):
        super().__init__()
        self.heads = heads
        self.embed = nn.Embedding(vocab, hidden)
        self.up = nn.Linear(hidden, 4 * hidden)
        self.down = nn.Linear(4 * hidden, hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, input_ids, labels):
        x = self.embed(input_ids)
        x = x + self.down(F.gelu(self.up(x)))
        b, s, h = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + a.transpose(1, 2).reshape(b, s, h)
        logits = self.lm_head(x)
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return types.SimpleNamespace(loss=loss, logits=logits)


def _batch(vocab=256, b=8, s=64):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (b, s), generator=g)
    return {"input_ids": ids, "labels": ids}


def _param_bytes(model):
    return sum(p.numel() * p.element_size() for p in model.parameters())


def test_exact_categories_on_a_plain_module():
    torch.manual_seed(0)
    model = TinyLM()
    report = profile_step(model, _batch())
    n = _param_bytes(model)
    n_tensors = len(list(model.parameters()))
    assert report.method == "cpu-dispatch-tracker"
    assert report.parameters == n == report.totals["parameters"]
    assert report.totals["gradients"] == n
    # AdamW: two float32 moments per parameter and a float32 step counter per tensor
    assert report.optimizer_state == 2 * n + 4 * n_tensors == report.totals["optimizer_state"]
    assert sum(report.categories().values()) == report.peak_bytes
    # the logits' float32 log-softmax is kept by F.cross_entropy: loss scratch at the peak
    assert report.logits_loss >= 2 * 8 * 64 * 256 * 4
    assert report.attention > 0 and report.activations > 0
    fwd = report.at_forward_end
    assert fwd["activations"] > 0 and fwd["attention"] > 0 and fwd["gradients"] == 0


def test_warmup_zero_measures_the_first_step_without_optimizer_state():
    torch.manual_seed(0)
    model = TinyLM()
    report = profile_step(model, _batch(), warmup=0)
    assert report.at_forward_end["optimizer_state"] == 0
    assert report.totals["optimizer_state"] > 0


def test_user_step_fn_and_optimizer():
    torch.manual_seed(0)
    model = TinyLM()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    calls = []

    def step(m, batch, o):
        calls.append(1)
        o.zero_grad()
        m(**batch).loss.backward()
        o.step()

    report = profile_step(model, _batch(), opt, step_fn=step, warmup=0)
    assert calls == [1]
    assert report.optimizer_state == 0
    assert report.totals["gradients"] == _param_bytes(model)


def test_tracker_counts_allocations_frees_views_and_custom_op_scratch():
    @torch.library.custom_op("fusedops_memtest::scratchy", mutates_args=())
    def scratchy(x: torch.Tensor) -> torch.Tensor:
        tmp = torch.empty(100_000)  # 400 kB of scratch, freed inside the op
        tmp.fill_(1.0)
        return x + tmp[: x.numel()].view_as(x)

    tracker = CpuTracker()
    with tracker:
        a = torch.empty(1000)  # 4000 bytes
        view = a[10:].view(-1, 10)  # no new storage
        b = scratchy(torch.zeros(10))  # zeros (40), scratch (400000), result (40)
        del a, view
    tracker.stop()
    sizes = [(sign, blk.size) for sign, blk in tracker.events]
    assert (1, 4000) in sizes and (-1, 4000) in sizes
    assert (1, 400_000) in sizes and (-1, 400_000) in sizes
    assert sum(1 for sign, s in sizes if sign > 0 and s == 4000) == 1  # the view is no storage
    del b


@pytest.mark.parametrize("path,name,want", [
    ("/x/site-packages/fusedops/linear_ce/chunked.py", "fused_forward", LOSS),
    ("/x/site-packages/transformers/loss/loss_utils.py", "ForCausalLMLoss", LOSS),
    ("/x/site-packages/fusedops/attention/ops.py", "forward", ATTENTION),
    ("/x/transformers/integrations/sdpa_attention.py", "sdpa_attention_forward", ATTENTION),
    ("/x/transformers/models/llama/modeling_llama.py", "eager_attention_forward", ATTENTION),
    ("/x/fusedops/integrations/transformers.py", "fusedops_attention_forward", ATTENTION),
    ("/x/fusedops/integrations/transformers.py", "causal_lm_loss", LOSS),
    ("/x/transformers/models/llama/modeling_llama.py", "forward", None),
    ("/work/tests/attention/test_attention.py", "test_attention_runs", None),
])
def test_frame_rules(path, name, want):
    assert frame_region(path, name) == want


def test_stack_facts_innermost_region_recompute_and_backward_entry():
    frames = [("/t/torch/nn/functional.py", 1, "linear"),
              ("/t/transformers/integrations/sdpa_attention.py", 2, "sdpa_attention_forward"),
              ("/t/torch/utils/checkpoint.py", 3, "recompute_fn"),
              ("/t/transformers/loss/loss_utils.py", 4, "ForCausalLMLoss")]
    region, recompute, where = stack_facts(frames)
    assert region == ATTENTION and recompute and where.startswith("sdpa_attention.py:2")
    below_backward = [("/t/torch/_tensor.py", 5, "backward"),
                      ("/t/transformers/loss/loss_utils.py", 6, "ForCausalLMLoss")]
    assert stack_facts(below_backward)[0] is None


def test_block_category_precedence():
    assert Block(8, phase=FORWARD, frame_region=LOSS, kind="gradients").category() == "gradients"
    assert Block(8, phase=FORWARD, region=LOSS).category() == "logits_loss"
    assert Block(8, phase=BACKWARD, region=ATTENTION).category() == "attention"
    assert Block(8, phase=FORWARD).category() == "activations"
    assert Block(8, phase=BACKWARD, recompute=True).category() == "activations"
    assert Block(8, phase=BACKWARD).category() == "other"
    assert Block(8, phase=OPTIMIZER).detail() == "optimizer temporaries"


def test_cuda_trace_replay_on_a_synthetic_snapshot():
    """Address reuse within the step: the gradient mark must pick the allocation live at the
    mark, not the earlier one at the same address."""
    initial = {"segments": [{"device": 0, "address": 0x0E00, "total_size": 2048, "blocks": [
        {"size": 512, "state": "inactive"},
        {"size": 512, "state": "active_allocated"},  # at 0x1000: a parameter
        {"size": 1024, "state": "inactive"}]}]}
    sdpa = [{"filename": "/t/transformers/integrations/sdpa_attention.py", "line": 1,
             "name": "sdpa_attention_forward"}]
    trace = [
        dict(action="alloc", addr=0x2000, size=1024, frames=[]),       # 1 forward activation
        dict(action="alloc", addr=0x3000, size=2048, frames=sdpa),     # 2 attention output
        dict(action="free_requested", addr=0x2000, size=1024),
        dict(action="free_completed", addr=0x2000, size=1024),
        dict(action="alloc", addr=0x2000, size=1024, frames=[]),       # 3 backward: a gradient
        dict(action="alloc", addr=0x4000, size=4096, frames=[]),       # 4 backward, loss region
        dict(action="free_requested", addr=0x4000, size=4096),
        dict(action="segment_alloc", addr=0x8000, size=1 << 20),
    ]
    final = {"device_traces": [trace]}
    tl = Timeline()
    tl.add(0, "setup", "")
    tl.add(0, FORWARD, "")
    tl.add(2, BACKWARD, "")  # after two allocations
    tl.add(3, BACKWARD, LOSS)
    marks = [(0, 0x1000, 512, "parameters"), (3, 0x2000, 1024, "gradients")]
    base, events, n_alloc, facts = events_from_trace(initial, final, 0, tl, marks, _KIND_RANK)
    assert n_alloc == 4 and facts["trace_entries"] == len(trace)
    assert [b.size for b in base] == [512] and base[0].kind == "parameters"
    allocs = [b for s, b in events if s > 0]
    assert [b.seq for b in allocs] == [1, 2, 3, 4]
    assert allocs[0].kind is None and allocs[0].category() == "activations"
    assert allocs[1].category() == "attention"
    assert allocs[2].kind == "gradients" and allocs[2].phase == BACKWARD
    assert allocs[3].category() == "logits_loss"
    assert [s for s, _ in events] == [1, 1, -1, 1, 1, -1]


def test_report_table_json_plot_and_snapshot(tmp_path):
    torch.manual_seed(0)
    report = profile_step(TinyLM(), _batch(), label="tiny")
    json.dumps(report.to_dict())
    text = report.table()
    for word in ("parameters", "optimizer state", "logits/loss scratch", "attention scratch",
                 "total at peak"):
        assert word in text
    assert list(report.categories()) == list(CATEGORIES)
    assert report.largest and report.largest[0]["bytes"] >= report.largest[-1]["bytes"]
    with pytest.raises(ValueError, match="no CUDA memory snapshot"):
        report.save_snapshot(str(tmp_path / "s.pickle"))
    pytest.importorskip("matplotlib")
    other = MemoryReport(**{**report.categories(), "activations": 0},
                         peak_bytes=report.peak_bytes - report.activations, label="other")
    path = report.plot(str(tmp_path / "m.png"), other)
    assert (tmp_path / "m.png").stat().st_size > 1000 and path.endswith("m.png")


class FakeCudaRecorder(TorchDispatchMode):
    """Stands in for the CUDA allocator's memory history on the CPU: the storages ATen ops
    return become 'alloc' entries (address = data_ptr, Python frames innermost first) and their
    frees 'free_requested'/'free_completed' entries, numbered by a counter like the allocator's
    allocation count. profile.py's CUDA path then runs unchanged on top of it."""

    index = 0

    def __init__(self, existing):
        super().__init__()
        self.existing = existing
        self.trace, self.n_alloc, self.live, self.fins = [], 0, {}, []
        self.current = self.peak = 0

    def owns(self, t):
        return t.device.type == "cpu"

    def sync(self):
        pass

    def allocated(self):
        return sum(s.nbytes() for s in self._existing_storages())

    def max_allocated(self):
        return self.peak

    def count(self):
        return self.n_alloc

    def _existing_storages(self):
        seen = {}
        for t in self.existing:
            s = t.untyped_storage()
            seen[s.data_ptr()] = s
        return list(seen.values())

    def _watch(self, s):
        ptr, size = s.data_ptr(), s.nbytes()
        self.live[ptr] = size
        self.current += size
        self.peak = max(self.peak, self.current)

        def freed():
            if self.live.pop(ptr, None) is not None:
                self.current -= size
                self.trace.append(dict(action="free_requested", addr=ptr, size=size))
                self.trace.append(dict(action="free_completed", addr=ptr, size=size))
        self.fins.append(weakref.finalize(s, freed))

    def start(self):
        segments = []
        for s in self._existing_storages():
            segments.append(dict(device=0, address=s.data_ptr(), total_size=s.nbytes(),
                                 blocks=[dict(size=s.nbytes(), state="active_allocated")]))
            self._watch(s)
        self.__enter__()
        return {"segments": segments, "device_traces": [[]]}

    def stop(self):
        return {"segments": [], "device_traces": [list(self.trace)]}

    def close(self):
        self.__exit__(None, None, None)
        for f in self.fins:
            f.detach()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in torch.utils._pytree.tree_leaves(
            (args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in torch.utils._pytree.tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            s = t.untyped_storage()
            if s.nbytes() == 0 or s.data_ptr() in inputs or s.data_ptr() in self.live:
                continue
            frames, f = [], sys._getframe(1)
            while f is not None:
                frames.append(dict(filename=f.f_code.co_filename, line=f.f_lineno,
                                   name=f.f_code.co_name))
                f = f.f_back
            self.n_alloc += 1
            self.trace.append(dict(action="alloc", addr=s.data_ptr(), size=s.nbytes(),
                                   frames=frames))
            self._watch(s)
        return out


def test_cuda_path_on_a_fake_allocator_history_matches_the_cpu_tracker():
    """profile.py's CUDA path (allocation-count timeline, marks resolved in the replay) gives
    the same breakdown as the CPU tracker for the same step."""
    batch = _batch()
    torch.manual_seed(0)
    cpu_report = profile_step(TinyLM(), batch, warmup=1)

    torch.manual_seed(0)
    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    default_step(model, batch, opt)  # the same warm-up step
    existing = [*model.parameters(), *optimizer_tensors(opt), *model.buffers(),
                *batch.values()]
    rec = FakeCudaRecorder(existing)
    report = _profile_cuda(model, batch, opt, default_step, torch.device("cpu"), "fake", 10**6,
                           recorder=rec)
    assert report.method == "cuda-snapshot"
    assert report.notes == []  # trace and counter agree, the replay peak is the recorder's
    assert report.peak_bytes == cpu_report.peak_bytes == rec.peak
    assert report.categories() == cpu_report.categories()
    assert report.at_forward_end == cpu_report.at_forward_end
    assert report.peak_phase == cpu_report.peak_phase


@pytest.mark.parametrize("argv,match", [
    (["--seq", "0"], "argument --seq: expected an integer >= 1"),
    (["--batch", "x"], "argument --batch: expected an integer >= 1"),
    (["--dtype", "bf16"], "argument --dtype: invalid choice"),
    (["--warmup", "-1"], "argument --warmup: expected an integer >= 0"),
    (["--memory-budget", "-5"], "argument --memory-budget: expected a positive number"),
])
def test_cli_refuses_bad_arguments_by_name(argv, match, capsys):
    """Bad values stop at the parser, naming the flag (--seq 0 used to run with S=256)."""
    from fusedops.memory.__main__ import main
    with pytest.raises(SystemExit):
        main(argv)
    assert match in capsys.readouterr().err
