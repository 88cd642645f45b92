"""The dt_proj kernel (ops/mamba_inner/kernels.py) against float64 and against itself, and
the scan backward's rounding of delta to the f16 that kernel stores.

B batch, T time, D = d_inner, N = d_state, R = dt_rank. With softplus it gives
delta = softplus(raw + dt_bias) (in f16, f32 for f32 inputs) and B, C widened; without,
raw = dt_r W_dt^T rounded to the compute dtype (what the fused node's backward reads).
Without CUDA the kernel runs under the Triton interpreter (shapes past its 16-wide blocks,
R and 2N not powers of two); `-m gpu` adds the 130m and 1.4b shapes.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mambakit.ops.mamba_inner import delta_dtype
from mambakit.ops.mamba_inner.kernels import dt_proj

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
# max|got - ref| / max|ref|: reordered f32 sums, then one rounding of raw to f16 (2^-11) or
# bf16 (2^-8) that the f64 oracle may round the other way
TOL = {F32: 2e-5, F16: 1.5e-3, BF16: 1e-2}
# delta stored in f16 (bf16 and f16 inputs): softplus of the same raw bits, one rounding
# apart (2^-11 of the element, at most that of the largest)
TOL_STORED = {F32: 2e-6, F16: 2**-11, BF16: 2**-11}


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
    assert delta.dtype == delta_dtype(dtype) and bc.dtype == F32
    assert raw.dtype == dtype and empty.numel() == 0
    assert (delta > 0).all(), "softplus is positive, and so is its rounding"

    raw64 = F.linear(x_dbl[..., :R].double(), w.to(dtype).double())
    assert rel_err(raw, raw64) <= TOL[dtype], "raw"
    b64 = bias.double() if with_bias else 0.0
    assert rel_err(delta, F.softplus(raw64 + b64)) <= TOL[dtype], "delta"
    # the two modes start from the same raw bits: softplus of the raw output is delta up
    # to its rounding (a raw one ulp apart would be 2^-8 off in bf16)
    assert rel_err(delta, F.softplus(raw.double() + b64)) <= TOL_STORED[dtype], "delta vs raw"
    assert torch.equal(bc, x_dbl[..., R:].float()), "B, C widened"


CASES = {"bias": (2, 21, 40, 3, 5, True), "nobias-r1": (1, 17, 24, 1, 1, False)}


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


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1, 4096, 1536, 48), (3, 700, 4096, 128)], ids=["130m", "1.4b"])
def test_dt_proj_real_shapes(shape, nan_empty):
    check(*shape, 16, True, BF16, torch.Generator().manual_seed(2))


@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "f16"])
def test_scan_backward_rounds_delta_as_stored(dtype, nan_empty):
    """scan_bwd(raw, softplus, delta_f16=True), the fused node's backward, runs on the f16
    delta the forward stored: every gradient but delta's equals the backward given that
    delta itself (no softplus), bit for bit, and d raw is d delta through softplus, straight
    through the rounding. Without the rounding the two differ."""
    from mambakit.ops.selective_scan import kernels as K

    gen = torch.Generator().manual_seed(3)
    Bsz, T, D, R, N = 2, 21, 24, 3, 4
    x_dbl = torch.randn(Bsz, T, R + 2 * N, generator=gen).to(DEVICE, dtype)
    w = (torch.randn(D, R, generator=gen) * R**-0.5).to(DEVICE)
    bias = (torch.randn(D, generator=gen) - 1).to(DEVICE)
    delta, _ = dt_proj(x_dbl, w, bias, True)
    raw, _ = dt_proj(x_dbl, w, None, False)
    B, C = x_dbl[..., R : R + N], x_dbl[..., R + N :]
    u, z = (torch.randn(Bsz, T, D, generator=gen).to(DEVICE, dtype) for _ in range(2))
    A = -(torch.rand(D, N, generator=gen) + 0.5).to(DEVICE)
    Dv = torch.randn(D, generator=gen).to(DEVICE)
    gy = torch.randn(Bsz, T, D, generator=gen).to(DEVICE, dtype)
    _, _, states = K.scan_fwd(u, delta, A, B, C, Dv, z, None, False, None, None, True)

    def bwd(dt, dt_bias, softplus, f16):
        return K.scan_bwd(gy, None, u, dt, A, B, C, Dv, z, dt_bias, softplus, None, None,
                          states, delta_f16=f16)  # fmt: skip

    given = bwd(delta.float(), None, False, False)
    rounded = bwd(raw, bias, True, True)
    for i, name in enumerate(("du", "dA", "dB", "dC", "dD", "dz")):
        j = (0, 2, 3, 4, 5, 6)[i]
        assert torch.equal(rounded[j], given[j]), name
    sig = torch.sigmoid(raw.float() + bias)
    torch.testing.assert_close(rounded[1].float(), (given[1].float() * sig).to(raw.dtype).float(),
                               rtol=2**-7, atol=1e-6)  # fmt: skip
    unrounded = bwd(raw, bias, True, False)
    assert not torch.equal(unrounded[0], given[0]), "the rounding is what makes them equal"
