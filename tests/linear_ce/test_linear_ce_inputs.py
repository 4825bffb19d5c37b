"""Bad input to linear_cross_entropy gets a clear error naming the argument."""

import pytest
import torch

from fusedops import _ext
from fusedops.linear_ce import linear_cross_entropy


def _inputs(n=6, h=16, v=11, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(n, h, generator=g, dtype=dtype),
            torch.randn(v, h, generator=g, dtype=dtype), torch.randint(0, v, (n,), generator=g))


@pytest.mark.parametrize("mutate,exc,match", [
    (lambda h, w, t: (h.long(), w, t), TypeError, "hidden must be float"),
    (lambda h, w, t: (h, w.double(), t), TypeError, "weight dtype"),
    (lambda h, w, t: (h, w[:, :8], t), ValueError, "second dimension"),
    (lambda h, w, t: (h, w[None], t), ValueError, r"weight must have shape \(V, H\)"),
    (lambda h, w, t: (h, w[:0], t), ValueError, "vocabulary size 0"),
    (lambda h, w, t: (h[:, :0], w[:, :0], t), ValueError, "hidden size 0"),
    (lambda h, w, t: (h, w, t.float()), TypeError, "target must be int64 or int32"),
    (lambda h, w, t: (h, w, t[:3]), ValueError, "target must have hidden's leading shape"),
    (lambda h, w, t: (h, w, t[None]), ValueError, "target must have hidden's leading shape"),
    (lambda h, w, t: (h.numpy(), w, t), TypeError, "hidden must be a Tensor"),
    (lambda h, w, t: (h, w.to("meta"), t), ValueError, "weight is on meta"),
    (lambda h, w, t: (h, w, t.to("meta")), ValueError, "target is on meta"),
])
def test_bad_tensors(mutate, exc, match):
    h, w, t = mutate(*_inputs())
    with pytest.raises(exc, match=match):
        linear_cross_entropy(h, w, t, backend="torch")


@pytest.mark.parametrize("bias,exc,match", [
    (torch.zeros(10), ValueError, r"bias must have shape \(11,\)"),
    (torch.zeros(11, dtype=torch.float64), TypeError, "bias dtype"),
    ([0.0] * 11, TypeError, "bias must be a Tensor"),
])
def test_bad_bias(bias, exc, match):
    h, w, t = _inputs()
    with pytest.raises(exc, match=match):
        linear_cross_entropy(h, w, t, bias, backend="torch")


@pytest.mark.parametrize("kwargs,match", [
    (dict(reduction="avg"), "reduction must be one of"),
    (dict(label_smoothing=1.5), "label_smoothing must be in"),
    (dict(label_smoothing=-0.1), "label_smoothing must be in"),
    (dict(softcap=0.0), "softcap must be a positive"),
    (dict(softcap=float("inf")), "softcap must be a positive"),
    # the kernels' softcap is a float32: past its normal range it would be inf or 0
    (dict(softcap=1e39), "within float32's normal range"),
    (dict(softcap=1e-46), "within float32's normal range"),
    (dict(z_loss=-1.0), "z_loss must be"),
    (dict(backend="cudnn"), "backend must be one of"),
])
def test_bad_options(kwargs, match):
    h, w, t = _inputs()
    kwargs.setdefault("backend", "torch")
    with pytest.raises(ValueError, match=match):
        linear_cross_entropy(h, w, t, **kwargs)


@pytest.mark.parametrize("bad", [11, 1000, -1, -101])
def test_out_of_range_target_raises(bad):
    h, w, t = _inputs()
    t[4] = bad
    with pytest.raises(ValueError, match=rf"target\[4\] = {bad} is outside \[0, 11\)"):
        linear_cross_entropy(h, w, t, backend="torch")


@pytest.mark.parametrize("algo", ["auto", "recompute"])
@pytest.mark.parametrize("reduction,return_lse", [("mean", False), ("none", False),
                                                  ("sum", True)])
@pytest.mark.parametrize("lead,pos", [((2, 3), (1, 1)), ((2, 3, 4), (1, 0, 2)),
                                      ((2, 3, 4), (0, 2, 3))])
