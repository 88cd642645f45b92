"""The Mamba-3 layer's compiled CPU core (`ops.mamba3.reference.mamba3_layer_compiled`: the
per-token terms of `cpu_jit.terms3` and the scan of `cpu_jit.scan3` as one autograd node)
against the layer's op chain with the chunked PyTorch scan: outputs, the final state and the
gradients of the input, every parameter and the initial state, in float64 (to rounding) and
float32; and where it runs."""

from __future__ import annotations

import pytest
import torch

import mambakit.ops.mamba3.reference as ref
from mambakit.layers.mamba3 import Mamba3
from mambakit.state import Mamba3State

pytest.importorskip("numba")


def make(dtype, G=2, rope_fraction=0.5, d_state=8, headdim=8, d_model=32, seed=0):
    torch.manual_seed(seed)
    layer = Mamba3(d_model, d_state=d_state, headdim=headdim, ngroups=G,
                   rope_fraction=rope_fraction).to(dtype)  # fmt: skip
    with torch.no_grad():  # away from the initial values (ones, zeros), so every term counts
        for p in layer.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return layer


def start_state(layer, B, dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    H, P, N, S = layer.nheads, layer.headdim, layer.d_state, layer.n_angles

    def r(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)

    return Mamba3State(r(B, H, S).abs() * 3, r(B, H, P, N), r(B, H, N), r(B, H, P))


def run(layer, u, state, compiled: bool, monkeypatch):
    """(out, final state fields, gradients by name) of a loss over the output and every final
    field; compiled=False: the modules' op chain and the chunked PyTorch scan."""
    layer.zero_grad(set_to_none=True)
    with monkeypatch.context() as m:
        if not compiled:
            m.setattr(Mamba3, "_compiled", lambda *a: None)
            m.setattr(ref, "scan_compiles", lambda *a: False)
        u = u.clone().requires_grad_()
        st = None
        if state is not None:
            st = Mamba3State(*(t.clone().requires_grad_() for t in state))
        out, final = layer(u, st, return_state=True)
        g = torch.Generator().manual_seed(3)
        w = torch.randn(out.shape, generator=g, dtype=torch.float64).to(out.dtype)
        loss = (out * w).sum() + 0.3 * final.ssm.square().sum() + final.angle.sin().sum()
        loss = loss + 1.3 * final.k.sum() + 0.7 * final.x.square().sum()
        loss.backward()
    grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
    grads["u"] = u.grad
    if st is not None:
        grads.update({f"state.{f}": t.grad for f, t in zip(Mamba3State._fields, st)})
    return out.detach(), [t.detach() for t in final], grads


def rel(a, b) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-30)).item()


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-11), (torch.float32, 1e-4)])
@pytest.mark.parametrize(
    "G, rope_fraction, with_state, B, T",
    [(1, 0.5, False, 1, 12), (2, 1.0, True, 2, 19), (2, 0.5, True, 3, 1)],
    ids=["one-group", "full-rope-state", "one-step"],
)  # fmt: skip
def test_compiled_layer_matches_the_op_chain(dtype, tol, G, rope_fraction, with_state, B, T,
                                             monkeypatch):  # fmt: skip
    layer = make(dtype, G=G, rope_fraction=rope_fraction)
    u = torch.randn(B, T, 32, generator=torch.Generator().manual_seed(2),
                    dtype=torch.float64).to(dtype)  # fmt: skip
    state = start_state(layer, B, dtype) if with_state else None
    assert layer._compiled(layer.in_proj(u), state, "auto")
    out, final, grads = run(layer, u, state, True, monkeypatch)
    want_out, want_final, want_grads = run(layer, u, state, False, monkeypatch)
    assert rel(out, want_out) < tol
    for a, b in zip(final, want_final):
        assert rel(a, b) < tol
    assert grads.keys() == want_grads.keys()
    for name, b in want_grads.items():
        assert rel(grads[name], b) < tol, name


