"""The dt_proj kernel (ops/mamba_inner/kernels.py) against float64 and against itself.

B batch, T time, D = d_inner, N = d_state, R = dt_rank. With softplus it gives
delta = softplus(raw + dt_bias) in f32 and B, C widened; without, raw = dt_r W_dt^T
rounded to the compute dtype (what the fused node's backward reads). Without CUDA the
kernel runs under the Triton interpreter (shapes past its 16-wide blocks, R and 2N not
powers of two); `-m gpu` adds the 130m and 1.4b shapes.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mambakit.ops.mamba_inner.launch import dt_proj

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
# max|got - ref| / max|ref|: reordered f32 sums, then one rounding of raw to f16 (2^-11) or
# bf16 (2^-8) that the f64 oracle may round the other way
TOL = {F32: 2e-5, F16: 1.5e-3, BF16: 1e-2}


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    assert got.shape == ref.shape, (got.shape, ref.shape)
    assert torch.isfinite(got).all(), "non-finite values (an unwritten element?)"
    return ((got.double() - ref).abs().max() / ref.abs().max().clamp(min=1e-12)).item()


def check(Bsz, T, D, R, N, with_bias, dtype, gen):
    x_dbl = (torch.randn(Bsz, T, R + 2 * N, generator=gen)).to(DEVICE, dtype)
    w = (torch.randn(D, R, generator=gen) * R**-0.5).to(DEVICE)  # f32, as a master weight
    bias = (torch.randn(D, generator=gen) - 2).to(DEVICE) if with_bias else None
    delta, bc = dt_proj(x_dbl, w, bias, True)
    raw, empty = dt_proj(x_dbl, w, bias, False)
    assert delta.dtype == bc.dtype == F32 and raw.dtype == dtype and empty.numel() == 0

    raw64 = F.linear(x_dbl[..., :R].double(), w.to(dtype).double())
    assert rel_err(raw, raw64) <= TOL[dtype], "raw"
    b64 = bias.double() if with_bias else 0.0
    assert rel_err(delta, F.softplus(raw64 + b64)) <= TOL[dtype], "delta"
    # the two modes start from the same raw bits: softplus of the raw output is delta up
    # to f32 rounding (a raw one ulp apart would be 2^-8 off in bf16)
    assert rel_err(delta, F.softplus(raw.double() + b64)) <= 2e-6, "delta vs raw"
    assert torch.equal(bc, x_dbl[..., R:].float()), "B, C widened"


# "even": rows and channels in whole 16-wide tiles (the interpreter's), no partial tile
CASES = {
    "bias": (2, 21, 40, 3, 5, True),
    "nobias-r1": (1, 17, 24, 1, 1, False),
    "even": (2, 16, 32, 3, 5, True),
}


@pytest.mark.parametrize("dtype", [F32, BF16, F16], ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_dt_proj_matches_float64(case, dtype, nan_empty):
    check(*CASES[case], dtype, torch.Generator().manual_seed(0))


def test_dt_proj_strided_rows(nan_empty):
    """x_dbl as a view with padded rows (stride > R + 2N) reads only its own columns."""
    gen = torch.Generator().manual_seed(1)
    Bsz, T, D, R, N = 2, 19, 24, 3, 4
    wide = torch.randn(Bsz, T, R + 2 * N + 5, generator=gen).to(DEVICE, BF16)
    x_dbl = wide[..., : R + 2 * N]
    w = torch.randn(D, R, generator=gen).to(DEVICE)
    got = dt_proj(x_dbl, w, None, True)
    ref = dt_proj(x_dbl.contiguous(), w, None, True)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])


def test_dt_proj_strided_bias(nan_empty):
    """dt_bias as a strided view (a column of a stacked tensor) adds the same values as
    its contiguous copy: the kernel reads the bias densely."""
    gen = torch.Generator().manual_seed(3)
    Bsz, T, D, R, N = 2, 19, 24, 3, 4
    x_dbl = torch.randn(Bsz, T, R + 2 * N, generator=gen).to(DEVICE)
    w = torch.randn(D, R, generator=gen).to(DEVICE)
    bias = torch.randn(D, 2, generator=gen).to(DEVICE)[:, 0]
    assert bias.stride(0) == 2
    got = dt_proj(x_dbl, w, bias, True)
    ref = dt_proj(x_dbl, w, bias.contiguous(), True)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1, 4096, 1536, 48), (3, 700, 4096, 128)], ids=["130m", "1.4b"])
def test_dt_proj_real_shapes(shape, nan_empty):
    check(*shape, 16, True, BF16, torch.Generator().manual_seed(2))