def test_out_of_range_target_is_named_in_the_callers_shape(lead, pos, reduction, return_lse,
                                                           algo, monkeypatch):
    """target[1, 1] of a (2, 3) target, not its flat index target[4]; on every op path."""
    monkeypatch.setenv("FUSEDOPS_LCE_ALGO", algo)
    g = torch.Generator().manual_seed(1)
    h = torch.randn(*lead, 16, generator=g)
    w = torch.randn(11, 16, generator=g)
    t = torch.randint(0, 11, lead, generator=g)
    t[pos] = 99
    where = ", ".join(map(str, pos))
    with pytest.raises(ValueError, match=rf"^target\[{where}\] = 99 is outside \[0, 11\) and "
                       r"is not ignore_index \(-100\)$"):
        linear_cross_entropy(h, w, t, backend="torch", reduction=reduction,
                             return_lse=return_lse)


def test_out_of_range_target_index_of_a_non_contiguous_target():
    """The index is the caller's, also when the target is a strided view."""
    g = torch.Generator().manual_seed(2)
    h = torch.randn(3, 2, 16, generator=g)
    w = torch.randn(11, 16, generator=g)
    t = torch.randint(0, 11, (2, 3), generator=g)
    t[0, 2] = 50  # t.T[2, 0]
    with pytest.raises(ValueError, match=r"^target\[2, 0\] = 50 is outside"):
        linear_cross_entropy(h, w, t.T, backend="torch")


def test_out_of_range_target_unchecked_reads_nothing_outside():
    """With the check off, an out-of-range target contributes its lse alone (documented)."""
    h, w, t = _inputs()
    t[2] = 999
    loss = linear_cross_entropy(h, w, t, reduction="none", backend="torch", check_targets=False)
    lse = torch.logsumexp(h @ w.T, dim=1)
    torch.testing.assert_close(loss[2], lse[2])


def test_ignore_index_custom_value():
    h, w, t = _inputs()
    t[1] = 7
    a = linear_cross_entropy(h, w, t, ignore_index=7, reduction="none", backend="torch")
    assert a[1].item() == 0.0 and (a[t != 7] > 0).all()


def test_env_backend_override_errors_name_the_variable(monkeypatch):
    monkeypatch.setenv("FUSEDOPS_BACKEND", "nonsense")
    h, w, t = _inputs()
    with pytest.raises(ValueError, match="FUSEDOPS_BACKEND must be one of"):
        linear_cross_entropy(h, w, t)


def test_cuda_backend_on_cpu_tensors_says_why():
    h, w, t = _inputs(dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="cuda-sm80: .*(not built|need CUDA tensors)"):
        linear_cross_entropy(h, w, t, backend="cuda")


def test_triton_on_cpu_without_interpreter_says_why(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    h, w, t = _inputs()
    with pytest.raises(RuntimeError, match="triton: .*(CPU|not importable)"):
        linear_cross_entropy(h, w, t, backend="triton")


@pytest.mark.gpu
@pytest.mark.skipif(not _ext.available(), reason="fusedops._C not built")
@pytest.mark.parametrize("case,exc,match", [
    ("dtype", TypeError, "hidden must be float16 or bfloat16"),
    ("hidden_size", ValueError, "hidden size must be a multiple of 8, got 12"),
    ("arch", ValueError, "arch must be 80 or 90, got 70"),
])
def test_cuda_op_checks_its_inputs(case, exc, match):
    """The C++ op raises (never crashes) on bad input, integers in the message included."""
    h = 12 if case == "hidden_size" else 16
    dtype = torch.float32 if case == "dtype" else torch.bfloat16
    hidden = torch.randn(4, h, device="cuda", dtype=dtype)
    weight = torch.randn(10, h, device="cuda", dtype=dtype)
    target = torch.zeros(4, dtype=torch.long, device="cuda")
    with pytest.raises(exc, match=match):
        torch.ops.fusedops.linear_ce_fwd_cuda(hidden, weight, None, target, 0.0,
                                              70 if case == "arch" else 90)
