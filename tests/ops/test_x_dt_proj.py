"""x_proj and dt_proj in one kernel (`mambakit::x_dt_proj`, ops/mamba_inner/kernels.py)
against float64 and against the chain it replaces.

B batch, T time, D = d_inner, N = d_state, R = dt_rank. From u it gives x_dbl = u W_x^T
rounded to u's dtype (as the cuBLAS GEMM rounds it), delta = softplus(dt_r W_dt^T + dt_bias)
in f32 with the product rounded to u's dtype first, and B, C widened to f32. Without CUDA
the kernel runs under the Triton interpreter (16-wide tiles: the K and channel loops run
several times, with masked edges); `-m gpu` adds the 130m and 1.4b shapes.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mambakit.ops.mamba_inner import x_dt_proj_op
from mambakit.ops.mamba_inner.kernels import dt_proj

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
# max|got - ref| / max|ref|: f32 sums in another order, then one rounding to the dtype
# that the float64 oracle may take the other way
TOL = {F32: 2e-5, F16: 2e-3, BF16: 1.2e-2}


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    assert got.shape == ref.shape, (got.shape, ref.shape)
    assert torch.isfinite(got).all(), "non-finite values (an unwritten element?)"
    return ((got.double() - ref).abs().max() / ref.abs().max().clamp(min=1e-12)).item()


def check(Bsz, T, D, R, N, with_bias, dtype, gen, strided=False):
    wide = torch.randn(Bsz, T, 2 * D if strided else D, generator=gen).to(DEVICE, dtype)
    u = wide[..., :D]  # strided: rows 2D apart, as a view of a wider tensor
    wx = (torch.randn(R + 2 * N, D, generator=gen) * D**-0.5).to(DEVICE)  # f32 master weights
    wdt = (torch.randn(D, R, generator=gen) * R**-0.5).to(DEVICE)
    bias = (torch.randn(D, generator=gen) - 2).to(DEVICE) if with_bias else None
    x_dbl, delta, bc = x_dt_proj_op(u, wx, wdt, bias)
    assert (x_dbl.dtype, delta.dtype, bc.dtype) == (dtype, F32, F32)
    assert rel_err(x_dbl, F.linear(u.double(), wx.to(dtype).double())) <= TOL[dtype], "x_dbl"
    # delta from the x_dbl it stored: dt_r W_dt^T rounded to the dtype, bias, softplus
    raw64 = F.linear(x_dbl[..., :R].double(), wdt.to(dtype).double())
    b64 = bias.double() if with_bias else 0.0
    assert rel_err(delta, F.softplus(raw64 + b64)) <= TOL[dtype], "delta"
    assert torch.equal(bc, x_dbl[..., R:].float()), "B, C widened"
    # the chain it replaces, from the same x_dbl: the dt_proj kernel gives delta to a rounding
    delta_chain, bc_chain = dt_proj(x_dbl, wdt, bias, True)
    assert torch.equal(bc, bc_chain)
    assert rel_err(delta, delta_chain.double()) <= TOL[dtype], "against the dt_proj kernel"


CASES = {  # B, T, D, R, N, bias
    "bias": (2, 37, 40, 5, 6, True),
    "nobias-r1": (1, 17, 24, 1, 1, False),
    "wide-r": (1, 9, 56, 20, 3, True),
}


@pytest.mark.parametrize("dtype", [F32, BF16, F16], ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_x_dt_proj_matches_float64(case, dtype, nan_empty):
    check(*CASES[case], dtype, torch.Generator().manual_seed(0))


def test_x_dt_proj_strided_rows(nan_empty):
    check(2, 19, 48, 3, 4, True, BF16, torch.Generator().manual_seed(1), strided=True)


def test_x_dt_proj_is_deterministic():
    gen = torch.Generator().manual_seed(3)
    u = torch.randn(2, 33, 56, generator=gen).to(DEVICE, BF16)
    wx, wdt = torch.randn(12, 56, generator=gen), torch.randn(56, 4, generator=gen)
    bias = torch.randn(56, generator=gen)
    first = x_dt_proj_op(u, wx.to(DEVICE), wdt.to(DEVICE), bias.to(DEVICE))
    again = x_dt_proj_op(u, wx.to(DEVICE), wdt.to(DEVICE), bias.to(DEVICE))
    assert all(torch.equal(a, b) for a, b in zip(first, again))


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1, 4096, 1536, 48), (2, 700, 4096, 128)], ids=["130m", "1.4b"])
def test_x_dt_proj_real_shapes(shape, nan_empty):
    check(*shape, 16, True, BF16, torch.Generator().manual_seed(2))
