"""dt_proj for the scan, as one Triton kernel: delta through softplus in f32, B and C widened.

B batch, T time, D = d_inner, N = d_state, R = dt_rank; x_dbl = u W_x^T [B, T, R + 2N].

    raw    = x_dbl[..., :R] @ W_dt^T          [B, T, D], rounded to x_dbl's dtype (the GEMM's)
    delta  = softplus(raw + dt_bias)          [B, T, D] f32 (the scan's softplus)
    bc     = x_dbl[..., R:] in f32            [B, T, 2N]

The scan reads delta and B, C once per pass, and it makes two passes over a long row (the
segment summaries, then the outputs): given raw delta it computes softplus in both, 17
instructions and two of the exponential unit's per (t, channel), a tenth of that unit's
work in each pass. This kernel computes it once, in the epilogue of the dt_proj product,
and widens B and C to the f32 the scan reads (a launch of its own before), so the chain
cuBLAS dt_proj -> widen B, C -> scan(softplus) becomes this kernel -> scan. The forward of
the fused node runs it with softplus; its backward with `softplus=False` for raw delta, the
same bits the forward started from, for the scan's backward (which needs the raw values).
Its launcher and launch parameters are in launch.py.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .._triton import COMPILED
from ..selective_scan.tiles import _delta_of


# fmt: off
@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr):
    """acc + a @ b in f32. Interpreted, bf16 operands go through f32 (exact products): the
    interpreter's bf16 dot (Triton 3.9) multiplies garbage."""
    if COMPILED:
        if IEEE:
            return tl.dot(a, b, acc, input_precision="ieee")
        return tl.dot(a, b, acc)
    return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")


@triton.jit
def _round(x, dtype: tl.constexpr):
    """x rounded to dtype to nearest even, as torch rounds (a GEMM's output, `.to`).
    Interpreted, Triton 3.9 truncates f32 to bf16, so the rounding is done on the bits first."""
    if not COMPILED:
        if (dtype == tl.bfloat16) & (x.dtype == tl.float32):
            bits = x.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)


@triton.jit
def _dt_proj_kernel(
    p_xdbl, p_w, p_bias, p_delta, p_bc,
    M, D, R, N2,
    s_xdbl_m, s_w_d, s_w_r,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_BC: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr, IEEE: tl.constexpr,
    D_TILES: tl.constexpr, STAGES: tl.constexpr,
):
    # x_dbl [M, R + 2N] rows (M = B T) with stride 1 along them; delta [M, D] (SOFTPLUS: f32,
    # else x_dbl's dtype) and bc [M, 2N] f32, contiguous. A program: BLOCK_M rows, D_TILES
    # tiles of BLOCK_D channels one after the other (its dt rows loaded once).
    pid_m = tl.program_id(0)
    pid_d = tl.program_id(1)
    dtype = p_xdbl.dtype.element_ty
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    mask_m = offs_m < M
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < R
    p_rows = p_xdbl + offs_m[:, None] * s_xdbl_m
    dt_r = tl.load(p_rows + offs_r[None, :], mask=mask_m[:, None] & mask_r[None, :], other=0.0)
    for j in tl.range(D_TILES, num_stages=STAGES):
        offs_d = (pid_d * D_TILES + j) * BLOCK_D + tl.arange(0, BLOCK_D)
        mask_d = offs_d < D
        w = tl.load(
            p_w + offs_d[None, :] * s_w_d + offs_r[:, None] * s_w_r,
            mask=mask_r[:, None] & mask_d[None, :], other=0.0,
        )
        raw = _dot(dt_r, _round(w, dtype), tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32), IEEE)
        raw = _round(raw, dtype)  # dt_proj's output, as the GEMM rounds it
        m2 = mask_m[:, None] & mask_d[None, :]
        p_out = p_delta + offs_m[:, None] * D + offs_d[None, :]
        if SOFTPLUS:
            bias = tl.zeros([BLOCK_D], dtype=tl.float32)
            if HAS_BIAS:
                bias = tl.load(p_bias + offs_d, mask=mask_d, other=0.0).to(tl.float32)
            _, delta = _delta_of(raw.to(tl.float32), m2, bias, HAS_BIAS, True, True)
            tl.store(p_out, delta, mask=m2)
        else:
            tl.store(p_out, raw, mask=m2)
    if SOFTPLUS:
        if pid_d == 0:  # B and C, widened
            offs_c = tl.arange(0, BLOCK_BC)
            m_c = mask_m[:, None] & (offs_c < N2)[None, :]
            bc = tl.load(p_rows + R + offs_c[None, :], mask=m_c, other=0.0)
            tl.store(p_bc + offs_m[:, None] * N2 + offs_c[None, :], bc.to(tl.float32), mask=m_c)


# fmt: on
