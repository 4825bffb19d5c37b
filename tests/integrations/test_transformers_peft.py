"""apply_fusedops with PEFT adapters, and with other wrappers of a model's forward, on CPU."""

from __future__ import annotations

import types

import pytest
import torch

pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from hf_models import FAMILIES, batch, model_pair, reference_loss, rel_err  # noqa: E402

import fusedops.integrations.transformers as fo_hf  # noqa: E402

ATTN_MLP = ["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"]


def _lora(model, **kw):
    torch.manual_seed(3)
    cfg = peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, **kw)
    return peft.get_peft_model(model, cfg)


def _step(model, inputs, labels):
    model.train()
    model.zero_grad(set_to_none=True)
    out = model(**inputs, labels=labels, use_cache=False)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out, grads


def _check_against_stock(cand, ref, kind="right"):
    inputs, labels = batch(kind)
    out, grads = _step(cand, inputs, labels)
    assert out.logits is None  # the fused loss ran
    ref.train()
    ref.zero_grad(set_to_none=True)
    ref_out = ref(**inputs, use_cache=False)
    want = reference_loss(ref_out.logits, labels)
    if getattr(ref_out, "aux_loss", None) is not None:  # a mixture's router loss
        base = ref.get_base_model() if isinstance(ref, peft.PeftModel) else ref
        want = want + base.router_aux_loss_coef * ref_out.aux_loss
    want.backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    assert rel_err(out.loss, want) < 1e-10
    assert grads.keys() == ref_grads.keys() and grads
    worst = max(grads, key=lambda n: rel_err(grads[n], ref_grads[n]))
    assert rel_err(grads[worst], ref_grads[worst]) < 1e-10, worst


@pytest.mark.parametrize("order", ["fusedops_first", "peft_first"])
@pytest.mark.parametrize("family", [f for f in ("llama", "qwen2_moe") if f in FAMILIES])
def test_lora(family, order):
    """LoRA on attention and MLP projections: the fused loss, attention and swiglu run through
    the adapters (their gradients are stock's); apply_fusedops takes the PEFT model itself."""
    ref, cand = model_pair(family, torch.float64)
    target = ATTN_MLP if family == "llama" else ["q_proj", "v_proj"]
    ref = _lora(ref, target_modules=target)
    if order == "fusedops_first":
        cand = _lora(fo_hf.apply_fusedops(cand), target_modules=target)
    else:
        cand = _lora(cand, target_modules=target)
        assert fo_hf.apply_fusedops(cand) is cand
    base = cand.get_base_model()
    assert base.config._attn_implementation == "fusedops"
    if family == "llama":
        assert all(getattr(layer.mlp, "_fusedops_mlp", False) for layer in base.model.layers)
    _check_against_stock(cand, ref)


@pytest.mark.parametrize("order", ["fusedops_first", "peft_first"])
def test_lm_head_in_modules_to_save(order):
    """modules_to_save=["lm_head"] (a trained copy of the head, e.g. for new tokens): each
    copy the wrapper may call gets the fused forward."""
    ref, cand = model_pair("llama", torch.float64)
    kw = dict(target_modules=["q_proj"], modules_to_save=["lm_head"])
    ref = _lora(ref, **kw)
    if order == "fusedops_first":
        cand = _lora(fo_hf.apply_fusedops(cand, memory_budget_mib=64), **kw)
    else:
        cand = fo_hf.apply_fusedops(_lora(cand, **kw), memory_budget_mib=64)
    head = cand.get_base_model().lm_head
    copies = [head.original_module, *head.modules_to_save.values()]
    with torch.no_grad():  # the trained copy differs from the original
        for m in head.modules_to_save.values():
            m.weight.mul_(1.5)
        for m in ref.get_base_model().lm_head.modules_to_save.values():
            m.weight.mul_(1.5)
    _check_against_stock(cand, ref)
    assert all(getattr(m, "_fusedops_memory_budget_mib", None) == 64 for m in copies)
    assert any("modules_to_save" in n and "lm_head" in n for n, p in cand.named_parameters()
               if p.requires_grad)


