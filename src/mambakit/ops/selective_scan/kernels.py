"""Triton kernels of the selective scan: a chunk-parallel forward and backward.

B batch, T time, D = d_inner, N = d_state, CHUNK = 16 timesteps. Time is cut
into chunks and every (row, chunk, channel block, state block) is a program,
so a long sequence gives thousands of programs instead of a serial walk.

Forward, three launches:
  1. `_fwd_chunk_kernel` (FINAL=False): each chunk's recurrence from a zero
     state: the end state hloc_c and the product of its decays P_c.
  2. `_carry_fwd_kernel`: the chunk-start states S_c (S_0 = initial_state,
     S_{c+1} = P_c S_c + hloc_c) by an associative scan over chunks, and h_T.
     S is what the backward keeps: 4 D N / CHUNK bytes per token.
  3. `_fwd_chunk_kernel` (FINAL=True): each chunk again from S_c, writing
     y_t = sum_n h_t C_t (+ D u_t, * silu(z_t)).
Backward, three launches (g_h_t = C_t gy_t + a_{t+1} g_h_{t+1}, reversed):
  1. `_bwd_local_kernel`: each chunk's reverse recurrence from a zero carry:
     W_c = a_first g_first and the decay product P_c.
  2. `_carry_bwd_kernel`: the carry into each chunk's end, Gin_c
     (Gin_{c-1} = W_c + P_c Gin_c, seeded by dL/dh_T), and dL/d initial_state.
  3. `_bwd_chunk_kernel`: per chunk, the 16 states are recomputed from S_c and
     held in registers, then walked backwards with the carry Gin_c; a_t h_{t-1}
     is h_t - b_t, so nothing divides by a decay. Every gradient comes out here;
     dB, dC (over channel blocks), dA, dD, d delta_bias (over rows and chunks)
     are per-program partials summed afterwards in a fixed order: no atomics.
Each program computes exponentials with exp2 (log2(e) folded into A).
"""

import json
import os

import torch
import triton
import triton.language as tl

CHUNK = 16  # the backward body below is unrolled for exactly this many steps
LOG2E = tl.constexpr(1.4426950408889634)
MAX_BLOCK_N = 32  # states per program; larger N is split over programs

# fmt: off


@triton.jit
def _in_range(mask, t, T):
    """mask & (t < T) for a scalar t, built as a vector (the interpreter refuses vector & scalar)."""
    return mask & ((t + tl.zeros_like(mask).to(tl.int32)) < T)


@triton.jit
def _softplus(x):
    return tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(x)))


@triton.jit
def _combine(a1, b1, a2, b2):
    """(a1, b1) then (a2, b2) for h -> a h + b."""
    return a1 * a2, a2 * b1 + b2


@triton.jit
def _inputs(
    t, T, p_dt, s_dt, p_u, s_u, p_B, s_B, p_seq, s_seq, md, mn, A2, bias,
    HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr, HAS_SEQ: tl.constexpr,
):
    """Step t: raw delta (+ bias), delta, u [BD], B_t [BN], a_t [BD, BN]; steps past T are
    identities (delta 0, so a = 1 and b = 0)."""
    valid = t < T
    m = _in_range(md, t, T)
    raw = tl.load(p_dt + t * s_dt, mask=m, other=0.0).to(tl.float32)
    if HAS_BIAS:
        raw = raw + bias
    if SOFTPLUS:
        dt = _softplus(raw)
    else:
        dt = raw
    dt = tl.where(m, dt, 0.0)
    u = tl.load(p_u + t * s_u, mask=m, other=0.0).to(tl.float32)
    Bt = tl.load(p_B + t * s_B, mask=_in_range(mn, t, T), other=0.0).to(tl.float32)
    a = tl.exp2(dt[:, None] * A2)
    if HAS_SEQ:
        first = valid & (t > 0)
        cur = tl.load(p_seq + t * s_seq, mask=first, other=0)
        prev = tl.load(p_seq + (t - 1) * s_seq, mask=first, other=0)
        a = tl.where(cur != prev, 0.0, a)  # a document starts at t: nothing flows in
    return raw, dt, u, Bt, a


@triton.jit
def _recompute(
    t, h, T, p_dt, s_dt, p_u, s_u, p_B, s_B, p_seq, s_seq, md, mn, A2, bias,
    HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr, HAS_SEQ: tl.constexpr,
):
    _raw, dt, u, Bt, a = _inputs(
        t, T, p_dt, s_dt, p_u, s_u, p_B, s_B, p_seq, s_seq, md, mn, A2, bias,
        HAS_BIAS, SOFTPLUS, HAS_SEQ,
    )
    return a * h + (dt * u)[:, None] * Bt[None, :]


@triton.jit
def _gate_grad(t, T, p_dy, s_dy, p_z, s_z, md, HAS_Z: tl.constexpr):
    """dy_t, z_t, sigmoid(z_t), gy_t = dy_t * silu(z_t) (the gradient reaching y before the gate)."""
    m = _in_range(md, t, T)
    dy = tl.load(p_dy + t * s_dy, mask=m, other=0.0).to(tl.float32)
    if HAS_Z:
        z = tl.load(p_z + t * s_z, mask=m, other=0.0).to(tl.float32)
        sz = tl.sigmoid(z)
        gy = dy * z * sz
    else:
        z = dy
        sz = dy
        gy = dy
    return dy, z, sz, gy


@triton.jit
def _program_block(A_ptr, bias_ptr, Dn, N, Bsz, HAS_BIAS: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_N: tl.constexpr):
    """This program's (chunk, row, channel block, state block) on the grid (D blocks, chunks,
    rows x state blocks), its masks, A [BLOCK_D, BLOCK_N] and the dt bias [BLOCK_D]."""
    pid_d = tl.program_id(0)
    c = tl.program_id(1)
    b = (tl.program_id(2) % Bsz).to(tl.int64)
    pid_n = tl.program_id(2) // Bsz
    d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    md = d < Dn
    mn = n < N
    mdn = md[:, None] & mn[None, :]
    A = tl.load(A_ptr + d[:, None] * N + n[None, :], mask=mdn, other=0.0)
    bias = tl.zeros([BLOCK_D], tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + d, mask=md, other=0.0)
    return pid_d, c, b, pid_n, d, n, md, mn, mdn, A, bias


