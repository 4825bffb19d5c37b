"""fusedops.integrations.transformers against stock transformers, on CPU with tiny models."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_models import (  # noqa: E402
    FAMILIES,
    MOE,
    SEQ,
    SWIGLU_MLP,
    VOCAB,
    batch,
    config,
    model_pair,
    reference_loss,
    rel_err,
    swiglu_mlps,
)

import fusedops.integrations.transformers as fo_hf  # noqa: E402

KINDS = ("unpadded", "right", "left", "packed")


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _run(model, inputs, labels, **kw):
    model.zero_grad(set_to_none=True)
    out = model(**inputs, labels=labels, use_cache=False, **kw)
    out.loss.backward()
    return out, _grads(model)


def _compare(family, kind, dtype, tol, num_items=False):
    ref, cand = model_pair(family, dtype)
    fo_hf.apply_fusedops(cand, mlp=True)
    assert cand.config._attn_implementation == "fusedops"
    ref.train()
    cand.train()
    inputs, labels = batch(kind)
    kw = {}
    if num_items:
        kw["num_items_in_batch"] = torch.tensor(2 * int((labels[..., 1:] != -100).sum()))
    out, grads = _run(cand, inputs, labels, **kw)
    assert out.logits is None
    ref.zero_grad(set_to_none=True)
    if dtype == torch.float64:  # stock loss rounds logits to float32: the formula in float64
        ref_out = ref(**inputs, use_cache=False)
        ref_loss = reference_loss(ref_out.logits, labels, kw.get("num_items_in_batch"))
        if getattr(ref_out, "aux_loss", None) is not None:  # a mixture of experts' router loss
            ref_loss = ref_loss + ref.router_aux_loss_coef * ref_out.aux_loss
    else:  # the stock loss itself
        ref_out = ref(**inputs, labels=labels, use_cache=False, **kw)
        ref_loss = ref_out.loss
    assert type(out) is type(ref_out)
    if family in MOE:
        assert rel_err(out.aux_loss, ref_out.aux_loss) < tol
        assert len(out.router_logits) == len(ref_out.router_logits) > 0
    ref_loss.backward()
    ref_grads = _grads(ref)
    assert out.loss.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert rel_err(out.loss, ref_loss) < tol, (out.loss.item(), ref_loss.item())
    assert grads.keys() == ref_grads.keys()
    worst = max(grads, key=lambda n: rel_err(grads[n], ref_grads[n]))
    assert rel_err(grads[worst], ref_grads[worst]) < tol, worst


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_loss_and_grads_float64(family, kind):
    _compare(family, kind, torch.float64, 1e-10)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_loss_and_grads_float32(family, kind):
    _compare(family, kind, torch.float32, 1e-5)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_num_items_in_batch(family):
    _compare(family, "right", torch.float64, 1e-10, num_items=True)
    _compare(family, "packed", torch.float32, 1e-5, num_items=True)


def test_window_and_softcap_matter():
    """The tiny models are sensitive to what the tests check: windows and softcaps change the
    loss (so agreement above is not by accident)."""
    inputs, labels = batch("unpadded")
    for family, change in (("mistral", dict(sliding_window=None)),
                           ("gemma2", dict(attn_logit_softcapping=None)),
                           ("gemma2", dict(final_logit_softcapping=None)),
                           ("qwen2", dict(use_sliding_window=False)),
                           ("gemma3", dict(final_logit_softcapping=None)),
                           ("granite", dict(logits_scaling=1.0)),
                           ("cohere", dict(logit_scale=1.0)),
                           ("mixtral", dict(router_aux_loss_coef=0.0))):
        a, _ = model_pair(family, torch.float64)
        b, _ = model_pair(family, torch.float64, **change)
        la = a(**inputs, labels=labels).loss
        lb = b(**inputs, labels=labels).loss
        assert abs(la.item() - lb.item()) > 1e-4, (family, change)


@pytest.mark.parametrize("family", ["llama", "gemma3", "granite", "cohere", "qwen3_moe"])
def test_logits_contract(family):
    _logits_contract(family)


def test_cohere_scale_is_the_models_own():
    """Cohere's forward multiplies by the model's logit_scale attribute (set from the config):
    the fused loss follows the attribute too."""
    ref, cand = model_pair("cohere", torch.float64)
    fo_hf.apply_fusedops(cand)
    for m in (ref, cand):
        m.logit_scale = 0.7
        m.train()
    inputs, labels = batch("right")
    want = reference_loss(ref(**inputs, use_cache=False).logits, labels)
    assert rel_err(cand(**inputs, labels=labels, use_cache=False).loss, want) < 1e-10


def _logits_contract(family):
    """Without labels (or in eval) the logits are stock's, with the model's scale and softcap;
    the fused loss equals the stock loss of those logits (a mixture's router loss included)."""
    ref, cand = model_pair(family, torch.float32)
    fo_hf.apply_fusedops(cand)
    inputs, labels = batch("unpadded")
    cand.train()
    ref.train()
    out = cand(**inputs, labels=labels)
    assert out.logits is None and out.loss is not None
    # No labels: logits as stock, also with logits_to_keep.
    torch.testing.assert_close(cand(**inputs).logits, ref(**inputs).logits, rtol=1e-5, atol=1e-5)
    kept = cand(**inputs, logits_to_keep=1).logits
    assert kept.shape == (2, 1, VOCAB)
    torch.testing.assert_close(kept, ref(**inputs, logits_to_keep=1).logits, rtol=1e-5,
                               atol=1e-5)
    # Eval with labels: logits and the stock loss; skip_logits=True forces the fused loss.
    cand.eval()
    ref.eval()
    with torch.no_grad():
        out = cand(**inputs, labels=labels)
        ref_out = ref(**inputs, labels=labels)
        assert out.logits is not None
        torch.testing.assert_close(out.loss, ref_out.loss, rtol=1e-5, atol=1e-6)
        fused = cand(**inputs, labels=labels, skip_logits=True)
        assert fused.logits is None
        torch.testing.assert_close(fused.loss, ref_out.loss, rtol=1e-5, atol=1e-6)
        # shift_labels given directly, and return_dict=False
        shift = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]
        fused = cand(**inputs, shift_labels=shift, skip_logits=True, return_dict=False)
        assert isinstance(fused, tuple)
        torch.testing.assert_close(fused[0], ref_out.loss, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="skip_logits"):
        cand(**inputs, skip_logits=True)


