"""The Mamba-3 per-token terms' Triton kernels (`@triton.jit` only): the angle kernels
forward and backward, the turn and the unturn; terms.py says what each computes and
launches them."""

from __future__ import annotations

import triton
import triton.language as tl

from .._triton import fast_cos_sin

# fmt: off


@triton.jit
def _tanh(x):
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit
def _angle_block(inc, doc, carry, carry_doc, rows, HAS_SEQ: tl.constexpr):
    """Inclusive within-document sum of inc [BT, K] down the rows, plus the carried angle
    on the rows that continue the carried document."""
    if HAS_SEQ:
        m = (rows[:, None] >= rows[None, :]) & (doc[:, None] == doc[None, :])
        local = tl.dot(m.to(tl.float32), inc, input_precision="ieee")
        return local + tl.where(doc == carry_doc, 1.0, 0.0)[:, None] * carry[None, :]
    return tl.cumsum(inc, axis=0) + carry[None, :]


@triton.jit
def _row(x, rows, r):
    """Row r of a [BT, K] tile as [K]."""
    return tl.sum(tl.where((rows == r)[:, None], x, 0.0), axis=0)


@triton.jit
def _bias(p_b, h, N, i):
    """Head h's bias [N] as its even and odd halves [BLOCK_H2], f32."""
    be = tl.load(p_b + h * N + 2 * i, mask=2 * i < N, other=0.0).to(tl.float32)
    bo = tl.load(p_b + h * N + 2 * i + 1, mask=2 * i + 1 < N, other=0.0).to(tl.float32)
    return be, bo