@triton.jit
def _fwd_chunk_kernel(
    u_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, bias_ptr, seq_ptr,
    S_ptr, hloc_ptr, P_ptr, y_ptr,
    T, Dn, N, Bsz, nc,
    s_u_b, s_u_t, s_dt_b, s_dt_t, s_B_b, s_B_t, s_C_b, s_C_t, s_z_b, s_z_t, s_seq_b, s_seq_t,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
    HAS_SEQ: tl.constexpr, FINAL: tl.constexpr, SPLIT_N: tl.constexpr,
    CHUNK: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid_d, c, b, pid_n, d, n, md, mn, mdn, A, bias = _program_block(
        A_ptr, bias_ptr, Dn, N, Bsz, HAS_BIAS, BLOCK_D, BLOCK_N
    )
    A2 = A * 1.4426950408889634
    p_u = u_ptr + b * s_u_b + d
    p_dt = dt_ptr + b * s_dt_b + d
    p_B = B_ptr + b * s_B_b + n
    p_seq = seq_ptr + b * s_seq_b
    off_state = ((b * nc + c) * Dn + d[:, None]) * N + n[None, :]  # [B, nc, D, N]
    t0 = c * CHUNK
    if FINAL:
        h = tl.load(S_ptr + off_state, mask=mdn, other=0.0)
        p_C = C_ptr + b * s_C_b + n
        p_z = z_ptr + b * s_z_b + d
        Dv = tl.zeros([BLOCK_D], tl.float32)
        if HAS_D:
            Dv = tl.load(D_ptr + d, mask=_in_range(md, pid_n, 1), other=0.0)
        p_y = y_ptr + (pid_n * Bsz + b) * T * Dn + d  # [nb, B, T, D] (nb = 1: [B, T, D])
        for i in tl.static_range(CHUNK):
            t = t0 + i
            _raw, dt, u, Bt, a = _inputs(
                t, T, p_dt, s_dt_t, p_u, s_u_t, p_B, s_B_t, p_seq, s_seq_t, md, mn, A2, bias,
                HAS_BIAS, SOFTPLUS, HAS_SEQ,
            )
            h = a * h + (dt * u)[:, None] * Bt[None, :]
            m = _in_range(md, t, T)
            Ct = tl.load(p_C + t * s_C_t, mask=_in_range(mn, t, T), other=0.0).to(tl.float32)
            y = tl.sum(h * Ct[None, :], axis=1)
            if not SPLIT_N:  # the whole of y is here: finish it
                if HAS_D:
                    y += Dv * u
                if HAS_Z:
                    zt = tl.load(p_z + t * s_z_t, mask=m, other=0.0).to(tl.float32)
                    y = y * zt * tl.sigmoid(zt)
            tl.store(p_y + t * Dn, y, mask=m)
    else:
        h = tl.zeros([BLOCK_D, BLOCK_N], tl.float32)
        p = tl.full([BLOCK_D, BLOCK_N], 1.0, tl.float32)
        for i in tl.static_range(CHUNK):
            _raw, dt, u, Bt, a = _inputs(
                t0 + i, T, p_dt, s_dt_t, p_u, s_u_t, p_B, s_B_t, p_seq, s_seq_t, md, mn, A2,
                bias, HAS_BIAS, SOFTPLUS, HAS_SEQ,
            )
            h = a * h + (dt * u)[:, None] * Bt[None, :]
            p = p * a
        tl.store(hloc_ptr + off_state, h, mask=mdn)
        tl.store(P_ptr + off_state, p, mask=mdn)


@triton.jit
def _carry_fwd_kernel(
    hloc_ptr, P_ptr, h0_ptr, S_ptr, hT_ptr, nc, DN,
    HAS_H0: tl.constexpr, BLOCK_E: tl.constexpr, CB: tl.constexpr,
):
    """S_0 = h0, S_{c+1} = P_c S_c + hloc_c over the chunks of one row; h_T = S_nc."""
    e = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    b = tl.program_id(1).to(tl.int64)
    me = e < DN
    if HAS_H0:
        carry = tl.load(h0_ptr + b * DN + e, mask=me, other=0.0)
    else:
        carry = tl.zeros([BLOCK_E], tl.float32)
    base = b * nc * DN
    tl.store(S_ptr + base + e, carry, mask=me)
    rows = tl.arange(0, CB)
    for c0 in range(0, nc, CB):
        cs = c0 + rows
        m2 = (cs < nc)[:, None] & me[None, :]
        off = base + cs[:, None].to(tl.int64) * DN + e[None, :]
        P = tl.load(P_ptr + off, mask=m2, other=1.0)
        H = tl.load(hloc_ptr + off, mask=m2, other=0.0)
        Pc, Hc = tl.associative_scan((P, H), 0, _combine)
        after = Hc + Pc * carry[None, :]  # the state after chunk cs
        tl.store(S_ptr + off + DN, after, mask=m2 & (cs < nc - 1)[:, None])
        tl.store(hT_ptr + b * DN + e[None, :] + 0 * cs[:, None], after,
                 mask=m2 & (cs == nc - 1)[:, None])
        last = tl.minimum(CB, nc - c0) - 1
        carry = tl.sum(tl.where((rows == last)[:, None], after, 0.0), axis=0)


@triton.jit
def _bwd_local_kernel(
    u_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, z_ptr, bias_ptr, seq_ptr, dy_ptr, W_ptr, P_ptr,
    T, Dn, N, Bsz, nc,
    s_u_b, s_u_t, s_dt_b, s_dt_t, s_B_b, s_B_t, s_C_b, s_C_t, s_z_b, s_z_t, s_seq_b, s_seq_t,
    s_dy_b, s_dy_t, s_dy_d,
    HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr, HAS_SEQ: tl.constexpr,
    CHUNK: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Reverse recurrence of one chunk from a zero carry: W_c = a_first g_first, P_c."""
    pid_d, c, b, pid_n, d, n, md, mn, mdn, A, bias = _program_block(
        A_ptr, bias_ptr, Dn, N, Bsz, HAS_BIAS, BLOCK_D, BLOCK_N
    )
    A2 = A * 1.4426950408889634
    p_u = u_ptr + b * s_u_b + d
    p_dt = dt_ptr + b * s_dt_b + d
    p_B = B_ptr + b * s_B_b + n
    p_C = C_ptr + b * s_C_b + n
    p_z = z_ptr + b * s_z_b + d
    p_dy = dy_ptr + b * s_dy_b + d * s_dy_d
    p_seq = seq_ptr + b * s_seq_b
    g = tl.zeros([BLOCK_D, BLOCK_N], tl.float32)
    a_next = tl.full([BLOCK_D, BLOCK_N], 1.0, tl.float32)
    p = tl.full([BLOCK_D, BLOCK_N], 1.0, tl.float32)
    t0 = c * CHUNK
    for i in tl.static_range(CHUNK):
        t = t0 + CHUNK - 1 - i
        _raw, _dt, _u, _Bt, a = _inputs(
            t, T, p_dt, s_dt_t, p_u, s_u_t, p_B, s_B_t, p_seq, s_seq_t, md, mn, A2, bias,
            HAS_BIAS, SOFTPLUS, HAS_SEQ,
        )
        _dy, _z, _sz, gy = _gate_grad(t, T, p_dy, s_dy_t, p_z, s_z_t, md, HAS_Z)
        Ct = tl.load(p_C + t * s_C_t, mask=_in_range(mn, t, T), other=0.0).to(tl.float32)
        g = Ct[None, :] * gy[:, None] + a_next * g
        a_next = a
        p = p * a
    off_state = ((b * nc + c) * Dn + d[:, None]) * N + n[None, :]
    tl.store(W_ptr + off_state, a_next * g, mask=mdn)
    tl.store(P_ptr + off_state, p, mask=mdn)


@triton.jit
def _carry_bwd_kernel(
    W_ptr, P_ptr, gT_ptr, gin_ptr, dh0_ptr, nc, DN,
    HAS_GT: tl.constexpr, HAS_H0: tl.constexpr, BLOCK_E: tl.constexpr, CB: tl.constexpr,
):
    """Gin_{nc-1} = dL/dh_T, Gin_{c-1} = W_c + P_c Gin_c; dL/dh0 = W_0 + P_0 Gin_0."""
    e = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    b = tl.program_id(1).to(tl.int64)
    me = e < DN
    if HAS_GT:
        G = tl.load(gT_ptr + b * DN + e, mask=me, other=0.0)
    else:
        G = tl.zeros([BLOCK_E], tl.float32)
    base = b * nc * DN
    tl.store(gin_ptr + base + (nc - 1) * DN + e, G, mask=me)
    rows = tl.arange(0, CB)
    for k in range(0, nc, CB):
        cs = nc - 1 - k - rows  # row r holds chunk nc-1-k-r: the scan runs backwards in time
        m2 = (cs >= 0)[:, None] & me[None, :]
        off = base + cs[:, None].to(tl.int64) * DN + e[None, :]
        P = tl.load(P_ptr + off, mask=m2, other=1.0)
        W = tl.load(W_ptr + off, mask=m2, other=0.0)
        Pc, Wc = tl.associative_scan((P, W), 0, _combine)
        X = Wc + Pc * G[None, :]  # dL/dh just before chunk cs
        tl.store(gin_ptr + off - DN, X, mask=m2 & (cs >= 1)[:, None])
        if HAS_H0:
            tl.store(dh0_ptr + b * DN + e[None, :] + 0 * cs[:, None], X,
                     mask=m2 & (cs == 0)[:, None])
        last = tl.minimum(CB, nc - k) - 1
        G = tl.sum(tl.where((rows == last)[:, None], X, 0.0), axis=0)


@triton.jit
def _reverse_step(
    t, h, G, a_next, dA_acc, dD_acc, db_acc, T, pid_n,
    p_dt, s_dt, p_u, s_u, p_B, s_B, p_C, s_C, p_z, s_z, p_dy, s_dy, p_seq, s_seq,
    p_du, p_ddt, p_dz, p_ys, s_o, p_dB, p_dC, s_p, md, mn, A2, A, bias, Dv,
    HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr, HAS_SEQ: tl.constexpr, HAS_D: tl.constexpr,
    HAS_Z: tl.constexpr, SPLIT_N: tl.constexpr,
):
    """Step t of the backward, given h_t and G = g_h_{t+1}, a_next = a_{t+1}."""
    raw, dt, u, Bt, a = _inputs(
        t, T, p_dt, s_dt, p_u, s_u, p_B, s_B, p_seq, s_seq, md, mn, A2, bias,
        HAS_BIAS, SOFTPLUS, HAS_SEQ,
    )
    m = _in_range(md, t, T)
    Ct = tl.load(p_C + t * s_C, mask=_in_range(mn, t, T), other=0.0).to(tl.float32)
    dy, z, sz, gy = _gate_grad(t, T, p_dy, s_dy, p_z, s_z, md, HAS_Z)
    if HAS_Z:
        ys = tl.sum(h * Ct[None, :], axis=1)
        if SPLIT_N:  # y needs every state block: dz is finished outside
            tl.store(p_ys + t * s_o, ys, mask=m)
        else:
            if HAS_D:
                ys += Dv * u
            tl.store(p_dz + t * s_o, dy * ys * sz * (1.0 + z * (1.0 - sz)), mask=m)
    g = Ct[None, :] * gy[:, None] + a_next * G  # g_h_t
    dtu = dt * u
    hb = h - dtu[:, None] * Bt[None, :]  # a_t h_{t-1}
    ddt = tl.sum(g * (u[:, None] * Bt[None, :] + A * hb), axis=1)
    du = tl.sum(g * Bt[None, :], axis=1) * dt
    if HAS_D:
        du += Dv * gy  # Dv is 0 outside the first state block
        dD_acc += gy * u
    if SOFTPLUS:
        ddt = ddt * tl.sigmoid(raw)
    db_acc += tl.where(m, ddt, 0.0)
    tl.store(p_du + t * s_o, du, mask=m)
    tl.store(p_ddt + t * s_o, ddt, mask=m)
    tl.store(p_dB + t * s_p, tl.sum(g * dtu[:, None], axis=0), mask=_in_range(mn, t, T))
    tl.store(p_dC + t * s_p, tl.sum(h * gy[:, None], axis=0), mask=_in_range(mn, t, T))
    dA_acc += g * dt[:, None] * hb
    return g, a, dA_acc, dD_acc, db_acc


@triton.jit
def _bwd_chunk_kernel(
    u_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, bias_ptr, seq_ptr, dy_ptr, S_ptr, gin_ptr,
    du_ptr, ddt_ptr, dz_ptr, ys_ptr, dB_ptr, dC_ptr, dA_ptr, dD_ptr, db_ptr,
    T, Dn, N, Bsz, nc,
    s_u_b, s_u_t, s_dt_b, s_dt_t, s_B_b, s_B_t, s_C_b, s_C_t, s_z_b, s_z_t, s_seq_b, s_seq_t,
    s_dy_b, s_dy_t, s_dy_d,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
    HAS_SEQ: tl.constexpr, SPLIT_N: tl.constexpr, QUARTERS: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Every gradient of one chunk (16 steps): states recomputed into registers, then reversed.

    QUARTERS keeps 4 states at a time instead of 16 (ptxas, sm_90a, BLOCK_D 8, 1 warp: 225
    registers and no spills, against 255 registers and 652 bytes of spills), at the price
    of recomputing 24 steps."""
    pid_d, c, b, pid_n, d, n, md, mn, mdn, A, bias = _program_block(
        A_ptr, bias_ptr, Dn, N, Bsz, HAS_BIAS, BLOCK_D, BLOCK_N
    )
    A2 = A * 1.4426950408889634
    Dv = tl.zeros([BLOCK_D], tl.float32)
    if HAS_D:
        Dv = tl.load(D_ptr + d, mask=_in_range(md, pid_n, 1), other=0.0)
    p_u = u_ptr + b * s_u_b + d
    p_dt = dt_ptr + b * s_dt_b + d
    p_B = B_ptr + b * s_B_b + n
    p_C = C_ptr + b * s_C_b + n
    p_z = z_ptr + b * s_z_b + d
    p_dy = dy_ptr + b * s_dy_b + d * s_dy_d
    p_seq = seq_ptr + b * s_seq_b
    s_o = Dn
    p_out = (pid_n * Bsz + b) * T * Dn + d  # [nb, B, T, D] (nb = 1: [B, T, D])
    p_du = du_ptr + p_out
    p_ddt = ddt_ptr + p_out
    p_dz = dz_ptr + p_out
    p_ys = ys_ptr + p_out
    s_p = N
    p_part = (pid_d * Bsz + b) * T * N + n  # [n_dblocks, B, T, N]
    p_dB = dB_ptr + p_part
    p_dC = dC_ptr + p_part
    off_state = ((b * nc + c) * Dn + d[:, None]) * N + n[None, :]
    h = tl.load(S_ptr + off_state, mask=mdn, other=0.0)
    G = tl.load(gin_ptr + off_state, mask=mdn, other=0.0)
    a_next = tl.full([BLOCK_D, BLOCK_N], 1.0, tl.float32)
    dA_acc = tl.zeros([BLOCK_D, BLOCK_N], tl.float32)
    dD_acc = tl.zeros([BLOCK_D], tl.float32)
    db_acc = tl.zeros([BLOCK_D], tl.float32)
    s_dt = s_dt_t
    s_u = s_u_t
    s_B = s_B_t
    s_C = s_C_t
    s_z = s_z_t
    s_dy = s_dy_t
    s_seq = s_seq_t
    c0 = c * 16
    if QUARTERS:
        # 4 steps at a time, last quarter first: recompute up to the quarter (a loop, few
        # registers), keep its 4 states, walk them back; 24 extra steps, no 16-state block
        for qi in range(4):
            q0 = c0 + 12 - 4 * qi
            hq = h
            for i in range(12 - 4 * qi):
                hq = _recompute(c0 + i, hq, T, p_dt, s_dt, p_u, s_u, p_B, s_B, p_seq, s_seq, md, mn, A2, bias, HAS_BIAS, SOFTPLUS, HAS_SEQ)
            h0 = _recompute(q0 + 0, hq, T, p_dt, s_dt, p_u, s_u, p_B, s_B, p_seq, s_seq, md, mn, A2, bias, HAS_BIAS, SOFTPLUS, HAS_SEQ)
            h1 = _recompute(q0 + 1, h0, T, p_dt, s_dt, p_u, s_u, p_B, s_B, p_seq, s_seq, md, mn, A2, bias, HAS_BIAS, SOFTPLUS, HAS_SEQ)
            h2 = _recompute(q0 + 2, h1, T, p_dt, s_dt, p_u, s_u, p_B, s_B, p_seq, s_seq, md, mn, A2, bias, HAS_BIAS, SOFTPLUS, HAS_SEQ)
            h3 = _recompute(q0 + 3, h2, T, p_dt, s_dt, p_u, s_u, p_B, s_B, p_seq, s_seq, md, mn, A2, bias, HAS_BIAS, SOFTPLUS, HAS_SEQ)
            G, a_next, dA_acc, dD_acc, db_acc = _reverse_step(q0 + 3, h3, G, a_next, dA_acc, dD_acc, db_acc, T, pid_n, p_dt, s_dt, p_u, s_u, p_B, s_B, p_C, s_C, p_z, s_z, p_dy, s_dy, p_seq, s_seq, p_du, p_ddt, p_dz, p_ys, s_o, p_dB, p_dC, s_p, md, mn, A2, A, bias, Dv, HAS_BIAS, SOFTPLUS, HAS_SEQ, HAS_D, HAS_Z, SPLIT_N)
            G, a_next, dA_acc, dD_acc, db_acc = _reverse_step(q0 + 2, h2, G, a_next, dA_acc, dD_acc, db_acc, T, pid_n, p_dt, s_dt, p_u, s_u, p_B, s_B, p_C, s_C, p_z, s_z, p_dy, s_dy, p_seq, s_seq, p_du, p_ddt, p_dz, p_ys, s_o, p_dB, p_dC, s_p, md, mn, A2, A, bias, Dv, HAS_BIAS, SOFTPLUS, HAS_SEQ, HAS_D, HAS_Z, SPLIT_N)
            G, a_next, dA_acc, dD_acc, db_acc = _reverse_step(q0 + 1, h1, G, a_next, dA_acc, dD_acc, db_acc, T, pid_n, p_dt, s_dt, p_u, s_u, p_B, s_B, p_C, s_C, p_z, s_z, p_dy, s_dy, p_seq, s_seq, p_du, p_ddt, p_dz, p_ys, s_o, p_dB, p_dC, s_p, md, mn, A2, A, bias, Dv, HAS_BIAS, SOFTPLUS, HAS_SEQ, HAS_D, HAS_Z, SPLIT_N)
            G, a_next, dA_acc, dD_acc, db_acc = _reverse_step(q0 + 0, h0, G, a_next, dA_acc, dD_acc, db_acc, T, pid_n, p_dt, s_dt, p_u, s_u, p_B, s_B, p_C, s_C, p_z, s_z, p_dy, s_dy, p_seq, s_seq, p_du, p_ddt, p_dz, p_ys, s_o, p_dB, p_dC, s_p, md, mn, A2, A, bias, Dv, HAS_BIAS, SOFTPLUS, HAS_SEQ, HAS_D, HAS_Z, SPLIT_N)
    else:
        # the 16 states of the chunk, h0 ... h15, kept in registers (CHUNK = 16, unrolled by hand)
        h0 = _recompute(c0 + 0, h, T, p_dt, s_dt, p_u, s_u, p_B, s_B, p_seq, s_seq, md, mn, A2, bias, HAS_BIAS, SOFTPLUS, HAS_SEQ)
        h1 = _recompute(c0 + 1, h0, T, p_dt, s_dt, p_u, s_u, p_B, s_B, p_seq, s_seq, md, mn, A2, bias, HAS_BIAS, SOFTPLUS, HAS_SEQ)
        h2 = _recompute(c0 + 2, h1, T, p_dt, s_dt, p_u, s_u, p_B, s_B, p_seq, s_seq, md, mn, A2, bias, HAS_BIAS, SOFTPLUS, HAS_SEQ)
        h3 = _recompute(c0 + 3, h2, T, p_dt, s_dt, p_u, s_u, p_B, s_B, p_seq, s_seq, md, mn, A2, bias, HAS_BIAS, SOFTPLUS, HAS_SEQ)
        h4 = _recompute(c0 + 4, h3, T, p_dt, s_dt, p_u, s_u, p_B, s_B, p_seq, s_seq, md, mn, A2, bias, HAS_BIAS, SOFTPLUS, HAS_SEQ)
        h5 = _recompute(c0 + 5, h4, T, p_dt, s_dt, p_u, s_u, p_B, s_B, p_seq, s_seq, md, mn, A2, bias, HAS_BIAS, SOFTPLUS, HAS_SEQ)
        h6 = _recompute(c0 + 6, h5, T, p_dt, s_dt, p_u, s_u, p_B, s_B, p_seq, s_seq, md, mn, A2, bias, HAS_BIAS, SOFTPLUS, HAS_SEQ)
        h7 = _recompute(c0 + 7, h6, T, p_dt, s_dt, p_u, s_u, p_B, s_B, p_seq, s_seq, md, mn, A2, bias, HAS_BIAS, SOFTPLUS, HAS_SEQ)
        h8 = _recompute(c0 + 8, h7, T, p_dt, s_dt, p_u, s_u, p_B, s_B, p_seq, s_seq, md, mn, A2, bias, HAS_BIAS, SOFTPLUS, HAS_SEQ)
        h9 = _recompute(c0 + 9, h8, T, p_dt, s_dt, p_u, s_u, p_B, s_B, p_seq, s_seq, md, mn, A2, bias, HAS_BIAS, SOFTPLUS, HAS_SEQ)
        h10 = _recompute(c0 + 10, h9, T, p_dt, s_dt, p_u, s_u, p_B, s_B, p_seq, s_seq, md, mn, A2, bias, HAS_BIAS, SOFTPLUS, HAS_SEQ)
        h11 = _recompute(c0 + 11, h10, T, p_dt, s_dt, p_u, s_u, p_B, s_B, p_seq, s_seq, md, mn, A2, bias, HAS_BIAS, SOFTPLUS, HAS_SEQ)
        h12 = _recompute(c0 + 12, h11, T, p_dt, s_dt, p_u, s_u, p_B, s_B, p_seq, s_seq, md, mn, A2, bias, HAS_BIAS, SOFTPLUS, HAS_SEQ)
        h13 = _recompute(c0 + 13, h12, T, p_dt, s_dt, p_u, s_u, p_B, s_B, p_seq, s_seq, md, mn, A2, bias, HAS_BIAS, SOFTPLUS, HAS_SEQ)
        h14 = _recompute(c0 + 14, h13, T, p_dt, s_dt, p_u, s_u, p_B, s_B, p_seq, s_seq, md, mn, A2, bias, HAS_BIAS, SOFTPLUS, HAS_SEQ)
        h15 = _recompute(c0 + 15, h14, T, p_dt, s_dt, p_u, s_u, p_B, s_B, p_seq, s_seq, md, mn, A2, bias, HAS_BIAS, SOFTPLUS, HAS_SEQ)
        G, a_next, dA_acc, dD_acc, db_acc = _reverse_step(c0 + 15, h15, G, a_next, dA_acc, dD_acc, db_acc, T, pid_n, p_dt, s_dt, p_u, s_u, p_B, s_B, p_C, s_C, p_z, s_z, p_dy, s_dy, p_seq, s_seq, p_du, p_ddt, p_dz, p_ys, s_o, p_dB, p_dC, s_p, md, mn, A2, A, bias, Dv, HAS_BIAS, SOFTPLUS, HAS_SEQ, HAS_D, HAS_Z, SPLIT_N)
        G, a_next, dA_acc, dD_acc, db_acc = _reverse_step(c0 + 14, h14, G, a_next, dA_acc, dD_acc, db_acc, T, pid_n, p_dt, s_dt, p_u, s_u, p_B, s_B, p_C, s_C, p_z, s_z, p_dy, s_dy, p_seq, s_seq, p_du, p_ddt, p_dz, p_ys, s_o, p_dB, p_dC, s_p, md, mn, A2, A, bias, Dv, HAS_BIAS, SOFTPLUS, HAS_SEQ, HAS_D, HAS_Z, SPLIT_N)
        G, a_next, dA_acc, dD_acc, db_acc = _reverse_step(c0 + 13, h13, G, a_next, dA_acc, dD_acc, db_acc, T, pid_n, p_dt, s_dt, p_u, s_u, p_B, s_B, p_C, s_C, p_z, s_z, p_dy, s_dy, p_seq, s_seq, p_du, p_ddt, p_dz, p_ys, s_o, p_dB, p_dC, s_p, md, mn, A2, A, bias, Dv, HAS_BIAS, SOFTPLUS, HAS_SEQ, HAS_D, HAS_Z, SPLIT_N)
        G, a_next, dA_acc, dD_acc, db_acc = _reverse_step(c0 + 12, h12, G, a_next, dA_acc, dD_acc, db_acc, T, pid_n, p_dt, s_dt, p_u, s_u, p_B, s_B, p_C, s_C, p_z, s_z, p_dy, s_dy, p_seq, s_seq, p_du, p_ddt, p_dz, p_ys, s_o, p_dB, p_dC, s_p, md, mn, A2, A, bias, Dv, HAS_BIAS, SOFTPLUS, HAS_SEQ, HAS_D, HAS_Z, SPLIT_N)
        G, a_next, dA_acc, dD_acc, db_acc = _reverse_step(c0 + 11, h11, G, a_next, dA_acc, dD_acc, db_acc, T, pid_n, p_dt, s_dt, p_u, s_u, p_B, s_B, p_C, s_C, p_z, s_z, p_dy, s_dy, p_seq, s_seq, p_du, p_ddt, p_dz, p_ys, s_o, p_dB, p_dC, s_p, md, mn, A2, A, bias, Dv, HAS_BIAS, SOFTPLUS, HAS_SEQ, HAS_D, HAS_Z, SPLIT_N)
        G, a_next, dA_acc, dD_acc, db_acc = _reverse_step(c0 + 10, h10, G, a_next, dA_acc, dD_acc, db_acc, T, pid_n, p_dt, s_dt, p_u, s_u, p_B, s_B, p_C, s_C, p_z, s_z, p_dy, s_dy, p_seq, s_seq, p_du, p_ddt, p_dz, p_ys, s_o, p_dB, p_dC, s_p, md, mn, A2, A, bias, Dv, HAS_BIAS, SOFTPLUS, HAS_SEQ, HAS_D, HAS_Z, SPLIT_N)
        G, a_next, dA_acc, dD_acc, db_acc = _reverse_step(c0 + 9, h9, G, a_next, dA_acc, dD_acc, db_acc, T, pid_n, p_dt, s_dt, p_u, s_u, p_B, s_B, p_C, s_C, p_z, s_z, p_dy, s_dy, p_seq, s_seq, p_du, p_ddt, p_dz, p_ys, s_o, p_dB, p_dC, s_p, md, mn, A2, A, bias, Dv, HAS_BIAS, SOFTPLUS, HAS_SEQ, HAS_D, HAS_Z, SPLIT_N)
        G, a_next, dA_acc, dD_acc, db_acc = _reverse_step(c0 + 8, h8, G, a_next, dA_acc, dD_acc, db_acc, T, pid_n, p_dt, s_dt, p_u, s_u, p_B, s_B, p_C, s_C, p_z, s_z, p_dy, s_dy, p_seq, s_seq, p_du, p_ddt, p_dz, p_ys, s_o, p_dB, p_dC, s_p, md, mn, A2, A, bias, Dv, HAS_BIAS, SOFTPLUS, HAS_SEQ, HAS_D, HAS_Z, SPLIT_N)
        G, a_next, dA_acc, dD_acc, db_acc = _reverse_step(c0 + 7, h7, G, a_next, dA_acc, dD_acc, db_acc, T, pid_n, p_dt, s_dt, p_u, s_u, p_B, s_B, p_C, s_C, p_z, s_z, p_dy, s_dy, p_seq, s_seq, p_du, p_ddt, p_dz, p_ys, s_o, p_dB, p_dC, s_p, md, mn, A2, A, bias, Dv, HAS_BIAS, SOFTPLUS, HAS_SEQ, HAS_D, HAS_Z, SPLIT_N)
        G, a_next, dA_acc, dD_acc, db_acc = _reverse_step(c0 + 6, h6, G, a_next, dA_acc, dD_acc, db_acc, T, pid_n, p_dt, s_dt, p_u, s_u, p_B, s_B, p_C, s_C, p_z, s_z, p_dy, s_dy, p_seq, s_seq, p_du, p_ddt, p_dz, p_ys, s_o, p_dB, p_dC, s_p, md, mn, A2, A, bias, Dv, HAS_BIAS, SOFTPLUS, HAS_SEQ, HAS_D, HAS_Z, SPLIT_N)
        G, a_next, dA_acc, dD_acc, db_acc = _reverse_step(c0 + 5, h5, G, a_next, dA_acc, dD_acc, db_acc, T, pid_n, p_dt, s_dt, p_u, s_u, p_B, s_B, p_C, s_C, p_z, s_z, p_dy, s_dy, p_seq, s_seq, p_du, p_ddt, p_dz, p_ys, s_o, p_dB, p_dC, s_p, md, mn, A2, A, bias, Dv, HAS_BIAS, SOFTPLUS, HAS_SEQ, HAS_D, HAS_Z, SPLIT_N)
        G, a_next, dA_acc, dD_acc, db_acc = _reverse_step(c0 + 4, h4, G, a_next, dA_acc, dD_acc, db_acc, T, pid_n, p_dt, s_dt, p_u, s_u, p_B, s_B, p_C, s_C, p_z, s_z, p_dy, s_dy, p_seq, s_seq, p_du, p_ddt, p_dz, p_ys, s_o, p_dB, p_dC, s_p, md, mn, A2, A, bias, Dv, HAS_BIAS, SOFTPLUS, HAS_SEQ, HAS_D, HAS_Z, SPLIT_N)
        G, a_next, dA_acc, dD_acc, db_acc = _reverse_step(c0 + 3, h3, G, a_next, dA_acc, dD_acc, db_acc, T, pid_n, p_dt, s_dt, p_u, s_u, p_B, s_B, p_C, s_C, p_z, s_z, p_dy, s_dy, p_seq, s_seq, p_du, p_ddt, p_dz, p_ys, s_o, p_dB, p_dC, s_p, md, mn, A2, A, bias, Dv, HAS_BIAS, SOFTPLUS, HAS_SEQ, HAS_D, HAS_Z, SPLIT_N)
        G, a_next, dA_acc, dD_acc, db_acc = _reverse_step(c0 + 2, h2, G, a_next, dA_acc, dD_acc, db_acc, T, pid_n, p_dt, s_dt, p_u, s_u, p_B, s_B, p_C, s_C, p_z, s_z, p_dy, s_dy, p_seq, s_seq, p_du, p_ddt, p_dz, p_ys, s_o, p_dB, p_dC, s_p, md, mn, A2, A, bias, Dv, HAS_BIAS, SOFTPLUS, HAS_SEQ, HAS_D, HAS_Z, SPLIT_N)
        G, a_next, dA_acc, dD_acc, db_acc = _reverse_step(c0 + 1, h1, G, a_next, dA_acc, dD_acc, db_acc, T, pid_n, p_dt, s_dt, p_u, s_u, p_B, s_B, p_C, s_C, p_z, s_z, p_dy, s_dy, p_seq, s_seq, p_du, p_ddt, p_dz, p_ys, s_o, p_dB, p_dC, s_p, md, mn, A2, A, bias, Dv, HAS_BIAS, SOFTPLUS, HAS_SEQ, HAS_D, HAS_Z, SPLIT_N)
        G, a_next, dA_acc, dD_acc, db_acc = _reverse_step(c0 + 0, h0, G, a_next, dA_acc, dD_acc, db_acc, T, pid_n, p_dt, s_dt, p_u, s_u, p_B, s_B, p_C, s_C, p_z, s_z, p_dy, s_dy, p_seq, s_seq, p_du, p_ddt, p_dz, p_ys, s_o, p_dB, p_dC, s_p, md, mn, A2, A, bias, Dv, HAS_BIAS, SOFTPLUS, HAS_SEQ, HAS_D, HAS_Z, SPLIT_N)
    off_part = (b * nc + c) * Dn + d  # [B, nc, D] partials
    tl.store(dA_ptr + off_state, dA_acc, mask=mdn)
    tl.store(db_ptr + pid_n * Bsz * nc * Dn + off_part, db_acc, mask=md)
    if HAS_D:
        tl.store(dD_ptr + off_part, dD_acc, mask=_in_range(md, pid_n, 1))


# fmt: on
# ----------------------------------------------------------------------------- launchers


def _new(shape, dtype, device) -> torch.Tensor:
    """Every buffer a kernel fills; tests swap it for a NaN-filled one."""
    return torch.empty(shape, dtype=dtype, device=device)


def config(N: int, Dn: int, interpret: bool, override: dict | None = None) -> dict:
    """Launch parameters (fixed, never autotuned, so reruns are bit-identical)."""
    bn = min(triton.next_power_of_2(N), MAX_BLOCK_N)
    if interpret:
        cfg = dict(
            BLOCK_D=min(8, triton.next_power_of_2(Dn)),
            BLOCK_N=bn,
            num_warps=1,
            bwd_warps=1,
            BLOCK_E=64,
            CB=8,
        )
    else:
        # measured on the H200 at 8x2048x1536x16 bf16 (scripts/scan_sweep.py): forward
        # BLOCK_D 32 / 1 warp 0.83 ms (32 / 4 warps 1.50); backward 8 / 1 warp 5.76 ms (16 / 1 7.25)
        p2 = triton.next_power_of_2(Dn)
        cfg = dict(BLOCK_D=min(32, p2), BWD_BLOCK_D=min(8, p2), BLOCK_N=bn, num_warps=1,
                   bwd_warps=1, BLOCK_E=256, CB=16)  # fmt: skip
    env = os.environ.get("MAMBAKIT_SCAN_CONFIG")  # a tuning knob: JSON of the keys above
    if env:
        cfg.update(json.loads(env))
    cfg.update(override or {})
    return cfg


def _opt(t: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return like if t is None else t


def _strides(u, delta, B, C, z, seq_idx):
    zs = z.stride()[:2] if z is not None else (0, 0)
    ss = seq_idx.stride() if seq_idx is not None else (0, 0)
    return (
        u.stride(0),
        u.stride(1),
        delta.stride(0),
        delta.stride(1),
        B.stride(0),
        B.stride(1),
        C.stride(0),
        C.stride(1),
        *zs,
        *ss,
    )


def scan_fwd(
    u,
    delta,
    A,
    B,
    C,
    D,
    z,
    delta_bias,
    delta_softplus,
    initial_state,
    seq_idx,
    save_states: bool,
    chunk: int = CHUNK,
    config_override: dict | None = None,
):
    """(y [B, T, D] in u.dtype, final state [B, D, N] f32, chunk-start states or an empty tensor)."""
    assert chunk == CHUNK, "the kernels are written for CHUNK = 16"
    Bsz, T, Dn = u.shape
    N = A.shape[1]
    dev = u.device
    cfg = config(N, Dn, not u.is_cuda, config_override)
    bd, bn = cfg["BLOCK_D"], cfg["BLOCK_N"]
    nb, nc = triton.cdiv(N, bn), triton.cdiv(T, CHUNK)
    f32 = torch.float32
    A = A.contiguous()
    h0 = initial_state.contiguous() if initial_state is not None else None
    flags = dict(
        HAS_D=D is not None,
        HAS_Z=z is not None,
        HAS_BIAS=delta_bias is not None,
        SOFTPLUS=bool(delta_softplus),
        HAS_SEQ=seq_idx is not None,
        SPLIT_N=nb > 1,
        CHUNK=CHUNK,
        BLOCK_D=bd,
        BLOCK_N=bn,
        num_warps=cfg["num_warps"],
    )
    grid = (triton.cdiv(Dn, bd), nc, Bsz * nb)
    ins = (u, delta, A, B, C, _opt(D, A), _opt(z, u), _opt(delta_bias, A), _opt(seq_idx, A))
    strides = _strides(u, delta, B, C, z, seq_idx)
    hloc = torch.empty(Bsz, nc, Dn, N, dtype=f32, device=dev)
    P = torch.empty_like(hloc)
    _fwd_chunk_kernel[grid](
        *ins, hloc, hloc, P, hloc, T, Dn, N, Bsz, nc, *strides, FINAL=False, **flags
    )
    states = _new((Bsz, nc, Dn, N), f32, dev)
    hT = _new((Bsz, Dn, N), f32, dev)
    DN = Dn * N
    _carry_fwd_kernel[(triton.cdiv(DN, cfg["BLOCK_E"]), Bsz)](
        hloc,
        P,
        _opt(h0, A),
        states,
        hT,
        nc,
        DN,
        HAS_H0=h0 is not None,
        BLOCK_E=cfg["BLOCK_E"],
        CB=cfg["CB"],
    )
    del hloc, P
    y = _new((Bsz, T, Dn), u.dtype, dev) if nb == 1 else _new((nb, Bsz, T, Dn), f32, dev)
    _fwd_chunk_kernel[grid](
        *ins, states, states, states, y, T, Dn, N, Bsz, nc, *strides, FINAL=True, **flags
    )
    if nb > 1:  # the state blocks' partial sums, then D u and the gate
        y = y.sum(0)
        if D is not None:
            y = y + u.float() * D
        if z is not None:
            y = y * torch.nn.functional.silu(z.float())
        y = y.to(u.dtype)
    return y, hT, states if save_states else _new((0,), f32, dev)


def scan_bwd(
    gy,
    g_final,
    u,
    delta,
    A,
    B,
    C,
    D,
    z,
    delta_bias,
    delta_softplus,
    initial_state,
    seq_idx,
    states,
    chunk: int = CHUNK,
    config_override: dict | None = None,
):
    """(du, ddelta, dA, dB, dC, dD, dz, d delta_bias, d initial_state); absent ones None."""
    assert chunk == CHUNK, "the kernels are written for CHUNK = 16"
    Bsz, T, Dn = u.shape
    N = A.shape[1]
    dev = u.device
    cfg = config(N, Dn, not u.is_cuda, config_override)
    bd, bn = cfg.get("BWD_BLOCK_D", cfg["BLOCK_D"]), cfg["BLOCK_N"]
    nb, nc, ndb = triton.cdiv(N, bn), triton.cdiv(T, CHUNK), triton.cdiv(Dn, bd)
    f32 = torch.float32
    A = A.contiguous()
    DN = Dn * N
    common = dict(
        HAS_Z=z is not None,
        HAS_BIAS=delta_bias is not None,
        SOFTPLUS=bool(delta_softplus),
        HAS_SEQ=seq_idx is not None,
        BLOCK_D=bd,
        BLOCK_N=bn,
        num_warps=cfg["bwd_warps"],
    )
    grid = (ndb, nc, Bsz * nb)
    strides = _strides(u, delta, B, C, z, seq_idx)
    s_dy = gy.stride()
    W = torch.empty(Bsz, nc, Dn, N, dtype=f32, device=dev)
    P = torch.empty_like(W)
    _bwd_local_kernel[grid](
        u,
        delta,
        A,
        B,
        C,
        _opt(z, u),
        _opt(delta_bias, A),
        _opt(seq_idx, A),
        gy,
        W,
        P,
        T,
        Dn,
        N,
        Bsz,
        nc,
        *strides,
        *s_dy,
        CHUNK=CHUNK,
        **common,
    )
    gin = torch.empty_like(W)
    dh0 = _new((Bsz, Dn, N), f32, dev) if initial_state is not None else None
    gT = g_final.contiguous() if g_final is not None else None
    _carry_bwd_kernel[(triton.cdiv(DN, cfg["BLOCK_E"]), Bsz)](
        W,
        P,
        _opt(gT, A),
        gin,
        _opt(dh0, A),
        nc,
        DN,
        HAS_GT=gT is not None,
        HAS_H0=dh0 is not None,
        BLOCK_E=cfg["BLOCK_E"],
        CB=cfg["CB"],
    )
    del W, P
    if nb == 1:
        du = _new((Bsz, T, Dn), u.dtype, dev)
        ddt = _new((Bsz, T, Dn), delta.dtype, dev)
        dz = _new((Bsz, T, Dn), z.dtype, dev) if z is not None else None
        ys = None
    else:
        du = _new((nb, Bsz, T, Dn), f32, dev)
        ddt = _new((nb, Bsz, T, Dn), f32, dev)
        dz = None
        ys = _new((nb, Bsz, T, Dn), f32, dev) if z is not None else None
    dBp = _new((ndb, Bsz, T, N), f32, dev)
    dCp = _new((ndb, Bsz, T, N), f32, dev)
    dAp = _new((Bsz, nc, Dn, N), f32, dev)
    dDp = _new((Bsz, nc, Dn), f32, dev) if D is not None else None
    dbp = _new((nb, Bsz, nc, Dn), f32, dev)
    _bwd_chunk_kernel[grid](
        u,
        delta,
        A,
        B,
        C,
        _opt(D, A),
        _opt(z, u),
        _opt(delta_bias, A),
        _opt(seq_idx, A),
        gy,
        states,
        gin,
        du,
        ddt,
        _opt(dz, du),
        _opt(ys, du),
        dBp,
        dCp,
        dAp,
        _opt(dDp, A),
        dbp,
        T,
        Dn,
        N,
        Bsz,
        nc,
        *strides,
        *s_dy,
        HAS_D=D is not None,
        SPLIT_N=nb > 1,
        QUARTERS=bool(cfg.get("BWD_QUARTERS", False)),
        **common,
    )
    if nb > 1:
        du = du.sum(0).to(u.dtype)
        ddt = ddt.sum(0).to(delta.dtype)
        if z is not None:  # dz needs y over every state block
            zf = z.float()
            y_pre = ys.sum(0) + (u.float() * D if D is not None else 0.0)
            sz = torch.sigmoid(zf)
            dz = (gy.float() * y_pre * sz * (1 + zf * (1 - sz))).to(z.dtype)
    dB = dBp.sum(0).to(B.dtype)
    dC = dCp.sum(0).to(C.dtype)
    dA = dAp.sum((0, 1))
    dD = dDp.sum((0, 1)) if dDp is not None else None
    dbias = dbp.sum((0, 1, 2)) if delta_bias is not None else None
    return du, ddt, dA, dB, dC, dD, dz, dbias, dh0
