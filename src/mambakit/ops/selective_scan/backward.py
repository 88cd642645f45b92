"""The scan's backward kernels: every gradient, tile by tile from the last.

B batch, T time, D = d_inner, N = d_state, TC the time tile; the state at every tile's
start is the forward's (KS = 1) or replayed from its sparser ones (`replay.py`).
g_t = dL/dh_t satisfies g_t = C_t gy_t + a_{t+1} g_{t+1}; inside a tile it is a loop over
the tile's rows from the last (`_reverse_scan`: the rows lie within a thread, so no shuffles;
`tl.associative_scan(reverse=True)` also reverses the lanes).
`_bwd_kernel` recomputes each tile's states from its start state and writes du,
d delta, dz and the per-program partials of dB, dC, dA, dD and d delta_bias;
`_bwd_local_kernel` is the first pass over segments (each segment's reverse recurrence from
a zero carry) when time is cut into segments.
"""

import triton
import triton.language as tl

from .._triton import fast_sigmoid
from .channel_sum import _store_channel_sum
from .tiles import (
    LOG2E,
    _combine,
    _delta_of,
    _doc_starts,
    _in_range,
    _ld,
    _mul,
    _program_block,
    _reverse_scan,
    _row_ptrs,
    _second,
    _st,
)

# fmt: off


@triton.jit
def _bwd_local_kernel(
    p_dt, p_A, p_C, p_z, p_bias, p_seq, p_dy, p_W, p_P,
    T, Dn, N, Bsz, nseg, seg_chunks,
    s_dt_b, s_dt_t, s_C_b, s_C_t, s_z_b, s_z_t, s_seq_b, s_seq_t, s_dy_b, s_dy_t, s_dy_d,
    HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr, HAS_SEQ: tl.constexpr,
    TC: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, EVEN: tl.constexpr,
    OFF64: tl.constexpr,
):
    """A segment's reverse recurrence from a zero carry: W = a_first g_first, and the segment's
    decay product P (the carry into its end reaches its start times P). Pointers as in
    `_bwd_kernel`: each tensor's at step 0 of the row once, a tile adds its steps' offset."""
    pid_d, s, b, pid_n, d, n, md, mn, mdn, A, bias = _program_block(
        p_A, p_bias, Dn, N, Bsz, HAS_BIAS, BLOCK_D, BLOCK_N
    )
    s += 1  # segments 1.. (the first one's summary is never used)
    A2 = A * LOG2E
    rows = tl.arange(0, TC)
    q_dt = _row_ptrs(p_dt, s_dt_b, s_dt_t, b, rows, d, 1)
    q_C = _row_ptrs(p_C, s_C_b, s_C_t, b, rows, n, 1)
    q_dy = _row_ptrs(p_dy, s_dy_b, s_dy_t, b, rows, d, s_dy_d)
    q_z = _row_ptrs(p_z, s_z_b, s_z_t, b, rows, d, 1)
    G = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    p = tl.full([BLOCK_N, BLOCK_D], 1.0, tl.float32)
    c0 = s * seg_chunks
    n_here = tl.minimum(seg_chunks, tl.cdiv(T, TC) - c0)  # the last segment may be short
    for i in tl.range(n_here, num_stages=1):
        c = c0 + n_here - 1 - i
        t0 = c * TC
        t = t0 + rows
        mt = t < T
        m2 = mt[:, None] & md[None, :]
        t0o = t0.to(tl.int64) if OFF64 else t0
        raw, dt = _delta_of(_ld(q_dt + t0o * s_dt_t, m2, EVEN), m2, bias, HAS_BIAS, SOFTPLUS,
                            EVEN)  # fmt: skip
        a = tl.exp2(dt[:, None, :] * A2[None, :, :])
        if HAS_SEQ:
            starts = _doc_starts(t, mt, b, p_seq, s_seq_b, s_seq_t)
            a = tl.where(starts[:, None, None], 0.0, a)
        gy = _ld(q_dy + t0o * s_dy_t, m2, EVEN)
        if HAS_Z:
            z = _ld(q_z + t0o * s_z_t, m2, EVEN)
            gy = gy * z * fast_sigmoid(z)
        Ct = _ld(q_C + t0o * s_C_t, mt[:, None] & mn[None, :], EVEN)
        _g, G = _reverse_scan(Ct[:, :, None] * gy[:, None, :], a, G, rows, TC)
        p = p * tl.reduce(a, 0, _mul)
    off_seg = ((b * nseg + s) * Dn + d[None, :]) * N + n[:, None]
    tl.store(p_W + off_seg, G, mask=mdn)
    tl.store(p_P + off_seg, p, mask=mdn)