def test_compiled_terms_at_their_edges(monkeypatch):
    """in_proj rows that put A on its floor (heavy_tail below A_floor: no gradient to dd_A),
    delta past softplus' threshold (slope 1) and dd_A at 0 (both clamps' gradients), in
    float64 against the op chain on the same rows."""
    layer = make(torch.float64, G=1)
    E, N, G, H, P, S = layer._sizes()
    zx = torch.randn(2, 7, 2 * E + 2 * G * N + 3 * H + S, dtype=torch.float64) * 0.5
    o_dt, o_A = 2 * E + 2 * G * N, 2 * E + 2 * G * N + H
    zx[0, :3, o_A : o_A + H] = -1e5  # heavy_tail ~ 1e-5 < A_floor
    zx[0, 3, o_A] = 0.0
    zx[1, :, o_dt : o_dt + H] = 30.0  # softplus' threshold is 20
    layer.A_floor = 1e-4

    def loss_of(compiled: bool):
        z = zx.clone().requires_grad_()
        layer.zero_grad(set_to_none=True)
        with monkeypatch.context() as m:
            m.setattr(ref, "scan_compiles", lambda *a: False if not compiled else True)
            if compiled:
                bn, cn = layer.B_norm, layer.C_norm
                y, fin = ref.mamba3_layer_compiled(
                    z, layer._sizes(), (bn.weight, bn.eps, cn.weight, cn.eps), layer.dt_bias,
                    layer.A_floor, layer.C_bias, layer.B_bias, layer.D, None,
                )  # fmt: skip
            else:
                x, q, k, delta, A, trap, theta, zg = layer._terms(z)
                y, fin = ref.mamba3_scan_reference(
                    x, q, k, delta, A, trap, theta, layer.C_bias[:, 0], layer.B_bias[:, 0],
                    layer.D, zg,
                )  # fmt: skip
        w = torch.randn(y.shape, generator=torch.Generator().manual_seed(5), dtype=y.dtype)
        ((y * w).sum() + fin.ssm.sum()).backward()
        grads = [p.grad.clone() for p in layer.parameters() if p.grad is not None]
        return y.detach(), z.grad, grads

    y, g_z, g_p = loss_of(True)
    y0, g_z0, g_p0 = loss_of(False)
    assert rel(y, y0) < 1e-11
    assert rel(g_z, g_z0) < 1e-11
    assert g_z[0, :3, o_A : o_A + H].abs().max() == 0  # on the floor: no gradient
    assert len(g_p) == len(g_p0)
    for a, b in zip(g_p, g_p0):
        assert rel(a, b) < 1e-11


def test_compiled_layer_runs_only_where_it_applies(monkeypatch):
    """It runs for a plain layer on the CPU in float32/float64 without documents, with
    in_proj wrapped (a hook on it still runs: in_proj is called); a hook on the B norm,
    documents or bfloat16 take the op chain, with the same values."""
    calls = []
    real = ref._Layer3.apply
    monkeypatch.setattr(ref._Layer3, "apply", lambda *a: calls.append(1) or real(*a))
    layer = make(torch.float64)
    u = torch.randn(1, 6, 32, dtype=torch.float64)
    want = layer(u)
    assert calls == [1]
    seen = []
    h = layer.in_proj.register_forward_hook(lambda m, i, o: seen.append(1))
    layer(u)
    h.remove()
    assert calls == [1, 1] and seen == [1]
    h = layer.B_norm.register_forward_hook(lambda m, i, o: seen.append(2))
    got = layer(u)
    h.remove()
    assert calls == [1, 1] and seen == [1, 2]
    assert rel(got, want) < 1e-12
    seq = torch.tensor([[0, 0, 0, 1, 1, 1]], dtype=torch.int32)
    layer(u, seq_idx=seq)
    layer.to(torch.bfloat16)(u.to(torch.bfloat16))
    assert calls == [1, 1]


