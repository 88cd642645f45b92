"""The scan's forward kernel: y, the final state, and the states the backward restarts from.

B batch, T time, D = d_inner, N = d_state. A program owns (row, BLOCK_D channels, BLOCK_N
states, one segment of time) and walks its segment TC steps at a time, carrying only the
state between tiles; inside a tile the recurrence h_t = a_t h_{t-1} + b_t is one
`tl.associative_scan` over time. The same kernel, LOCAL, gives a segment's end state from a
zero start and its decay product (its summary: h -> P h + h_loc; P = exp2(A log2(e) sum(delta))
once per segment, or the product of the decays when a document may start inside it); an
output program starts its segment by composing the summaries of the segments before it (a
few [BLOCK_N, BLOCK_D] multiply-adds each, read from L2).
"""

import triton
import triton.language as tl

from .._triton import fast_sigmoid
from .tiles import (
    LOG2E,
    _combine,
    _in_range,
    _program_block,
    _row,
    _st,
    _tile_decay,
    _tile_ptrs,
    _tile_rows,
)

# fmt: off


@triton.jit
def _compose(h, p_P, p_hloc, b, nseg, count, Dn, N, off_dn, mdn):
    """h [BLOCK_N, BLOCK_D] carried through the summaries (h -> P h + hloc; [B, nseg, D, N])
    of segments 0 .. count - 1 of row b, in order (a few multiply-adds each, read from L2)."""
    for j in tl.range(count, num_stages=3):
        off_j = (b * nseg + j) * Dn * N + off_dn
        h = tl.load(p_P + off_j, mask=mdn, other=0.0) * h + tl.load(
            p_hloc + off_j, mask=mdn, other=0.0
        )
    return h


