"""The Mamba-2 decode step's Triton kernels (`@triton.jit` only); step.py says what they do,
why there are two, and launches them.

B batch, H heads of P values, G groups of N-wide B/C rows (head h reads group h // (H / G)),
K = d_conv. A row of zxbcdt is [z0, x0 (d_mlp each), z (H P), xBC (H P + 2 G N), dt (H)];
the conv state [B, K-1, H P + 2 G N] holds the last K-1 xBC rows, oldest first; a row of
the output is [silu(z0) x0 (d_mlp), y (H P)].
"""

from __future__ import annotations

import triton
import triton.language as tl

from .._triton import pdl_start, pdl_wait
from ..selective_scan.tiles import LOG2E, _softplus

# fmt: off


@triton.jit
def _taps(p_w, s_w_c, s_w_k, c, mc, r, K: tl.constexpr):
    """The conv weights of channels c as a [BLOCK_K, BLOCK_C] f32 tile (tap r in row r)."""
    m = (r < K)[:, None] & mc[None, :]
    return tl.load(p_w + c[None, :] * s_w_c + r[:, None] * s_w_k, mask=m, other=0.0).to(tl.float32)


@triton.jit
def _window(p_new, p_state, s_state_k, c, mc, r, K: tl.constexpr):
    """The conv window of channels c, [BLOCK_K, BLOCK_C] f32: rows 0..K-2 the state (oldest
    first), row K-1 this token's input (p_new + c), rows past K zero."""
    m_old = (r < K - 1)[:, None] & mc[None, :]
    old = tl.load(p_state + r[:, None] * s_state_k + c[None, :], mask=m_old, other=0.0)
    new = tl.load(p_new + c, mask=mc, other=0.0).to(tl.float32)
    return tl.where((r == K - 1)[:, None], new[None, :], old.to(tl.float32))


@triton.jit
def _shift(p_state, s_state_k, c, mc, r, win, K: tl.constexpr):
    """The state of channels c becomes the window's rows 1..K-1 (state row r - 1 <- row r)."""
    m = ((r >= 1) & (r < K))[:, None] & mc[None, :]
    tl.store(p_state + (r[:, None] - 1) * s_state_k + c[None, :],
             win.to(p_state.dtype.element_ty), mask=m)


@triton.jit
def _conv_silu(win, w, bias, dtype):
    """silu(bias + sum_k w[k] win[k]) per channel, rounded to `dtype` (the compute dtype the
    sequence path stores the conv's output in) and widened back to f32: [BLOCK_C]."""
    acc = tl.sum(win * w, axis=0) + bias
    return (acc * tl.sigmoid(acc)).to(dtype).to(tl.float32)


@triton.jit
def _ssm_kernel(
    p_zx, p_conv, p_ssm, p_w, p_cb, p_dtb, p_A, p_D, p_out,
    d_mlp, d_ssm, G, N, P, heads_per_group, lo, hi,
    s_zx_b, s_conv_b, s_conv_k, s_ssm_b, s_ssm_h, s_ssm_p, s_w_c, s_w_k, s_D_h, s_out_b,
    K: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_D: tl.constexpr, D_HDIM: tl.constexpr,
    HAS_NORM: tl.constexpr, LIMIT: tl.constexpr, PDL: tl.constexpr,
):
    """Program (row b, head h, block of P): the conv of the block's x channels (their state
    shifted in place) and of the group's B and C channels (their state only read: the norm
    kernel shifts it once per group, after every program here has read it), SiLU, delta,
    the [BLOCK_P, N] state rows in place, y = h C + D x, stored in the output's dtype at
    its place in the output row; without a norm, y * silu(z) instead."""
    pdl_start(PDL)
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    g = h // heads_per_group
    n = tl.arange(0, BLOCK_N)
    r = tl.arange(0, BLOCK_K)  # window rows: the state's K-1, then this token
    mp = p < P
    mn = n < N
    c_x = h * P + p  # channels of xBC
    c_B = d_ssm + g * N + n
    c_C = c_B + G * N
    # the weights: no kernel writes them
    w_x = _taps(p_w, s_w_c, s_w_k, c_x, mp, r, K)
    w_B = _taps(p_w, s_w_c, s_w_k, c_B, mn, r, K)
    w_C = _taps(p_w, s_w_c, s_w_k, c_C, mn, r, K)
    if HAS_BIAS:
        cb_x = tl.load(p_cb + c_x, mask=mp, other=0.0).to(tl.float32)
        cb_B = tl.load(p_cb + c_B, mask=mn, other=0.0).to(tl.float32)
        cb_C = tl.load(p_cb + c_C, mask=mn, other=0.0).to(tl.float32)
    else:
        cb_x = 0.0
        cb_B = 0.0
        cb_C = 0.0
    dt_bias = tl.load(p_dtb + h).to(tl.float32)
    A = tl.load(p_A + h).to(tl.float32)
    if HAS_D:
        if D_HDIM:
            Dh = tl.load(p_D + h * s_D_h + p, mask=mp, other=0.0).to(tl.float32)
        else:
            Dh = tl.load(p_D + h).to(tl.float32)
    pdl_wait(PDL)
    p_row = p_zx + b * s_zx_b
    p_xbc = p_row + 2 * d_mlp + d_ssm
    p_cs = p_conv + b * s_conv_b
    win_x = _window(p_xbc, p_cs, s_conv_k, c_x, mp, r, K)
    win_B = _window(p_xbc, p_cs, s_conv_k, c_B, mn, r, K)
    win_C = _window(p_xbc, p_cs, s_conv_k, c_C, mn, r, K)
    dtype = p_zx.dtype.element_ty
    x = _conv_silu(win_x, w_x, cb_x, dtype)  # [BLOCK_P]
    Bg = _conv_silu(win_B, w_B, cb_B, dtype)  # [BLOCK_N]
    Cg = _conv_silu(win_C, w_C, cb_C, dtype)
    delta = _softplus(tl.load(p_xbc + d_ssm + 2 * G * N + h).to(tl.float32) + dt_bias)
    if LIMIT:
        delta = tl.minimum(tl.maximum(delta, lo), hi)
    p_s = p_ssm + b * s_ssm_b + h * s_ssm_h + p[:, None] * s_ssm_p + n[None, :]
    m_s = mp[:, None] & mn[None, :]
    st = tl.load(p_s, mask=m_s, other=0.0)
    st = tl.exp2(delta * A * LOG2E) * st + (delta * x)[:, None] * Bg[None, :]
    y = tl.sum(st * Cg[None, :], axis=1)
    if HAS_D:
        y += Dh * x
    if not HAS_NORM:
        z = tl.load(p_row + 2 * d_mlp + h * P + p, mask=mp, other=0.0).to(tl.float32)
        y = y * z * tl.sigmoid(z)
    tl.debug_barrier()  # a value held by several threads: all of them load before any stores
    _shift(p_cs, s_conv_k, c_x, mp, r, win_x, K)
    tl.store(p_s, st, mask=m_s)
    tl.store(p_out + b * s_out_b + d_mlp + h * P + p, y.to(p_out.dtype.element_ty), mask=mp)


