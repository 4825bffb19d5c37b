"""The common dispatch layer: per-op declarations, reasons, logging, info and the missing-extension
warning."""

import logging
import warnings

import pytest
import torch

from fusedops import _ext, dispatch, info


def _sig(op, dtype=torch.bfloat16, inner=128, device="cuda", causal=False):
    return dispatch.InputSig(op, device, 0 if device == "cuda" else -1, dtype, inner, causal)


def test_every_op_declares_every_backend_name():
    for op in ("linear_ce", "attention", "attention_decode"):
        table = dispatch.op_backends(op)
        assert [b.name for b in table.backends] == list(dispatch.BACKENDS)
        for b in table.backends:
            assert b.summary and b.dtypes
            assert (b.arch is not None) == (b.kind == "cuda")


def test_unknown_op_and_backend_are_refused():
    with pytest.raises(ValueError, match="unknown op"):
        dispatch.op_backends("conv")
    with pytest.raises(ValueError, match="backend must be one of"):
        dispatch.why_not("cudnn", _sig("attention"))
    with pytest.raises(TypeError, match="backend must be a str"):
        dispatch.select("attention", torch.randn(2), 16, backend=3)


def test_cuda_arch_comes_from_the_declarations():
    assert dispatch.cuda_arch("attention", "cuda-sm80") == 80
    assert dispatch.cuda_arch("linear_ce", "cuda-sm90") == 90
    with pytest.raises(ValueError, match="not a CUDA backend"):
        dispatch.cuda_arch("linear_ce", "triton")


def test_dtype_reason_names_what_the_backend_takes():
    reason = dispatch.why_not("cuda-sm80", _sig("linear_ce", torch.float32))
    assert "float32" in reason and "float16, bfloat16" in reason
    assert "float64" in dispatch.why_not("triton", _sig("attention", torch.float64))


def test_unbuilt_backend_says_so_whatever_the_input(monkeypatch):
    """A declared backend without kernels yet is refused with its own reason; auto skips it."""
    table = dispatch.OpBackends("toy", "size", (
        dispatch.Backend("cuda-sm90", "cuda", (torch.bfloat16,), "not yet", arch=90,
                         unbuilt="no toy kernel for Hopper yet"),
        dispatch.Backend("torch", "torch", (torch.bfloat16,), "reference")),
        lambda sig, forced: ["cuda-sm90", "torch"])
    monkeypatch.setitem(dispatch._OPS, "toy", table)
    assert dispatch.why_not("cuda-sm90", _sig("toy")) == "no toy kernel for Hopper yet"
    assert dispatch.why_not("cuda-sm80", _sig("toy")) == "toy has no cuda-sm80 backend"
    assert dispatch.select_name("toy", "cpu", -1, "bfloat16", 8, None) == "torch"
    with pytest.raises(RuntimeError, match="no toy kernel for Hopper yet"):
        dispatch.select_name("toy", "cpu", -1, "bfloat16", 8, "cuda-sm90")


