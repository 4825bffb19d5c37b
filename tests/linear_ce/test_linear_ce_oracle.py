"""The oracle checker must reject a subtly wrong implementation (else it proves nothing)."""

import pytest
import torch

import lce_oracle as O
from fusedops.linear_ce import linear_cross_entropy


def _wrong_backward(h, w, t, b, **kw):
    """Right forward, but the target term of dz is 2% too large in the backward."""
    loss = linear_cross_entropy(h, w, t, b, backend="torch", **kw)

    class Scale(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            return g * 1.02

    hh = Scale.apply(h)
    extra = linear_cross_entropy(hh, w, t, b, backend="torch", **kw) - loss.detach()
    return loss + extra - extra.detach()


@pytest.mark.parametrize("impl", [_wrong_backward])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_checker_rejects(impl, dtype):
    case = O.Case((37,), 64, 123, dtype, "cpu", reduction="sum", bias=True)
    with pytest.raises(AssertionError):
        O.check(case, impl)


def test_checker_accepts_eager_itself():
    case = O.Case((37,), 64, 123, torch.bfloat16, "cpu", reduction="sum", bias=True)
    O.check(case, O.eager_loss)
