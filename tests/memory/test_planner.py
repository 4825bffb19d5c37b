"""fusedops.memory.plan: conventions, monotonic sanity and argument checks (no model is run)."""

import pytest

from fusedops.memory import CATEGORIES, ModelShape, plan
from fusedops.memory.configs import model_config

LLAMA_1B = model_config("llama-1b")


def test_llama_1b_parameter_count():
    # Llama-3.2-1B: 1,235,814,400 parameters (tied embeddings)
    assert ModelShape.from_config(LLAMA_1B).params() == 1_235_814_400
    untied = dict(LLAMA_1B, tie_word_embeddings=False)
    assert ModelShape.from_config(untied).params() == 1_235_814_400 + 128256 * 2048


def test_categories_add_up_and_peak_is_the_largest_moment():
    p = plan(LLAMA_1B, batch=1, seq=8192)
    assert sum(p.categories().values()) == p.peak_bytes
    assert p.peak_bytes == max(c["total"] for c in p.candidates.values())
    assert set(p.categories()) == set(CATEGORIES)
    text = p.table()
    assert "activations" in text and "total at peak" in text


def test_parameter_gradient_optimizer_conventions():
    n = ModelShape.from_config(LLAMA_1B).params()
    pure = plan(LLAMA_1B, batch=1, seq=1024, mixed_precision=False)
    assert pure.parameters == 2 * n
    assert pure.candidates["optimizer step"]["gradients"] == 2 * n
    assert pure.optimizer_state == 2 * 2 * n  # AdamW moments in bf16, like the parameters
    master = plan(LLAMA_1B, batch=1, seq=1024, mixed_precision=True)
    assert master.optimizer_state == 12 * n  # float32 master weights and two moments
    fp32 = plan(LLAMA_1B, batch=1, seq=1024, dtype="float32")
    assert fp32.parameters == 4 * n and fp32.optimizer_state == 8 * n  # no master copy
    assert plan(LLAMA_1B, batch=1, seq=1024, optimizer="sgd").optimizer_state == 4 * n  # master
    assert plan(LLAMA_1B, batch=1, seq=1024, optimizer="sgd",
                mixed_precision=False).optimizer_state == 0


def test_activation_formula_per_layer_and_token():
    # the module docstring's figure for Llama-3.2-1B in bf16
    assert plan(LLAMA_1B, batch=1, seq=8192).per_token_layer_bytes == 108_680


def test_checkpointing_reduces_activations():
    off = plan(LLAMA_1B, batch=1, seq=8192)
    on = plan(LLAMA_1B, batch=1, seq=8192, activation_checkpointing=True)
    a_off = off.candidates["loss backward"]["activations"]
    a_on = on.candidates["loss backward"]["activations"]
    assert a_on < a_off / 10
    assert on.peak_bytes < off.peak_bytes


def test_fused_loss_reduces_logits_scratch():
    stock = plan(LLAMA_1B, batch=1, seq=8192, fused_loss=False)
    fused = plan(LLAMA_1B, batch=1, seq=8192, fused_loss=True)
    stock_loss = max(c["logits_loss"] for c in stock.candidates.values())
    fused_loss = max(c["logits_loss"] for c in fused.candidates.values())
    assert stock_loss == 12 * 128256 * 8192 + 16 * 8192  # float32 log-softmax backward
    assert fused_loss < stock_loss / 8
    assert fused.peak_bytes < stock.peak_bytes


def test_tiled_attention_is_linear_in_seq_and_eager_quadratic():
    def attn(seq, tiled):
        p = plan(LLAMA_1B, batch=1, seq=seq, tiled_attention=tiled)
        return p.candidates["loss backward"]["attention"]
    assert attn(8192, True) == 2 * attn(4096, True)
    assert attn(8192, False) > 3.5 * attn(4096, False)


@pytest.mark.parametrize("shard", ["zero1", "zero2", "zero3", "fsdp"])
def test_sharding_divides(shard):
    one = plan(LLAMA_1B, batch=1, seq=2048)
    eight = plan(LLAMA_1B, batch=1, seq=2048, shard=shard, world_size=8)
    step1, step8 = one.candidates["optimizer step"], eight.candidates["optimizer step"]
    assert step8["optimizer_state"] == step1["optimizer_state"] // 8
    if shard in ("zero2", "zero3", "fsdp"):
        assert step8["gradients"] == step1["gradients"] // 8
    else:
        assert step8["gradients"] == step1["gradients"]
    if shard in ("zero3", "fsdp"):
        assert eight.parameters == one.parameters // 8
    else:
        assert eight.parameters == one.parameters


