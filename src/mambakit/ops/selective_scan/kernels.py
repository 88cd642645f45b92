"""Triton kernels of the selective scan: a time-chunked forward and backward.

B batch, T time, D = d_inner, N = d_state; TC = the backward's time tile and
the interval of the saved states, FWD_TC = the forward's tile (see `config`).
A program owns one row, one block of channels, one block of states and one
segment of time; it walks its segment one tile of steps at a time, holding
the [TC, BLOCK_N, BLOCK_D] decays and inputs of a tile in registers and
resolving the recurrence inside the tile with `tl.associative_scan` over time.
Each exponential is computed once per pass. Only the state between tiles is
carried from one iteration to the next.

A segment is the whole sequence unless rows x channel blocks give too few
programs to fill the GPU (a long single sequence); then time is cut into
segments, each segment's summary is computed first and a small scan over
segments gives every segment its start (forward) or end (backward) carry.

Forward (one launch; three with segments):
  [`_fwd_kernel` LOCAL: each segment from a zero state: end state, decay product;
   `_carry_fwd_kernel`: the start state of each segment]
  `_fwd_kernel`: y_t = sum_n h_t C_t (+ D u_t, * silu(z_t)); the state every TC
  steps is stored for the backward: 4 D N / TC bytes per token.
Backward (one launch; three with segments). g_t = dL/dh_t satisfies
g_t = C_t gy_t + a_{t+1} g_{t+1}; inside a tile it is a reverse scan whose
elements carry their own decay, so a_{t+1} never has to be shifted into row t:
  [`_bwd_local_kernel`: each segment's reverse recurrence from a zero carry;
   `_carry_bwd_kernel`: the carry into each segment's end]
  `_bwd_kernel`: per tile, the states are recomputed from the saved tile-start
  state (forward scan) and the adjoints by the reverse scan; a_t h_{t-1} is
  h_t - b_t, so nothing divides by a decay. dB, dC (over channel blocks), dA,
  dD, d delta_bias (over rows and segments) are per-program partials summed
  afterwards in a fixed order: no atomics, bit-identical reruns.
Exponentials use exp2 with log2(e) folded into A.
"""

import functools
import json
import os

import torch
import triton
import triton.language as tl

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
def _combine_rev(k_r, c_r, f_r, k_l, c_l, f_l):
    """Reverse-scan combine of the adjoint recurrence g_t = c_t + a_{t+1} g_{t+1}.

    An element (k, c, f) over steps [t, s] maps the carry w = a_{s+1} g_{s+1} to
    g_t = c + k w, and f = a_t turns g_t into the carry for step t - 1. A single
    step t is (1, c_t, a_t). `reverse=True` passes the later span first."""
    m = k_l * f_r
    return m * k_r, c_l + m * c_r, f_l


@triton.jit
def _row(x, rows, r):
    """Row r of a [TC, BN, BD] tile as [BN, BD]."""
    return tl.sum(tl.where((rows == r)[:, None, None], x, 0.0), axis=0)


@triton.jit
def _program_block(A_ptr, bias_ptr, Dn, N, Bsz, HAS_BIAS: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_N: tl.constexpr):
    """This program's (segment, row, channel block, state block) on the grid (D blocks,
    segments, rows x state blocks), its masks, A [BLOCK_N, BLOCK_D] and the dt bias [BLOCK_D]."""
    pid_d = tl.program_id(0)
    s = tl.program_id(1)
    b = (tl.program_id(2) % Bsz).to(tl.int64)
    pid_n = tl.program_id(2) // Bsz
    d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    md = d < Dn
    mn = n < N
    mdn = mn[:, None] & md[None, :]  # [BLOCK_N, BLOCK_D]: channels along the lanes
    A = tl.load(A_ptr + d[None, :] * N + n[:, None], mask=mdn, other=0.0)
    bias = tl.zeros([BLOCK_D], tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + d, mask=md, other=0.0)
    return pid_d, s, b, pid_n, d, n, md, mn, mdn, A, bias


@triton.jit
def _ld(ptrs, mask, EVEN: tl.constexpr):
    """Load as f32; EVEN: every element is in bounds, no mask."""
    if EVEN:
        return tl.load(ptrs).to(tl.float32)
    else:
        return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _st(ptrs, value, mask, EVEN: tl.constexpr):
    if EVEN:
        tl.store(ptrs, value)
    else:
        tl.store(ptrs, value, mask=mask)


@triton.jit
def _delta_of(raw, m2, bias, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr, EVEN: tl.constexpr):
    """Raw delta [TC, BD] as loaded -> (raw + bias, delta); delta is 0 on rows past T."""
    if HAS_BIAS:
        raw = raw + bias[None, :]
    if SOFTPLUS:
        dt = _softplus(raw)
    else:
        dt = raw
    if not EVEN:
        dt = tl.where(m2, dt, 0.0)
    return raw, dt


@triton.jit
def _tile_dt(
    t0, rows, mt, b, d, md, dt_ptr, s_dt_b, s_dt_t, bias,
    HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr, EVEN: tl.constexpr,
):
    """Tile rows t0 + rows: mask [TC, BD], raw delta (+ bias), delta (0 on rows past T)."""
    m2 = mt[:, None] & md[None, :]
    raw = _ld(_tile_ptrs(dt_ptr, s_dt_b, s_dt_t, b, t0, rows, d, 1), m2, EVEN)
    raw, dt = _delta_of(raw, m2, bias, HAS_BIAS, SOFTPLUS, EVEN)
    return m2, raw, dt


@triton.jit
def _doc_starts(t, mt, b, seq_ptr, s_seq_b, s_seq_t):
    """[TC] bool: a document starts at row t (nothing flows in from t - 1)."""
    t64 = t.to(tl.int64)
    first = mt & (t > 0)
    cur = tl.load(seq_ptr + b * s_seq_b + t64 * s_seq_t, mask=first, other=0)
    prev = tl.load(seq_ptr + b * s_seq_b + (t64 - 1) * s_seq_t, mask=first, other=0)
    return cur != prev


