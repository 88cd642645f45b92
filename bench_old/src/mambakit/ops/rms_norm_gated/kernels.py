"""Triton kernels of Mamba-2's gated RMSNorm (launched from launch.py).

M rows (the flattened leading dims), D features in NG groups of G channels. Per row and
group, with s = silu(z):

    h    = x * s (NORM_BEFORE_GATE off)   or   x (on)
    rstd = 1 / sqrt(mean_G(h^2) + eps)                       (f32)
    out  = h * rstd * w (* s when NORM_BEFORE_GATE)           (cast to the output dtype)

Backward, with g = dL/dout, ĥ = h * rstd, s' = sigmoid(z) (1 + z (1 - sigmoid(z))) and e
the gradient on ĥ * w (g, or g * s with the gate after the norm):

    dh = rstd * (e*w - ĥ * mean_G(e*w * ĥ))        dw = sum_rows e * ĥ
    off: dx = dh * s,  dz = dh * x * s'             on: dx = dh,  dz = g * ĥ * w * s'

A program holds a [BLOCK_M, BLOCK_N] tile: BLOCK_M rows of one group (program axis 1),
BLOCK_N = next_pow2(G), so a group's statistic is a row sum of the tile. The backward walks
a fixed range of row blocks per program, keeps its dweight partial in registers and writes
it out; the partials are summed in a fixed order.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .._triton import fast_sigmoid


@triton.jit
def _gated_fwd_kernel(
    p_x,
    p_z,
    p_w,
    p_out,
    p_rstd,
    M,
    G,
    NG,
    eps,
    s_x_m,
    s_z_m,
    s_out_m,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_Z: tl.constexpr,
    HAS_W: tl.constexpr,
    NORM_BEFORE_GATE: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs = tl.arange(0, BLOCK_N)
    cols = tl.program_id(1) * G + offs  # this group's channels
    mask_m = rows < M
    mask = mask_m[:, None] & (offs < G)[None, :]
    r2, c2 = rows[:, None], cols[None, :]
    b_h = tl.load(p_x + r2 * s_x_m + c2, mask=mask, other=0.0).to(tl.float32)
    if HAS_Z:
        b_z = tl.load(p_z + r2 * s_z_m + c2, mask=mask, other=0.0).to(tl.float32)
        b_s = b_z * fast_sigmoid(b_z)
        if not NORM_BEFORE_GATE:
            b_h = b_h * b_s
    b_rstd = 1.0 / tl.sqrt(tl.sum(b_h * b_h, axis=1) / G + eps)  # [BLOCK_M]
    b_o = b_h * b_rstd[:, None]
    if HAS_W:
        b_w = tl.load(p_w + cols, mask=offs < G, other=0.0).to(tl.float32)
        b_o = b_o * b_w[None, :]
    if HAS_Z:
        if NORM_BEFORE_GATE:
            b_o = b_o * b_s
    tl.store(p_out + r2 * s_out_m + c2, b_o.to(p_out.dtype.element_ty), mask=mask)
    tl.store(p_rstd + rows * NG + tl.program_id(1), b_rstd, mask=mask_m)


@triton.jit
def _gated_bwd_kernel(
    p_x,
    p_z,
    p_w,
    p_rstd,
    p_dout,
    p_dx,
    p_dz,
    p_dw_part,
    M,
    D,
    G,
    NG,
    N_ITER,
    s_x_m,
    s_z_m,
    s_dout_m,
    s_dout_n,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_Z: tl.constexpr,
    HAS_W: tl.constexpr,
    NORM_BEFORE_GATE: tl.constexpr,
):
    pid = tl.program_id(0)
    grp = tl.program_id(1)
    offs = tl.arange(0, BLOCK_N)
    cols = grp * G + offs
    mask_g = offs < G
    if HAS_W:
        b_w = tl.load(p_w + cols, mask=mask_g, other=0.0).to(tl.float32)
    else:
        b_w = tl.full([BLOCK_N], 1.0, dtype=tl.float32)
    b_dw = tl.zeros([BLOCK_N], dtype=tl.float32)
    for i in range(N_ITER):
        rows = (pid.to(tl.int64) * N_ITER + i) * BLOCK_M + tl.arange(0, BLOCK_M)
        mask_m = rows < M
        mask = mask_m[:, None] & mask_g[None, :]
        r2, c2 = rows[:, None], cols[None, :]
        b_x = tl.load(p_x + r2 * s_x_m + c2, mask=mask, other=0.0).to(tl.float32)
        b_rstd = tl.load(p_rstd + rows * NG + grp, mask=mask_m, other=0.0)
        b_g = tl.load(p_dout + r2 * s_dout_m + c2 * s_dout_n, mask=mask, other=0.0).to(tl.float32)
        b_e = b_g  # the gradient on ĥ * w
        b_h = b_x
        if HAS_Z:
            b_z = tl.load(p_z + r2 * s_z_m + c2, mask=mask, other=0.0).to(tl.float32)
            b_sig = fast_sigmoid(b_z)
            b_s = b_z * b_sig
            b_ds = b_sig * (1.0 + b_z * (1.0 - b_sig))  # silu'(z)
            if NORM_BEFORE_GATE:
                b_e = b_g * b_s
            else:
                b_h = b_x * b_s
        b_hhat = b_h * b_rstd[:, None]
        b_dw += tl.sum(b_e * b_hhat, axis=0)
        b_ew = b_e * b_w[None, :]
        b_c = tl.sum(b_ew * b_hhat, axis=1) / G  # [BLOCK_M]
        b_dh = (b_ew - b_hhat * b_c[:, None]) * b_rstd[:, None]
        b_dx = b_dh
        if HAS_Z:
            if NORM_BEFORE_GATE:
                b_dz = b_g * b_hhat * b_w[None, :] * b_ds
            else:
                b_dx = b_dh * b_s
                b_dz = b_dh * b_x * b_ds
            tl.store(p_dz + r2 * D + c2, b_dz.to(p_dz.dtype.element_ty), mask=mask)
        tl.store(p_dx + r2 * D + c2, b_dx.to(p_dx.dtype.element_ty), mask=mask)
    if HAS_W:
        tl.store(p_dw_part + pid * D + cols, b_dw, mask=mask_g)