def test_best_switch():
    stock = plan(LLAMA_1B, batch=1, seq=8192, fused_loss=False, tiled_attention=False)
    best = stock.best_switch()
    assert best.name == "tiled_attention" and best.saving_bytes > 0
    assert best.peak_bytes == best.plan.peak_bytes == stock.peak_bytes - best.saving_bytes
    assert "saves" in str(best)
    sdpa = plan(LLAMA_1B, batch=1, seq=8192, fused_loss=False)
    assert sdpa.best_switch().name in ("fused_loss", "activation_checkpointing")
    everything = plan(LLAMA_1B, batch=1, seq=8192, activation_checkpointing=True)
    assert everything.best_switch() is None or everything.best_switch().saving_bytes > 0
    sharded = plan(LLAMA_1B, batch=1, seq=512, activation_checkpointing=True, world_size=8)
    assert sharded.best_switch().name == "shard"


def test_loss_budget():
    """At the default 512 MiB the fused loss's chunk is Llama-3.2-1B's planned peak at 8192
    tokens; loss_budget is the largest whole budget at which it is not, and one MiB more makes it
    the peak again. Elsewhere (the loss not at the peak, or the stock loss) it is None."""
    fused = plan(LLAMA_1B, batch=1, seq=8192, mixed_precision=False, attention_impl="fusedops")
    assert fused.peak_phase == "loss forward"
    budget = fused.loss_budget()
    assert budget is not None and 3 <= budget < 512
    at = plan(LLAMA_1B, batch=1, seq=8192, mixed_precision=False, attention_impl="fusedops",
              memory_budget_mib=budget)
    above = plan(LLAMA_1B, batch=1, seq=8192, mixed_precision=False, attention_impl="fusedops",
                 memory_budget_mib=budget + 1)
    assert at.peak_phase != "loss forward" and at.peak_bytes < fused.peak_bytes
    assert above.peak_phase == "loss forward"
    assert at.loss_budget() is None
    assert plan(LLAMA_1B, batch=1, seq=8192, fused_loss=False).loss_budget() is None
    # best_switch considers the budget; checkpointing saves more here.
    best = fused.best_switch()
    assert best.name == "activation_checkpointing"
    assert best.saving_bytes > fused.peak_bytes - at.peak_bytes > 0


def test_bad_arguments():
    with pytest.raises(ValueError, match="dtype"):
        plan(LLAMA_1B, batch=1, seq=8, dtype="int8")
    with pytest.raises(ValueError, match="shard"):
        plan(LLAMA_1B, batch=1, seq=8, shard="zero4")
    with pytest.raises(ValueError, match="optimizer"):
        plan(LLAMA_1B, batch=1, seq=8, optimizer="lion")
    with pytest.raises(ValueError, match="batch"):
        plan(LLAMA_1B, batch=0, seq=8)


def test_bad_arguments_are_named_and_devices_normalised():
    """device spellings of one type give one plan; sizes, flags, budgets and configs are
    checked by name (they used to give other numbers, negative bytes or unnamed errors)."""
    import torch

    base = plan(LLAMA_1B, batch=1, seq=1024, device="cuda").peak_bytes
    for dev in ("cuda:0", torch.device("cuda")):
        assert plan(LLAMA_1B, batch=1, seq=1024, device=dev).peak_bytes == base
    for bad in ("tpu", "CPU", ""):
        with pytest.raises(ValueError, match="device must be 'cuda' or 'cpu'"):
            plan(LLAMA_1B, batch=1, seq=8, device=bad)
    for kw, exc, match in [
        (dict(batch=1.5), TypeError, "batch must be an int"),
        (dict(batch=True), TypeError, "batch must be an int"),
        (dict(seq="8"), TypeError, "seq must be an int"),
        (dict(world_size=0), ValueError, "world_size must be >= 1"),
        (dict(fused_loss="no"), TypeError, "fused_loss must be a bool"),
        (dict(memory_budget_mib=-100), ValueError, "memory_budget_mib must be a positive"),
        (dict(memory_budget_mib=float("nan")), ValueError, "memory_budget_mib must not be NaN"),
        (dict(tiled_attention=False, attention_impl="sdpa"), ValueError, "contradicts"),
    ]:
        with pytest.raises(exc, match=match):
            plan(LLAMA_1B, **{"batch": 1, "seq": 8, **kw})
    for cfg, exc, match in [
        ("llama-1b", TypeError, "model_config"),
        ({**LLAMA_1B, "vocab_size": None}, ValueError, "config has no vocab_size"),
        ({**LLAMA_1B, "hidden_size": -128}, ValueError, "hidden_size must be a positive"),
        ({**LLAMA_1B, "hidden_size": 128.7}, ValueError, "hidden_size must be a positive"),
        ({**LLAMA_1B, "num_attention_heads": 0}, ValueError, "num_attention_heads"),
    ]:
        with pytest.raises(exc, match=match):
            plan(cfg, batch=1, seq=8)
