"""The references of causal_conv1d, rms_norm and the Mamba-3 scan against their naive oracles.

B batch, T time, D channels (d_inner), K = d_conv; M rows of the norm; H heads of P
values, G groups of N states, S rotary angles (Mamba-3). Each oracle (`ops/<op>/naive.py`)
is the recurrence as written, one timestep (or row) at a time; the reference path
(`backend="reference"`, or `mamba3_scan_reference`) runs in float64 on the same inputs, so
the two agree to rounding: 1e-10 relative, norm-wise, for values, final states and the
gradient of every input (autograd through both, random cotangents on every output).

Documents in `seq_idx` start at chosen times: one inside the first K-1 steps, one inside
the last K-1 (the final state keeps only the last document), one on the last step; ids
keep growing across rows, so every row after the first opens with a new document at t = 0
(which still reads the initial state: times before 0 belong to the document of t = 0).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from mambakit.ops import causal_conv1d, rms_norm
from mambakit.ops.causal_conv1d.naive import causal_conv1d_naive
from mambakit.ops.mamba3.naive import mamba3_scan_naive
from mambakit.ops.mamba3.reference import mamba3_scan_reference
from mambakit.ops.rms_norm.naive import rms_norm_naive
from mambakit.state import Mamba3State

F64 = torch.float64
TOL = 1e-10


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm() / want.norm().clamp(min=1e-30)).item()


def seq_from_starts(starts: tuple[tuple[int, ...], ...], T: int) -> torch.Tensor:
    """[B, T] int32 document ids, a new id at every listed start of each row; ids grow
    across rows, so row b > 0 opens with an id its predecessor did not end with."""
    rows, first = [], 0
    for row in starts:
        t = torch.arange(T)
        ids = first + (t[:, None] >= torch.tensor(row, dtype=torch.long)[None, :]).sum(-1)
        rows.append(ids)
        first = int(ids[-1]) + 1
    return torch.stack(rows).to(torch.int32)


def grads(outputs: list[torch.Tensor], cotangents: list[torch.Tensor], leaves: dict) -> dict:
    loss = sum((o * c).sum() for o, c in zip(outputs, cotangents))
    names = list(leaves)
    return dict(zip(names, torch.autograd.grad(loss, [leaves[n] for n in names])))


def leaves_of(inp: dict) -> dict:
    return {k: v for k, v in inp.items() if isinstance(v, torch.Tensor) and v.is_floating_point()}


# --- causal_conv1d ------------------------------------------------------------------------


@dataclasses.dataclass
class Conv:
    Bsz: int = 3
    T: int = 13
    Dn: int = 5
    K: int = 4
    bias: bool = True
    silu: bool = True
    h0: bool = True
    starts: tuple[tuple[int, ...], ...] | None = None  # document starts per row

    @property
    def id(self) -> str:
        on = [n for n in ("bias", "silu", "h0") if getattr(self, n)]
        if self.starts is not None:
            on.append("docs" + "/".join(",".join(map(str, r)) or "none" for r in self.starts))
        return f"B{self.Bsz}-T{self.T}-D{self.Dn}-K{self.K}-" + ("+".join(on) or "plain")


CONV_CASES = [
    Conv(),
    Conv(bias=False, silu=False, h0=False),
    Conv(K=2, T=9, Dn=3),
    # starts at 1 (inside the first K-1 steps) and in the last K-1 steps; a row without one
    Conv(starts=((1, 11), (6,), ())),
    # starts at T-(K-1) exactly and on the last step; a start at 2 and 3 (a 1-step document)
    Conv(T=15, K=5, starts=((2, 3, 11), (14,), (7, 13))),
    Conv(Bsz=2, T=7, K=3, h0=False, starts=((1, 2), (5,))),
    # T < K-1: the final state keeps initial-state rows unless a document started
    Conv(Bsz=2, T=2, K=4, starts=((1,), ())),
    Conv(Bsz=1, T=1, K=3, Dn=2),
]


def conv_inputs(c: Conv) -> dict:
    return dict(
        x=torch.randn(c.Bsz, c.T, c.Dn, dtype=F64),
        weight=torch.randn(c.Dn, c.K, dtype=F64),
        bias=torch.randn(c.Dn, dtype=F64) if c.bias else None,
        initial_state=torch.randn(c.Bsz, c.K - 1, c.Dn, dtype=F64) if c.h0 else None,
        seq_idx=seq_from_starts(c.starts, c.T) if c.starts is not None else None,
        activation="silu" if c.silu else None,
    )


@pytest.mark.parametrize("c", CONV_CASES, ids=lambda c: c.id)
def test_causal_conv1d_reference_matches_naive(c: Conv, seed):
    inp = conv_inputs(c)
    leaves = {k: v.requires_grad_() for k, v in leaves_of(inp).items()}
    out, final = causal_conv1d(**inp, return_final_state=True, backend="reference")
    out_n, final_n = causal_conv1d_naive(**inp)
    assert out.shape == out_n.shape == (c.Bsz, c.T, c.Dn)
    assert final.shape == final_n.shape == (c.Bsz, c.K - 1, c.Dn)
    assert rel(out, out_n) < TOL, ("out", rel(out, out_n))
    assert torch.equal(final, final_n), "final_state"  # the same inputs, copied or zeroed

    cot = [torch.randn_like(out), torch.randn_like(final)]
    g, g_n = grads([out, final], cot, leaves), grads([out_n, final_n], cot, leaves)
    for name in leaves:
        assert rel(g[name], g_n[name]) < TOL, (name, rel(g[name], g_n[name]))


def test_causal_conv1d_final_state_contract(seed):
    """What the final state holds, spelled out: the last K-1 inputs of the row's last
    document, zero before its start, initial-state rows where it is the row's first."""
    K, Dn = 4, 2
    x = torch.randn(3, 5, Dn, dtype=F64)
    h0 = torch.randn(3, K - 1, Dn, dtype=F64)
    w = torch.randn(Dn, K, dtype=F64)
    seq = seq_from_starts(((3,), (), (4,)), 5)
    _, final = causal_conv1d_naive(x, w, initial_state=h0, seq_idx=seq)
    assert torch.equal(final[0], torch.stack([torch.zeros(Dn, dtype=F64), x[0, 3], x[0, 4]]))
    assert torch.equal(final[1], x[1, 2:])
    assert torch.equal(final[2, :2], torch.zeros(2, Dn, dtype=F64))
    assert torch.equal(final[2, 2], x[2, 4])
    _, short = causal_conv1d_naive(x[:, :1], w, initial_state=h0)  # T = 1 < K-1
    assert torch.equal(short, torch.cat([h0[:, 1:], x[:, :1]], dim=1))