@triton.jit
def _halves(p_v, rows, mask):
    """Rows [BT, 2 BLOCK_H2] of v (row offsets `rows` [BT], the row's values contiguous;
    mask [BT, 2 BLOCK_H2]) as their even and odd halves [BT, BLOCK_H2] in f32: one
    contiguous load, split in registers."""
    BT: tl.constexpr = mask.shape[0]
    W: tl.constexpr = mask.shape[1]
    j = tl.arange(0, W)
    v = tl.load(p_v + rows[:, None] + j[None, :], mask=mask, other=0.0).to(tl.float32)
    return tl.split(tl.reshape(v, [BT, W // 2, 2]))


@triton.jit
def _store_halves(p_v, rows, mask, ve, vo):
    """Even and odd halves [BT, BLOCK_H2] stored interleaved as rows of v (in v's dtype):
    one contiguous store."""
    BT: tl.constexpr = mask.shape[0]
    W: tl.constexpr = mask.shape[1]
    j = tl.arange(0, W)
    v = tl.reshape(tl.join(ve, vo), [BT, W]).to(p_v.dtype.element_ty)
    tl.store(p_v + rows[:, None] + j[None, :], v, mask=mask)


@triton.jit
def _turn(p_v, p_out, src, dst, mask, be, bo, cos, sin):
    """The rows of v at src plus the bias, turned pair by pair, stored to out at dst."""
    ve, vo = _halves(p_v, src, mask)
    ve, vo = ve + be[None, :], vo + bo[None, :]
    _store_halves(p_out, dst, mask, ve * cos - vo * sin, ve * sin + vo * cos)


@triton.jit
def _unturn(ve, vo, p_dr, dst, mask, be, bo, cos, sin):
    """The turned rows' gradient (dr, at dst) back through the rotation of the rows (ve, vo:
    even and odd halves, before the bias): (the angle's gradient, the rows' gradient as even
    and odd halves), each [BT, BLOCK_H2], zero where masked."""
    ve, vo = ve + be[None, :], vo + bo[None, :]
    dre, dro = _halves(p_dr, dst, mask)
    dphi = dro * (ve * cos - vo * sin) - dre * (ve * sin + vo * cos)
    return dphi, dre * cos + dro * sin, dro * cos - dre * sin


@triton.jit
def _doc_at(p_seq, t, HAS_SEQ: tl.constexpr):
    """The document id at step t (p_seq at the row's start), or 0 without documents."""
    if HAS_SEQ:
        return tl.load(p_seq + t)
    return 0


@triton.jit
def _terms_fwd_kernel(
    p_delta, p_A, p_trap, p_theta, p_angle0, p_seq, p_sum,
    p_phi, p_adt, p_gam, p_late, p_phiT,
    T, H, S, CH, C,
    s_w_b, s_w_t, s_tr_b, s_tr_t, s_th_b, s_th_t, s_seq_b,
    HAS_SEQ: tl.constexpr, SUMS: tl.constexpr, BT: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """One chunk of CH steps of one (row, head), in blocks of BT. SUMS: from a zero angle,
    only the angle at the chunk's end (sum [B, H, C, S]: what the chunk adds to an angle
    carried into it, or the angle itself when a document starts inside it). Else: the
    chunk's start angle from the sums of the chunks before it, then phi, A delta, gamma
    and late (`_turn_kernel` turns q and k by phi)."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    c = tl.program_id(2)
    rows = tl.arange(0, BT)
    i = tl.arange(0, BLOCK_S)
    mr = i < S
    bh = b * H + h
    p_row_seq = p_seq + b * s_seq_b
    ang = tl.zeros([BLOCK_S], dtype=tl.float32)
    if not SUMS:  # the angle at the chunk's start: the chunks before it, in order
        ang = tl.load(p_angle0 + bh * S + i, mask=mr, other=0.0)
        for j in range(0, c):
            inc = tl.load(p_sum + (bh * C + j) * S + i, mask=mr, other=0.0)
            if HAS_SEQ:  # a document starting inside chunk j drops what came before it
                restart = _doc_at(p_row_seq, tl.maximum(j * CH - 1, 0), HAS_SEQ) != _doc_at(
                    p_row_seq, tl.minimum((j + 1) * CH, T) - 1, HAS_SEQ
                )
                ang = tl.where(restart, 0.0, ang)
            ang = ang + inc
            ang = ang - 6.283185307179586 * tl.floor(ang / 6.283185307179586)
    carry_doc = _doc_at(p_row_seq, tl.maximum(c * CH - 1, 0), HAS_SEQ)
    for t0 in range(c * CH, tl.minimum(c * CH + CH, T), BT):
        t = t0 + rows
        mt = t < T  # CH is a whole number of blocks
        last = tl.minimum(BT, T - t0) - 1
        wo = b * s_w_b + t * s_w_t + h
        delta = tl.load(p_delta + wo, mask=mt, other=0.0).to(tl.float32)
        mti = mt[:, None] & mr[None, :]
        th = tl.load(p_theta + b * s_th_b + t[:, None] * s_th_t + i[None, :], mask=mti,
                     other=0.0).to(tl.float32)
        inc = 3.141592653589793 * _tanh(th) * delta[:, None]
        same = mt
        doc = rows
        if HAS_SEQ:
            doc = tl.load(p_row_seq + t, mask=mt, other=-1)
            prev = tl.load(p_row_seq + tl.maximum(t - 1, 0), mask=mt, other=-1)
            same = doc == prev
        phi = _angle_block(inc, doc, ang, carry_doc, rows, HAS_SEQ)
        phi = phi - 6.283185307179586 * tl.floor(phi / 6.283185307179586)
        phi = tl.where(mti, phi, 0.0)
        ang = _row(phi, rows, last)
        if HAS_SEQ:
            carry_doc = tl.sum(tl.where(rows == last, doc, 0), axis=0)
        if not SUMS:
            tl.store(p_phi + ((b * T + t[:, None]) * H + h) * S + i[None, :], phi, mask=mti)
            A = tl.load(p_A + wo, mask=mt, other=0.0).to(tl.float32)
            trap = tl.load(p_trap + b * s_tr_b + t * s_tr_t + h, mask=mt, other=0.0).to(tl.float32)
            lam = tl.sigmoid(trap)
            out = (b * T + t) * H + h
            tl.store(p_adt + out, A * delta, mask=mt)
            tl.store(p_gam + out, lam * delta, mask=mt)
            tl.store(p_late + out, tl.where(same, (1.0 - lam) * delta, 0.0), mask=mt)
    if SUMS:
        tl.store(p_sum + (bh * C + c) * S + i, ang, mask=mr)
    elif c == C - 1:
        tl.store(p_phiT + bh * S + i, ang, mask=mr)


@triton.jit
def _terms_bwd_kernel(
    p_delta, p_A, p_trap, p_theta, p_seq, p_dphi, p_sum,
    p_dadt, p_dgam, p_dlate, p_dphiT,
    p_ddelta, p_dA, p_dtrap, p_dth, p_dangle0,
    T, H, S, CH, C, C0,
    s_w_b, s_w_t, s_tr_b, s_tr_t, s_th_b, s_th_t, s_seq_b,
    HAS_SEQ: tl.constexpr, HAS_DPHIT: tl.constexpr, SUMS: tl.constexpr, BT: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """One chunk (C0 + program_id(2)) of one (row, head), its blocks in reverse, carrying acc
    [S]: the sum of dphi (`_unturn_kernel`'s, [B, T, H, S]) over the later steps of the
    document the block's end continues. SUMS: from a zero carry, only acc at the chunk's
    first step (sum [B, H, C, S]). Else: the carry into the chunk's end from the sums of the
    chunks after it (dphiT beyond the last), then every gradient."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    c = C0 + tl.program_id(2)
    rows = tl.arange(0, BT)
    i = tl.arange(0, BLOCK_S)
    mr = i < S
    bh = b * H + h
    p_row_seq = p_seq + b * s_seq_b
    acc = tl.zeros([BLOCK_S], dtype=tl.float32)
    if not SUMS:  # the carry into the chunk's end: the chunks after it, last first
        if HAS_DPHIT:
            acc = tl.load(p_dphiT + bh * S + i, mask=mr, other=0.0)
        carry_doc = _doc_at(p_row_seq, tl.maximum(T - 1, 0), HAS_SEQ)
        for jj in range(0, C - 1 - c):
            j = C - 1 - jj
            if HAS_SEQ:  # the carry reaches chunk j's first step only within one document
                first = _doc_at(p_row_seq, j * CH, HAS_SEQ)
                acc = tl.where(first == carry_doc, acc, 0.0)
                carry_doc = first
            acc += tl.load(p_sum + (bh * C + j) * S + i, mask=mr, other=0.0)
    # the document the carry belongs to: the next chunk's first step's (the last step's)
    carry_doc = _doc_at(p_row_seq, tl.maximum(tl.minimum(c * CH + CH, T - 1), 0), HAS_SEQ)
    n_blocks = tl.cdiv(tl.minimum(CH, T - c * CH), BT)
    for jb in range(0, n_blocks):
        t0 = c * CH + (n_blocks - 1 - jb) * BT
        t = t0 + rows
        mt = t < T
        mti = mt[:, None] & mr[None, :]
        dphi = tl.load(p_dphi + ((b * T + t[:, None]) * H + h) * S + i[None, :], mask=mti,
                       other=0.0)
        # d inc_r = the sum of dphi_t over t >= r in r's document
        same = mt
        if HAS_SEQ:
            doc = tl.load(p_row_seq + t, mask=mt, other=-1)
            prev = tl.load(p_row_seq + tl.maximum(t - 1, 0), mask=mt, other=-1)
            same = doc == prev
            m = (rows[None, :] >= rows[:, None]) & (doc[:, None] == doc[None, :])
            dinc = tl.dot(m.to(tl.float32), dphi, input_precision="ieee")
            dinc += tl.where(doc == carry_doc, 1.0, 0.0)[:, None] * acc[None, :]
            carry_doc = tl.sum(tl.where(rows == 0, doc, 0), axis=0)
        else:
            dinc = tl.cumsum(dphi, axis=0, reverse=True) + acc[None, :]
        acc = _row(dinc, rows, 0)
        if not SUMS:
            wo = b * s_w_b + t * s_w_t + h
            delta = tl.load(p_delta + wo, mask=mt, other=0.0).to(tl.float32)
            A = tl.load(p_A + wo, mask=mt, other=0.0).to(tl.float32)
            trap = tl.load(p_trap + b * s_tr_b + t * s_tr_t + h, mask=mt, other=0.0).to(tl.float32)
            th = tl.load(p_theta + b * s_th_b + t[:, None] * s_th_t + i[None, :], mask=mti,
                         other=0.0).to(tl.float32)
            tt = _tanh(th)
            dinc = tl.where(mti, dinc, 0.0)
            tl.store(p_dth + ((h * tl.num_programs(0) + b) * T + t[:, None]) * S + i[None, :],
                     dinc * delta[:, None] * 3.141592653589793 * (1.0 - tt * tt), mask=mti)
            out = (b * T + t) * H + h
            dadt = tl.load(p_dadt + out, mask=mt, other=0.0)
            dgam = tl.load(p_dgam + out, mask=mt, other=0.0)
            dlate = tl.where(same, tl.load(p_dlate + out, mask=mt, other=0.0), 0.0)
            lam = tl.sigmoid(trap)
            ddelta = tl.sum(dinc * 3.141592653589793 * tt, axis=1)
            ddelta += dadt * A + dgam * lam + dlate * (1.0 - lam)
            tl.store(p_ddelta + out, ddelta, mask=mt)
            tl.store(p_dA + out, dadt * delta, mask=mt)
            dtrap = (dgam - dlate) * delta * lam * (1.0 - lam)
            tl.store(p_dtrap + out, dtrap.to(p_dtrap.dtype.element_ty), mask=mt)
    if SUMS:
        tl.store(p_sum + (bh * C + c) * S + i, acc, mask=mr)
    elif c == 0:
        tl.store(p_dangle0 + bh * S + i, acc, mask=mr)


@triton.jit
def _turn_kernel(
    p_q, p_k, p_qb, p_kb, p_phi, p_qr, p_kr,
    T, H, G, N, S, s_q_b, s_q_t, s_q_g,
    BT: tl.constexpr, BLOCK_H2: tl.constexpr,
):
    """q~, k~ [B, T, H, N] for BT steps of one (row, head): the group's rows plus the head's
    bias, turned by phi [B, T, H, S] (angles past S: 0). No carry: every block is its own
    program."""
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    b = tl.program_id(1).to(tl.int64)
    h = tl.program_id(2)
    g = h // (H // G)
    i = tl.arange(0, BLOCK_H2)
    mt = t < T
    mask = mt[:, None] & (tl.arange(0, 2 * BLOCK_H2) < N)[None, :]
    phi = tl.load(p_phi + ((b * T + t[:, None]) * H + h) * S + i[None, :],
                  mask=mt[:, None] & (i < S)[None, :], other=0.0)
    cos, sin = fast_cos_sin(phi)
    src = b * s_q_b + t * s_q_t + g * s_q_g  # [BT] row offsets
    dst = ((b * T + t) * H + h) * N
    qbe, qbo = _bias(p_qb, h, N, i)
    kbe, kbo = _bias(p_kb, h, N, i)
    _turn(p_q, p_qr, src, dst, mask, qbe, qbo, cos, sin)
    _turn(p_k, p_kr, src, dst, mask, kbe, kbo, cos, sin)


@triton.jit
def _unturn_kernel(
    p_q, p_k, p_qb, p_kb, p_phi, p_dqr, p_dkr, p_dq, p_dk, p_dphi, p_dqb, p_dkb,
    T, H, G, N, S, s_q_b, s_q_t, s_q_g,
    BT: tl.constexpr, BLOCK_H2: tl.constexpr,
):
    """q~ and k~'s gradients [B, T, H, N] back through the turn for BT steps of one (row,
    group), its heads in order: dq, dk [B, T, G, N] summed over the group's heads, dphi
    [B, T, H, S], and each head's bias gradient summed over the block's steps (dqb, dkb
    [blocks, B, H, N], summed after)."""
    tb = tl.program_id(0)
    t = tb * BT + tl.arange(0, BT)
    b = tl.program_id(1).to(tl.int64)
    g = tl.program_id(2)
    HG = H // G
    i = tl.arange(0, BLOCK_H2)
    me, mo = 2 * i < N, 2 * i + 1 < N
    mt = t < T
    mask = mt[:, None] & (tl.arange(0, 2 * BLOCK_H2) < N)[None, :]
    mti = mt[:, None] & (i < S)[None, :]
    src = b * s_q_b + t * s_q_t + g * s_q_g  # [BT] row offsets
    dqe = tl.zeros([BT, BLOCK_H2], dtype=tl.float32)
    dqo, dke, dko = dqe, dqe, dqe
    qe, qo = _halves(p_q, src, mask)  # the group's rows, the same for each of its heads
    ke, ko = _halves(p_k, src, mask)
    for hh in range(0, HG):
        h = g * HG + hh
        phi = tl.load(p_phi + ((b * T + t[:, None]) * H + h) * S + i[None, :], mask=mti,
                      other=0.0)
        cos, sin = fast_cos_sin(phi)
        dst = ((b * T + t) * H + h) * N
        qbe, qbo = _bias(p_qb, h, N, i)
        kbe, kbo = _bias(p_kb, h, N, i)
        dphi, ve, vo = _unturn(qe, qo, p_dqr, dst, mask, qbe, qbo, cos, sin)
        dqe, dqo = dqe + ve, dqo + vo
        ob = ((tb * tl.num_programs(1) + b) * H + h) * N + 2 * i
        tl.store(p_dqb + ob, tl.sum(ve, axis=0), mask=me)
        tl.store(p_dqb + ob + 1, tl.sum(vo, axis=0), mask=mo)
        dphi_k, ve, vo = _unturn(ke, ko, p_dkr, dst, mask, kbe, kbo, cos, sin)
        dke, dko = dke + ve, dko + vo
        tl.store(p_dkb + ob, tl.sum(ve, axis=0), mask=me)
        tl.store(p_dkb + ob + 1, tl.sum(vo, axis=0), mask=mo)
        tl.store(p_dphi + ((b * T + t[:, None]) * H + h) * S + i[None, :], dphi + dphi_k,
                 mask=mti)
    og = ((b * T + t) * G + g) * N
    _store_halves(p_dq, og, mask, dqe, dqo)
    _store_halves(p_dk, og, mask, dke, dko)


# fmt: on