@triton.jit
def _tile_decay(
    t0, rows, mt, b, d, md, dt_ptr, s_dt_b, s_dt_t, seq_ptr, s_seq_b, s_seq_t, A2, bias,
    HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr, HAS_SEQ: tl.constexpr, EVEN: tl.constexpr,
):
    """_tile_dt, and a_t [TC, BN, BD] (A2 = A^T log2(e), [BN, BD]). Rows past T are identities
    (delta 0: a = 1, b = 0)."""
    m2, raw, dt = _tile_dt(
        t0, rows, mt, b, d, md, dt_ptr, s_dt_b, s_dt_t, bias, HAS_BIAS, SOFTPLUS, EVEN
    )
    a = tl.exp2(dt[:, None, :] * A2[None, :, :])
    if HAS_SEQ:
        starts = _doc_starts(t0 + rows, mt, b, seq_ptr, s_seq_b, s_seq_t)
        a = tl.where(starts[:, None, None], 0.0, a)
    return m2, raw, dt, a


@triton.jit
def _tile_ptrs(ptr, s_b, s_t, b, t0, rows, cols, s_c):
    """Pointers of the [TC, len(cols)] tile at steps t0 + rows of row b of a [B, T, cols]
    tensor: a scalar int64 base and int32 offsets that stay the same from tile to tile (so
    they are computed once, outside the tile loop)."""
    return (ptr + (b * s_b + t0.to(tl.int64) * s_t)) + (rows[:, None] * s_t + cols[None, :] * s_c)


@triton.jit
def _tile_rows(ptr, s_b, s_t, b, t0, rows, cols, mask, EVEN: tl.constexpr):
    """A [TC, len(cols)] tile of a [B, T, cols] tensor, as f32."""
    return _ld(_tile_ptrs(ptr, s_b, s_t, b, t0, rows, cols, 1), mask, EVEN)


@triton.jit
def _tile_gate(dy_ptr, s_dy_b, s_dy_t, s_dy_d, z_ptr, s_z_b, s_z_t, b, t0, rows, d, m2,
               HAS_Z: tl.constexpr, EVEN: tl.constexpr):
    """dy, z, sigmoid(z), gy = dy * silu(z) (the gradient reaching y before the gate)."""
    dy = _ld(_tile_ptrs(dy_ptr, s_dy_b, s_dy_t, b, t0, rows, d, s_dy_d), m2, EVEN)
    if HAS_Z:
        z = _tile_rows(z_ptr, s_z_b, s_z_t, b, t0, rows, d, m2, EVEN)
        sz = tl.sigmoid(z)
        gy = dy * z * sz
    else:
        z = dy
        sz = dy
        gy = dy
    return dy, z, sz, gy