@triton.jit
def _bwd_loads(
    q_dt, q_u, q_B, q_C, q_dy, q_z, q_h, t0, c, rows, md, mn, mdn, T,
    s_dt_t, s_u_t, s_B_t, s_C_t, s_dy_t, s_z_t, s_h, HAS_Z: tl.constexpr, EVEN: tl.constexpr,
    OFF64: tl.constexpr,
):
    """The inputs of backward tile c (steps t0..), as f32: raw delta, u, B, C, dy, z (dy
    without z) and the state at its start. q_*: each tensor's pointers at step 0 of the row
    (computed once), s_*: its step strides (the states': a tile's); OFF64: the offsets
    t0 s_* need int64."""
    mt = (t0 + rows) < T
    if OFF64:
        c = c.to(tl.int64)
        t0 = t0.to(tl.int64)
    m2 = mt[:, None] & md[None, :]
    mtn = mt[:, None] & mn[None, :]
    raw = _ld(q_dt + t0 * s_dt_t, m2, EVEN)
    u = _ld(q_u + t0 * s_u_t, m2, EVEN)
    Bt = _ld(q_B + t0 * s_B_t, mtn, EVEN)
    Ct = _ld(q_C + t0 * s_C_t, mtn, EVEN)
    dy = _ld(q_dy + t0 * s_dy_t, m2, EVEN)
    if HAS_Z:
        z = _ld(q_z + t0 * s_z_t, m2, EVEN)
    else:
        z = dy
    if EVEN:
        h0 = tl.load(q_h + c * s_h)
    else:
        h0 = tl.load(q_h + c * s_h, mask=mdn, other=0.0)
    return raw, u, Bt, Ct, dy, z, h0


