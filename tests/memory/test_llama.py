"""The planner against measured numbers of tiny transformers Llama models on the CPU, the CLI,
and the fusedops integration where it is installed."""

import json
import os
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

from fusedops.memory import ModelShape, plan, profile_step  # noqa: E402
from fusedops.memory.configs import build_llama  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CFG = dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, head_dim=16, vocab_size=512, tie_word_embeddings=True,
           max_position_embeddings=1024, rms_norm_eps=1e-5)
B, S = 2, 128


def _measure(dtype="float32", attn="sdpa", checkpointing=False, fused=False, cfg=CFG):
    model = build_llama(cfg, dtype=getattr(torch, dtype), attn_implementation=attn)
    if checkpointing:
        enable = (getattr(model, "activation_checkpointing_enable", None)
                  or model.gradient_checkpointing_enable)  # the old name in transformers < 5.19
        enable()
    if fused:
        from fusedops.integrations.transformers import apply_fusedops
        model = apply_fusedops(model, mlp=True)
    ids = torch.randint(0, cfg["vocab_size"], (B, S), generator=torch.Generator().manual_seed(0))
    report = profile_step(model, {"input_ids": ids, "labels": ids})
    est = plan(cfg, batch=B, seq=S, dtype=dtype, mixed_precision=False, device="cpu",
               activation_checkpointing=checkpointing, fused_loss=fused,
               attention_impl="fusedops" if fused else attn, fused_mlp=fused)
    return model, report, est


@pytest.mark.parametrize("dtype,attn,checkpointing", [
    ("float32", "sdpa", False), ("bfloat16", "sdpa", False), ("float32", "eager", False),
    ("float32", "sdpa", True),
])
def test_planner_matches_the_tracker(dtype, attn, checkpointing):
    if attn == "sdpa" and int(transformers.__version__.split(".")[0]) < 5:
        pytest.skip("the planner's sdpa is transformers 5's (no mask, K and V not repeated)")
    model, report, est = _measure(dtype, attn, checkpointing)
    n_params = sum(p.numel() for p in model.parameters())
    assert ModelShape.from_config(model.config).params() == n_params
    e = torch.finfo(getattr(torch, dtype)).bits // 8
    # exact: parameters, gradients, optimizer state (two moments and a step counter per tensor)
    assert report.parameters == est.parameters == n_params * e
    assert report.totals["gradients"] == est.candidates["optimizer step"]["gradients"]
    assert report.optimizer_state == est.optimizer_state
    # what the forward leaves for the backward: the activation formula
    fwd, planned = report.at_forward_end, est.candidates["loss forward"]
    assert fwd["activations"] == pytest.approx(planned["activations"], rel=0.10)
    assert fwd["attention"] == pytest.approx(planned["attention"], rel=0.10)
    assert report.peak_bytes == pytest.approx(est.peak_bytes, rel=0.10)


def test_checkpointing_reduces_measured_activations():
    _, plain, _ = _measure()
    _, ckpt, _ = _measure(checkpointing=True)
    assert ckpt.at_forward_end["activations"] < plain.at_forward_end["activations"] / 3
    assert ckpt.peak_bytes < plain.peak_bytes


def test_stock_loss_scratch_is_the_float32_log_softmax_backward():
    _, report, _ = _measure()
    assert "loss" in report.peak_phase
    assert report.logits_loss >= 12 * CFG["vocab_size"] * B * S


def test_plan_takes_a_pretrained_config():
    model = build_llama(CFG)
    assert plan(model.config, batch=B, seq=S).peak_bytes == plan(CFG, batch=B, seq=S).peak_bytes


def test_fused_loss_measured_and_planned(monkeypatch):
    pytest.importorskip("fusedops.integrations.transformers")
    monkeypatch.setenv("FUSEDOPS_LCE_MEMORY_MIB", "3")  # a budget that binds at this size
    cfg = dict(CFG, vocab_size=4096)
    _, stock, _ = _measure(cfg=cfg)
    model, fused, est = _measure(fused=True, cfg=cfg)
    assert fused.logits_loss < stock.logits_loss / 2
    assert fused.optimizer_state == est.optimizer_state
    assert fused.at_forward_end["activations"] == pytest.approx(
        est.candidates["loss forward"]["activations"], rel=0.10)
    assert fused.peak_bytes == pytest.approx(est.peak_bytes, rel=0.15)


def test_fused_mlp_measured_and_planned():
    """A wide MLP (the last layer's MLP backward sets the stock peak): swiglu's backward,
    scratch included, lowers the measured peak, and the planner follows it."""
    pytest.importorskip("fusedops.integrations.transformers")
    cfg = dict(CFG, vocab_size=256, intermediate_size=8 * CFG["intermediate_size"])
    _, stock, stock_est = _measure(cfg=cfg)
    assert max(stock_est.candidates, key=lambda k: stock_est.candidates[k]["total"]) == \
        "backward, last layer's MLP"
    _, fused, est = _measure(fused=True, cfg=cfg)
    assert fused.peak_bytes < stock.peak_bytes
    assert fused.peak_bytes == pytest.approx(est.peak_bytes, rel=0.05)


def test_cli_on_the_cpu(tmp_path):
    from fusedops.memory.__main__ import main

    rc = main(["--model", "tiny", "--seq", "64", "--batch", "1", "--device", "cpu",
               "--out", str(tmp_path)])
    assert rc == 0
    assert (tmp_path / "memory_report.json").exists()
    pytest.importorskip("matplotlib")
    assert (tmp_path / "memory.png").exists()


def test_bench_train_step_tiny_on_the_cpu(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.join(ROOT, "python")] + sys.path))
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_train_step.py"),
                          "--model", "tiny", "--seq", "64", "--steps", "1", "--warmup", "1",
                          "--methods", "eager,fusedops", "--out", str(tmp_path)],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [json.loads(r) for r in (tmp_path / "train_step.jsonl").read_text().splitlines()]
    assert rows[0]["method"] == "eager" and not rows[0]["oom"]
    for key in ("model", "params", "B", "S", "dtype", "ms", "tokens_per_s", "peak_gib",
                "loss_head_gib", "oom"):
        assert key in rows[0]
    assert "planner" in out.stdout


def _demo():
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    try:
        import demo
    finally:
        sys.path.pop(0)
    return demo


def test_demo_learns_and_both_runs_agree(capsys):
    pytest.importorskip("fusedops.integrations.transformers")
    rc = _demo().main(["--device", "cpu", "--steps", "10", "--seq", "64"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "fusedops backends: linear_ce torch, attention torch" in out and "ok:" in out


def test_demo_without_the_integration_exits_2(capsys, monkeypatch):
    """A missing integration (as on an install without it) stops the demo with exit code 2."""
    monkeypatch.setitem(sys.modules, "fusedops.integrations.transformers", None)
    assert _demo().main(["--device", "cpu", "--steps", "4"]) == 2
    assert "fusedops.integrations.transformers" in capsys.readouterr().err
