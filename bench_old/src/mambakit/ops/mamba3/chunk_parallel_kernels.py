"""The forward's chunks in parallel (chunk.py's `_launch_fwd_chunks`, without autograd at
few (row, head) pairs): each chunk's own part of the next chunk's start state, the start
states in order, then y from them. The helpers they share with the walking forward and
the backward are chunk_kernels.py's.
"""

import triton
import triton.language as tl

from .chunk_kernels import _chunk_ctx, _chunk_inputs, _chunk_y, _last_row, _mm, _walk_chunks

# fmt: off


@triton.jit
def _program(T, H, P, L: tl.constexpr, BLOCK_P: tl.constexpr):
    """Where a program of the grid (row, head, chunk x blocks of P) stands: (b, h, the chunk
    c, its block of P p and mask, c0, rows, t, mask of t, the last row, b H + h, chunks).
    c is int64: t * strides pass 2^31 on long rows."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    blocks = tl.cdiv(P, BLOCK_P)
    c = (tl.program_id(2) // blocks).to(tl.int64)
    p = (tl.program_id(2) % blocks) * BLOCK_P + tl.arange(0, BLOCK_P)
    c0 = c * L
    rows = tl.arange(0, L)
    t = c0 + rows
    return (b, h, c, p, p < P, c0, rows, t, t < T, tl.minimum(L, T - c0) - 1, b * H + h,
            tl.cdiv(T, L))


@triton.jit
def _chunk_end_kernel(
    p_x, p_k, p_adt, p_gam, p_late, p_seq, p_u, p_keep,
    T, H, P, N,
    s_x_b, s_x_t, s_x_h, s_q_b, s_q_t, s_q_h, s_w_b, s_w_t, s_seq_b,
    HAS_SEQ: tl.constexpr, L: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
    PREC: tl.constexpr,
):
    """The forward's chunks in parallel, first pass: what chunk c adds to the next chunk's
    start state from its own tokens, u_c [P, N] = (x tail)^T k~ with tail_s = e^(cs_last -
    cs_s) (gamma_s + late_{s+1}) over the rows of the chunk's last document (the next
    chunk's first late term is its last row's; none past T), to u [B, H, chunks, P, N] f32,
    and the factor keep of the start state (keep [B, H, chunks]):
    S'_start(c + 1) = keep_c S'_start(c) + u_c. A program per (row, head, chunk, block of P)."""
    b, h, c, p, mp, c0, rows, t, mt, last, bh, nc = _program(T, H, P, L, BLOCK_P)
    cs, cs_last, _, keep_doc, _, keep = _chunk_ctx(p_seq, p_adt, b, h, c0, t, mt, rows, last,
                                                   s_w_b, s_w_t, s_seq_b, HAS_SEQ)
    wo = b * s_w_b + t * s_w_t + h
    gam = tl.load(p_gam + wo, mask=mt, other=0.0)
    nxt = tl.load(p_late + wo + s_w_t, mask=t + 1 < T, other=0.0)
    tail = tl.where(keep_doc, tl.exp(cs_last - cs) * (gam + nxt), 0.0)
    xc = tl.load(p_x + b * s_x_b + t[:, None] * s_x_t + h * s_x_h + p[None, :],
                 mask=mt[:, None] & mp[None, :], other=0.0).to(tl.float32)
    xt = tl.trans(xc * tail[:, None])  # [P, L]
    for n0 in range(0, N, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        mn = n < N
        kc = tl.load(p_k + b * s_q_b + t[:, None] * s_q_t + h * s_q_h + n[None, :],
                     mask=mt[:, None] & mn[None, :], other=0.0).to(tl.float32)
        tl.store(p_u + ((bh * nc + c) * P + p[:, None]) * N + n[None, :], _mm(xt, kc, PREC),
                 mask=mp[:, None] & mn[None, :])
    if tl.program_id(2) % tl.cdiv(P, BLOCK_P) == 0:
        tl.store(p_keep + bh * nc + c, keep)


@triton.jit
def _state_scan_kernel(
    p_keep, p_s0, p_k0, p_x0, p_late, p_u, p_st, p_sT, T, H, PN, N, L, s_w_b,
    BLOCK: tl.constexpr, CHUNKS: tl.constexpr, LATE0: tl.constexpr,
):
    """The forward's chunks in parallel, second pass: each chunk's start state for one
    (row, head) and BLOCK of its P N values, the chunks in order, from S'_start(0) = S0 +
    late_0 x0 k~0^T (the initial state with the first token's late term):
    S'_start(c + 1) = keep_c S'_start(c) + u_c. st (u [B, H, chunks, P, N], `_chunk_end_kernel`'s,
    or a buffer of its shape in another dtype) gets S'_start(c) in u_c's place; sT the final
    state (the last chunk's end, f32). Without
    LATE0 (Mamba-2's scan, ssd_kernels.py) S'_start(0) = S0, and k0, x0, late are not read."""
    bh = tl.program_id(0).to(tl.int64)
    e = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    me = e < PN
    S = tl.load(p_s0 + bh * PN + e, mask=me, other=0.0)
    if LATE0:
        late0 = tl.load(p_late + (bh // H) * s_w_b + bh % H)
        x0 = tl.load(p_x0 + bh * (PN // N) + e // N, mask=me, other=0.0)
        k0 = tl.load(p_k0 + bh * N + e % N, mask=me, other=0.0)
        S += late0 * x0 * k0
    n_chunks = tl.cdiv(T, L)
    for i in range(0, n_chunks, CHUNKS):
        S = _walk_chunks(p_u, p_st, p_keep, S, bh, e, me, PN, n_chunks, i, False, CHUNKS, BLOCK)
    tl.store(p_sT + bh * PN + e, S, mask=me)


@triton.jit
def _chunk_y_kernel(
    p_x, p_q, p_k, p_adt, p_gam, p_late, p_seq, p_z, p_D, p_st, p_y, p_kT, p_xT,
    T, H, P, N,
    s_x_b, s_x_t, s_x_h, s_q_b, s_q_t, s_q_h, s_w_b, s_w_t, s_seq_b, s_z_b, s_z_t, s_z_h,
    s_y_b, s_y_t, s_y_h,
    HAS_SEQ: tl.constexpr, HAS_Z: tl.constexpr, HAS_D: tl.constexpr,
    L: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr,
):
    """The forward's chunks in parallel, last pass: chunk c's y from its start state
    (st [B, H, chunks, P, N], `_state_scan_kernel`'s), as `_chunk_fwd_kernel` computes it;
    the last chunk's programs also store the last token's k~ (kT) and x (xT), f32. A program
    per (row, head, chunk, block of P)."""
    b, h, c, p, mp, c0, rows, t, mt, last, bh, nc = _program(T, H, P, L, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    mn = n < N
    start = tl.load(p_st + ((bh * nc + c) * P + p[:, None]) * N + n[None, :],
                    mask=mp[:, None] & mn[None, :], other=0.0)
    xc = tl.load(p_x + b * s_x_b + t[:, None] * s_x_t + h * s_x_h + p[None, :],
                 mask=mt[:, None] & mp[None, :], other=0.0).to(tl.float32)
    _, _, qc, kc, _, gam, w, cs, _, _ = _chunk_inputs(
        p_q, p_k, p_adt, p_gam, p_late, b, h, c0, t, n, mt, mn, rows, last, T,
        s_q_b, s_q_t, s_q_h, s_w_b, s_w_t)
    same = (rows[:, None] >= rows[None, :]) & mt[None, :]
    carry = mt.to(tl.float32)
    if HAS_SEQ:
        prev_doc = tl.load(p_seq + b * s_seq_b + tl.maximum(c0 - 1, 0))
        doc = tl.load(p_seq + b * s_seq_b + t, mask=mt, other=-1)
        same = same & (doc[:, None] == doc[None, :])
        carry = tl.where(doc == prev_doc, carry, 0.0)
    Dh = 0.0
    if HAS_D:
        Dh = tl.load(p_D + h)
    _chunk_y(qc, kc, xc, start, same, cs, gam, w, carry, Dh, rows, t, mt, p, mp, b, h,
             p_z, p_y, p_y, s_z_b, s_z_t, s_z_h, s_y_b, s_y_t, s_y_h,
             HAS_Z, HAS_D, False, PREC)
    if c == nc - 1:
        tl.store(p_xT + bh * P + p, _last_row(xc, rows, last), mask=mp)
        if tl.program_id(2) % tl.cdiv(P, BLOCK_P) == 0:
            tl.store(p_kT + bh * N + n, _last_row(kc, rows, last), mask=mn)


# fmt: on