# --- rms_norm -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "shape, with_residual, eps",
    [((3, 5, 7), True, 1e-5), ((3, 5, 7), False, 1e-5), ((1, 13), True, 1e-2), ((9,), True, 1e-6)],
    ids=["M15-D7-res", "M15-D7-nores", "M1-D13-res-eps1e-2", "M1-D9-res-1d"],
)
def test_rms_norm_reference_matches_naive(shape, with_residual, eps, seed):
    Dn = shape[-1]
    x = (torch.randn(shape, dtype=F64) * 2).requires_grad_()
    residual = torch.randn(shape, dtype=F64).requires_grad_() if with_residual else None
    weight = (1 + 0.3 * torch.randn(Dn, dtype=F64)).requires_grad_()
    out, res = rms_norm(x, weight, eps=eps, residual=residual, backend="reference")
    out_n, res_n = rms_norm_naive(x, weight, eps=eps, residual=residual)
    assert out.dtype == res.dtype == F64 and out.shape == res.shape == out_n.shape == x.shape
    assert rel(out, out_n) < TOL, ("out", rel(out, out_n))
    assert rel(res, res_n) < TOL, ("residual_out", rel(res, res_n))

    leaves = {"x": x, "weight": weight} | ({"residual": residual} if with_residual else {})
    cot = [torch.randn_like(out), torch.randn_like(res)]
    g, g_n = grads([out, res], cot, leaves), grads([out_n, res_n], cot, leaves)
    for name in leaves:
        assert rel(g[name], g_n[name]) < TOL, (name, rel(g[name], g_n[name]))


# --- mamba3 -------------------------------------------------------------------------------