@pytest.mark.parametrize("family", sorted(MOE & FAMILIES.keys()))
def test_router_loss_follows_output_router_logits(family):
    """A mixture's router loss is added when output_router_logits is on (the config's value or
    the call's), as in the stock forward, and left out otherwise."""
    inputs, labels = batch("right")
    for config_flag in (False, True):
        ref, cand = model_pair(family, torch.float64, output_router_logits=config_flag)
        fo_hf.apply_fusedops(cand)
        ref.train()
        cand.train()
        for call_flag in (None, not config_flag):
            kw = {} if call_flag is None else dict(output_router_logits=call_flag)
            on = config_flag if call_flag is None else call_flag
            out = cand(**inputs, labels=labels, **kw)
            ref_out = ref(**inputs, **kw)
            want = reference_loss(ref_out.logits, labels)
            assert (out.aux_loss is not None) == on == (ref_out.aux_loss is not None)
            if on:
                want = want + ref.router_aux_loss_coef * ref_out.aux_loss
                assert len(out.router_logits) == cand.config.num_hidden_layers
            assert rel_err(out.loss, want) < 1e-10, (config_flag, call_flag)


@pytest.mark.parametrize("kind", ["unpadded", "right", "packed"])
@pytest.mark.parametrize("family", ["llama", "gemma2", "granite"])
def test_autocast_training(family, kind):
    """Mixed precision (float32 weights under torch.autocast, as Trainer's bf16=True runs):
    rotary embeddings leave q and k in float32 while v is bfloat16; the step runs and its loss
    and gradients are as close to float32's as stock's under the same autocast. (Not a mixture
    of experts: bfloat16 rounding flips its top-k choices, stock's and fusedops' differently.)"""
    ref, cand = model_pair(family, torch.float32)  # eager: sdpa has no softcap
    exact = copy.deepcopy(ref)
    fo_hf.apply_fusedops(cand)
    inputs, labels = batch(kind)
    results = {}
    for name, model, amp in (("exact", exact, False), ("stock", ref, True),
                             ("fused", cand, True)):
        model.train()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            out = model(**inputs, labels=labels, use_cache=False)
        model.zero_grad(set_to_none=True)
        out.loss.backward()
        results[name] = out.loss.detach(), _grads(model)
    loss, grads = results["exact"]
    for name in ("stock", "fused"):
        assert results[name][1].keys() == grads.keys()
    err = {name: max(rel_err(results[name][1][n], grads[n]) for n in grads)
           for name in ("stock", "fused")}
    assert err["fused"] <= 2 * err["stock"] + 1e-3, err
    assert abs(results["fused"][0] - loss) <= 2 * abs(results["stock"][0] - loss) + 1e-3