def test_lora_on_the_lm_head_is_refused_by_name():
    """LoRA on the head changes its product: refused before anything is patched, or at the
    first fused loss when added after apply_fusedops; linear_ce=False keeps it working."""
    _, cand = model_pair("llama", torch.float32)
    cand = _lora(cand, target_modules=["q_proj", "lm_head"])
    with pytest.raises(TypeError, match=r"peft\.tuners\.lora\.layer\.Linear.*linear_ce=False"):
        fo_hf.apply_fusedops(cand)
    base = cand.get_base_model()
    assert base.config._attn_implementation == "eager"  # nothing changed
    assert not any(getattr(m, "_fusedops_mlp", False) for m in base.modules())
    fo_hf.apply_fusedops(cand, linear_ce=False)
    inputs, labels = batch("right")
    out, grads = _step(cand, inputs, labels)
    assert out.logits is not None and any("lm_head.lora_A" in n for n in grads)

    _, late = model_pair("llama", torch.float32)
    late = _lora(fo_hf.apply_fusedops(late), target_modules=["lm_head"])
    with pytest.raises(TypeError, match=r"peft\.tuners\.lora\.layer\.Linear"):
        _step(late, inputs, labels)


def test_merge_and_unload_keeps_the_fused_model():
    ref, cand = model_pair("llama", torch.float64)
    ref = _lora(ref, target_modules=ATTN_MLP).merge_and_unload()
    cand = _lora(fo_hf.apply_fusedops(cand), target_modules=ATTN_MLP).merge_and_unload()
    assert type(cand).__name__ == "LlamaForCausalLM"
    for model in (ref, cand):  # merged: train every weight
        model.requires_grad_(True)
    _check_against_stock(cand, ref)


def test_quantised_or_custom_head_is_refused():
    """A head whose class has its own forward (a quantised Linear, say) is not read as a plain
    weight."""
    class Custom(torch.nn.Linear):
        def forward(self, x):
            return super().forward(x) * 2

    _, cand = model_pair("llama", torch.float32)
    old = cand.lm_head
    cand.lm_head = Custom(old.in_features, old.out_features, bias=False)
    with pytest.raises(TypeError, match="Custom"):
        fo_hf.apply_fusedops(cand)


def test_a_forward_replaced_by_another_library_is_not_overwritten():
    """TRL's trainers replace the model's forward with their own LM head; apply_fusedops then
    refuses (naming it) rather than undo it silently; linear_ce=False is still allowed."""
    _, cand = model_pair("llama", torch.float32)
    original = cand.forward

    def trl_like_forward(self, *args, fused_lm_head=False, **kwargs):
        return original(*args, **kwargs)

    cand.forward = types.MethodType(trl_like_forward, cand)
    with pytest.raises(ValueError, match=r"trl_like_forward.*before building the trainer"):
        fo_hf.apply_fusedops(cand)
    assert cand.config._attn_implementation == "eager"
    fo_hf.apply_fusedops(cand, linear_ce=False)
    assert cand.config._attn_implementation == "fusedops"


def test_accelerate_hook_keeps_wrapping_the_fused_forward():
    """A model dispatched by accelerate (device_map) has a hook wrapping its forward: the fused
    forward goes under the hook, which keeps running."""
    hooks = pytest.importorskip("accelerate.hooks")

    class Counting(hooks.ModelHook):
        calls = 0

        def pre_forward(self, module, *args, **kwargs):
            Counting.calls += 1
            return args, kwargs

    ref, cand = model_pair("llama", torch.float64)
    hooks.add_hook_to_module(cand, Counting())
    fo_hf.apply_fusedops(cand)
    _check_against_stock(cand, ref)
    assert Counting.calls == 1
    hooks.remove_hook_from_module(cand)  # the fused forward stays
    _check_against_stock(cand, ref)

    # A foreign forward beneath a hook is refused as one without.
    _, other = model_pair("llama", torch.float32)
    original = other.forward
    other.forward = types.MethodType(lambda self, *a, **kw: original(*a, **kw), other)
    hooks.add_hook_to_module(other, Counting())
    with pytest.raises(ValueError, match="already replaced"):
        fo_hf.apply_fusedops(other)