@triton.jit
def _fwd_kernel(
    p_u, p_dt, p_A, p_B, p_C, p_D, p_z, p_bias, p_seq,
    p_h0, p_states, p_hT, p_hloc, p_P, p_y, p_slot, p_tiles, p_at,
    T, Dn, N, Bsz, nc, ns, nseg, seg_chunks, n_at,
    s_u_b, s_u_t, s_dt_b, s_dt_t, s_B_b, s_B_t, s_C_b, s_C_t, s_z_b, s_z_t, s_seq_b, s_seq_t,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
    HAS_SEQ: tl.constexpr, HAS_H0: tl.constexpr, LOCAL: tl.constexpr, SAVE: tl.constexpr,
    HAS_AT: tl.constexpr, SPLIT_N: tl.constexpr, TC: tl.constexpr, TS: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, EVEN: tl.constexpr,
):
    """One segment of one row, tile by tile. LOCAL: from a zero state, only the segment's end
    state and decay product; else, from h0 (HAS_H0) and the summaries of the earlier segments
    (hloc, P: [B, nseg, D, N]), y, the state every TS steps (SAVE), h_T (last segment) and
    (HAS_AT) the state after every step t whose slot[b, t] (int32 [B, T]) is not negative, into
    row slot[b, t] of b's n_at states ([B, n_at, D, N]): a tile with one (tiles[b, c] >= 0,
    [B, nc]) stores it row by row in a branch (a whole-tile masked store keeps [TC, BLOCK_N,
    BLOCK_D] addresses live in registers on every tile and spills)."""
    pid_d, s, b, pid_n, d, n, md, mn, mdn, A, bias = _program_block(
        p_A, p_bias, Dn, N, Bsz, HAS_BIAS, BLOCK_D, BLOCK_N
    )
    A2 = A * LOG2E
    rows = tl.arange(0, TC)
    off_dn = d[None, :] * N + n[:, None]  # [BLOCK_N, BLOCK_D] in a [D, N] state
    off_seg = (b * nseg + s) * Dn * N + off_dn  # [B, nseg, D, N]
    if HAS_H0:
        h = tl.load(p_h0 + b * Dn * N + off_dn, mask=mdn, other=0.0)
    else:
        h = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    if not LOCAL:  # the segment's start: the summaries of the segments before it, in order
        h = _compose(h, p_P, p_hloc, b, nseg, s, Dn, N, off_dn, mdn)
    p = tl.full([BLOCK_N, BLOCK_D], 1.0, tl.float32)
    dsum = tl.zeros([BLOCK_D], tl.float32)  # LOCAL without documents: the segment's sum of delta
    Dv = tl.zeros([BLOCK_D], tl.float32)
    if HAS_D:
        Dv = tl.load(p_D + d, mask=_in_range(md, pid_n, 1), other=0.0)
    y_base = p_y + (pid_n * Bsz + b) * T * Dn  # [nb, B, T, D] (nb = 1: [B, T, D])
    c0 = s * seg_chunks
    n_here = tl.minimum(seg_chunks, tl.cdiv(T, TC) - c0)  # the last segment may be short
    for i in tl.range(n_here, num_stages=3):  # pipelined: later tiles load during this one
        c = c0 + i
        t0 = c * TC
        t = t0 + rows
        mt = t < T
        m2, _raw, dt, a = _tile_decay(
            t0, rows, mt, b, d, md, p_dt, s_dt_b, s_dt_t, p_seq, s_seq_b, s_seq_t, A2, bias,
            HAS_BIAS, SOFTPLUS, HAS_SEQ, EVEN,
        )
        u = _tile_rows(p_u, s_u_b, s_u_t, b, t0, rows, d, m2, EVEN)
        Bt = _tile_rows(p_B, s_B_b, s_B_t, b, t0, rows, n, mt[:, None] & mn[None, :], EVEN)
        bx = (dt * u)[:, None, :] * Bt[:, :, None]
        # the carried state enters through the first row; the scan's decay products are then
        # only needed for a LOCAL pass (unused, they compile away)
        bx = tl.where((rows == 0)[:, None, None], bx + a * h[None, :, :], bx)
        pa, hs = tl.associative_scan((a, bx), 0, _combine)
        if HAS_AT:  # the states asked for inside this tile (rare: a branch, off the hot path,
            # on one number a tile: its largest slot)
            if tl.load(p_tiles + b * nc + c, mask=c < nc, other=-1) >= 0:
                sl = tl.load(p_slot + b * T + t, mask=mt, other=-1)
                for r in tl.static_range(TC):
                    s_r = tl.max(tl.where(rows == r, sl, -1), axis=0)
                    if s_r >= 0:
                        off_r = (b * n_at + s_r).to(tl.int64) * Dn * N
                        tl.store(p_at + off_r + off_dn, _row(hs, rows, r), mask=mdn)
        if SAVE:  # the state every TS steps (KS backward tiles), [B, ns, D, N]
            if TC <= TS:
                c_s = (c * TC) // TS
                off_c = (b * ns + c_s) * Dn * N + off_dn
                m_s = _in_range(_in_range(mdn, c_s, ns), (c * TC) % TS, 1)
                tl.store(p_states + off_c, h, mask=m_s)
            else:
                for k in tl.static_range(TC // TS):
                    c_s = c * (TC // TS) + k
                    off_c = (b * ns + c_s) * Dn * N + off_dn
                    if k == 0:
                        hk = h
                    else:
                        hk = _row(hs, rows, k * TS - 1)
                    tl.store(p_states + off_c, hk, mask=_in_range(mdn, c_s, ns))
        if LOCAL:
            if HAS_SEQ:  # a document start zeroes the product: multiply the decays out
                p = p * _row(pa, rows, TC - 1)
            else:  # exp2(A sum(delta)) once at the end; pa is unused and compiles away
                dsum += tl.sum(dt, axis=0)
        else:
            Ct = _tile_rows(p_C, s_C_b, s_C_t, b, t0, rows, n, mt[:, None] & mn[None, :], EVEN)
            y = tl.sum(hs * Ct[:, :, None], axis=1)
            if not SPLIT_N:  # the whole of y is here: finish it
                if HAS_D:
                    y += Dv[None, :] * u
                if HAS_Z:
                    zt = _tile_rows(p_z, s_z_b, s_z_t, b, t0, rows, d, m2, EVEN)
                    y = y * zt * fast_sigmoid(zt)
            _st(_tile_ptrs(y_base, 0, Dn, b, t0, rows, d, 1), y, m2, EVEN)
        h = _row(hs, rows, TC - 1)
    if LOCAL:
        if not HAS_SEQ:
            p = tl.exp2(A2 * dsum[None, :])
        tl.store(p_hloc + off_seg, h, mask=mdn)
        tl.store(p_P + off_seg, p, mask=mdn)
    else:
        tl.store(p_hT + b * Dn * N + off_dn, h, mask=_in_range(mdn, nseg - 1 - s, 1))  # last


@triton.jit
def _fwd_last_kernel(
    p_u, p_C, p_D, p_z, p_h0, p_hloc, p_P, p_hT, p_y,
    T, Dn, N, nseg, s_u_b, s_u_t, s_C_b, s_C_t, s_z_b,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_H0: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """h_T and y at the last step only, for (row, BLOCK_D channels), from every segment's
    summary (hloc, P: [B, nseg, D, N], the LOCAL pass over the whole row): h_T is h0 (or 0)
    through the summaries in order, y_T = (sum_n h_T C_T + D u_T) silu(z_T). z_T, y: [B, D]."""
    pid_d = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    n = tl.arange(0, BLOCK_N)
    md = d < Dn
    mn = n < N
    mdn = mn[:, None] & md[None, :]
    off_dn = d[None, :] * N + n[:, None]  # [BLOCK_N, BLOCK_D] in a [D, N] state
    if HAS_H0:
        h = tl.load(p_h0 + b * Dn * N + off_dn, mask=mdn, other=0.0)
    else:
        h = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    h = _compose(h, p_P, p_hloc, b, nseg, nseg, Dn, N, off_dn, mdn)
    tl.store(p_hT + b * Dn * N + off_dn, h, mask=mdn)
    t = T - 1
    Ct = tl.load(p_C + b * s_C_b + t * s_C_t + n, mask=mn, other=0.0).to(tl.float32)
    y = tl.sum(h * Ct[:, None], axis=0)
    u = tl.load(p_u + b * s_u_b + t * s_u_t + d, mask=md, other=0.0).to(tl.float32)
    if HAS_D:
        y += tl.load(p_D + d, mask=md, other=0.0) * u
    if HAS_Z:
        zt = tl.load(p_z + b * s_z_b + d, mask=md, other=0.0).to(tl.float32)
        y = y * zt * fast_sigmoid(zt)
    tl.store(p_y + b * Dn + d, y, mask=md)