@triton.jit
def _fwd_kernel(
    u_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, bias_ptr, seq_ptr,
    h0_ptr, states_ptr, hT_ptr, hloc_ptr, P_ptr, y_ptr,
    T, Dn, N, Bsz, nc, ns, nseg, seg_chunks,
    s_u_b, s_u_t, s_dt_b, s_dt_t, s_B_b, s_B_t, s_C_b, s_C_t, s_z_b, s_z_t, s_seq_b, s_seq_t,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
    HAS_SEQ: tl.constexpr, HAS_H0: tl.constexpr, LOCAL: tl.constexpr, SAVE: tl.constexpr,
    SPLIT_N: tl.constexpr, TC: tl.constexpr, TS: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, STAGES: tl.constexpr, EVEN: tl.constexpr,
):
    """One segment of one row, tile by tile. LOCAL: from a zero state, only the segment's end
    state and decay product; else y, the state every TS steps (SAVE) and h_T (last segment)."""
    pid_d, s, b, pid_n, d, n, md, mn, mdn, A, bias = _program_block(
        A_ptr, bias_ptr, Dn, N, Bsz, HAS_BIAS, BLOCK_D, BLOCK_N
    )
    A2 = A * LOG2E
    rows = tl.arange(0, TC)
    off_seg = ((b * nseg + s) * Dn + d[None, :]) * N + n[:, None]  # [B, nseg, D, N]
    if HAS_H0:
        h = tl.load(h0_ptr + off_seg, mask=mdn, other=0.0)
    else:
        h = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    p = tl.full([BLOCK_N, BLOCK_D], 1.0, tl.float32)
    Dv = tl.zeros([BLOCK_D], tl.float32)
    if HAS_D:
        Dv = tl.load(D_ptr + d, mask=_in_range(md, pid_n, 1), other=0.0)
    y_base = y_ptr + (pid_n * Bsz + b) * T * Dn  # [nb, B, T, D] (nb = 1: [B, T, D])
    c0 = s * seg_chunks
    for i in tl.range(seg_chunks, num_stages=STAGES):
        c = c0 + i  # past the last tile (c >= nc) every row is masked: an identity
        t0 = c * TC
        t = t0 + rows
        mt = t < T
        m2, _raw, dt, a = _tile_decay(
            t0, rows, mt, b, d, md, dt_ptr, s_dt_b, s_dt_t, seq_ptr, s_seq_b, s_seq_t, A2, bias,
            HAS_BIAS, SOFTPLUS, HAS_SEQ, EVEN,
        )
        u = _tile_rows(u_ptr, s_u_b, s_u_t, b, t0, rows, d, m2, EVEN)
        Bt = _tile_rows(B_ptr, s_B_b, s_B_t, b, t0, rows, n, mt[:, None] & mn[None, :], EVEN)
        bx = (dt * u)[:, None, :] * Bt[:, :, None]
        # the carried state enters through the first row; the scan's decay products are then
        # only needed for a LOCAL pass (unused, they compile away)
        bx = tl.where((rows == 0)[:, None, None], bx + a * h[None, :, :], bx)
        pa, hs = tl.associative_scan((a, bx), 0, _combine)
        if SAVE:  # the state every TS steps (the backward's tile), [B, ns, D, N]
            if TC <= TS:
                c_s = (c * TC) // TS
                off_c = ((b * ns + c_s) * Dn + d[None, :]) * N + n[:, None]
                m_s = _in_range(_in_range(mdn, c_s, ns), (c * TC) % TS, 1)
                tl.store(states_ptr + off_c, h, mask=m_s)
            else:
                for k in tl.static_range(TC // TS):
                    c_s = c * (TC // TS) + k
                    off_c = ((b * ns + c_s) * Dn + d[None, :]) * N + n[:, None]
                    if k == 0:
                        hk = h
                    else:
                        hk = _row(hs, rows, k * TS - 1)
                    tl.store(states_ptr + off_c, hk, mask=_in_range(mdn, c_s, ns))
        if LOCAL:
            p = p * _row(pa, rows, TC - 1)
        else:
            Ct = _tile_rows(C_ptr, s_C_b, s_C_t, b, t0, rows, n, mt[:, None] & mn[None, :], EVEN)
            y = tl.sum(hs * Ct[:, :, None], axis=1)
            if not SPLIT_N:  # the whole of y is here: finish it
                if HAS_D:
                    y += Dv[None, :] * u
                if HAS_Z:
                    zt = _tile_rows(z_ptr, s_z_b, s_z_t, b, t0, rows, d, m2, EVEN)
                    y = y * zt * tl.sigmoid(zt)
            _st(_tile_ptrs(y_base, 0, Dn, b, t0, rows, d, 1), y, m2, EVEN)
        h = _row(hs, rows, TC - 1)
    if LOCAL:
        tl.store(hloc_ptr + off_seg, h, mask=mdn)
        tl.store(P_ptr + off_seg, p, mask=mdn)
    else:
        off_T = (b * Dn + d[None, :]) * N + n[:, None]
        tl.store(hT_ptr + off_T, h, mask=_in_range(mdn, nseg - 1 - s, 1))  # the last segment


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
def _bwd_local_kernel(
    dt_ptr, A_ptr, C_ptr, z_ptr, bias_ptr, seq_ptr, dy_ptr, W_ptr, P_ptr,
    T, Dn, N, Bsz, nseg, seg_chunks,
    s_dt_b, s_dt_t, s_C_b, s_C_t, s_z_b, s_z_t, s_seq_b, s_seq_t, s_dy_b, s_dy_t, s_dy_d,
    HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr, HAS_SEQ: tl.constexpr,
    TC: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, STAGES: tl.constexpr,
    EVEN: tl.constexpr,
):
    """A segment's reverse recurrence from a zero carry: W = a_first g_first, and the segment's
    decay product P (the carry into its end reaches its start times P)."""
    pid_d, s, b, pid_n, d, n, md, mn, mdn, A, bias = _program_block(
        A_ptr, bias_ptr, Dn, N, Bsz, HAS_BIAS, BLOCK_D, BLOCK_N
    )
    A2 = A * LOG2E
    rows = tl.arange(0, TC)
    ones = tl.full([TC, BLOCK_N, BLOCK_D], 1.0, tl.float32)
    G = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    p = tl.full([BLOCK_N, BLOCK_D], 1.0, tl.float32)
    c0 = s * seg_chunks
    for i in tl.range(seg_chunks, num_stages=STAGES):
        c = c0 + seg_chunks - 1 - i
        t0 = c * TC
        t = t0 + rows
        mt = t < T
        m2, _raw, _dt, a = _tile_decay(
            t0, rows, mt, b, d, md, dt_ptr, s_dt_b, s_dt_t, seq_ptr, s_seq_b, s_seq_t, A2, bias,
            HAS_BIAS, SOFTPLUS, HAS_SEQ, EVEN,
        )
        _dy, _z, _sz, gy = _tile_gate(
            dy_ptr, s_dy_b, s_dy_t, s_dy_d, z_ptr, s_z_b, s_z_t, b, t0, rows, d, m2, HAS_Z, EVEN
        )
        Ct = _tile_rows(C_ptr, s_C_b, s_C_t, b, t0, rows, n, mt[:, None] & mn[None, :], EVEN)
        cc = Ct[:, :, None] * gy[:, None, :]
        cc = tl.where((rows == TC - 1)[:, None, None], cc + G[None, :, :], cc)  # the carry
        k, g, _f = tl.associative_scan((ones, cc, a), 0, _combine_rev, reverse=True)
        a0 = _row(a, rows, 0)
        G = a0 * _row(g, rows, 0)
        p = p * a0 * _row(k, rows, 0)
    off_seg = ((b * nseg + s) * Dn + d[None, :]) * N + n[:, None]
    tl.store(W_ptr + off_seg, G, mask=mdn)
    tl.store(P_ptr + off_seg, p, mask=mdn)


@triton.jit
def _shfl_xor(x, M: tl.constexpr, ASM: tl.constexpr):
    """y[..., d] = x[..., d ^ M] over the last dim of x [V, NL, BD], whose index d is lane bits
    0.. of the warp: one butterfly shuffle per element on the GPU (ASM), tensor ops otherwise
    (the interpreter runs no PTX)."""
    if ASM:
        xi = x.to(tl.int32, bitcast=True)
        if M == 1:
            asm: tl.constexpr = "shfl.sync.bfly.b32 $0, $1, 1, 0x1f, 0xffffffff;"
        elif M == 2:
            asm: tl.constexpr = "shfl.sync.bfly.b32 $0, $1, 2, 0x1f, 0xffffffff;"
        elif M == 4:
            asm: tl.constexpr = "shfl.sync.bfly.b32 $0, $1, 4, 0x1f, 0xffffffff;"
        elif M == 8:
            asm: tl.constexpr = "shfl.sync.bfly.b32 $0, $1, 8, 0x1f, 0xffffffff;"
        else:
            asm: tl.constexpr = "shfl.sync.bfly.b32 $0, $1, 16, 0x1f, 0xffffffff;"
        yi = tl.inline_asm_elementwise(asm, "=r,r", [xi], dtype=tl.int32, is_pure=True, pack=1)
        return yi.to(tl.float32, bitcast=True)
    else:
        V: tl.constexpr = x.shape[0]
        NL: tl.constexpr = x.shape[1]
        BD: tl.constexpr = x.shape[2]
        x5 = tl.permute(tl.reshape(x, [V, NL, BD // (2 * M), 2, M]), (0, 1, 2, 4, 3))
        lo, hi = tl.split(x5)
        return tl.reshape(tl.permute(tl.join(hi, lo), (0, 1, 2, 4, 3)), [V, NL, BD])


@triton.jit
def _halve(r, d, M: tl.constexpr, ASM: tl.constexpr):
    """One reduce-scatter step over lane bit M: lanes with that bit clear keep the first half
    of their values and receive their partner's first half, the others the second halves."""
    V: tl.constexpr = r.shape[0]
    NL: tl.constexpr = r.shape[1]
    BD: tl.constexpr = r.shape[2]
    lo, hi = tl.split(tl.permute(tl.reshape(r, [2, V // 2, NL, BD]), (1, 2, 3, 0)))
    up = ((d & M) != 0)[None, None, :]
    return tl.where(up, hi, lo) + _shfl_xor(tl.where(up, lo, hi), M, ASM)


@triton.jit
def _store_channel_sum(
    ptr, p, t0, rows, n, mtn, T, N, pid_n, TC: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, RS: tl.constexpr, ASM: tl.constexpr, EVEN: tl.constexpr,
):
    """Store sum_d p[t, n, d] of a [TC, BN, BD] tile at ptr + (t0 + t) N + n.

    RS: the tile's layout has the BD channels on lane bits 0.. and NL = 32 / BD states on the
    other lanes, the rest in registers; a reduce-scatter (halve the values, swap a half with
    the partner lane, add) leaves each lane V / BD finished sums, V = TC BN / NL, with log2(BD)
    levels of V/2 + V/4 + ... shuffles instead of log2(BD) shuffles for every one of V values.
    Lane (l, d)'s value j is the sum for flat = j + (V / BD) d, flat = t (BN / NL) + n // NL,
    l = n % NL."""
    if RS:
        NL: tl.constexpr = 32 // BLOCK_D
        NH: tl.constexpr = BLOCK_N // NL
        V: tl.constexpr = TC * NH
        VF: tl.constexpr = V // BLOCK_D
        d = tl.arange(0, BLOCK_D)
        r = tl.reshape(p, [V, NL, BLOCK_D])
        if BLOCK_D >= 32:
            r = _halve(r, d, 16, ASM)
        if BLOCK_D >= 16:
            r = _halve(r, d, 8, ASM)
        if BLOCK_D >= 8:
            r = _halve(r, d, 4, ASM)
        if BLOCK_D >= 4:
            r = _halve(r, d, 2, ASM)
        if BLOCK_D >= 2:
            r = _halve(r, d, 1, ASM)
        flat = tl.arange(0, VF)[:, None, None] + VF * d[None, None, :]
        tt = flat // NH
        nn = pid_n * BLOCK_N + (flat % NH) * NL + tl.arange(0, NL)[None, :, None]
        off = (t0 + tt) * N + nn
        if EVEN:
            tl.store(ptr + off, r)
        else:
            tl.store(ptr + off, r, mask=((t0 + tt) < T) & (nn < N))
    else:
        _st(_tile_ptrs(ptr, 0, N, 0, t0, rows, n, 1), tl.sum(p, axis=2), mtn, EVEN)


@triton.jit
def _bwd_loads(
    c, rows, b, d, n, md, mn, mdn, T, Dn, N, nc, u_ptr, dt_ptr, B_ptr, C_ptr, z_ptr, dy_ptr,
    states_ptr, s_u_b, s_u_t, s_dt_b, s_dt_t, s_B_b, s_B_t, s_C_b, s_C_t, s_z_b, s_z_t, s_dy_b,
    s_dy_t, s_dy_d, HAS_Z: tl.constexpr, TC: tl.constexpr, EVEN: tl.constexpr,
):
    """The inputs of backward tile c, as f32: raw delta, u, B, C, dy, z (dy without z) and
    the saved state at the tile's start."""
    t0 = c * TC
    mt = (t0 + rows) < T
    m2 = mt[:, None] & md[None, :]
    mtn = mt[:, None] & mn[None, :]
    raw = _ld(_tile_ptrs(dt_ptr, s_dt_b, s_dt_t, b, t0, rows, d, 1), m2, EVEN)
    u = _tile_rows(u_ptr, s_u_b, s_u_t, b, t0, rows, d, m2, EVEN)
    Bt = _tile_rows(B_ptr, s_B_b, s_B_t, b, t0, rows, n, mtn, EVEN)
    Ct = _tile_rows(C_ptr, s_C_b, s_C_t, b, t0, rows, n, mtn, EVEN)
    dy = _ld(_tile_ptrs(dy_ptr, s_dy_b, s_dy_t, b, t0, rows, d, s_dy_d), m2, EVEN)
    if HAS_Z:
        z = _tile_rows(z_ptr, s_z_b, s_z_t, b, t0, rows, d, m2, EVEN)
    else:
        z = dy
    off_c = ((b * nc + c) * Dn + d[None, :]) * N + n[:, None]  # [B, nc, D, N]
    h0 = tl.load(states_ptr + off_c, mask=_in_range(mdn, c, nc), other=0.0)
    return raw, u, Bt, Ct, dy, z, h0


@triton.jit
def _bwd_kernel(
    u_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, bias_ptr, seq_ptr, dy_ptr, states_ptr,
    gin_ptr, du_ptr, ddt_ptr, dz_ptr, ys_ptr, dB_ptr, dC_ptr, dA_ptr, dD_ptr, db_ptr, dh0_ptr,
    T, Dn, N, Bsz, nc, nseg, seg_chunks,
    s_u_b, s_u_t, s_dt_b, s_dt_t, s_B_b, s_B_t, s_C_b, s_C_t, s_z_b, s_z_t, s_seq_b, s_seq_t,
    s_dy_b, s_dy_t, s_dy_d,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
    HAS_SEQ: tl.constexpr, HAS_G: tl.constexpr, HAS_H0: tl.constexpr, SPLIT_N: tl.constexpr,
    TC: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, STAGES: tl.constexpr,
    EVEN: tl.constexpr, PREFETCH: tl.constexpr, RS: tl.constexpr, RS_ASM: tl.constexpr,
):
    """Every gradient of one segment, tiles last to first: states by a forward scan from the
    saved tile-start state, adjoints by a reverse scan from the carry G."""
    pid_d, s, b, pid_n, d, n, md, mn, mdn, A, bias = _program_block(
        A_ptr, bias_ptr, Dn, N, Bsz, HAS_BIAS, BLOCK_D, BLOCK_N
    )
    A2 = A * LOG2E
    rows = tl.arange(0, TC)
    ones = tl.full([TC, BLOCK_N, BLOCK_D], 1.0, tl.float32)
    off_seg = ((b * nseg + s) * Dn + d[None, :]) * N + n[:, None]  # [B, nseg, D, N]
    if HAS_G:
        G = tl.load(gin_ptr + off_seg, mask=mdn, other=0.0)
    else:
        G = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    Dv = tl.zeros([BLOCK_D], tl.float32)
    if HAS_D:
        Dv = tl.load(D_ptr + d, mask=_in_range(md, pid_n, 1), other=0.0)
    dA_acc = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dD_acc = tl.zeros([BLOCK_D], tl.float32)
    db_acc = tl.zeros([BLOCK_D], tl.float32)
    out_base = (pid_n * Bsz + b) * T * Dn  # [nb, B, T, D] (nb = 1: [B, T, D])
    part_base = (pid_d * Bsz + b) * T * N  # [n_dblocks, B, T, N]
    c0 = s * seg_chunks
    c_last = c0 + seg_chunks - 1
    if PREFETCH:  # a tile's loads are issued one iteration ahead, behind the previous tile's
        # arithmetic: few warps per SM are resident at this register count to hide them
        nx_raw, nx_u, nx_B, nx_C, nx_dy, nx_z, nx_h0 = _bwd_loads(
            c_last, rows, b, d, n, md, mn, mdn, T, Dn, N, nc, u_ptr, dt_ptr, B_ptr, C_ptr, z_ptr,
            dy_ptr, states_ptr, s_u_b, s_u_t, s_dt_b, s_dt_t, s_B_b, s_B_t, s_C_b, s_C_t, s_z_b,
            s_z_t, s_dy_b, s_dy_t, s_dy_d, HAS_Z, TC, EVEN,
        )
    for i in tl.range(seg_chunks, num_stages=STAGES):
        c = c_last - i
        if PREFETCH:
            raw, u, Bt, Ct, dy, z, h0 = nx_raw, nx_u, nx_B, nx_C, nx_dy, nx_z, nx_h0
            nx_raw, nx_u, nx_B, nx_C, nx_dy, nx_z, nx_h0 = _bwd_loads(
                tl.maximum(c - 1, c0), rows, b, d, n, md, mn, mdn, T, Dn, N, nc, u_ptr, dt_ptr,
                B_ptr, C_ptr, z_ptr, dy_ptr, states_ptr, s_u_b, s_u_t, s_dt_b, s_dt_t, s_B_b,
                s_B_t, s_C_b, s_C_t, s_z_b, s_z_t, s_dy_b, s_dy_t, s_dy_d, HAS_Z, TC, EVEN,
            )  # the next tile's (the first tile's again on the last iteration: unused)
        else:
            raw, u, Bt, Ct, dy, z, h0 = _bwd_loads(
                c, rows, b, d, n, md, mn, mdn, T, Dn, N, nc, u_ptr, dt_ptr, B_ptr, C_ptr, z_ptr,
                dy_ptr, states_ptr, s_u_b, s_u_t, s_dt_b, s_dt_t, s_B_b, s_B_t, s_C_b, s_C_t,
                s_z_b, s_z_t, s_dy_b, s_dy_t, s_dy_d, HAS_Z, TC, EVEN,
            )
        t0 = c * TC
        t = t0 + rows
        mt = t < T
        mtn = mt[:, None] & mn[None, :]
        m2 = mt[:, None] & md[None, :]
        raw, dt = _delta_of(raw, m2, bias, HAS_BIAS, SOFTPLUS, EVEN)
        a = tl.exp2(dt[:, None, :] * A2[None, :, :])
        if HAS_SEQ:
            starts = _doc_starts(t, mt, b, seq_ptr, s_seq_b, s_seq_t)
            a = tl.where(starts[:, None, None], 0.0, a)
        if HAS_Z:
            sz = tl.sigmoid(z)
            gy = dy * z * sz
        else:
            sz = dy
            gy = dy
        dtu = dt * u
        bx = dtu[:, None, :] * Bt[:, :, None]
        # carries enter through the first (forward) and last (reverse) rows; the scans' decay
        # products are then unused and compile away
        hs_in = tl.where((rows == 0)[:, None, None], bx + a * h0[None, :, :], bx)
        _pa, hs = tl.associative_scan((a, hs_in), 0, _combine)  # h_t
        cc = Ct[:, :, None] * gy[:, None, :]
        cc = tl.where((rows == TC - 1)[:, None, None], cc + G[None, :, :], cc)
        _k, x, _f = tl.associative_scan((ones, cc, a), 0, _combine_rev, reverse=True)  # dL/dh_t
        G = _row(a, rows, 0) * _row(x, rows, 0)  # the carry into the previous tile
        if HAS_Z:
            ys = tl.sum(hs * Ct[:, :, None], axis=1)
            if SPLIT_N:  # y needs every state block: dz is finished outside
                _st(_tile_ptrs(ys_ptr + out_base, 0, Dn, b, t0, rows, d, 1), ys, m2, EVEN)
            else:
                if HAS_D:
                    ys += Dv[None, :] * u
                dz = dy * ys * sz * (1.0 + z * (1.0 - sz))
                _st(_tile_ptrs(dz_ptr + out_base, 0, Dn, b, t0, rows, d, 1), dz, m2, EVEN)
        xhb = x * (hs - bx)  # g_t a_t h_{t-1}
        xB = tl.sum(x * Bt[:, :, None], axis=1)
        ddt = u * xB + tl.sum(xhb * A[None, :, :], axis=1)
        du = dt * xB
        if HAS_D:
            du += Dv[None, :] * gy  # Dv is 0 outside the first state block
            dD_acc += tl.sum(gy * u, axis=0)
        if SOFTPLUS:
            ddt = ddt * tl.sigmoid(raw)
        if EVEN:
            db_acc += tl.sum(ddt, axis=0)
        else:
            db_acc += tl.sum(tl.where(m2, ddt, 0.0), axis=0)
        _st(_tile_ptrs(du_ptr + out_base, 0, Dn, b, t0, rows, d, 1), du, m2, EVEN)
        _st(_tile_ptrs(ddt_ptr + out_base, 0, Dn, b, t0, rows, d, 1), ddt, m2, EVEN)
        _store_channel_sum(dB_ptr + part_base, x * dtu[:, None, :], t0, rows, n, mtn, T, N,
                           pid_n, TC, BLOCK_N, BLOCK_D, RS, RS_ASM, EVEN)
        _store_channel_sum(dC_ptr + part_base, hs * gy[:, None, :], t0, rows, n, mtn, T, N,
                           pid_n, TC, BLOCK_N, BLOCK_D, RS, RS_ASM, EVEN)
        dA_acc += tl.sum(xhb * dt[:, None, :], axis=0)
    tl.store(dA_ptr + off_seg, dA_acc, mask=mdn)  # [B, nseg, D, N] partials
    off_part = (b * nseg + s) * Dn + d  # [B, nseg, D] partials
    tl.store(db_ptr + pid_n * Bsz * nseg * Dn + off_part, db_acc, mask=md)
    if HAS_D:
        tl.store(dD_ptr + off_part, dD_acc, mask=_in_range(md, pid_n, 1))
    if HAS_H0:  # after the first segment, G is dL/d initial_state
        off_0 = (b * Dn + d[None, :]) * N + n[:, None]
        tl.store(dh0_ptr + off_0, G, mask=_in_range(mdn, s, 1))


# fmt: on
# ----------------------------------------------------------------------------- launchers


def _new(shape, dtype, device) -> torch.Tensor:
    """Every buffer a kernel fills; tests swap it for a NaN-filled one."""
    return torch.empty(shape, dtype=dtype, device=device)


def config(N: int, Dn: int, interpret: bool, override: dict | None = None) -> dict:
    """Launch parameters (fixed, never autotuned, so reruns are bit-identical).

    FWD_TC / TC: the forward's / the backward's time tile; the forward saves the state every
    TC steps (4 D N / TC bytes per token). BLOCK_D / BWD_BLOCK_D: channels per program (along
    the lanes; the states of a channel stay in one thread, so sums over N need no shuffles).
    FWD_STAGES / STAGES: software-pipelining depth of the tile loops; fwd_maxnreg /
    bwd_maxnreg: a register cap (more programs per SM). BWD_PREFETCH: the backward loads a
    tile one iteration ahead. BWD_RS: the backward's sums over channels (dB, dC) by a warp
    reduce-scatter where the layout allows (`_reduce_scatter`). SEG_CHUNKS: tiles per segment (0: the
    whole sequence, cut only when rows x channel blocks give fewer than MIN_PROGRAMS programs,
    by default SEG_BELOW_PER_SM per SM, and then into enough segments for SEG_TARGET_PER_SM
    programs per SM)."""
    bn = min(triton.next_power_of_2(N), MAX_BLOCK_N)
    p2 = triton.next_power_of_2(Dn)
    if interpret:  # small tiles, and segments of two tiles so the carries run in every test
        cfg = dict(FWD_TC=4, TC=8, BLOCK_D=min(8, p2), BWD_BLOCK_D=min(8, p2), BLOCK_N=bn,
                   num_warps=1, bwd_warps=1, FWD_STAGES=1, STAGES=1, BWD_PREFETCH=1, BWD_RS=1,
                   BLOCK_E=64, CB=8, SEG_CHUNKS=2, MIN_PROGRAMS=0,
                   SEG_TARGET_PER_SM=0)  # fmt: skip
    else:
        # measured on the H200 at 8x2048x1536x16 bf16 (scripts/scan_sweep.py): forward tile 8 x
        # 32 channels, 1 warp, 3 stages 0.363 ms (tile 2: 1.41; tile 16 / 4 warps: 1.52);
        # backward tile 4 x 16 channels, 1 warp, prefetch, reduce-scatter 1.49 ms (8 channels
        # 1.54; without the reduce-scatter 1.92; without prefetch 2.02; tile 2: 2.91).
        # Segments below 8 programs per SM: 1x65536 fwd+bwd 17.5 ms instead of 42.2 (2 per
        # SM), 8x2048 unchanged.
        cfg = dict(FWD_TC=8, TC=4, BLOCK_D=min(32, p2), BWD_BLOCK_D=min(16, p2), BLOCK_N=bn,
                   num_warps=1, bwd_warps=1, FWD_STAGES=3, STAGES=1, BWD_PREFETCH=1,
                   BWD_RS=1, BLOCK_E=256, CB=16,
                   SEG_CHUNKS=0, MIN_PROGRAMS=None, SEG_BELOW_PER_SM=2,
                   SEG_TARGET_PER_SM=8)  # fmt: skip
    env = os.environ.get("MAMBAKIT_SCAN_CONFIG")  # a tuning knob: JSON of the keys above
    if env:
        cfg.update(json.loads(env))
    cfg.update(override or {})
    return cfg


def state_chunk(is_cuda: bool) -> int:
    """Timesteps between the states the forward saves (the backward's time tile)."""
    return config(1, 1, not is_cuda)["TC"]


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _segments(nc: int, programs: int, cfg: dict, device: torch.device) -> tuple[int, int]:
    """(segments, tiles per segment) for nc tiles and `programs` programs per segment."""
    per = cfg.get("SEG_CHUNKS") or 0
    if per <= 0:
        sms = _sm_count(device.index or 0) if device.type == "cuda" else 0
        below = cfg.get("MIN_PROGRAMS")
        if below is None:
            below = cfg.get("SEG_BELOW_PER_SM", 2) * sms
        target = max(below, cfg.get("SEG_TARGET_PER_SM", 8) * sms)
        nseg = 1 if programs >= below else min(nc, triton.cdiv(target, programs))
        per = triton.cdiv(nc, nseg)
    per = max(1, min(per, nc))
    return triton.cdiv(nc, per), per


def _even(T, Dn, N, tc, bd, bn, whole_segments) -> bool:
    """Every tile of every program lies inside the tensors: the kernels drop their masks."""
    return T % tc == 0 and Dn % bd == 0 and N % bn == 0 and whole_segments


def _reduce_scatter(tc: int, bd: int, bn: int, warps: int) -> bool:
    """Whether the channel sums of the backward can use `_store_channel_sum`'s reduce-scatter:
    one warp whose [TC, BN, BD] tiles put the BD channels on the low lane bits and 32 / BD
    states on the others (Triton's default layout for these shapes), every lane busy."""
    if warps != 1 or bd < 2 or bd > 32 or 32 % bd:
        return False
    nl = 32 // bd
    return bn % nl == 0 and tc * (bn // nl) >= bd


def _maxnreg(n: int | None) -> dict:
    return {} if not n else {"maxnreg": int(n)}


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
    config_override: dict | None = None,
):
    """(y [B, T, D] in u.dtype, final state [B, D, N] f32, the states at every TC-th step
    [B, T/TC, D, N] or an empty tensor)."""
    Bsz, T, Dn = u.shape
    N = A.shape[1]
    dev = u.device
    f32 = torch.float32
    if T == 0 or Bsz == 0:  # nothing to scan: the state passes through
        hT = initial_state.float().clone() if initial_state is not None else None
        hT = hT if hT is not None else torch.zeros(Bsz, Dn, N, dtype=f32, device=dev)
        return u.new_empty(Bsz, T, Dn), hT, _new((Bsz, 0, Dn, N) if save_states else (0,), f32, dev)
    cfg = config(N, Dn, not u.is_cuda, config_override)
    tc, ts, bd, bn = cfg["FWD_TC"], cfg["TC"], cfg["BLOCK_D"], cfg["BLOCK_N"]
    nb, nc, ndb = triton.cdiv(N, bn), triton.cdiv(T, tc), triton.cdiv(Dn, bd)
    ns = triton.cdiv(T, ts)
    nseg, per = _segments(nc, Bsz * ndb * nb, cfg, dev)
    A = A.contiguous()
    h0 = initial_state.contiguous() if initial_state is not None else None
    flags = dict(
        HAS_D=D is not None,
        HAS_Z=z is not None,
        HAS_BIAS=delta_bias is not None,
        SOFTPLUS=bool(delta_softplus),
        HAS_SEQ=seq_idx is not None,
        SPLIT_N=nb > 1,
        TC=tc,
        TS=ts,
        BLOCK_D=bd,
        BLOCK_N=bn,
        STAGES=cfg["FWD_STAGES"],
        EVEN=_even(T, Dn, N, tc, bd, bn, nseg * per == nc),
        num_warps=cfg["num_warps"],
        **_maxnreg(cfg.get("fwd_maxnreg")),
    )
    grid = (ndb, nseg, Bsz * nb)
    ins = (u, delta, A, B, C, _opt(D, A), _opt(z, u), _opt(delta_bias, A), _opt(seq_idx, A))
    sizes = (T, Dn, N, Bsz, nc, ns, nseg, per, *_strides(u, delta, B, C, z, seq_idx))
    hT = _new((Bsz, Dn, N), f32, dev)
    start = h0
    if nseg > 1:  # each segment's summary, then the start state of every segment
        hloc = torch.empty(Bsz, nseg, Dn, N, dtype=f32, device=dev)
        P = torch.empty_like(hloc)
        _fwd_kernel[grid](
            *ins, A, A, A, hloc, P, A, *sizes, HAS_H0=False, LOCAL=True, SAVE=False, **flags
        )
        start = torch.empty_like(hloc)
        DN = Dn * N
        _carry_fwd_kernel[(triton.cdiv(DN, cfg["BLOCK_E"]), Bsz)](
            hloc,
            P,
            _opt(h0, A),
            start,
            hT,
            nseg,
            DN,
            HAS_H0=h0 is not None,
            BLOCK_E=cfg["BLOCK_E"],
            CB=cfg["CB"],
        )
        del hloc, P
    states = _new((Bsz, ns, Dn, N), f32, dev) if save_states else _new((0,), f32, dev)
    y = _new((Bsz, T, Dn), u.dtype, dev) if nb == 1 else _new((nb, Bsz, T, Dn), f32, dev)
    _fwd_kernel[grid](
        *ins, _opt(start, A), _opt(states, A), hT, A, A, y, *sizes,
        HAS_H0=start is not None, LOCAL=False, SAVE=save_states, **flags,
    )  # fmt: skip
    if nb > 1:  # the state blocks' partial sums, then D u and the gate
        y = y.sum(0)
        if D is not None:
            y = y + u.float() * D
        if z is not None:
            y = y * torch.nn.functional.silu(z.float())
        y = y.to(u.dtype)
    return y, hT, states


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
    config_override: dict | None = None,
):
    """(du, ddelta, dA, dB, dC, dD, dz, d delta_bias, d initial_state); absent ones None."""
    Bsz, T, Dn = u.shape
    N = A.shape[1]
    dev = u.device
    if T == 0 or Bsz == 0:  # the final state was the initial state: its gradient passes through
        z32 = torch.zeros(Dn, dtype=torch.float32, device=dev)
        dh0 = None
        if initial_state is not None:
            dh0 = (
                g_final.float().clone() if g_final is not None else torch.zeros_like(initial_state)
            )
        return (
            torch.empty_like(u), torch.empty_like(delta), torch.zeros_like(A, dtype=torch.float32),
            torch.empty_like(B), torch.empty_like(C), z32 if D is not None else None,
            torch.empty_like(z) if z is not None else None,
            z32.clone() if delta_bias is not None else None, dh0,
        )  # fmt: skip
    cfg = config(N, Dn, not u.is_cuda, config_override)
    tc, bd, bn = cfg["TC"], cfg["BWD_BLOCK_D"], cfg["BLOCK_N"]
    nb, nc, ndb = triton.cdiv(N, bn), triton.cdiv(T, tc), triton.cdiv(Dn, bd)
    if tuple(states.shape) != (Bsz, nc, Dn, N):
        raise ValueError(
            f"states: expected the forward's tile-start states of shape {(Bsz, nc, Dn, N)} "
            f"(time tile {tc}), got {tuple(states.shape)}"
        )
    nseg, per = _segments(nc, Bsz * ndb * nb, cfg, dev)
    f32 = torch.float32
    A = A.contiguous()
    DN = Dn * N
    common = dict(
        HAS_Z=z is not None,
        HAS_BIAS=delta_bias is not None,
        SOFTPLUS=bool(delta_softplus),
        HAS_SEQ=seq_idx is not None,
        TC=tc,
        BLOCK_D=bd,
        BLOCK_N=bn,
        STAGES=cfg["STAGES"],
        EVEN=_even(T, Dn, N, tc, bd, bn, nseg * per == nc),
        num_warps=cfg["bwd_warps"],
        **_maxnreg(cfg.get("bwd_maxnreg")),
    )
    grid = (ndb, nseg, Bsz * nb)
    strides = _strides(u, delta, B, C, z, seq_idx)
    s_dy = gy.stride()
    gin = g_final.contiguous() if g_final is not None else None
    if nseg > 1:  # each segment's summary, then the carry into every segment's end
        W = torch.empty(Bsz, nseg, Dn, N, dtype=f32, device=dev)
        P = torch.empty_like(W)
        _bwd_local_kernel[grid](
            delta, A, C, _opt(z, u), _opt(delta_bias, A), _opt(seq_idx, A), gy, W, P,
            T, Dn, N, Bsz, nseg, per, *strides[2:4], *strides[6:], *s_dy, **common,
        )  # fmt: skip
        G = torch.empty_like(W)
        _carry_bwd_kernel[(triton.cdiv(DN, cfg["BLOCK_E"]), Bsz)](
            W,
            P,
            _opt(gin, A),
            G,
            A,
            nseg,
            DN,
            HAS_GT=gin is not None,
            HAS_H0=False,
            BLOCK_E=cfg["BLOCK_E"],
            CB=cfg["CB"],
        )
        gin = G
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
    dAp = _new((Bsz, nseg, Dn, N), f32, dev)
    dDp = _new((Bsz, nseg, Dn), f32, dev) if D is not None else None
    dbp = _new((nb, Bsz, nseg, Dn), f32, dev)
    dh0 = _new((Bsz, Dn, N), f32, dev) if initial_state is not None else None
    _bwd_kernel[grid](
        u, delta, A, B, C, _opt(D, A), _opt(z, u), _opt(delta_bias, A), _opt(seq_idx, A), gy,
        states, _opt(gin, A), du, ddt, _opt(dz, du), _opt(ys, du), dBp, dCp, dAp,
        _opt(dDp, A), dbp, _opt(dh0, A),
        T, Dn, N, Bsz, nc, nseg, per, *strides, *s_dy,
        HAS_D=D is not None, HAS_G=gin is not None, HAS_H0=dh0 is not None, SPLIT_N=nb > 1,
        PREFETCH=bool(cfg.get("BWD_PREFETCH", 1)),
        RS=bool(cfg.get("BWD_RS", 1)) and _reduce_scatter(tc, bd, bn, cfg["bwd_warps"]),
        RS_ASM=u.is_cuda, **common,
    )  # fmt: skip
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
