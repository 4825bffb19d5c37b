"""The oracle rule for linear cross-entropy tests (CONVENTIONS.md): an implementation passes when
its relative error against the float64 reference is at most 2x the error of plain PyTorch eager
in the same dtype (bf16/fp16 logits, float32 cross-entropy), plus a small slack."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import pytest
import torch
import torch.nn.functional as F

from fusedops import dispatch
from fusedops.linear_ce import linear_cross_entropy


def available_backends():
    """(backend, device) pairs that can run here."""
    out = [("torch", "cpu")]
    if os.environ.get("TRITON_INTERPRET") == "1" and not torch.cuda.is_available():
        try:
            import triton  # noqa: F401
            out.append(("triton", "cpu"))
        except ImportError:
            pass
    if torch.cuda.is_available():
        sig = dispatch.InputSig("linear_ce", "cuda", 0, torch.bfloat16, 64)
        for name in ("cuda-sm90", "cuda-sm80", "triton", "torch"):
            if dispatch.why_not(name, sig) is None:
                out.append((name, "cuda"))
    return out


def backend_params(backends):
    """(backend, device) pairs as pytest params, the CUDA ones marked gpu."""
    return [pytest.param(b, d, marks=[pytest.mark.gpu] if d == "cuda" else [], id=f"{b}-{d}")
            for b, d in backends]


SLACK = {torch.float32: 2e-6, torch.float16: 2e-5, torch.bfloat16: 2e-5, torch.float64: 1e-12}
# Unit roundoff of the logits' dtype. Outputs computed from logits rounded to that dtype (as eager
# and our mean/sum path both do, then dz rounded likewise) carry a random error of about
# u / sqrt(tokens) relative when few tokens or few dominant softmax entries contribute; eager's
# error is one draw of that and can be far smaller by luck, so every output also gets
# u / sqrt(valid tokens) of slack (a wrong formula is off by far more).
UNIT = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8,
        torch.float64: 0.0}


@dataclass
class Case:
    lead: tuple
    hidden_size: int
    vocab_size: int
    dtype: torch.dtype
    device: str
    bias: bool = False
    ignore_frac: float = 0.0
    reduction: str = "mean"
    label_smoothing: float = 0.0
    softcap: float | None = None
    z_loss: float = 0.0
    return_lse: bool = False
    noncontig: bool = False
    seed: int = 0
    opts: dict = field(default_factory=dict)

    def kwargs(self):
        return dict(reduction=self.reduction, label_smoothing=self.label_smoothing,
                    softcap=self.softcap, z_loss=self.z_loss, return_lse=self.return_lse)


def make_inputs(case: Case):
    g = torch.Generator(device="cpu").manual_seed(case.seed)
    n_hidden = case.hidden_size * (2 if case.noncontig else 1)
    h = torch.randn(*case.lead, n_hidden, generator=g)
    if case.noncontig:
        h = h[..., ::2]
    # Logits ~ N(0, 3^2): peaked enough that softmax is far from uniform.
    w = torch.randn(case.vocab_size, case.hidden_size, generator=g)
    w = w * (3.0 / math.sqrt(case.hidden_size))
    b = torch.randn(case.vocab_size, generator=g) * 0.5 if case.bias else None
    t = torch.randint(0, case.vocab_size, case.lead, generator=g)
    if case.ignore_frac >= 1.0:
        t[...] = -100
    elif case.ignore_frac > 0:
        t[torch.rand(case.lead, generator=g) < case.ignore_frac] = -100
    if case.reduction == "none":
        up = torch.randn(case.lead, generator=g)
    else:
        up = torch.tensor(0.7)
    lse_up = torch.randn(case.lead, generator=g) * 0.1
    cast = lambda x, dt: None if x is None else x.to(device=case.device, dtype=dt)  # noqa: E731
    return dict(h=cast(h, case.dtype), w=cast(w, case.dtype), b=cast(b, case.dtype),
                t=t.to(case.device), up=up.to(case.device), lse_up=lse_up.to(case.device))


def eager_loss(h, w, t, b, *, reduction, label_smoothing, softcap, z_loss, return_lse):
    """What users run today: logits in the input dtype, cross-entropy in float32."""
    z = h @ w.T
    if b is not None:
        z = z + b
    z = z.double() if z.dtype == torch.float64 else z.float()
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    flat = z.reshape(-1, z.shape[-1])
    tt = t.reshape(-1)
    loss = F.cross_entropy(flat, tt, reduction="none", label_smoothing=label_smoothing)
    lse = torch.logsumexp(flat, -1)
    valid = tt != -100
    if z_loss:
        loss = loss + z_loss * lse * lse
    loss = torch.where(valid, loss, 0.0)
    if reduction == "mean":
        loss = loss.sum() / valid.sum().clamp(min=1)
    elif reduction == "sum":
        loss = loss.sum()
    else:
        loss = loss.view(t.shape)
    return (loss, lse.view(t.shape)) if return_lse else loss


def run(fn, inp, case: Case, dtype=None):
    """Runs fn(h, w, t, b, **opts) on leaf copies (cast to dtype), returns outputs and grads."""
    dt = dtype or case.dtype
    h = inp["h"].detach().to(dt).requires_grad_()
    w = inp["w"].detach().to(dt).requires_grad_()
    b = inp["b"].detach().to(dt).requires_grad_() if inp["b"] is not None else None
    out = fn(h, w, inp["t"], b, **case.kwargs())
    if case.return_lse:
        loss, lse = out
        total = (loss * inp["up"].to(loss.dtype)).sum() + (lse * inp["lse_up"].to(lse.dtype)).sum()
        vals = {"loss": loss.detach(), "lse": lse.detach()}
    else:
        loss = out
        total = (loss * inp["up"].to(loss.dtype)).sum()
        vals = {"loss": loss.detach()}
    leaves = [("d_hidden", h), ("d_weight", w)] + ([("d_bias", b)] if b is not None else [])
    grads = torch.autograd.grad(total, [x for _, x in leaves], allow_unused=True)
    for (name, x), gr in zip(leaves, grads, strict=True):
        vals[name] = torch.zeros_like(x) if gr is None else gr
    return vals


def rel_err(x, ref):
    x = x.double()
    ref = ref.double()
    if not torch.isfinite(x).all():
        return math.inf
    denom = ref.norm().item()
    diff = (x - ref).norm().item()
    return diff if denom == 0 else diff / denom


def _big(case: Case) -> bool:
    """An oracle of gigabytes (the 1000 x 4096 x 32003 and x 128256 GPU cases)."""
    return math.prod(case.lead) * case.hidden_size * case.vocab_size > 10**11


def check(case: Case, impl, oracle_cache=None):
    """Asserts impl(h, w, t, b, **kwargs) meets the oracle rule; returns the error table."""
    inp = make_inputs(case)
    key = (case.lead, case.hidden_size, case.vocab_size, case.dtype, case.device, case.bias,
           case.ignore_frac, case.reduction, case.label_smoothing, case.softcap, case.z_loss,
           case.return_lse, case.noncontig, case.seed, _big(case))
    if oracle_cache is not None and key in oracle_cache:
        ref, eager = oracle_cache[key]
    else:
        ref = run(lambda *a, **k: linear_cross_entropy(*a, **k, backend="torch"), inp, case,
                  torch.float64)
        eager = run(eager_loss, inp, case)
        if oracle_cache is not None:
            if _big(case):  # at most one such entry (~6 GiB each at 1000 x 4096 x 128256)
                for k in [k for k in oracle_cache if k[-1]]:
                    del oracle_cache[k]
            oracle_cache[key] = (ref, eager)
    got = run(impl, inp, case)
    table = {}
    n_valid = int((inp["t"] != -100).sum())
    for name, r in ref.items():
        assert got[name].shape == r.shape, f"{name}: shape {got[name].shape} != {r.shape}"
        e_got = rel_err(got[name], r)
        e_eager = rel_err(eager[name], r)
        if not math.isfinite(e_eager):  # eager mean over zero tokens is NaN; ours must be exact
            e_eager = 0.0
        table[name] = (e_got, e_eager)
        slack = SLACK[case.dtype] + UNIT[case.dtype] / math.sqrt(max(n_valid, 1))
        assert e_got <= 2 * e_eager + slack, (
            f"{name}: error {e_got:.3e} > 2 x eager {e_eager:.3e} + {slack:.0e}")
    for name in ("loss", "lse"):
        if name in got:
            assert got[name].dtype == (torch.float64 if case.dtype == torch.float64
                                       else torch.float32), f"{name} dtype {got[name].dtype}"
    return table