@pytest.mark.parametrize("kind", ["unpadded", "right", "packed"])
def test_torch_compile_training(kind):
    """torch.compile(model) (Trainer's torch_compile=True) over the patched model: the fused
    attention, loss and swiglu compile (graph breaks allowed where the padding is read) and
    train as in eager mode."""
    torch._dynamo.reset()
    eager, cand = model_pair("mixtral" if kind == "right" else "llama", torch.float32)
    for m in (eager, cand):
        fo_hf.apply_fusedops(m)
        m.train()
    inputs, labels = batch(kind)
    compiled = torch.compile(cand, backend="aot_eager")
    out, _ = _run(compiled, inputs, labels)
    grads = _grads(cand)
    want, want_grads = _run(eager, inputs, labels)
    assert out.logits is None
    assert rel_err(out.loss, want.loss) < 1e-6
    assert grads.keys() == want_grads.keys()
    assert max(rel_err(grads[n], want_grads[n]) for n in grads) < 1e-5


def test_outputs_pass_through():
    ref, cand = model_pair("qwen3", torch.float32)
    fo_hf.apply_fusedops(cand)
    inputs, labels = batch("unpadded")
    cand.train()
    out = cand(**inputs, labels=labels, output_hidden_states=True, use_cache=True)
    ref_out = ref(**inputs, labels=labels, output_hidden_states=True, use_cache=True)
    assert type(out) is type(ref_out)
    assert len(out.hidden_states) == len(ref_out.hidden_states) == 3
    assert out.past_key_values is not None
    torch.testing.assert_close(out.hidden_states[-1], ref_out.hidden_states[-1], rtol=1e-5,
                               atol=1e-5)


def test_idempotent_and_flags():
    ref, cand = model_pair("mistral", torch.float64)
    assert fo_hf.apply_fusedops(cand) is cand
    forward = cand.forward
    fo_hf.apply_fusedops(cand)
    assert cand.forward == forward
    inputs, labels = batch("left")
    cand.train()
    ref.train()
    a = cand(**inputs, labels=labels).loss
    b = reference_loss(ref(**inputs).logits, labels)
    assert rel_err(a, b) < 1e-10
    # attention only / loss only
    _, only_attn = model_pair("llama", torch.float32)
    fo_hf.apply_fusedops(only_attn, linear_ce=False)
    assert only_attn.config._attn_implementation == "fusedops"
    only_attn.train()
    assert only_attn(**batch("right")[0], labels=batch("right")[1]).logits is not None
    _, only_loss = model_pair("llama", torch.float32)
    fo_hf.apply_fusedops(only_loss, attention=False)
    assert only_loss.config._attn_implementation == "eager"
    only_loss.train()
    assert only_loss(**batch("right")[0], labels=batch("right")[1]).logits is None
    with pytest.raises(TypeError, match="attention"):
        fo_hf.apply_fusedops(only_loss, attention=1)


