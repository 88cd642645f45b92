"""The compiled Mamba-3 scan (`cpu_jit.scan3`) against the PyTorch chunked body it
replaces on the CPU: outputs and the gradients of every input, the final state's included,
in float64 (to its rounding) and float32."""

from __future__ import annotations

import pytest
import torch

import mambakit.ops.mamba3.reference as ref
from mambakit.state import Mamba3State

pytest.importorskip("numba")


def scan(compiled: bool, dtype, monkeypatch, B=2, T=37, H=4, P=3, N=8, S=2, G=2, gate=True,
         skip=True, start=True, seq_idx=None, grad=True):  # fmt: skip
    """(outputs, gradients of a loss over y and every final field) of one scan (under
    no_grad, or with no input requiring grad (`grad` False), the outputs and None)."""
    g = torch.Generator().manual_seed(1)

    def rand(*shape, lo=None):
        t = torch.randn(*shape, generator=g, dtype=torch.float64)
        if lo is not None:  # positive values in [lo, lo + 0.5)
            t = torch.rand(*shape, generator=g, dtype=torch.float64) * 0.5 + lo
        return t.to(dtype).requires_grad_(grad)

    x, q, k = rand(B, T, H, P), rand(B, T, G, N), rand(B, T, G, N)
    delta, A = rand(B, T, H, lo=0.05), (-rand(B, T, H, lo=0.1)).detach().requires_grad_(grad)
    trap, theta, qb, kb = rand(B, T, H), rand(B, T, S), rand(H, N), rand(H, N)
    D = rand(H) if skip else None
    z = rand(B, T, H, P) if gate else None
    state = Mamba3State(rand(B, H, S), rand(B, H, P, N), rand(B, H, N), rand(B, H, P))
    state = state if start else None
    with monkeypatch.context() as m:
        if not compiled:
            m.setattr(ref, "scan_compiles", lambda *a: False)
        y, final = ref.mamba3_scan_reference(x, q, k, delta, A, trap, theta, qb, kb, D, z,
                                             state, seq_idx)  # fmt: skip
    if not (grad and torch.is_grad_enabled()):  # no backward: the outputs alone
        return [y, *final], None
    w = torch.randn(y.shape, generator=g, dtype=torch.float64).to(dtype)
    loss = (y * w).sum() + 0.1 * final.ssm.square().sum() + final.angle.sin().sum()
    loss = loss + 1.3 * final.k.sum() + 0.7 * final.x.sum()
    ins = [x, q, k, delta, A, trap, theta, qb, kb, *(t for t in (D, z) if t is not None)]
    ins += list(state) if state is not None else []
    return [y, *final], torch.autograd.grad(loss, ins)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-30)).item()


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 2e-5)])
@pytest.mark.parametrize(
    "shape",
    [dict(), dict(gate=False, skip=False, start=False), dict(G=1, H=3, S=4, T=5),
     dict(B=1, T=1, S=1)],
    ids=["all", "bare", "one-group", "one-step"],
)  # fmt: skip
def test_compiled_scan_matches_the_chunked_body(dtype, tol, shape, monkeypatch):
    got, g_got = scan(True, dtype, monkeypatch, **shape)
    want, g_want = scan(False, dtype, monkeypatch, **shape)
    for a, b in zip(got, want):
        assert rel(a, b) < tol
    for a, b in zip(g_got, g_want):
        assert rel(a, b) < tol


def test_compiled_scan_runs_only_where_it_applies(monkeypatch):
    """It runs without documents and within its memory bound; with `seq_idx`, or past the
    bound, the chunked body runs (the same values)."""
    calls = []
    real = ref._Scan3.apply
    monkeypatch.setattr(ref._Scan3, "apply", lambda *a: calls.append(1) or real(*a))
    scan(True, torch.float64, monkeypatch, B=1, T=6)
    assert calls == [1]
    seq = torch.tensor([[0, 0, 0, 1, 1, 1]], dtype=torch.int32)
    scan(True, torch.float64, monkeypatch, B=1, T=6, seq_idx=seq)
    from mambakit.ops.cpu_jit import scan3

    monkeypatch.setattr(scan3, "MAX_STATE_BYTES", 64)
    got, _ = scan(True, torch.float64, monkeypatch, B=1, T=6)
    assert calls == [1]  # neither call compiled
    want, _ = scan(False, torch.float64, monkeypatch, B=1, T=6)
    assert all(rel(a, b) < 1e-12 for a, b in zip(got, want))


def test_compiled_scan_keeps_nothing_for_inference(monkeypatch):
    """Without a backward to come (no_grad, or grad mode on with no input requiring grad) the
    node keeps no step's state, so its memory bound does not apply: past it, the scan still
    compiles, and y and the final state are bit for bit those of the scan that keeps every
    state."""
    from mambakit.ops.cpu_jit import scan3

    calls, kept = [], []
    real = ref._Scan3.apply
    monkeypatch.setattr(ref._Scan3, "apply", lambda *a: calls.append(a[0]) or real(*a))
    real_fwd = scan3.forward_arrays

    def keeping(arrs, keep=True):
        out = real_fwd(arrs, keep)
        kept.append(out[-1])
        return out

    monkeypatch.setattr(scan3, "forward_arrays", keeping)
    want, _ = scan(True, torch.float32, monkeypatch, B=2, T=9)
    assert calls == [True] and kept[0] is not None
    monkeypatch.setattr(scan3, "MAX_STATE_BYTES", 64)
    with torch.no_grad():
        got, _ = scan(True, torch.float32, monkeypatch, B=2, T=9)
    got_free, _ = scan(True, torch.float32, monkeypatch, B=2, T=9, grad=False)  # grad mode on
    assert calls == [True, False, False] and kept[-2] is None and kept[-1] is None
    for a, b, c in zip(got, want, got_free):
        assert torch.equal(a, b.detach()) and torch.equal(c, a)
    calls.clear()
    scan(True, torch.float32, monkeypatch, B=2, T=9)  # with grad past the bound: chunked
    assert calls == []
