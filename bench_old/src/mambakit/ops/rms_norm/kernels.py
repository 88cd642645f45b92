"""Triton kernels for RMSNorm with a fused residual add (launched from launch.py).

M rows (the flattened leading dims), D features. Per row:

    r    = x + residual                        (f32: the residual stream)
    rstd = 1 / sqrt(mean(r^2) + eps)           (f32)
    out  = r * rstd * weight                   (cast to the compute dtype)

Backward, with g_out = dL/dout, g_r = dL/d residual_out and r_hat = r * rstd:

    dr      = rstd * (g_out*w - r_hat * mean(g_out*w * r_hat)) + g_r
    dx      = dr (in x.dtype),   dresidual = dr (in residual.dtype)
    dweight = sum_rows g_out * r_hat

The forward saves r (it is an output anyway, the next block's residual) and
rstd [M]; the backward reads r once instead of x and residual. Each program
holds a [BLOCK_M, BLOCK_N] tile with BLOCK_N = next_pow2(D) (the whole row) and
BLOCK_M rows, several for small D so that a program moves enough bytes. The
backward walks a fixed range of rows per program, keeps its dweight partial in
registers and writes it out; the partials are summed in a fixed order.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _rms_fwd_kernel(
    p_x,
    p_res,
    p_w,
    p_out,
    p_rout,
    p_rstd,
    M,
    D,
    eps,
    s_x_m,
    s_res_m,
    s_out_m,
    s_rout_m,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_RES: tl.constexpr,
    STORE_RES: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < D)[None, :]
    b_r = tl.load(p_x + rows[:, None] * s_x_m + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        b_r += tl.load(p_res + rows[:, None] * s_res_m + cols[None, :], mask=mask, other=0.0).to(
            tl.float32
        )
    if STORE_RES:
        tl.store(p_rout + rows[:, None] * s_rout_m + cols[None, :], b_r, mask=mask)
    b_rstd = 1.0 / tl.sqrt(tl.sum(b_r * b_r, axis=1) / D + eps)  # [BLOCK_M]
    b_w = tl.load(p_w + cols, mask=cols < D, other=0.0).to(tl.float32)
    b_o = b_r * b_rstd[:, None] * b_w[None, :]
    tl.store(
        p_out + rows[:, None] * s_out_m + cols[None, :], b_o.to(p_out.dtype.element_ty), mask=mask
    )
    tl.store(p_rstd + rows, b_rstd, mask=rows < M)


@triton.jit
def _rms_bwd_kernel(
    p_rout,
    p_rstd,
    p_w,
    p_dout,
    p_drout,
    p_dx,
    p_dres,
    p_dw_part,
    M,
    D,
    N_ITER,
    s_rout_m,
    s_dout_m,
    s_dout_n,
    s_drout_m,
    s_drout_n,
    s_dx_m,
    s_dres_m,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_DOUT: tl.constexpr,
    HAS_DROUT: tl.constexpr,
    HAS_DRES: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    mask_n = cols < D
    b_w = tl.load(p_w + cols, mask=mask_n, other=0.0).to(tl.float32)
    b_dw = tl.zeros([BLOCK_N], dtype=tl.float32)
    for i in range(N_ITER):
        rows = (pid.to(tl.int64) * N_ITER + i) * BLOCK_M + tl.arange(0, BLOCK_M)
        mask_m = rows < M
        mask = mask_m[:, None] & mask_n[None, :]
        b_dr = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        if HAS_DOUT:
            b_r = tl.load(p_rout + rows[:, None] * s_rout_m + cols[None, :], mask=mask, other=0.0)
            b_rstd = tl.load(p_rstd + rows, mask=mask_m, other=0.0)
            b_rhat = b_r * b_rstd[:, None]
            b_g = tl.load(
                p_dout + rows[:, None] * s_dout_m + cols[None, :] * s_dout_n, mask=mask, other=0.0
            ).to(tl.float32)
            b_dw += tl.sum(b_g * b_rhat, axis=0)
            b_gw = b_g * b_w[None, :]
            b_c = tl.sum(b_gw * b_rhat, axis=1) / D  # [BLOCK_M]
            b_dr = (b_gw - b_rhat * b_c[:, None]) * b_rstd[:, None]
        if HAS_DROUT:
            b_dr += tl.load(
                p_drout + rows[:, None] * s_drout_m + cols[None, :] * s_drout_n,
                mask=mask,
                other=0.0,
            ).to(tl.float32)
        tl.store(
            p_dx + rows[:, None] * s_dx_m + cols[None, :],
            b_dr.to(p_dx.dtype.element_ty),
            mask=mask,
        )
        if HAS_DRES:
            tl.store(
                p_dres + rows[:, None] * s_dres_m + cols[None, :],
                b_dr.to(p_dres.dtype.element_ty),
                mask=mask,
            )
    tl.store(p_dw_part + pid * D + cols, b_dw, mask=mask_n)
