"""The Mamba-3 layer's delta and A kernels (`@triton.jit` only): activations.py says what
they compute and launches them. `delta_and_A` is also the decode step's."""

from __future__ import annotations

import triton
import triton.language as tl

# fmt: off


@triton.jit
def _softplus_log1p(u):
    """softplus(u): u above 20, else log1p(e^u) as log(w) e / (w - 1) with w = 1 + e, which
    keeps log1p's relative precision for small steps (the scan kernels' `_softplus`, whose
    exp2 argument is rounded after the multiply by log2 e, is some 1e-6 off there); a NaN
    stays NaN."""
    e = tl.exp(tl.where(u > 20.0, 20.0, u))
    w = 1.0 + e
    return tl.where(u > 20.0, u, tl.where(w == 1.0, e, tl.log(w) * tl.math.div_rn(e, w - 1.0)))


@triton.jit
def _softplus_slope(u):
    """softplus's derivative as torch takes it: 1 above 20, else e^u / (e^u + 1)."""
    e = tl.exp(tl.where(u > 20.0, 20.0, u))
    return tl.where(u > 20.0, 1.0, tl.math.div_rn(e, 1.0 + e))


@triton.jit
def _heavy_tail_parts(a):
    """(f(a), 1 / (1 - min(a, 0))): the heavy tail and its negative branch's reciprocal,
    correctly rounded as torch's reciprocal is (so f's ties with A_floor are torch's); a
    NaN stays NaN."""
    rcp = tl.math.div_rn(1.0, 1.0 - tl.where(a > 0.0, 0.0, a))
    return tl.where(a < 0.0, 0.0, a) + rcp, rcp


@triton.jit
def delta_and_A(u, a, A_floor):
    """delta = softplus(u) (u = dd_dt + dt_bias) and A = -max(f(a), A_floor) with the heavy
    tail f: the layer's forward kernel and the decode step's."""
    f, _ = _heavy_tail_parts(a)
    return _softplus_log1p(u), -tl.where(f < A_floor, A_floor, f)


@triton.jit
def _dt_A_fwd_kernel(
    p_dt, p_da, p_bias, p_delta, p_A, R, H, s_r, A_floor,
    BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    h = tl.arange(0, BLOCK_H)
    mh = h < H
    m = (r < R)[:, None] & mh[None, :]
    src = r.to(tl.int64)[:, None] * s_r + h[None, :]
    u = tl.load(p_dt + src, mask=m, other=0.0).to(tl.float32)
    u += tl.load(p_bias + h, mask=mh, other=0.0).to(tl.float32)[None, :]
    a = tl.load(p_da + src, mask=m, other=0.0).to(tl.float32)
    delta, A = delta_and_A(u, a, A_floor)
    dst = r.to(tl.int64)[:, None] * H + h[None, :]
    tl.store(p_delta + dst, delta, mask=m)
    tl.store(p_A + dst, A, mask=m)


@triton.jit
def _dt_A_bwd_kernel(
    p_dt, p_da, p_bias, p_gdelta, p_gA, p_ddt, p_dda, p_dbias, R, H, s_r, A_floor,
    BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
):
    pid = tl.program_id(0)
    r = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    h = tl.arange(0, BLOCK_H)
    mh = h < H
    m = (r < R)[:, None] & mh[None, :]
    src = r.to(tl.int64)[:, None] * s_r + h[None, :]
    dst = r.to(tl.int64)[:, None] * H + h[None, :]
    u = tl.load(p_dt + src, mask=m, other=0.0).to(tl.float32)
    u += tl.load(p_bias + h, mask=mh, other=0.0).to(tl.float32)[None, :]
    a = tl.load(p_da + src, mask=m, other=0.0).to(tl.float32)
    gdelta = tl.load(p_gdelta + dst, mask=m, other=0.0)
    gA = tl.load(p_gA + dst, mask=m, other=0.0)
    du = gdelta * _softplus_slope(u)
    f, rcp = _heavy_tail_parts(a)
    gf = tl.where(f >= A_floor, -gA, 0.0)
    df = tl.where(a >= 0.0, 1.0, 0.0) + tl.where(a <= 0.0, rcp * rcp, 0.0)
    tl.store(p_ddt + dst, du.to(p_ddt.dtype.element_ty), mask=m)
    tl.store(p_dda + dst, (gf * df).to(p_dda.dtype.element_ty), mask=m)
    tl.store(p_dbias + pid * H + h, tl.sum(tl.where(m, du, 0.0), axis=0), mask=mh)


# fmt: on