@pytest.mark.parametrize("family", FAMILIES)
def test_mlp_runs_swiglu(family, monkeypatch):
    """mlp=True routes every SiLU MLP's product through fusedops.swiglu with the in-place
    backward in training (not Gemma's tanh-GELU MLPs, Phi-3's fused gate_up_proj or the
    experts of a mixture); the gradients then match stock (the
    parity tests above run with it); it is the default, and mlp=False leaves the MLPs alone."""
    from fusedops.integrations.transformers import mlp as fo_mlp

    calls, original = [], fo_mlp.swiglu

    def counted(gate, up, **kw):
        calls.append(kw["inplace_backward"])
        return original(gate, up, **kw)

    monkeypatch.setattr(fo_mlp, "swiglu", counted)
    ref, cand = model_pair(family, torch.float64)
    fo_hf.apply_fusedops(cand, mlp=True)
    expected = swiglu_mlps(family, ref)
    patched = sum(getattr(m, "_fusedops_mlp", False) for m in cand.modules())
    assert patched == expected
    cand.train()
    inputs, labels = batch("unpadded")
    _run(cand, inputs, labels)
    # An expert runs only on the tokens routed to it: count calls where each MLP runs once.
    per_token = expected == (cand.config.num_hidden_layers if family in SWIGLU_MLP else 0)
    assert len(calls) == expected if per_token else len(calls) > 0
    assert all(calls)
    calls.clear()
    with torch.no_grad():
        cand.eval()
        cand(**inputs, use_cache=False)
    assert (len(calls) == expected if per_token else len(calls) > 0) and not any(calls)
    _, default = model_pair(family, torch.float64)
    fo_hf.apply_fusedops(default)
    assert sum(getattr(m, "_fusedops_mlp", False) for m in default.modules()) == patched
    _, plain = model_pair(family, torch.float64)
    fo_hf.apply_fusedops(plain, mlp=False)
    assert not any(getattr(m, "_fusedops_mlp", False) for m in plain.modules())
    with pytest.raises(TypeError, match="mlp"):
        fo_hf.apply_fusedops(plain, mlp="yes")


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_gradient_checkpointing(family, reentrant):
    """Activation checkpointing (both kinds): the recomputed layers run fusedops attention
    and swiglu's in-place backward; the gradients still match stock."""
    ref, cand = model_pair(family, torch.float64)
    fo_hf.apply_fusedops(cand, mlp=True)
    for m in (ref, cand):
        m.train()
        if hasattr(m, "activation_checkpointing_enable"):  # transformers >= 5.19
            m.activation_checkpointing_enable({"use_reentrant": reentrant})
        else:
            m.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    inputs, labels = batch("unpadded")
    out, g = _run(cand, inputs, labels)
    ref.zero_grad(set_to_none=True)
    ref_loss = reference_loss(ref(**inputs, use_cache=False).logits, labels)
    ref_loss.backward()
    g_ref = _grads(ref)
    assert rel_err(out.loss, ref_loss) < 1e-10
    assert g.keys() == g_ref.keys()
    for name in g_ref:
        assert rel_err(g[name], g_ref[name]) < 1e-9, name


def test_memory_budget_reaches_the_loss():
    """apply_fusedops(memory_budget_mib=...) is the fused loss's scratch budget: a budget below
    the loss's fixed 2 MiB is refused by the loss itself, one just above it (two token chunks
    here) gives stock's loss and gradients, and patching again replaces it."""
    ref, cand = model_pair("llama", torch.float64)
    inputs, labels = batch("right")
    ref.train()
    cand.train()
    fo_hf.apply_fusedops(cand, memory_budget_mib=1)
    with pytest.raises(ValueError, match="memory_budget_mib=1.000 is too small"):
        cand(**inputs, labels=labels, use_cache=False)
    fo_hf.apply_fusedops(cand, memory_budget_mib=2.05)
    out, grads = _run(cand, inputs, labels)
    ref_loss = reference_loss(ref(**inputs, use_cache=False).logits, labels)
    ref_loss.backward()
    assert rel_err(out.loss, ref_loss) < 1e-10
    for name, g in _grads(ref).items():
        assert rel_err(grads[name], g) < 1e-10, name
    fo_hf.apply_fusedops(cand)  # back to the default budget
    assert cand(**inputs, labels=labels, use_cache=False).loss is not None
    for bad in (0, -5, "128", True):
        with pytest.raises(ValueError, match="memory_budget_mib"):
            fo_hf.apply_fusedops(cand, memory_budget_mib=bad)