def test_compiled_layer_is_deterministic():
    layer = make(torch.float32, G=2)
    u = torch.randn(3, 17, 32)
    grads = []
    for _ in range(2):
        layer.zero_grad(set_to_none=True)
        layer(u).square().sum().backward()
        grads.append([p.grad.clone() for p in layer.parameters()])
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def test_compiled_layer_on_threads_matches_the_op_chain(monkeypatch):
    """From 512 tokens the per-token terms run on threads (`terms3.PARALLEL_MIN`)."""
    from mambakit.ops.cpu_jit import terms3

    layer = make(torch.float64, G=2, d_model=16, d_state=8, headdim=8)
    u = torch.randn(2, 2 * terms3.PARALLEL_MIN // 2 + 3, 16, dtype=torch.float64)
    state = start_state(layer, 2, torch.float64)
    out, final, grads = run(layer, u, state, True, monkeypatch)
    want_out, want_final, want_grads = run(layer, u, state, False, monkeypatch)
    assert rel(out, want_out) < 1e-11
    for a, b in zip(final, want_final):
        assert rel(a, b) < 1e-11
    for name, b in want_grads.items():
        assert rel(grads[name], b) < 1e-11, name


def test_compiled_layer_leaves_what_it_cannot_take(monkeypatch):
    """An empty batch and a parametrized parameter take the op chain (the same values); the
    start state's angle and ssm may change in place between the forward and the backward
    (the node keeps copies of what it reads of them)."""
    calls = []
    real = ref._Layer3.apply
    monkeypatch.setattr(ref._Layer3, "apply", lambda *a: calls.append(1) or real(*a))
    layer = make(torch.float64)
    empty = torch.randn(0, 5, 32, dtype=torch.float64, requires_grad=True)
    out, final = layer(empty, return_state=True)
    (out.sum() + final.ssm.sum()).backward()
    assert calls == [] and out.shape == (0, 5, 32)
    assert all(p.grad is None or p.grad.abs().max() == 0 for p in layer.parameters())

    layer.zero_grad(set_to_none=True)
    u = torch.randn(2, 6, 32, dtype=torch.float64)
    state = Mamba3State(*(t.requires_grad_() for t in start_state(layer, 2, torch.float64)))
    out = layer(u, state)
    with torch.no_grad():
        state.ssm.zero_()
        state.angle.zero_()
    out.square().sum().backward()  # no "modified by an inplace operation"
    assert calls == [1]

    class Doubled(torch.nn.Module):
        def forward(self, t):
            return 2 * t

    torch.nn.utils.parametrize.register_parametrization(layer, "D", Doubled())
    got = layer(u)
    assert calls == [1]
    with monkeypatch.context() as m:
        m.setattr(Mamba3, "_compiled", lambda *a: None)
        m.setattr(ref, "scan_compiles", lambda *a: False)
        want = layer(u)
    assert rel(got, want) < 1e-12


def test_compiled_layer_keeps_nothing_for_inference(monkeypatch):
    """Under no_grad the node keeps no step's state (a long prefill is not held to the
    scan's memory bound): past the bound it still runs, with the output and final state of
    the node that keeps every state, bit for bit."""
    from mambakit.ops.cpu_jit import scan3

    calls = []
    real = ref._Layer3.apply
    monkeypatch.setattr(ref._Layer3, "apply", lambda *a: calls.append(a[0][-1]) or real(*a))
    layer = make(torch.float32)
    u = torch.randn(2, 11, 32)
    state = start_state(layer, 2, torch.float32)
    want, want_final = layer(u, state, return_state=True)
    monkeypatch.setattr(scan3, "MAX_STATE_BYTES", 64)
    with torch.no_grad():
        got, final = layer(u, state, return_state=True)
    assert calls == [True, False]  # (the grad flag the node was given)
    assert torch.equal(got, want.detach())
    for a, b in zip(final, want_final):
        assert torch.equal(a, b.detach())
    layer(u, state)  # with grad, past the bound: the op chain
    assert calls == [True, False]
    layer.requires_grad_(False)  # grad mode on, nothing requiring grad: as under no_grad
    assert torch.equal(layer(u, state), got) and calls == [True, False, False]
    # a node told no backward would come cannot give one: it says so
    monkeypatch.setattr(ref, "_needs_grad", lambda *a: False)
    y = layer(u.clone().requires_grad_(), state)
    with pytest.raises(RuntimeError, match="kept nothing for a backward"):
        y.sum().backward()


@pytest.mark.parametrize("whole", [True, False], ids=["layer", "scan"])
def test_compiled_core_leaves_the_parameters_resizable(whole, monkeypatch):
    """FSDP frees and regrows a sharded parameter's storage: neither the compiled layer nor
    the compiled scan alone (the path of a layer whose B, C norms are not plain) may mark a
    parameter's as never resizable (as `.numpy()` on it would)."""
    layer = make(torch.float32)
    if not whole:  # a hook on a norm: the layer's op chain, with the compiled scan
        layer.B_norm.register_forward_hook(lambda m, i, o: None)
    out = layer(torch.randn(2, 5, 32, requires_grad=True))
    out.sum().backward()
    for p in layer.parameters():
        p.untyped_storage().resize_(0)  # raises where the storage was marked
