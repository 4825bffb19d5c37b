"""torch.library registration: schemas, fakes, opcheck, torch.compile, dispatch rules."""

import pytest
import torch

from fusedops import _ext, dispatch
from fusedops.linear_ce import (
    linear_cross_entropy,
    ops,  # noqa: F401
)

HAS_GPU = torch.cuda.is_available()


def _args(device="cpu", dtype=torch.float32, n=9, h=16, v=37, bias=True):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, h, generator=g).to(device, dtype)
    w = torch.randn(v, h, generator=g).to(device, dtype)
    b = torch.randn(v, generator=g).to(device, dtype) if bias else None
    t = torch.randint(0, v, (n,), generator=g).to(device)
    return x, w, b, t


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("softcap", [0.0, 4.0])
def test_opcheck_fwd_torch_backend(bias, softcap):
    x, w, b, t = _args(bias=bias)
    x.requires_grad_()
    w.requires_grad_()
    torch.library.opcheck(torch.ops.fusedops.linear_ce_fwd.default,
                          (x, w, b, t, -100, softcap, True, "torch"))


def test_opcheck_bwd_torch_backend():
    x, w, b, t = _args()
    lse = torch.logsumexp(x @ w.T + b, 1)
    grads = [torch.randn(9) for _ in range(3)]
    torch.library.opcheck(torch.ops.fusedops.linear_ce_bwd.default,
                          (x, w, b, t, lse, *grads, 0.0, True, True, True, "torch"))
    torch.library.opcheck(torch.ops.fusedops.linear_ce_bwd.default,
                          (x, w, b, t, lse, *grads, 0.0, True, False, False, "torch"))


def test_fake_tensor_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        x, w, b, t = (torch.empty(5, 8), torch.empty(11, 8), torch.empty(11),
                      torch.zeros(5, dtype=torch.long))
        lse, zt, zs = torch.ops.fusedops.linear_ce_fwd(x, w, b, t, -100, 0.0, False, "torch")
        assert lse.shape == zt.shape == zs.shape == (5,) and lse.dtype == torch.float32
        dh, dw, db = torch.ops.fusedops.linear_ce_bwd(x, w, b, t, lse, lse, lse, lse, 0.0, True,
                                                      True, False, "torch")
        assert dh.shape == (5, 8) and dw.shape == (11, 8) and db.shape == (0,)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_torch_compile_fullgraph(device):
    """A function calling linear_cross_entropy compiles without graph breaks, forward+backward."""
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    x, w, b, t = _args(device, dtype, n=12, h=32, v=50)
    t[3] = -100

    def step(x, w, b, t):
        return linear_cross_entropy(x, w, t, b, label_smoothing=0.1, z_loss=1e-4, softcap=8.0)

    xa, wa, ba = (p.detach().clone().requires_grad_() for p in (x, w, b))
    xb, wb, bb = (p.detach().clone().requires_grad_() for p in (x, w, b))
    eager = step(xa, wa, ba, t)
    eager.backward()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager" if device == "cpu"
                             else "inductor")(xb, wb, bb, t)
    compiled.backward()
    torch.testing.assert_close(compiled, eager)
    for p, q in ((xa, xb), (wa, wb), (ba, bb)):
        torch.testing.assert_close(p.grad, q.grad)


def test_compiled_extension_registers_schemas_and_fakes():
    if not _ext.available():
        pytest.skip(f"extension not built here: {_ext.EXT_ERROR}")
    fwd = torch.ops.fusedops.linear_ce_fwd_cuda.default
    bwd = torch.ops.fusedops.linear_ce_bwd_cuda.default
    assert "Tensor? bias" in str(fwd._schema) and "int arch" in str(fwd._schema)
    assert "bool need_dw" in str(bwd._schema)
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        x, w, t = torch.empty(5, 8), torch.empty(11, 8), torch.zeros(5, dtype=torch.long)
        lse, _, _ = fwd(x, w, None, t, 0.0, 90)
        assert lse.shape == (5,)
        dh, dw, db = bwd(x, w, None, t, lse, lse, lse, lse, 0.0, True, True, False, 80)
        assert dh.shape == (5, 8) and dw.shape == (11, 8) and db.shape == (0,)


@pytest.mark.gpu
def test_opcheck_cuda_ops():
    if not _ext.available():
        pytest.skip("extension not built")
    x, w, b, t = _args("cuda", torch.bfloat16, n=130, h=64, v=300)
    torch.library.opcheck(torch.ops.fusedops.linear_ce_fwd_cuda.default, (x, w, b, t, 0.0, 80))
    lse, _, _ = torch.ops.fusedops.linear_ce_fwd_cuda(x, w, b, t, 0.0, 80)
    grads = [torch.randn(130, device="cuda") for _ in range(3)]
    torch.library.opcheck(torch.ops.fusedops.linear_ce_bwd_cuda.default,
                          (x, w, b, t, lse, *grads, 0.0, True, True, True, 80))
    x.requires_grad_()
    torch.library.opcheck(torch.ops.fusedops.linear_ce_fwd.default,
                          (x, w, b, t, -100, 0.0, True, dispatch.select("linear_ce", x, 64)))


def test_dispatch_on_cpu_is_torch(monkeypatch):
    monkeypatch.delenv("FUSEDOPS_BACKEND", raising=False)
    x, _, _, _ = _args()
    assert dispatch.select("linear_ce", x, 16) == "torch"
    monkeypatch.setenv("FUSEDOPS_BACKEND", "torch")
    assert dispatch.select("linear_ce", x, 16) == "torch"


def test_dispatch_bad_arch_override(monkeypatch):
    monkeypatch.setenv("FUSEDOPS_CUDA_ARCH", "sm75")
    sig = dispatch.InputSig("linear_ce", "cuda", 0, torch.bfloat16, 64)
    with pytest.raises(ValueError, match="FUSEDOPS_CUDA_ARCH"):
        dispatch.candidates("cuda", sig)


def test_forced_sm80_candidates(monkeypatch):
    sig = dispatch.InputSig("linear_ce", "cuda", 0, torch.bfloat16, 64)
    monkeypatch.setenv("FUSEDOPS_CUDA_ARCH", "sm80")
    assert dispatch.candidates("auto", sig)[0] == "cuda-sm80"
    assert dispatch.candidates("cuda", sig) == ["cuda-sm80"]
    monkeypatch.delenv("FUSEDOPS_CUDA_ARCH")
    assert dispatch.candidates("auto", sig)[:2] == ["cuda-sm90", "cuda-sm80"]


@pytest.mark.gpu
def test_gpu_default_dispatch(monkeypatch):
    monkeypatch.delenv("FUSEDOPS_BACKEND", raising=False)
    monkeypatch.delenv("FUSEDOPS_CUDA_ARCH", raising=False)
    x, _, _, _ = _args("cuda", torch.bfloat16, h=64)
    cap = torch.cuda.get_device_capability()
    name = dispatch.select("linear_ce", x, 64)
    if _ext.available() and cap == (9, 0):
        assert name == "cuda-sm90"
        monkeypatch.setenv("FUSEDOPS_CUDA_ARCH", "sm80")
        assert dispatch.select("linear_ce", x, 64) == "cuda-sm80"
    xf = x.float()
    assert dispatch.select("linear_ce", xf, 64) == "triton"  # CUDA kernels are fp16/bf16 only
    assert dispatch.select("linear_ce", x, 60) == "triton"  # H not a multiple of 8