def test_filter_eps_reaches_the_loss():
    """apply_fusedops(filter_eps=...) is the fused loss's gradient filtering: the loss stays
    stock's, the LM head's gradient is linear_cross_entropy's with that filter_eps on the same
    hidden states (and differs from the exact one), and patching again without it is exact."""
    from fusedops.linear_ce import linear_cross_entropy

    ref, cand = model_pair("llama", torch.float64)
    inputs, labels = batch("right")
    labels = torch.where(labels >= 0, labels % 128, labels)  # no target in vocab block 1 ...
    ref.train()
    cand.train()
    eps = 0.5  # ... whose probabilities (below 0.1 here) all lie below eps: the block drops
    fo_hf.apply_fusedops(cand, filter_eps=eps)
    seen = []
    hook = cand.model.register_forward_hook(
        lambda mod, args, out: seen.append(out.last_hidden_state.detach()))
    out, grads = _run(cand, inputs, labels)
    hook.remove()
    ref_loss = reference_loss(ref(**inputs, use_cache=False).logits, labels)
    ref_loss.backward()
    g_ref = _grads(ref)
    assert rel_err(out.loss, ref_loss) < 1e-10
    w = cand.lm_head.weight.detach().clone().requires_grad_(True)
    shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:]
    linear_cross_entropy(seen[0], w, shifted, filter_eps=eps).backward()
    assert rel_err(grads["lm_head.weight"], w.grad) < 1e-12
    assert rel_err(grads["lm_head.weight"], g_ref["lm_head.weight"]) > 1e-6
    fo_hf.apply_fusedops(cand)  # back to exact gradients
    _, grads = _run(cand, inputs, labels)
    for name, g in g_ref.items():
        assert rel_err(grads[name], g) < 1e-9, name
    for bad in (-0.1, 1.0, "0.1", True):
        with pytest.raises(ValueError, match="filter_eps"):
            fo_hf.apply_fusedops(cand, filter_eps=bad)


def test_memory_budget_on_a_class():
    from transformers import LlamaForCausalLM

    class Small(LlamaForCausalLM):
        pass

    fo_hf.apply_fusedops(Small, memory_budget_mib=1)
    model = Small(config("llama")).to(torch.float64)
    model.train()
    inputs, labels = batch("right")
    with pytest.raises(ValueError, match="memory_budget_mib=1.000 is too small"):
        model(**inputs, labels=labels, use_cache=False)


def test_patch_class_before_from_pretrained(tmp_path):
    class TinyLlama(transformers.LlamaForCausalLM):
        pass

    ref, _ = model_pair("llama", torch.float32)
    ref.save_pretrained(tmp_path)
    assert fo_hf.apply_fusedops(TinyLlama) is TinyLlama
    fo_hf.apply_fusedops(TinyLlama)
    model = TinyLlama.from_pretrained(tmp_path, attn_implementation="eager")
    assert model.config._attn_implementation == "fusedops"
    built = TinyLlama(config("llama"))
    assert built.config._attn_implementation == "fusedops"
    # The stock class is untouched.
    assert transformers.LlamaForCausalLM(config("llama")).config._attn_implementation == "eager"
    inputs, labels = batch("right")
    model.train()
    ref.train()
    out = model(**inputs, labels=labels)
    assert out.logits is None
    torch.testing.assert_close(out.loss, ref(**inputs, labels=labels).loss, rtol=1e-5,
                               atol=1e-6)


def test_load_with_attn_implementation_fusedops(tmp_path):
    ref, _ = model_pair("gemma2", torch.float32)
    ref.save_pretrained(tmp_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path,
                                                              attn_implementation="fusedops")
    assert model.config._attn_implementation == "fusedops"
    inputs, _ = batch("left")
    valid = inputs["attention_mask"].bool()
    torch.testing.assert_close(model(**inputs).logits[valid], ref(**inputs).logits[valid],
                               rtol=1e-5, atol=1e-5)


