"""The fused conv + x_proj kernel and dt_proj's sum of its parts (`mambakit::conv_x_dt`)
against float64 and against the unfused kernels.

B batch, T time, D = d_inner, K = d_conv, R = dt_rank, N = d_state, W = R + 2N. One launch
gives u = silu(conv(x)) and x_proj's partial sums over blocks of channels; dt_proj adds them
in order into x_dbl = u W_x^T (rounded once, as a GEMM rounds), then gives delta and B, C
as it does from a given x_dbl. Without CUDA the kernels run under the Triton interpreter
(16-wide tiles, two per part, so several parts are summed); `-m gpu` adds the 130m and
1.4b shapes.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mambakit.ops.causal_conv1d.reference import causal_conv1d_reference
from mambakit.ops.mamba_inner import conv_x_dt_op
from mambakit.ops.mamba_inner.kernels import dt_proj

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
# max|got - ref| / max|ref|: f32 sums in another order, then one rounding to the dtype
TOL = {F32: 2e-5, F16: 2e-3, BF16: 1.2e-2}


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    assert got.shape == ref.shape, (got.shape, ref.shape)
    assert torch.isfinite(got).all(), "non-finite values (an unwritten element?)"
    return ((got.double() - ref).abs().max() / ref.abs().max().clamp(min=1e-12)).item()


def inputs(Bsz, T, D, K, R, N, dtype, gen, bias=True, state=False, docs=False):
    xz = torch.randn(Bsz, T, 2 * D, generator=gen).to(DEVICE, dtype)
    x = xz[..., :D]  # the in_proj output's x half: rows strided by 2D
    cw = (torch.randn(D, K, generator=gen) * K**-0.5).to(DEVICE)
    cb = torch.randn(D, generator=gen).to(DEVICE) if bias else None
    st = torch.randn(Bsz, K - 1, D, generator=gen).to(DEVICE) if state else None
    seq = None
    if docs:
        seq = torch.sort(torch.randint(0, 3, (Bsz, T), generator=gen), dim=1).values
        seq = seq.to(DEVICE, torch.int32)
    wx = (torch.randn(R + 2 * N, D, generator=gen) * D**-0.5).to(DEVICE)  # f32 master weights
    wdt = (torch.randn(D, R, generator=gen) * R**-0.5).to(DEVICE)
    bdt = (torch.randn(D, generator=gen) - 2).to(DEVICE)
    return x, cw, cb, st, seq, wx, wdt, bdt


def check(args, dtype, R):
    x, cw, cb, st, seq, wx, wdt, bdt = args
    u, final, x_dbl, delta, bc = conv_x_dt_op(*args)
    assert (u.dtype, x_dbl.dtype) == (dtype, dtype)
    assert final.dtype == delta.dtype == bc.dtype == F32
    u64, final64 = causal_conv1d_reference(
        x.double(), cw.to(dtype).double() if dtype != F32 else cw.double(),
        cb.double() if cb is not None else None, st.double() if st is not None else None,
        seq, activation="silu", return_final_state=True,
    )  # fmt: skip
    assert rel_err(u, u64) <= TOL[dtype], "u"
    assert rel_err(final, final64) <= 1e-6, "final state"
    # x_proj of the stored u, with the weight rounded as `.to(dtype)` rounds it
    assert rel_err(x_dbl, F.linear(u.double(), wx.to(dtype).double())) <= TOL[dtype], "x_dbl"
    # delta, B and C are what dt_proj gives from that x_dbl: the same bits
    delta_ref, bc_ref = dt_proj(x_dbl, wdt, bdt, True)
    assert torch.equal(delta, delta_ref) and torch.equal(bc, bc_ref), "dt_proj of x_dbl"
    assert torch.equal(bc, x_dbl[..., R:].float())


CASES = {
    # B, T, D, K, R, N, bias, initial state, documents
    "plain": (2, 37, 40, 4, 5, 6, True, False, False),
    "state-docs": (2, 29, 48, 4, 3, 4, False, True, True),
    "k2-narrow": (1, 5, 24, 2, 1, 1, True, True, False),
}


@pytest.mark.parametrize("dtype", [F32, BF16, F16], ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_conv_x_proj_matches_float64(case, dtype, nan_empty):
    B, T, D, K, R, N, bias, state, docs = CASES[case]
    gen = torch.Generator().manual_seed(0)
    check(inputs(B, T, D, K, R, N, dtype, gen, bias, state, docs), dtype, R)


def test_conv_x_proj_is_deterministic():
    gen = torch.Generator().manual_seed(3)
    args = inputs(2, 33, 56, 4, 4, 8, BF16, gen, state=True, docs=True)
    first = conv_x_dt_op(*args)
    again = conv_x_dt_op(*args)
    assert all(torch.equal(a, b) for a, b in zip(first, again))


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1, 4096, 1536, 48), (2, 700, 4096, 128)], ids=["130m", "1.4b"])
def test_conv_x_proj_real_shapes(shape, nan_empty):
    B, T, D, R = shape
    gen = torch.Generator().manual_seed(2)
    check(inputs(B, T, D, 4, R, 16, BF16, gen, state=True), BF16, R)