@pytest.mark.parametrize("op", ["linear_ce", "attention"])
def test_interpreter_refuses_bfloat16_and_auto_takes_torch(op, monkeypatch):
    """The Triton interpreter has no bfloat16 (it returned garbage): refused with the reason."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delenv("FUSEDOPS_BACKEND", raising=False)
    sig = _sig(op, torch.bfloat16, 16, device="cpu")
    assert "no bfloat16" in dispatch.why_not("triton", sig)
    assert dispatch.why_not("triton", _sig(op, torch.float32, 16, device="cpu")) is None
    x = torch.randn(2, 16, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="no bfloat16"):
        dispatch.select(op, x, 16, backend="triton")
    assert dispatch.select(op, x, 16) == "torch"


def test_log_reports_each_new_decision_once(monkeypatch, caplog):
    monkeypatch.setenv("FUSEDOPS_LOG", "1")
    monkeypatch.delenv("FUSEDOPS_BACKEND", raising=False)
    dispatch._SELECTED.clear()
    x = torch.randn(3, 24)
    with caplog.at_level(logging.INFO, logger="fusedops"):
        for _ in range(3):
            assert dispatch.select("linear_ce", x, 24) == "torch"
        dispatch.select("attention", x, 24, causal=True)
    lines = [r.getMessage() for r in caplog.records if r.name == "fusedops"]
    assert len(lines) == 2, lines
    assert "linear_ce on float32 cpu, hidden size 24, request auto -> torch" in lines[0]
    assert "head dim 24, causal" in lines[1]


def test_log_is_off_by_default(monkeypatch, caplog):
    monkeypatch.delenv("FUSEDOPS_LOG", raising=False)
    dispatch._SELECTED.clear()
    with caplog.at_level(logging.INFO, logger="fusedops"):
        dispatch.select("linear_ce", torch.randn(3, 40), 40)
    assert not [r for r in caplog.records if r.name == "fusedops"]


def test_info_answers_for_the_users_case(capsys):
    info.main(["--dtype", "float32", "--hidden", "60", "--head-dim", "96", "--causal",
               "--width", "88", "--device", "cpu"])
    out = capsys.readouterr().out
    assert "linear_ce on float32 cpu inputs, hidden size 60:" in out
    assert "attention on float32 cpu inputs, head dim 96, causal:" in out
    assert "attention_decode on float32 cpu inputs, head dim 96, causal:" in out
    assert "swiglu on float32 cpu inputs, width 88:" in out
    assert out.count("default -> torch") == 4
    for b in dispatch.BACKENDS:
        assert f"  {b}" in out


@pytest.mark.parametrize("argv,match", [
    (["--device", "tpu"], "--device must be cpu, cuda or cuda:N, got 'tpu'"),
    (["--device", "cpu:3"], "--device must be cpu, cuda or cuda:N"),
    (["--hidden", "0"], "argument --hidden: expected an integer >= 1"),
    (["--head-dim", "-5"], "argument --head-dim: expected an integer >= 1"),
])
def test_info_refuses_bad_arguments(argv, match, capsys):
    with pytest.raises(SystemExit) as exc:
        info.main(argv)
    assert match in str(exc.value) + capsys.readouterr().err


def test_info_names_the_reason_of_each_backend():
    text = info.report("bfloat16", 4096, 128, device="cpu")
    assert "cuda-sm80  no: " in text and "torch      available" in text


def test_missing_extension_warns_once_when_a_gpu_is_visible(monkeypatch):
    monkeypatch.setattr(_ext, "_C", None)
    monkeypatch.setattr(_ext, "EXT_ERROR", "ImportError: built against another torch")
    monkeypatch.setattr(_ext, "_WARNED", False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.warns(RuntimeWarning, match="fusedops._C is not loaded.*another torch"):
        assert _ext.warn_if_missing()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not _ext.warn_if_missing()  # once


def test_no_warning_without_a_gpu(monkeypatch):
    monkeypatch.setattr(_ext, "_C", None)
    monkeypatch.setattr(_ext, "_WARNED", False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not _ext.warn_if_missing()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
@pytest.mark.parametrize("op,inner", [("linear_ce", 64), ("attention", 64)])
def test_cuda_inputs_without_a_gpu_get_a_reason(op, inner):
    """Asking about CUDA inputs where no driver is present gives reasons, never a driver error;
    static limits come first (they hold on any machine)."""
    for name in ("cuda-sm80", "triton"):
        assert dispatch.why_not(name, _sig(op, inner=inner)) == "no CUDA GPU is visible"
    if op == "attention":
        assert "head dim 96" in dispatch.why_not("cuda-sm80", _sig(op, inner=96))
    # auto's order must not ask the driver either
    assert dispatch.select_name(op, "cuda", 0, "bfloat16", inner, None, True) == "torch"