@triton.jit
def _norm_kernel(
    p_zx, p_conv, p_nw, p_out,
    d_mlp, d_ssm, G, N, group_size, mlp_per_group, eps,
    s_zx_b, s_conv_b, s_conv_k, s_out_b,
    K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_M: tl.constexpr, HAS_NORM: tl.constexpr, NORM_BEFORE_GATE: tl.constexpr,
    HAS_MLP: tl.constexpr, PDL: tl.constexpr,
):
    """Program (row b, group g), after the state kernel: the conv state of the group's B and
    C channels shifted in place; the gated RMSNorm of the group's y (its H / G heads, the
    output's channels d_mlp + g group_size ...), f32 statistics over the y the state kernel
    stored: norm_before_gate False: v = y silu(z), out = v rstd(v) w; True: out = y rstd(y) w
    silu(z); and silu(z0) x0 for the group's share of the d_mlp channels."""
    pdl_start(PDL)
    b = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    i = tl.arange(0, BLOCK_G)
    mj = i < group_size
    j = g * group_size + i  # the group's channels of y and z
    if HAS_NORM:
        w = tl.load(p_nw + j, mask=mj, other=0.0).to(tl.float32)
    pdl_wait(PDL)
    p_row = p_zx + b * s_zx_b
    p_orow = p_out + b * s_out_b
    p_cs = p_conv + b * s_conv_b
    n = tl.arange(0, BLOCK_N)
    r = tl.arange(0, BLOCK_K)
    mn = n < N
    c_B = d_ssm + g * N + n
    c_C = c_B + G * N
    p_xbc = p_row + 2 * d_mlp + d_ssm
    win_B = _window(p_xbc, p_cs, s_conv_k, c_B, mn, r, K)
    win_C = _window(p_xbc, p_cs, s_conv_k, c_C, mn, r, K)
    if HAS_NORM:
        y = tl.load(p_orow + d_mlp + j, mask=mj, other=0.0).to(tl.float32)
        z = tl.load(p_row + 2 * d_mlp + j, mask=mj, other=0.0).to(tl.float32)
        gate = z * tl.sigmoid(z)
        if NORM_BEFORE_GATE:
            v = y
        else:
            v = y * gate
        rstd = 1.0 / tl.sqrt(tl.sum(v * v, axis=0) / group_size + eps)
        o = v * rstd * w
        if NORM_BEFORE_GATE:
            o = o * gate
    if HAS_MLP:
        for start in tl.range(0, mlp_per_group, BLOCK_M):
            k = start + tl.arange(0, BLOCK_M)
            m = g * mlp_per_group + k
            mm = (k < mlp_per_group) & (m < d_mlp)
            z0 = tl.load(p_row + m, mask=mm, other=0.0).to(tl.float32)
            x0 = tl.load(p_row + d_mlp + m, mask=mm, other=0.0).to(tl.float32)
            tl.store(p_orow + m, (z0 * tl.sigmoid(z0) * x0).to(p_out.dtype.element_ty), mask=mm)
    tl.debug_barrier()  # a value held by several threads: all of them load before any stores
    _shift(p_cs, s_conv_k, c_B, mn, r, win_B, K)
    _shift(p_cs, s_conv_k, c_C, mn, r, win_C, K)
    if HAS_NORM:
        tl.store(p_orow + d_mlp + j, o.to(p_out.dtype.element_ty), mask=mj)


# fmt: on
