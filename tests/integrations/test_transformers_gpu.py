"""The transformers integration on a CUDA GPU (the fusedops CUDA or Triton kernels), bf16 and
float32, against stock transformers; skipped without a GPU."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from hf_models import batch, model_pair  # noqa: E402

import fusedops.integrations.transformers as fo_hf  # noqa: E402

pytestmark = pytest.mark.gpu


def _cos(a, b):
    a, b = a.double().flatten(), b.double().flatten()
    return float(a @ b / (a.norm() * b.norm()).clamp_min(1e-30))


@pytest.mark.parametrize("kind", ["unpadded", "left", "packed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_gpu_against_stock(family, dtype, kind):
    ref, cand = model_pair(family, torch.float32)
    fo_hf.apply_fusedops(cand)
    ref, cand = ref.cuda().to(dtype), cand.cuda().to(dtype)
    ref.train()
    cand.train()
    inputs, labels = batch(kind)
    inputs = {k: v.cuda() for k, v in inputs.items()}
    labels = labels.cuda()
    out = cand(**inputs, labels=labels, use_cache=False)
    assert out.logits is None and out.loss.dtype == torch.float32
    out.loss.backward()
    ref_loss = ref(**inputs, labels=labels, use_cache=False).loss
    ref_loss.backward()
    tol = 2e-3 if dtype == torch.float32 else 3e-2
    assert abs(out.loss.item() - ref_loss.item()) < tol * abs(ref_loss.item())
    for (name, p), q in zip(cand.named_parameters(), ref.parameters(), strict=True):
        assert _cos(p.grad, q.grad) > (0.9999 if dtype == torch.float32 else 0.99), name


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_gpu_generate(family):
    ref, cand = model_pair(family, torch.float32)
    fo_hf.apply_fusedops(cand)
    ref, cand = ref.cuda().eval(), cand.cuda().eval()
    g = torch.Generator().manual_seed(5)
    prompts = torch.randint(3, 160, (2, 7), generator=g).cuda()
    mask = torch.ones_like(prompts)
    mask[1, :3] = 0
    kw = dict(max_new_tokens=10, do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        want = ref.generate(input_ids=prompts, attention_mask=mask, **kw)
        got = cand.generate(input_ids=prompts, attention_mask=mask, **kw)
    # float32 kernels may round differently (TF32): most tokens agree
    assert (got == want).float().mean() > 0.9