@dataclasses.dataclass
class M3:
    Bsz: int = 3
    T: int = 17
    H: int = 4
    G: int = 2
    P: int = 3
    N: int = 7
    S: int = 2
    chunk: int = 5
    Dz: bool = True  # D and the gate z
    h0: bool = True
    starts: tuple[tuple[int, ...], ...] | None = None

    @property
    def id(self) -> str:
        on = [n for n in ("Dz", "h0") if getattr(self, n)]
        if self.starts is not None:
            on.append("docs" + "/".join(",".join(map(str, r)) or "none" for r in self.starts))
        dims = f"B{self.Bsz}-T{self.T}-H{self.H}-G{self.G}-P{self.P}-N{self.N}-S{self.S}"
        return f"{dims}-chunk{self.chunk}-" + ("+".join(on) or "plain")


M3_CASES = [
    M3(),
    M3(Dz=False, h0=False, chunk=64),
    M3(G=1, S=3, chunk=1),
    M3(G=4, S=0, N=5),
    # a start at 1, one on a chunk boundary (5, 10), one on the last step; a row without one
    M3(starts=((1, 10, 16), (5,), ())),
    M3(T=13, chunk=4, starts=((2, 3, 12), (4, 11), (7,))),
    M3(Bsz=2, T=9, chunk=64, h0=False, starts=((1,), (8,))),
    M3(Bsz=1, T=1, chunk=3),
]


def m3_inputs(c: M3) -> dict:
    B, T, H, G, P, N, S = c.Bsz, c.T, c.H, c.G, c.P, c.N, c.S

    def r(*shape, scale=1.0):
        return torch.randn(*shape, dtype=F64) * scale

    inp = dict(
        x=r(B, T, H, P),
        q=r(B, T, G, N, scale=0.5),
        k=r(B, T, G, N, scale=0.5),
        delta=torch.rand(B, T, H, dtype=F64) * 0.5 + 0.01,
        A=-(torch.rand(B, T, H, dtype=F64) * 2 + 0.1),
        trap=r(B, T, H),
        theta=r(B, T, S),
        q_bias=r(H, N, scale=0.3) + 1,
        k_bias=r(H, N, scale=0.3) + 1,
        D=r(H) if c.Dz else None,
        z=r(B, T, H, P) if c.Dz else None,
    )
    if c.h0:
        inp |= dict(
            h0_angle=torch.rand(B, H, S, dtype=F64) * 2 * math.pi,
            h0_ssm=r(B, H, P, N, scale=0.5),
            h0_k=r(B, H, N),
            h0_x=r(B, H, P),
        )
    inp["seq_idx"] = seq_from_starts(c.starts, T) if c.starts is not None else None
    return inp


def m3_call(fn, inp: dict, **kw) -> tuple[torch.Tensor, Mamba3State]:
    args = {k: v for k, v in inp.items() if not k.startswith("h0_")}
    h0 = None
    if "h0_ssm" in inp:
        h0 = Mamba3State(inp["h0_angle"], inp["h0_ssm"], inp["h0_k"], inp["h0_x"])
    return fn(**args, initial_state=h0, **kw)


@pytest.mark.parametrize("c", M3_CASES, ids=lambda c: c.id)
def test_mamba3_reference_matches_naive(c: M3, seed):
    inp = m3_inputs(c)
    leaves = {k: v.requires_grad_() for k, v in leaves_of(inp).items()}
    y, final = m3_call(mamba3_scan_reference, inp, chunk=c.chunk)
    y_n, final_n = m3_call(mamba3_scan_naive, inp)
    assert y.shape == y_n.shape == (c.Bsz, c.T, c.H, c.P)
    assert rel(y, y_n) < TOL, ("y", rel(y, y_n))
    for name in Mamba3State._fields:
        a, b = getattr(final, name), getattr(final_n, name)
        assert a.shape == b.shape, name
        assert rel(a, b) < TOL, (f"final.{name}", rel(a, b))

    outs, outs_n = [y, *final], [y_n, *final_n]
    cot = [torch.randn_like(o) for o in outs]
    g, g_n = grads(outs, cot, leaves), grads(outs_n, cot, leaves)
    for name in leaves:
        assert rel(g[name], g_n[name]) < TOL, (name, rel(g[name], g_n[name]))