@triton.jit
def _bwd_kernel(
    p_u, p_dt, p_A, p_B, p_C, p_D, p_z, p_bias, p_seq, p_dy, p_states,
    p_gin, p_du, p_ddt, p_dz, p_ys, p_dB, p_dC, p_dA, p_dD, p_db, p_dh0,
    T, Dn, N, Bsz, ns, nseg, seg_chunks,
    s_u_b, s_u_t, s_dt_b, s_dt_t, s_B_b, s_B_t, s_C_b, s_C_t, s_z_b, s_z_t, s_seq_b, s_seq_t,
    s_dy_b, s_dy_t, s_dy_d, s_dz_b, s_dz_t,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
    HAS_SEQ: tl.constexpr, HAS_G: tl.constexpr, HAS_H0: tl.constexpr, SPLIT_N: tl.constexpr,
    TC: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    EVEN: tl.constexpr, RS: tl.constexpr, RS_ASM: tl.constexpr, OFF64: tl.constexpr,
):
    """Every gradient of one segment, tiles last to first: states by a forward scan from the
    tile's start state (p_states: [B, ns, D, N], one per tile), adjoints by a reverse scan
    from the carry G."""
    pid_d, s, b, pid_n, d, n, md, mn, mdn, A, bias = _program_block(
        p_A, p_bias, Dn, N, Bsz, HAS_BIAS, BLOCK_D, BLOCK_N
    )
    A2 = A * LOG2E
    rows = tl.arange(0, TC)
    off_seg = ((b * nseg + s) * Dn + d[None, :]) * N + n[:, None]  # [B, nseg, D, N]
    if HAS_G:
        G = tl.load(p_gin + off_seg, mask=mdn, other=0.0)
    else:
        G = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    Dv = tl.zeros([BLOCK_D], tl.float32)
    if HAS_D:
        Dv = tl.load(p_D + d, mask=_in_range(md, pid_n, 1), other=0.0)
    dA_acc = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dD_acc = tl.zeros([BLOCK_D], tl.float32)
    db_acc = tl.zeros([BLOCK_D], tl.float32)
    out_base = (pid_n * Bsz + b) * T * Dn  # [nb, B, T, D] (nb = 1: [B, T, D])
    part_base = (pid_d * Bsz + b) * T * N  # [n_dblocks, B, T, N]
    c0 = s * seg_chunks
    n_here = tl.minimum(seg_chunks, ns - c0)  # the tiles of this segment (the last may be short)
    c_last = c0 + n_here - 1
    # each tensor's pointers at step 0 of this row, computed once; a tile adds its steps'
    # offset (int32 unless OFF64: the launcher checks whether each tensor's row fits). A
    # tile's loads are issued one iteration ahead, behind the previous tile's arithmetic: few
    # warps per SM are resident at this register count to hide them
    q_dt = _row_ptrs(p_dt, s_dt_b, s_dt_t, b, rows, d, 1)
    q_u = _row_ptrs(p_u, s_u_b, s_u_t, b, rows, d, 1)
    q_B = _row_ptrs(p_B, s_B_b, s_B_t, b, rows, n, 1)
    q_C = _row_ptrs(p_C, s_C_b, s_C_t, b, rows, n, 1)
    q_dy = _row_ptrs(p_dy, s_dy_b, s_dy_t, b, rows, d, s_dy_d)
    q_z = _row_ptrs(p_z, s_z_b, s_z_t, b, rows, d, 1)
    q_h = p_states + b * ns * Dn * N + (d[None, :] * N + n[:, None])
    w_du = _row_ptrs(p_du + out_base, 0, Dn, b, rows, d, 1)
    w_ddt = _row_ptrs(p_ddt + out_base, 0, Dn, b, rows, d, 1)
    w_ys = _row_ptrs(p_ys + out_base, 0, Dn, b, rows, d, 1)
    w_dz = _row_ptrs(p_dz, s_dz_b, s_dz_t, b, rows, d, 1)
    nx_raw, nx_u, nx_B, nx_C, nx_dy, nx_z, nx_h0 = _bwd_loads(
        q_dt, q_u, q_B, q_C, q_dy, q_z, q_h, c_last * TC, c_last, rows, md, mn, mdn, T,
        s_dt_t, s_u_t, s_B_t, s_C_t, s_dy_t, s_z_t, Dn * N, HAS_Z, EVEN, OFF64,
    )
    for i in tl.range(n_here, num_stages=1):  # loads run one tile ahead by hand (above)
        c = c_last - i
        raw, u, Bt, Ct, dy, z, h0 = nx_raw, nx_u, nx_B, nx_C, nx_dy, nx_z, nx_h0
        c_nx = tl.maximum(c - 1, c0)  # the next tile (the first again on the last iteration)
        nx_raw, nx_u, nx_B, nx_C, nx_dy, nx_z, nx_h0 = _bwd_loads(
            q_dt, q_u, q_B, q_C, q_dy, q_z, q_h, c_nx * TC, c_nx, rows, md, mn, mdn, T,
            s_dt_t, s_u_t, s_B_t, s_C_t, s_dy_t, s_z_t, Dn * N, HAS_Z, EVEN, OFF64,
        )
        t0 = c * TC
        t = t0 + rows
        mt = t < T
        mtn = mt[:, None] & mn[None, :]
        m2 = mt[:, None] & md[None, :]
        t0w = t0.to(tl.int64) if OFF64 else t0  # the stores' offsets (dB, dC partials too)
        raw, dt = _delta_of(raw, m2, bias, HAS_BIAS, SOFTPLUS, EVEN)
        a = tl.exp2(dt[:, None, :] * A2[None, :, :])
        if HAS_SEQ:
            starts = _doc_starts(t, mt, b, p_seq, s_seq_b, s_seq_t)
            a = tl.where(starts[:, None, None], 0.0, a)
        if HAS_Z:
            sz = fast_sigmoid(z)
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
        # dL/dh_t, and the carry into the previous tile; the identity scan pins x to the tile's
        # default layout, which the channel sums of dB (inline-asm shuffles) assume: without
        # it Triton 3.6 lays x out with states on the low lanes on masked tiles
        x, G = _reverse_scan(Ct[:, :, None] * gy[:, None, :], a, G, rows, TC)
        x = tl.associative_scan(x, 0, _second)
        if HAS_Z:
            ys = tl.sum(hs * Ct[:, :, None], axis=1)
            if SPLIT_N:  # y needs every state block: dz is finished outside
                _st(w_ys + t0w * Dn, ys, m2, EVEN)
            else:
                if HAS_D:
                    ys += Dv[None, :] * u
                dz = dy * ys * sz * (1.0 + z * (1.0 - sz))
                _st(w_dz + t0w * s_dz_t, dz, m2, EVEN)
        xhb = x * (hs - bx)  # g_t a_t h_{t-1}
        xB = tl.sum(x * Bt[:, :, None], axis=1)
        ddt = u * xB + tl.sum(xhb * A[None, :, :], axis=1)
        du = dt * xB
        if HAS_D:
            du += Dv[None, :] * gy  # Dv is 0 outside the first state block
            dD_acc += tl.sum(gy * u, axis=0)
        if SOFTPLUS:
            ddt = ddt * fast_sigmoid(raw)
        if EVEN:
            db_acc += tl.sum(ddt, axis=0)
        else:
            db_acc += tl.sum(tl.where(m2, ddt, 0.0), axis=0)
        _st(w_du + t0w * Dn, du, m2, EVEN)
        _st(w_ddt + t0w * Dn, ddt, m2, EVEN)
        _store_channel_sum(p_dB + part_base, x * dtu[:, None, :], t0w, rows, n, mtn, T, N,
                           pid_n, TC, BLOCK_N, BLOCK_D, RS, RS_ASM, EVEN)
        _store_channel_sum(p_dC + part_base, hs * gy[:, None, :], t0w, rows, n, mtn, T, N,
                           pid_n, TC, BLOCK_N, BLOCK_D, RS, RS_ASM, EVEN)
        dA_acc += tl.sum(xhb * dt[:, None, :], axis=0)
    tl.store(p_dA + off_seg, dA_acc, mask=mdn)  # [B, nseg, D, N] partials
    off_part = (b * nseg + s) * Dn + d  # [B, nseg, D] partials
    tl.store(p_db + pid_n * Bsz * nseg * Dn + off_part, db_acc, mask=md)
    if HAS_D:
        tl.store(p_dD + off_part, dD_acc, mask=_in_range(md, pid_n, 1))
    if HAS_H0:  # after the first segment, G is dL/d initial_state
        off_0 = (b * Dn + d[None, :]) * N + n[:, None]
        tl.store(p_dh0 + off_0, G, mask=_in_range(mdn, s, 1))
