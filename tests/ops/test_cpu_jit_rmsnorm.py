"""The compiled CPU RMSNorm (`ops.rms_norm.compiled` over `cpu_jit.rmsnorm`) against the
PyTorch body it replaces (`rms_norm_reference`): outputs and the gradients of x, the
residual and the weight, with and without a residual, either output unused, on few rows
and on enough to run on threads; float64 to its rounding, float32 to f32 sums'. Also:
`ops.rms_norm` takes it exactly where it applies."""

from __future__ import annotations

import pytest
import torch

import mambakit.ops as ops
from mambakit.ops.rms_norm.compiled import compiles, rms_norm_compiled
from mambakit.ops.rms_norm.reference import rms_norm_reference

pytest.importorskip("numba")


def norm(fn, shape, dtype, residual, use=(True, True), seed=0):
    """(out, residual_out, grads of x, residual, weight) of fn for a loss over the outputs
    that `use` names."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    w = (1 + 0.3 * torch.randn(shape[-1], generator=g, dtype=torch.float64)).to(dtype)
    w.requires_grad_()
    res = None
    if residual:
        res = torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    out, r = fn(x, w, 1e-5, res)
    a = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    b = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    loss = sum(t for t, u in (((out * a).sum(), use[0]), ((r * b).sum(), use[1])) if u)
    ins = [x, w] + ([res] if residual else [])
    grads = torch.autograd.grad(loss, ins, allow_unused=True)
    return [out, r, *grads]


def rel(a, b) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-30)).item()


def reference(x, w, eps, res):
    return rms_norm_reference(x, w, eps, res)


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-13), (torch.float32, 2e-6)])
@pytest.mark.parametrize("shape", [(1, 32, 128), (3, 7, 40), (5, 130, 24), (33,)],
                         ids=["window", "small", "threads", "one-row"])  # fmt: skip
@pytest.mark.parametrize("residual", [True, False])
@pytest.mark.parametrize("use", [(True, True), (True, False), (False, True)],
                         ids=["both", "out", "residual-out"])  # fmt: skip
def test_compiled_norm_matches_the_reference(dtype, tol, shape, residual, use):
    got = norm(rms_norm_compiled, shape, dtype, residual, use)
    want = norm(reference, shape, dtype, residual, use)
    for a, b in zip(got, want):
        if b is None:  # unused (the compiled node gives zeros or nothing)
            assert a is None or a.abs().max() == 0
            continue
        assert a.dtype == b.dtype and a.shape == b.shape
        assert rel(a, b) < tol


def test_compiled_norm_is_deterministic_over_threads():
    """The weight's gradient sums fixed chunks of rows in order: the same bits on 1 and 2
    threads."""
    before = torch.get_num_threads()
    try:
        runs = []
        for n in (1, 2):
            torch.set_num_threads(n)
            runs.append(norm(rms_norm_compiled, (4, 300, 48), torch.float32, True))
    finally:
        torch.set_num_threads(before)
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_rms_norm_takes_the_compiled_body_where_it_applies(monkeypatch):
    calls = []
    real = ops.rms_norm_compiled
    monkeypatch.setattr(ops, "rms_norm_compiled", lambda *a: calls.append(1) or real(*a))
    x32, x64 = torch.randn(4, 16), torch.randn(4, 16, dtype=torch.float64)
    w32 = torch.ones(16)
    ops.rms_norm(x32, w32, 1e-5, x32.clone())
    ops.rms_norm(x64, w32.double())
    assert calls == [1, 1]
    ops.rms_norm(x32, w32.double())  # weight in another dtype
    ops.rms_norm(x32, w32, 1e-5, None, torch.bfloat16)  # another out dtype
    ops.rms_norm(x32.bfloat16(), w32.bfloat16())  # bfloat16
    ops.rms_norm(x32, w32, 1e-5, x32.double())  # a float64 residual
    assert calls == [1, 1]
    assert not compiles(x32[:0], w32, None, None)
    monkeypatch.setenv("MAMBAKIT_NUMBA", "0")
    from mambakit.ops import cpu_jit

    cpu_jit.available.cache_clear()
    try:
        ops.rms_norm(x32, w32)
        assert calls == [1, 1]
    finally:
        cpu_jit.available.cache_clear()


def test_compiled_norm_leaves_the_weight_resizable():
    """FSDP frees and regrows a sharded parameter's storage: the compiled body must not mark
    it as never resizable (as `.numpy()` on the parameter would)."""
    w = torch.nn.Parameter(torch.ones(16))
    x = torch.randn(4, 16, requires_grad=True)
    out, r = rms_norm_compiled(x, w, 1e-5, torch.randn(4, 16))
    (out.sum() + r.sum()).backward()
    rms_norm_compiled(x, w, 1e-5, None)[0].sum().backward()
    w.untyped_storage().resize_(0)  # raises where the storage was marked


@pytest.mark.parametrize("residual", [True, False])
def test_compiled_norm_second_derivatives_and_func_transforms(residual):
    """A backward that is itself differentiated (create_graph) runs in PyTorch ops and gives
    the reference's second derivatives; under torch.func's transforms the reference body
    runs (a node with numpy inside cannot be traced)."""
    g = torch.Generator().manual_seed(3)

    def inputs():
        x = torch.randn(3, 5, 12, generator=g, dtype=torch.float64, requires_grad=True)
        w = (1 + 0.3 * torch.randn(12, generator=g, dtype=torch.float64)).requires_grad_()
        res = torch.randn(3, 5, 12, generator=g, dtype=torch.float64, requires_grad=True)
        return x, w, res if residual else None

    x, w, res = inputs()
    a = torch.randn(3, 5, 12, generator=g, dtype=torch.float64)
    grads = []
    for fn in (rms_norm_compiled, reference):
        out, r = fn(x, w, 1e-5, res)
        loss = (out * a).sum() + (r * r).sum()
        gx, gw = torch.autograd.grad(loss, (x, w), create_graph=True)
        grads.append(torch.autograd.grad((gx.square().sum() + gw.sum()), (x, w)))
    for got, want in zip(*grads):
        assert rel(got, want) < 1e-12
    from torch.func import grad

    def f(xx):
        return ops.rms_norm(xx, w.detach(), 1e-5, None if res is None else res.detach())[0].sum()

    got = grad(f)(x.detach())
    want = torch.autograd.grad(reference(x, w, 1e-5, res)[0].sum(), x)[0]
    assert rel(got, want) < 1e-12
