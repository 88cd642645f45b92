"""The Triton kernels of the Mamba-3 chunk scan's backward (chunk.py has the math, the
launchers and the autograd): what each chunk gets from dy alone (the gate's and D's
gradients, the chunk's part of its start state's gradient), the start states' gradients
summed over the chunks in reverse, then every other gradient, a program per chunk.
"""

import triton
import triton.language as tl

from .chunk_kernels import _chunk_ctx, _mm, _walk_chunks

# fmt: off


@triton.jit
def _dy_chunk_kernel(
    p_dy, p_z, p_pre, p_x, p_q, p_adt, p_seq, p_dyc, p_dz, p_dD, p_u, p_keep,
    T, H, P, N,
    s_z_b, s_z_t, s_z_h, s_x_b, s_x_t, s_x_h, s_q_b, s_q_t, s_q_h, s_w_b, s_w_t, s_seq_b,
    HAS_SEQ: tl.constexpr, HAS_Z: tl.constexpr, HAS_D: tl.constexpr,
    L: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr,
):
    """What the backward of one chunk of one (row, head) needs from dy alone, every chunk in
    parallel. y = pre silu(z), pre = core + D x (dy, pre, dyc, dz contiguous [B, T, H, P]):
    HAS_Z: dyc = dy silu(z) (the core's gradient, f32) and dz = dy pre silu'(z); HAS_D: the
    chunk's share of dD, sum dyc x (dD [B, chunks, H]; x's share, D dyc, is
    `_chunk_grad_kernel`'s). Then the chunk's own part of its start state's gradient,
    u [P, N] = (dyc e_cs)^T q~ (to u [B, H, chunks, P, N]), and the factor keep of the start
    state in the end state (keep [B, H, chunks]): `_dstate_scan_kernel` sums them over the
    chunks. A loop over blocks of P (dy's columns) and, inside it, of N (q~'s)."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    c = tl.program_id(2)
    c0 = c * L
    rows = tl.arange(0, L)
    t = c0 + rows
    mt = t < T
    last = tl.minimum(L, T - c0) - 1
    bh = b * H + h
    nc = tl.cdiv(T, L)
    _, _, _, _, e_cs, keep = _chunk_ctx(p_seq, p_adt, b, h, c0, t, mt, rows, last,
                                        s_w_b, s_w_t, s_seq_b, HAS_SEQ)
    tl.store(p_keep + bh * nc + c, keep)
    dD = tl.zeros([BLOCK_P], dtype=tl.float32)  # per column of the block, summed at the end
    for p0 in range(0, P, BLOCK_P):
        p = p0 + tl.arange(0, BLOCK_P)
        mp = p < P
        mtp = mt[:, None] & mp[None, :]
        off = ((b * T + t[:, None]) * H + h) * P + p[None, :]
        dy = tl.load(p_dy + off, mask=mtp, other=0.0).to(tl.float32)
        if HAS_Z:
            z = tl.load(p_z + b * s_z_b + t[:, None] * s_z_t + h * s_z_h + p[None, :], mask=mtp,
                        other=0.0).to(tl.float32)
            pre = tl.load(p_pre + off, mask=mtp, other=0.0).to(tl.float32)
            sz = tl.sigmoid(z)
            dz = dy * pre * sz * (1.0 + z * (1.0 - sz))
            dy = dy * z * sz
        if HAS_D:
            xc = tl.load(p_x + b * s_x_b + t[:, None] * s_x_t + h * s_x_h + p[None, :],
                         mask=mtp, other=0.0).to(tl.float32)
            dD += tl.sum(dy * xc, axis=0)
        dy_e = tl.trans(dy * e_cs[:, None])  # [P, L]
        for n0 in range(0, N, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            mn = n < N
            qc = tl.load(p_q + b * s_q_b + t[:, None] * s_q_t + h * s_q_h + n[None, :],
                         mask=mt[:, None] & mn[None, :], other=0.0).to(tl.float32)
            u = _mm(dy_e, qc, PREC)
            tl.store(p_u + ((bh * nc + c) * P + p[:, None]) * N + n[None, :],
                     u.to(p_u.dtype.element_ty), mask=mp[:, None] & mn[None, :])
        if HAS_Z:  # stored after the loads above (a store may alias a later load's address)
            tl.store(p_dz + off, dz.to(p_dz.dtype.element_ty), mask=mtp)
            tl.store(p_dyc + off, dy, mask=mtp)
    if HAS_D:
        tl.store(p_dD + (b * nc + c) * H + h, tl.sum(dD, axis=0))


@triton.jit
def _dstate_scan_kernel(
    p_keep, p_dsT, p_dst, p_ds0, T, PN, L,
    HAS_DST: tl.constexpr, BLOCK: tl.constexpr, CHUNKS: tl.constexpr,
):
    """The gradient of each chunk's start state S'_start, the chunks in reverse, for one
    (row, head) and BLOCK of its P N values: S'_start of chunk c enters y_t as
    e_cs_t q~_t S'^T and the next chunk's start as keep_c S', so

        dS'_c = keep_c dS'_{c+1} + u_c,    u_c = (dy_c e_cs_c)^T q~_c

    with dS'_{chunks} the final state's gradient. dst [B, H, chunks, P, N] holds u_c
    (`_dy_chunk_kernel`'s) and gets, at chunk c, dS'_{c+1} in its place (what
    `_chunk_grad_kernel` of chunk c reads); ds0 gets dS'_0 (f32). CHUNKS chunks at a time
    (`_walk_chunks`)."""
    bh = tl.program_id(0).to(tl.int64)
    e = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    me = e < PN
    if HAS_DST:
        dS = tl.load(p_dsT + bh * PN + e, mask=me, other=0.0)
    else:
        dS = tl.zeros([BLOCK], dtype=tl.float32)
    n_chunks = tl.cdiv(T, L)
    for i in range(0, n_chunks, CHUNKS):
        dS = _walk_chunks(p_dst, p_dst, p_keep, dS, bh, e, me, PN, n_chunks, i, True, CHUNKS, BLOCK)
    tl.store(p_ds0 + bh * PN + e, dS, mask=me)


@triton.jit
def _grad_terms(
    p_x, p_dy, p_adt, p_gam, p_late, p_seq, T, H, P, N,
    s_x_b, s_x_t, s_x_h, s_q_b, s_q_t, s_q_h, s_w_b, s_w_t, s_seq_b, s_dy_b, s_dy_t, s_dy_h,
    HAS_SEQ: tl.constexpr, L: tl.constexpr, BLOCK_P: tl.constexpr, h0=0,
):
    """What both gradient kernels of a chunk start from: the program's row b, head h, chunk c
    (first step c0; bh = b H + h), the chunk's rows and P values p (mask mp), the offsets of
    q~ and k~'s rows (q_row) and of S'_start's and dS's (st_at), its steps t (mask mt, last
    row, [L, P] mask mtp), x and dy in f32, the decays (e_cs, keep), the weights' offsets
    wo, the forward's [L, L] weight and its decay (on the mask `same`), tail and its decay.
    The grid's heads start at head h0 (a launch over a slice of the heads)."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) + h0
    c = tl.program_id(2)
    c0 = c * L
    rows = tl.arange(0, L)
    p = tl.arange(0, BLOCK_P)
    mp = p < P
    bh = b * H + h
    t = c0 + rows
    mt = t < T
    last = tl.minimum(L, T - c0) - 1
    q_row = b * s_q_b + t[:, None] * s_q_t + h * s_q_h  # [L, 1]: q~ and k~'s rows
    st_at = (bh * tl.cdiv(T, L) + c) * P * N + p[:, None] * N  # [P, 1]: S'_start's, dS's rows
    mtp = mt[:, None] & mp[None, :]
    xc = tl.load(p_x + b * s_x_b + t[:, None] * s_x_t + h * s_x_h + p[None, :],
                 mask=mtp, other=0.0).to(tl.float32)
    dy = tl.load(p_dy + b * s_dy_b + t[:, None] * s_dy_t + h * s_dy_h + p[None, :],
                 mask=mtp, other=0.0).to(tl.float32)
    cs, cs_last, carry, keep_doc, e_cs, keep = _chunk_ctx(
        p_seq, p_adt, b, h, c0, t, mt, rows, last, s_w_b, s_w_t, s_seq_b, HAS_SEQ)
    wo = b * s_w_b + t * s_w_t + h
    gam = tl.load(p_gam + wo, mask=mt, other=0.0)
    nxt = tl.load(p_late + wo + s_w_t, mask=(t + 1 < T) & (rows < last), other=0.0)
    w = gam + nxt  # the next token's late term, inside the chunk
    same = (rows[:, None] >= rows[None, :]) & mt[None, :]
    if HAS_SEQ:
        doc = tl.load(p_seq + b * s_seq_b + t, mask=mt, other=-1)
        same = same & (doc[:, None] == doc[None, :])
    decay = tl.exp(tl.where(same, cs[:, None] - cs[None, :], float("-inf")))
    weight = tl.where(rows[:, None] == rows[None, :], gam[None, :], decay * w[None, :])
    weight = tl.where(same, weight, 0.0)
    tail_decay = tl.where(keep_doc & (rows != last), tl.exp(cs_last - cs), 0.0)
    late_next = tl.load(p_late + b * s_w_b + (c0 + last + 1) * s_w_t + h,
                        mask=c0 + last + 1 < T, other=0.0)
    tail = tl.where(rows == last, gam + late_next, tail_decay * w)
    tail = tl.where(keep_doc, tail, 0.0)
    return (b, h, c, c0, rows, p, mp, bh, q_row, st_at, t, mt, last, mtp, xc, dy, e_cs, keep, wo,
            gam, same, decay, weight, tail_decay, tail)


@triton.jit
def _state_blocks(p_q, p_k, p_st, p_dst, q_row, st_at, j, mt, mp, N, BLOCK_N: tl.constexpr):
    """States j .. j + BLOCK_N of a chunk (n, mask mn; [L, BLOCK_N] mask mq): q~ and k~'s
    columns [L, BLOCK_N], S'_start's and dS's [P, BLOCK_N] in f32."""
    n = j + tl.arange(0, BLOCK_N)
    mn = n < N
    mq = mt[:, None] & mn[None, :]
    mpn = mp[:, None] & mn[None, :]
    qj = tl.load(p_q + q_row + n[None, :], mask=mq, other=0.0).to(tl.float32)
    kj = tl.load(p_k + q_row + n[None, :], mask=mq, other=0.0).to(tl.float32)
    stj = tl.load(p_st + st_at + n[None, :], mask=mpn, other=0.0).to(tl.float32)
    dsj = tl.load(p_dst + st_at + n[None, :], mask=mpn, other=0.0).to(tl.float32)
    return n, mn, mq, qj, kj, stj, dsj


# The gradients of one chunk of one (row, head), independent of the other chunks: the
# chunk's start state S'_start (st, the forward's) and the gradient dS of its end state
# (dst, `_dstate_scan_kernel`'s) bring in what the chunks
# around it see. With w_s = gamma_s plus the next token's late term and
# tail_s = exp(cs_last - cs_s) w_s,
#
#     y   = ((q~ k~^T) * weight) x + e_cs q~ S'^T        (weight: gamma on the diagonal,
#     end = keep S' + x^T diag(tail) k~                   exp(cs_t - cs_s) w_s below)
#
# where the last row's tail holds the next chunk's first late term: the next chunk's start
# S' + late x_last k~_last^T is folded into this chunk's end. That late term's own gradient,
# x_prev^T dS'_start k~_prev, is the next chunk's row 0 (its program computes it from its
# dS'_start = keep dS + (dy e_cs)^T q~, as sums of vectors). Two kernels, so neither holds
# the other's tiles (in one, 1.6 KB of spills a thread, sm_90 offline): `_chunk_grad_kernel`
# the gradients of x and the per-token weights, `_chunk_qk_grad_kernel` those of q~ and k~.
# dy is the core's gradient (`_dy_chunk_kernel`'s); the initial state's S gets dS'_0.


@triton.jit
def _chunk_grad_kernel(
    p_x, p_q, p_k, p_adt, p_gam, p_late, p_seq, p_st, p_dst, p_x0, p_k0, p_D,
    p_dy, p_dx, p_dadt, p_dgam, p_dlate, p_dx0,
    T, H, P, N,
    s_x_b, s_x_t, s_x_h, s_q_b, s_q_t, s_q_h, s_w_b, s_w_t, s_seq_b, s_dy_b, s_dy_t, s_dy_h,
    HAS_SEQ: tl.constexpr, HAS_D: tl.constexpr,
    L: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr,
):
    """A chunk's gradients of x (D dy added, in dy's layout and x's dtype), A delta, gamma and
    the late terms; chunk 0 also the initial x's. A pass over the N states in blocks of
    BLOCK_N sums what needs all of them: q~ k~^T, dS k~ (k_ds), q~ S'^T and the vectors."""
    (b, h, c, c0, rows, p, mp, bh, q_row, st_at, t, mt, last, mtp, xc, dy, e_cs, keep, wo, gam,
     same, decay, weight, tail_decay, tail) = _grad_terms(
        p_x, p_dy, p_adt, p_gam, p_late, p_seq, T, H, P, N,
        s_x_b, s_x_t, s_x_h, s_q_b, s_q_t, s_q_h, s_w_b, s_w_t, s_seq_b, s_dy_b, s_dy_t,
        s_dy_h, HAS_SEQ, L, BLOCK_P)
    # the token before the chunk: the previous chunk's last, or the initial state's
    inside_p = (p * 0 + c0) > 0
    x_prev = tl.load(p_x + b * s_x_b + (c0 - 1) * s_x_t + h * s_x_h + p,
                     mask=mp & inside_p, other=0.0).to(tl.float32)
    x_prev += tl.load(p_x0 + bh * P + p, mask=mp & ~inside_p, other=0.0)
    k_prev_at = b * s_q_b + (c0 - 1) * s_q_t + h * s_q_h
    qk = tl.zeros([L, L], dtype=tl.float32)  # q~ k~^T
    k_ds = tl.zeros([L, BLOCK_P], dtype=tl.float32)  # dS k~_s
    q_st = tl.zeros([L, BLOCK_P], dtype=tl.float32)  # q~_t S'^T
    q_k = tl.zeros([L], dtype=tl.float32)  # q~_t . k~_prev
    ds_k = tl.zeros([BLOCK_P], dtype=tl.float32)  # dS k~_prev
    ds_st = tl.zeros([BLOCK_P], dtype=tl.float32)  # rows of <dS, S'>
    for j in range(0, N, BLOCK_N):
        n, mn, mq, qj, kj, stj, dsj = _state_blocks(p_q, p_k, p_st, p_dst, q_row, st_at, j, mt,
                                                     mp, N, BLOCK_N)
        inside_n = (n * 0 + c0) > 0
        k_prev = tl.load(p_k + k_prev_at + n, mask=mn & inside_n, other=0.0).to(tl.float32)
        k_prev += tl.load(p_k0 + bh * N + n, mask=mn & ~inside_n, other=0.0)
        qk = _mm(qj, tl.trans(kj), PREC, qk)
        k_ds = _mm(kj, tl.trans(dsj), PREC, k_ds)
        q_st = _mm(qj, tl.trans(stj), PREC, q_st)
        q_k += tl.sum(qj * k_prev[None, :], axis=1)
        ds_k += tl.sum(dsj * k_prev[None, :], axis=1)
        ds_st += tl.sum(dsj * stj, axis=1)
    d_scores = _mm(dy, tl.trans(xc), PREC)  # [L(t), L(s)]
    dx = _mm(tl.trans(qk * weight), dy, PREC) + tail[:, None] * k_ds
    if HAS_D:
        dx += tl.load(p_D + h).to(tl.float32) * dy
    d_weight = d_scores * qk
    g = d_weight * weight  # d/d(cs_t - cs_s), zero off the mask and net zero on the diagonal
    d_tail = tl.sum(xc * k_ds, axis=1)
    g_tail = d_tail * tail  # d/d(cs_last - cs_s); the last row's nets to zero
    # the start term e_cs_t (q~_t S'^T) . dy_t
    dcs = tl.sum(g, axis=1) - tl.sum(g, axis=0) + e_cs * tl.sum(q_st * dy, axis=1) - g_tail
    dcs += tl.where(rows == last, keep * tl.sum(ds_st, axis=0) + tl.sum(g_tail, axis=0), 0.0)
    strict = same & (rows[:, None] > rows[None, :])
    dw = tl.sum(tl.where(strict, d_weight * decay, 0.0), axis=0) + d_tail * tail_decay
    dgam = tl.sum(tl.where((rows[:, None] == rows[None, :]) & same, d_weight, 0.0), axis=0)
    dgam += dw + tl.where(rows == last, d_tail, 0.0)
    below = rows[:, None] == rows[None, :] + 1  # [r, s]: s = r - 1
    dlate = tl.sum(tl.where(below, dw[None, :], 0.0), axis=1)  # token r's late term: w_{r-1}
    # row 0's late term, late0 x_prev k~_prev^T in S'_start: x_prev^T dS'_start k~_prev, with
    # dS'_start = keep dS + (dy e_cs)^T q~
    dy_x = tl.sum(dy * x_prev[None, :], axis=1)  # [L]
    dlate += tl.where(rows == 0, keep * tl.sum(x_prev * ds_k, axis=0)
                      + tl.sum(e_cs * dy_x * q_k, axis=0), 0.0)
    dadt = tl.sum(dcs, axis=0) - tl.cumsum(dcs, axis=0) + dcs  # A delta_r: every cs_t, t >= r
    tl.store(p_dx + b * s_dy_b + t[:, None] * s_dy_t + h * s_dy_h + p[None, :],
             dx.to(p_dx.dtype.element_ty), mask=mtp)  # dx: dy's layout
    tl.store(p_dadt + wo, dadt, mask=mt)
    tl.store(p_dgam + wo, dgam, mask=mt)
    tl.store(p_dlate + wo, dlate, mask=mt)
    if c == 0:  # the initial x through late0 x0 k0^T in S'_start of chunk 0
        late0 = tl.load(p_late + b * s_w_b + h)
        tl.store(p_dx0 + bh * P + p,
                 late0 * (keep * ds_k + tl.sum((e_cs * q_k)[:, None] * dy, axis=0)), mask=mp)


@triton.jit
def _chunk_qk_grad_kernel(
    p_x, p_q, p_k, p_adt, p_gam, p_late, p_seq, p_st, p_dst, p_x0,
    p_dy, p_dq, p_dk, p_dk0,
    T, H, P, N,
    s_x_b, s_x_t, s_x_h, s_q_b, s_q_t, s_q_h, s_w_b, s_w_t, s_seq_b, s_dy_b, s_dy_t, s_dy_h,
    s_dq_b, s_dq_t, s_dq_h, h0,
    HAS_SEQ: tl.constexpr,
    L: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr,
):
    """A chunk's gradients of q~ and k~, BLOCK_N states at a time (and chunk 0 the initial
    k~'s): dq~ = ((dy x^T) * weight) k~ + e_cs dy S', dk~ = its transpose's q~ + tail x dS.
    dq~ and dk~ have strides of their own (s_dq_*): q~ and k~ may be views whose heads share
    rows (stride 0 over heads: Mamba-2's B and C of one group), their gradients are per head.
    The grid may cover a slice of the heads, from head h0 (dq~ and dk~ hold the slice's)."""
    (b, h, c, c0, rows, p, mp, bh, q_row, st_at, t, mt, last, mtp, xc, dy, e_cs, keep, wo, gam,
     same, decay, weight, tail_decay, tail) = _grad_terms(
        p_x, p_dy, p_adt, p_gam, p_late, p_seq, T, H, P, N,
        s_x_b, s_x_t, s_x_h, s_q_b, s_q_t, s_q_h, s_w_b, s_w_t, s_seq_b, s_dy_b, s_dy_t,
        s_dy_h, HAS_SEQ, L, BLOCK_P, h0)
    d_qk = _mm(dy, tl.trans(xc), PREC) * weight
    for j in range(0, N, BLOCK_N):
        n, mn, mq, qj, kj, stj, dsj = _state_blocks(p_q, p_k, p_st, p_dst, q_row, st_at, j, mt,
                                                     mp, N, BLOCK_N)
        dq = _mm(d_qk, kj, PREC) + e_cs[:, None] * _mm(dy, stj, PREC)
        dk = _mm(tl.trans(d_qk), qj, PREC) + tail[:, None] * _mm(xc, dsj, PREC)
        dq_row = b * s_dq_b + t[:, None] * s_dq_t + (h - h0) * s_dq_h
        tl.store(p_dq + dq_row + n[None, :], dq, mask=mq)
        tl.store(p_dk + dq_row + n[None, :], dk, mask=mq)
        if c == 0:  # the initial k~ through late0 x0 k0^T in S'_start of chunk 0
            x0 = tl.load(p_x0 + bh * P + p, mask=mp, other=0.0)
            dy_x = tl.sum(dy * x0[None, :], axis=1)
            late0 = tl.load(p_late + b * s_w_b + h)
            tl.store(p_dk0 + bh * N + n,
                     late0 * (keep * tl.sum(dsj * x0[:, None], axis=0)
                              + tl.sum((e_cs * dy_x)[:, None] * qj, axis=0)), mask=mn)


# fmt: on
