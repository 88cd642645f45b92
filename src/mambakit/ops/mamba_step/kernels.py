"""Triton kernels of one decode step of a Mamba block (launched by launch.py).

B batch, M = d_model, D = d_inner, N = d_state, R = dt_rank, K = d_conv,
J = R + 2N (the x_proj rows).

At small batch a decode step reads every weight once and does almost no
arithmetic, so its time is that of the weights' round trips from memory, and,
once they stream fast, of its launches. Each matrix-vector kernel here gives a
program one slab of the weight, [BLOCK_N rows, all K columns] (`StepConfig.tile` elements,
32 KB in bf16), loaded before anything else so that every program's weights
are in flight at once (one memory round trip, not one per K block), and loops
over its batch rows with the slab in registers. At batch <= `rows_max_batch`
(1: a loop over rows serialises their memory round trips, since a row's loads
cannot move above the previous row's stores; 2 with 16-bit weights of short rows,
`rows_max_batch_narrow`; with float32 weights of at most
`f32_stream_bytes` `rows_max_batch_f32`, 16, where cuBLAS is slower still) a block is
four launches:

1. `_layer_in_kernel`: the x and z rows of in_proj for a block of channels,
   the conv update of those channels (in place on the state) and SiLU -> u.
   At batch 1 the residual add and RMSNorm are its prologue (each program
   recomputes the row's statistics: M values); above, one `rms_norm` launch
   before it normalises every row once.
2. `_linear_kernel`: x_proj, u W_x^T -> (dt_low, B, C).
3. `_layer_ssm_kernel`: dt_proj, softplus, the state update (in place), the
   D skip and the SiLU(z) gate -> y.
4. `_linear_kernel`: out_proj. With the add+norm prologue, the LM head.

Values are rounded to the compute dtype wherever the unfused op chain stores
them (xz, u, x_proj's output, delta, y, out), so both paths agree up to the
summation order of each dot product; accumulation is f32.

On sm_90+ the kernels are launched with programmatic dependent launch: each
lets the next one start as soon as all its programs are running, and waits
for its predecessor (`gdc_wait`) only after loading its own weights, so a
kernel's weight stream overlaps the previous kernel's tail and launch gap.

No kernel is
autotuned (two update the state in place) and none syncs with the host, so a
step can be captured in a CUDA graph.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .._triton import pdl_start, pdl_wait
from ..selective_scan.tiles import LOG2E, _softplus

# fmt: off


@triton.jit
def _load_row(p_x, p_res, b, k, mk, s_x, s_res, HAS_RES: tl.constexpr):
    """Row b of x (+ residual) in f32."""
    r = tl.load(p_x + b * s_x + k, mask=mk, other=0.0).to(tl.float32)
    if HAS_RES:
        r += tl.load(p_res + b * s_res + k, mask=mk, other=0.0)
    return r


@triton.jit
def _norm_row(r, nw, M, eps, cdt: tl.constexpr):
    """RMSNorm of one f32 row, rounded to the compute dtype (and back to f32)."""
    rstd = 1.0 / tl.sqrt(tl.sum(r * r, axis=0) / M + eps)
    return (r * rstd * nw).to(cdt).to(tl.float32)


@triton.jit
def _layer_in_kernel(
    p_x, p_res, p_nw, p_res_out, p_w_in, p_b_in, p_conv, p_cw, p_cb,
    p_z, p_u,
    Bsz, M, Dn, eps,
    s_x, s_res, s_ro, s_win, s_cs_b, s_cs_k, s_cs_d, s_cw_d, s_cw_k, s_z, s_u,
    K: tl.constexpr, HAS_NORM: tl.constexpr, HAS_RES: tl.constexpr,
    HAS_IN_BIAS: tl.constexpr, HAS_CONV_BIAS: tl.constexpr,
    BLOCK_B: tl.constexpr, BLOCK_D: tl.constexpr, K_PAD: tl.constexpr, KC: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_start(PDL)
    pid_b = tl.program_id(0)
    pid_d = tl.program_id(1)
    cdt: tl.constexpr = p_w_in.dtype.element_ty
    d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    md = d < Dn
    k = tl.arange(0, K_PAD)
    mk = k < M
    mw = md[:, None] & mk[None, :]
    # the slabs first: every program's weights in flight before any other load
    w_x = tl.load(p_w_in + d[:, None] * s_win + k[None, :], mask=mw, other=0.0)
    w_z = tl.load(p_w_in + (d + Dn)[:, None] * s_win + k[None, :], mask=mw, other=0.0)
    if HAS_NORM:
        nw = tl.load(p_nw + k, mask=mk, other=0.0).to(tl.float32)
    cw_last = tl.load(p_cw + d * s_cw_d + (K - 1) * s_cw_k, mask=md, other=0.0).to(tl.float32)
    j = tl.arange(0, KC)  # conv taps 0..K-2 are the history rows of the state
    mh = (j < K - 1)[:, None] & md[None, :]
    cw_hist = tl.load(p_cw + d[None, :] * s_cw_d + j[:, None] * s_cw_k, mask=mh, other=0.0
                      ).to(tl.float32)
    pdl_wait(PDL)
    for i in tl.static_range(BLOCK_B):
        b = pid_b * BLOCK_B + i
        if b < Bsz:
            r = _load_row(p_x, p_res, b, k, mk, s_x, s_res, HAS_RES)
            if HAS_NORM:
                if pid_d == 0:
                    tl.store(p_res_out + b * s_ro + k, r, mask=mk)
                a = _norm_row(r, nw, M, eps, cdt)
            else:
                a = r
            xin = tl.sum(w_x.to(tl.float32) * a[None, :], axis=1)
            z = tl.sum(w_z.to(tl.float32) * a[None, :], axis=1)
            if HAS_IN_BIAS:
                xin += tl.load(p_b_in + d, mask=md, other=0.0).to(tl.float32)
                z += tl.load(p_b_in + Dn + d, mask=md, other=0.0).to(tl.float32)
            tl.store(p_z + b * s_z + d, z.to(cdt), mask=md)
            xin = xin.to(cdt).to(tl.float32)
            # conv update: window = [state rows 0..K-2, x]; the state keeps rows 1..K-1.
            # A channel's value may sit in several threads (a small BLOCK_D): all of
            # them load the history before any of them stores its shift.
            p_s = p_conv + b * s_cs_b + j[:, None] * s_cs_k + d[None, :] * s_cs_d
            hist = tl.load(p_s, mask=mh, other=0.0)
            c = tl.sum(hist.to(tl.float32) * cw_hist, axis=0) + xin * cw_last
            if HAS_CONV_BIAS:
                c += tl.load(p_cb + d, mask=md, other=0.0).to(tl.float32)
            tl.debug_barrier()
            tl.store(p_s - s_cs_k, hist, mask=mh & (j >= 1)[:, None])
            tl.store(p_conv + b * s_cs_b + (K - 2) * s_cs_k + d * s_cs_d,
                     xin.to(p_conv.dtype.element_ty), mask=md)
            tl.store(p_u + b * s_u + d, (c * tl.sigmoid(c)).to(cdt), mask=md)


@triton.jit
def _layer_ssm_kernel(
    p_xd, p_w_dt, p_delta, p_dtb, p_A, p_Dv, p_u, p_z, p_h, p_y,
    Bsz, Dn, R, N,
    s_xd, s_wdt, s_delta, s_A, s_u, s_z, s_hb, s_hd, s_y,
    DT_PROJ: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr,
):
    """y = state update(u, delta, B, C) * silu(z) for BLOCK_B rows x BLOCK_D channels, delta
    = x_dbl[:, :R] W_dt^T computed here (DT_PROJ) or read from p_delta. The rows are one
    tile dimension, not a loop: every row's loads are issued before any store, and A and
    W_dt are read once per BLOCK_B rows."""
    pdl_start(PDL)
    pid_b = tl.program_id(0)
    pid_d = tl.program_id(1)
    cdt: tl.constexpr = p_w_dt.dtype.element_ty
    rb = pid_b * BLOCK_B + tl.arange(0, BLOCK_B)
    mb = rb < Bsz
    rb = rb.to(tl.int64)
    d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    md = d < Dn
    r = tl.arange(0, BLOCK_R)
    n = tl.arange(0, BLOCK_N)
    mn = n < N
    if DT_PROJ:
        w_dt = tl.load(p_w_dt + d[:, None] * s_wdt + r[None, :],
                       mask=md[:, None] & (r < R)[None, :], other=0.0).to(tl.float32)
    A = tl.load(p_A + d[:, None] * s_A + n[None, :], mask=md[:, None] & mn[None, :],
                other=0.0) * LOG2E
    dt_bias = tl.load(p_dtb + d, mask=md, other=0.0)
    Dv = tl.load(p_Dv + d, mask=md, other=0.0)
    pdl_wait(PDL)
    mbd = mb[:, None] & md[None, :]  # [BLOCK_B, BLOCK_D]
    mbn = mb[:, None] & mn[None, :]  # [BLOCK_B, BLOCK_N]
    # x_proj's output of the rows: dt_low [R], B [N], C [N]
    Bv = tl.load(p_xd + rb[:, None] * s_xd + R + n[None, :], mask=mbn, other=0.0)
    Cv = tl.load(p_xd + rb[:, None] * s_xd + R + N + n[None, :], mask=mbn, other=0.0)
    p_h_tile = p_h + rb[:, None, None] * s_hb + d[None, :, None] * s_hd + n[None, None, :]
    m_h = mbd[:, :, None] & mn[None, None, :]
    h = tl.load(p_h_tile, mask=m_h, other=0.0)
    u = tl.load(p_u + rb[:, None] * s_u + d[None, :], mask=mbd, other=0.0).to(tl.float32)
    zv = tl.load(p_z + rb[:, None] * s_z + d[None, :], mask=mbd, other=0.0).to(tl.float32)
    if DT_PROJ:  # [BLOCK_B, BLOCK_D, R] products summed over R
        dt_low = tl.load(p_xd + rb[:, None] * s_xd + r[None, :],
                         mask=mb[:, None] & (r < R)[None, :], other=0.0).to(tl.float32)
        raw = tl.sum(w_dt[None, :, :] * dt_low[:, None, :], axis=2)
        raw = raw.to(cdt).to(tl.float32)  # rounded as the GEMM's output would be
    else:
        raw = tl.load(p_delta + rb[:, None] * s_delta + d[None, :], mask=mbd,
                      other=0.0).to(tl.float32)
    dt = _softplus(raw + dt_bias[None, :])
    h = (tl.exp2(dt[:, :, None] * A[None, :, :]) * h
         + (dt * u)[:, :, None] * Bv.to(tl.float32)[:, None, :])
    tl.debug_barrier()  # every copy of a state element is loaded before one is stored
    tl.store(p_h_tile, h, mask=m_h)
    y = tl.sum(h * Cv.to(tl.float32)[:, None, :], axis=2) + Dv[None, :] * u
    y = y * zv * tl.sigmoid(zv)
    tl.store(p_y + rb[:, None] * s_y + d[None, :], y.to(cdt), mask=mbd)


@triton.jit
def _linear_kernel(
    p_x, p_res, p_nw, p_w, p_bias, p_out, p_res_out,
    Bsz, Nout, Kin, eps,
    s_x, s_res, s_w, s_o, s_ro,
    HAS_RES: tl.constexpr, HAS_NORM: tl.constexpr, HAS_BIAS: tl.constexpr,
    RES_OUT: tl.constexpr,
    BLOCK_B: tl.constexpr, BLOCK_N: tl.constexpr, K_PAD: tl.constexpr, PDL: tl.constexpr,
):
    """out = rmsnorm(x + residual) W^T (+ bias), or x W^T (+ bias) without the norm.
    RES_OUT: the first column block's programs also store x + residual (f32)."""
    pdl_start(PDL)
    pid_b = tl.program_id(0)
    pid_n = tl.program_id(1)
    cdt: tl.constexpr = p_w.dtype.element_ty
    nn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mn = nn < Nout
    k = tl.arange(0, K_PAD)
    mk = k < Kin
    w = tl.load(p_w + nn[:, None].to(tl.int64) * s_w + k[None, :],
                mask=mn[:, None] & mk[None, :], other=0.0)
    if HAS_NORM:
        nw = tl.load(p_nw + k, mask=mk, other=0.0).to(tl.float32)
    if HAS_BIAS:
        bias = tl.load(p_bias + nn, mask=mn, other=0.0).to(tl.float32)
    pdl_wait(PDL)
    for i in tl.static_range(BLOCK_B):
        b = pid_b * BLOCK_B + i
        if b < Bsz:
            a = _load_row(p_x, p_res, b, k, mk, s_x, s_res, HAS_RES)
            if RES_OUT:
                if pid_n == 0:
                    tl.store(p_res_out + b * s_ro + k, a, mask=mk)
            if HAS_NORM:
                a = _norm_row(a, nw, Kin, eps, cdt)
            out = tl.sum(w.to(tl.float32) * a[None, :], axis=1)
            if HAS_BIAS:
                out += bias
            tl.store(p_out + b * s_o + nn, out.to(p_out.dtype.element_ty), mask=mn)


# fmt: on