def test_trainer_step(tmp_path):
    pytest.importorskip("accelerate")  # Trainer needs it; transformers does not install it
    from torch.utils.data import Dataset
    from transformers import Trainer, TrainingArguments

    class Tokens(Dataset):
        def __init__(self):
            g = torch.Generator().manual_seed(3)
            self.ids = torch.randint(3, VOCAB, (8, 16), generator=g)

        def __len__(self):
            return len(self.ids)

        def __getitem__(self, i):
            return {"input_ids": self.ids[i], "labels": self.ids[i]}

    losses = {}
    for name in ("stock", "fused"):
        ref, cand = model_pair("llama", torch.float32)
        model = ref if name == "stock" else fo_hf.apply_fusedops(cand)
        args = TrainingArguments(output_dir=str(tmp_path / name), per_device_train_batch_size=4,
                                 max_steps=4, learning_rate=3e-3, logging_steps=1,
                                 report_to=[], use_cpu=True, save_strategy="no",
                                 gradient_accumulation_steps=1, dataloader_num_workers=0,
                                 disable_tqdm=True, seed=0)
        trainer = Trainer(model=model, args=args, train_dataset=Tokens())
        trainer.train()
        losses[name] = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses["fused"]) == 4
    assert abs(losses["fused"][0] - losses["stock"][0]) < 1e-4 * abs(losses["stock"][0])
    assert losses["fused"][-1] < losses["fused"][0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("family", ["llama", "mistral", "gemma2", "gemma3", "granite",
                                    "qwen3_moe"])
def test_generate_greedy(family, dtype, monkeypatch):
    """Greedy generate() equals stock's; the decode steps of the unpadded prompt run
    attention_with_kvcache (every layer, every step after the prefill), the left-padded batch
    the packed variable-length path."""
    # Stock eager gives NaN for left-padded rows in float64 (its float32 softmax turns the
    # float64 mask minimum into -inf): float64 compares with eager_exact.
    from fusedops.integrations.transformers import attention as fo_attn

    calls = []

    def counted(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    real = fo_attn.attention_with_kvcache
    monkeypatch.setattr(fo_attn, "attention_with_kvcache", counted)
    # (Stock generate of a mixture fails with a padded batch when it outputs router logits.)
    extra = dict(output_router_logits=False) if family in MOE else {}
    ref, cand = model_pair(family, dtype, **extra)
    fo_hf.apply_fusedops(cand)
    ref.eval()
    cand.eval()
    g = torch.Generator().manual_seed(5)
    prompts = torch.randint(3, VOCAB, (2, 7), generator=g)
    mask = torch.ones_like(prompts)
    mask[1, :3] = 0
    prompts = prompts.masked_fill(mask == 0, 0)
    kw = dict(max_new_tokens=10, do_sample=False, pad_token_id=0, eos_token_id=None)
    layers = cand.config.num_hidden_layers
    with torch.no_grad():
        for ids, m in ((prompts, mask), (prompts[:1, 2:], mask[:1, 2:])):
            calls.clear()
            want = ref.generate(input_ids=ids, attention_mask=m, **kw)
            got = cand.generate(input_ids=ids, attention_mask=m, **kw)
            assert got.shape == (ids.shape[0], ids.shape[1] + 10)
            assert torch.equal(got, want)
            assert all(c[1] == 1 for c in calls), calls
            if ids.shape[0] == 1:  # no padding: every decode step of every layer
                assert len(calls) == 9 * layers, calls
            else:  # padding in view: the packed path (sliding layers decode once it slid out)
                assert len(calls) < 9 * layers, calls


def test_static_cache_decode_steps_take_the_decode_path(monkeypatch):
    """A static cache: the decode step reads only the filled slots of the cache tensors."""
    from transformers import StaticCache

    from fusedops.integrations.transformers import attention as fo_attn

    calls = []
    real = fo_attn.attention_with_kvcache
    monkeypatch.setattr(fo_attn, "attention_with_kvcache",
                        lambda *a, **k: calls.append(a[3].tolist()) or real(*a, **k))
    ref, cand = model_pair("llama", torch.float64)
    fo_hf.apply_fusedops(cand)
    cand.eval()
    ids = torch.randint(3, VOCAB, (1, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = cand(ids).logits
        cache = StaticCache(config=cand.config, max_cache_len=32)
        cand(ids[:, :6], past_key_values=cache, use_cache=True)
        got = cand(ids[:, 6:], past_key_values=cache, use_cache=True,
                   cache_position=torch.arange(6, 9)).logits
    torch.testing.assert_close(got, want[:, 6:], rtol=1e-10, atol=1e-10)
    assert calls == [[9]] * cand.config.num_hidden_layers


def test_packed_from_flash_kwargs():
    """cu_seq_lens_* keyword arguments (DataCollatorWithFlattening(return_flash_attn_kwargs=True))
    give the same loss as position_ids."""
    _, cand = model_pair("qwen3", torch.float64)
    fo_hf.apply_fusedops(cand)
    cand.train()
    inputs, labels = batch("packed")
    a = cand(**inputs, labels=labels).loss
    cu = torch.tensor([0, 10, 18, 24], dtype=torch.int32)
    b = cand(**inputs, labels=labels, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=10,
             max_length_k=10).loss
    assert rel_err(a, b) < 1e-12
    c = cand(input_ids=inputs["input_ids"], labels=labels).loss  # one sequence: differs
    assert abs(a.item() - c.item()) > 1e-6


def test_unsupported_mask():
    _, cand = model_pair("llama", torch.float32)
    fo_hf.apply_fusedops(cand)
    inputs, labels = batch("unpadded")
    mask4d = torch.zeros(2, 1, SEQ, SEQ)
    with pytest.raises(ValueError, match="2-D padding mask"):
        cand(**inputs, attention_mask=mask4d, labels=labels)
    q = torch.randn(2, 4, 5, 8)
    attn = cand.model.layers[0].self_attn
    with pytest.raises(ValueError, match="bool or integer"):
        fo_hf.fusedops_attention_forward(attn, q, q, q, torch.ones(2, 5))


def test_dropout_in_training():
    _, cand = model_pair("llama", torch.float32, attention_dropout=0.1)
    fo_hf.apply_fusedops(cand)
    inputs, labels = batch("unpadded")
    cand.train()
    with pytest.raises(NotImplementedError, match="dropout"):
        cand(**inputs, labels=labels)
    cand.eval()  # no dropout in eval
    assert cand(**inputs).logits.shape == (2, SEQ, VOCAB)


def test_attention_backend_required(monkeypatch):
    """A model whose attention does not come from AttentionInterface (Qwen2-MoE before
    transformers 5) cannot take "fusedops": apply_fusedops raises before patching anything,
    instead of leaving the model on its old attention; attention=False still patches."""
    _, cand = model_pair("llama", torch.float32)
    monkeypatch.setattr(type(cand), "_can_set_attn_implementation",
                        classmethod(lambda cls: False))
    with pytest.raises(TypeError, match="attention=False"):
        fo_hf.apply_fusedops(cand)
    assert cand.config._attn_implementation == "eager"
    assert not any(getattr(m, "_fusedops_mlp", False) for m in cand.modules())
    assert "forward" not in cand.__dict__
    fo_hf.apply_fusedops(cand, attention=False)
    assert cand.config._attn_implementation == "eager" and "forward" in cand.__dict__


def test_unsupported_model():
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=2, n_positions=32))
    with pytest.raises(TypeError, match="GPT2LMHeadModel"):
        fo_hf.apply_fusedops(gpt2)
    with pytest.raises(TypeError, match="LlamaForSequenceClassification"):
        fo_hf.apply_fusedops(transformers.LlamaForSequenceClassification)


def test_lm_head_reached_through_its_module_call():
    """What FSDP2 and DeepSpeed ZeRO-3 rely on: the head's forward hooks run around the fused
    loss and the weight is read inside the call, so a hook that swaps the weight in (as ZeRO-3's
    gather does) is honoured."""
    ref, cand = model_pair("llama", torch.float64)
    fo_hf.apply_fusedops(cand)
    cand.train()
    inputs, labels = batch("right")
    head = cand.lm_head
    full = head.weight.data
    swapped = full * 1.5
    calls = []

    def gather(module, args, kwargs):
        calls.append(("pre", args[0].shape, args[1] is not None if len(args) > 1 else None))
        module.weight.data = swapped

    def release(module, args, kwargs, output):
        calls.append(("post", output.shape))
        module.weight.data = full

    h1 = head.register_forward_pre_hook(gather, with_kwargs=True)
    h2 = head.register_forward_hook(release, with_kwargs=True)
    head.weight.data = torch.empty(0, dtype=full.dtype)  # sharded away between calls
    try:
        out = cand(**inputs, labels=labels, use_cache=False)
    finally:
        h1.remove()
        h2.remove()
    assert calls == [("pre", (2, SEQ, 32), True), ("post", ())]
    assert head.weight.data_ptr() == full.data_ptr()
    out.loss.backward()
    ref.lm_head.weight.data = ref.lm_head.weight.data * 1.5
    ref_loss = reference_loss(ref(**inputs, use_cache=False).logits, labels)
    ref_loss.backward()
    assert rel_err(out.loss, ref_loss) < 1e-10
    assert rel_err(head.weight.grad, ref.lm_head.weight.grad) < 1e-10
    assert rel_err(cand.model.norm.weight.grad, ref.model.norm.weight.grad) < 1e-10


def test_resized_head_is_patched_again():
    _, cand = model_pair("llama", torch.float32)
    fo_hf.apply_fusedops(cand)
    cand.resize_token_embeddings(VOCAB + 8)
    cand.train()
    inputs, labels = batch("unpadded")
    out = cand(**inputs, labels=labels)
    assert out.logits is None and torch.isfinite(out.loss)


def test_packed_rows_in_a_batch():
    """Two rows, each packed with several sequences: as transformers' packed-sequence mask."""
    ref, cand = model_pair("mistral", torch.float64)
    fo_hf.apply_fusedops(cand)
    ref.train()
    cand.train()
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(3, VOCAB, (2, SEQ), generator=g)
    pos = torch.stack([torch.cat([torch.arange(14), torch.arange(10)]),
                       torch.cat([torch.arange(5), torch.arange(12), torch.arange(7)])])
    labels = ids.masked_fill(pos == 0, -100)
    inputs = dict(input_ids=ids, position_ids=pos)
    out, grads = _run(cand, inputs, labels)
    ref_loss = reference_loss(ref(**inputs, use_cache=False).logits, labels)
    ref_loss.backward()
    assert rel_err(out.loss, ref_loss) < 1e-10
    for name, p in ref.named_parameters():
        assert rel_err(grads[name], p.grad) < 1e-10, name


@pytest.mark.parametrize("window", [None, 4])
@pytest.mark.parametrize("q_len", [1, 3, 9])
def test_attention_with_cache_and_padding(q_len, window):
    """The attention function alone: Sq queries after Sk - Sq cached keys, left padding, GQA,
    softcap, sliding window, against the masked softmax written out."""
    torch.manual_seed(0)
    b, hq, hkv, sk, d = 2, 4, 2, 9, 8
    q = torch.randn(b, hq, q_len, d, dtype=torch.float64)
    k = torch.randn(b, hkv, sk, d, dtype=torch.float64)
    v = torch.randn(b, hkv, sk, d, dtype=torch.float64)
    mask = torch.ones(b, sk, dtype=torch.bool)
    mask[1, :3] = False
    attn = type("Attn", (torch.nn.Module,), {})()
    attn.is_causal = True
    out, weights = fo_hf.fusedops_attention_forward(attn, q, k, v, mask, scaling=0.3,
                                                    sliding_window=window, softcap=2.0)
    assert weights is None and out.shape == (b, q_len, hq, d)
    qpos = torch.arange(sk - q_len, sk)[:, None]
    kpos = torch.arange(sk)[None, :]
    allowed = (kpos <= qpos) & mask[:, None, :]
    if window is not None:
        allowed &= kpos > qpos - window
    kr, vr = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    s = torch.tanh(q @ kr.transpose(2, 3) * 0.3 / 2.0) * 2.0
    s = s.masked_fill(~allowed[:, None], float("-inf"))
    want = (s.softmax(-1) @ vr).transpose(1, 2)
    valid = mask[:, sk - q_len:]
    torch.testing.assert_close(out[valid], want[valid], rtol=1e-12, atol=1e-12)
    assert (out[~valid] == 0).all()


def test_static_cache_without_a_mask():
    """A static cache longer than what it holds, and no attention mask: the empty slots must not
    be attended to (logits as without a cache), prefill then one decode step."""
    from transformers import StaticCache

    _, cand = model_pair("llama", torch.float64)
    fo_hf.apply_fusedops(cand)
    cand.eval()
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(3, VOCAB, (1, 7), generator=g)
    with torch.no_grad():
        want = cand(ids).logits
        cache = StaticCache(config=cand.config, max_cache_len=16)
        got = cand(ids[:, :6], past_key_values=cache, use_cache=True).logits
        last = cand(ids[:, 6:], past_key_values=cache, use_cache=True,
                    cache_position=torch.tensor([6])).logits
    torch.testing.assert_close(got, want[:, :6], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(last, want[:, 6:], rtol=1e-10, atol=1e-10)
