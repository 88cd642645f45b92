"""The Mamba-3 per-token terms as Triton kernels: reference.token_terms and its backward.

B batch, T time, H heads, G groups (head h reads group h // (H / G)), N = d_state,
S angles. What the scan kernels read:

    phi_t = (phi_{t-1} + pi tanh(theta_t) delta_t) mod 2 pi        (0 at a document start,
                                                                     angle0 before t = 0)
    q~_t, k~_t = rot(q_t + q_bias, phi_t), rot(k_t + k_bias, phi_t)  [N]: pair (2i, 2i+1), i < S
    A delta, gamma = lam delta, late = (1 - lam) delta (0 at a document start),  lam = sigmoid(trap)

Two parts. The angles carry along time: time is cut into chunks of a few blocks of BT
steps, and a program owns one (row, head, chunk), walks its chunk block by block
carrying the angle and writes phi [B, T, H, S], A delta, gamma and late. Within a block the
angle sum is a cumsum, or with documents a [BT, BT] same-document lower-triangular product
in f32 (ieee). The chunks run in parallel, as the scan's segments do: a first launch
(SUMS) gives what each chunk adds to the carry (forward: the angle at its end from 0;
backward: dphi summed back to its first step from 0), and each program of the second
launch composes the sums of the chunks before (forward) or after (backward) its own in
order, restarting where a document starts inside a chunk. The turn carries nothing:
`_turn_kernel` turns each (row, head, block of steps) by phi, pairs read as the even and
odd halves of a row so the rotation is elementwise on [BT, N/2] tiles (angle i >= S: 0).

The backward runs the other way round: `_unturn_kernel` takes q~ and k~'s gradients back
through the turn for one (row, group, block of steps), its heads in order, summing q and
k's gradients over the group's heads in registers, writing dphi [B, T, H, S] and each
head's bias gradient summed over the block; then the angle kernels walk the blocks in
reverse with the reverse sum of dphi. theta's gradient is per head ([H, B, T, S]), summed
over the heads in a fixed order by `sum_blocks_kernel`. cos and sin: `fast_cos_sin`.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from .._triton import fast_cos_sin, launch, next_power_of_2, sum_blocks_kernel

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
    """Even and odd halves [BT, BLOCK_H2] stored interleaved as rows of v: one contiguous
    store."""
    BT: tl.constexpr = mask.shape[0]
    W: tl.constexpr = mask.shape[1]
    j = tl.arange(0, W)
    tl.store(p_v + rows[:, None] + j[None, :], tl.reshape(tl.join(ve, vo), [BT, W]), mask=mask)


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
            tl.store(p_dtrap + out, (dgam - dlate) * delta * lam * (1.0 - lam), mask=mt)
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


@dataclasses.dataclass(frozen=True)
class TermsConfig:
    """Launch parameters of the terms kernels (`CONFIG`; m3_terms_sweep.py and m3_chunk_sweep.py
    time others through `cfg=`). H200, 130m-mamba3 heads, 8 x 2048: chunks of 8 blocks of 16
    steps, 4 warps, 0.777 ms forward, 0.886 backward (the whole row a program: 0.941, 1.065);
    the unturn with 2 warps, the scan's forward + backward 3.92 ms (4 warps: 4.05)."""

    block_t: int = 16  # BT: time steps per block of the angle kernels
    fwd_chunk_blocks: int = 8  # blocks per chunk (programs along time) of the forward
    fwd_warps: int = 4
    bwd_chunk_blocks: int = 8  # the same, backward; more than a row's blocks: one chunk
    bwd_warps: int = 4
    turn_block_t: int = 16  # steps per program of the turn and of its backward (the unturn)
    turn_warps: int = 4
    unturn_warps: int = 2
    sum_block: int = 1024  # elements a program of the sum of theta's per-head gradients


CONFIG = TermsConfig()


def _chunks(T: int, block_t: int, blocks: int) -> tuple[int, int]:
    """(steps per chunk, chunks) for T steps in chunks of `blocks` blocks of block_t steps."""
    return block_t * blocks, max(1, -(-T // (block_t * blocks)))


def _h2(N: int) -> int:
    return max(16, next_power_of_2((N + 1) // 2))


def _s(S: int) -> int:
    return max(16, next_power_of_2(S))


class _Terms(torch.autograd.Function):
    """reference.token_terms on the kernels (f32 outputs, contiguous; q~ and k~ in `turned`),
    differentiable in q, k, delta, A, trap, theta, the biases and the initial angle."""

    @staticmethod
    def forward(ctx, q, k, delta, A, trap, theta, q_bias, k_bias, angle0, seq,
                turned=torch.float32, cfg=CONFIG):  # fmt: skip
        Bsz, T, G, N = q.shape
        H, S = delta.shape[-1], theta.shape[-1]
        f = dict(device=q.device, dtype=torch.float32)
        q, k = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k))
        delta, A = (t.float().contiguous() for t in (delta, A))
        trap, theta = (t if t.stride(-1) == 1 else t.contiguous() for t in (trap, theta))
        q_bias, k_bias = q_bias.contiguous(), k_bias.contiguous()
        angle0 = angle0.float().contiguous()
        qr = torch.empty(Bsz, T, H, N, device=q.device, dtype=turned)
        kr = torch.empty_like(qr)
        phi = torch.empty(Bsz, T, H, S, **f)
        adt, gam, late = (torch.empty(Bsz, T, H, **f) for _ in range(3))
        phiT = torch.empty(Bsz, H, S, **f)
        seqt = seq if seq is not None else adt
        ch, C = _chunks(T, cfg.block_t, cfg.fwd_chunk_blocks)
        sums = torch.empty(Bsz, H, C, S, **f)
        args = (delta, A, trap, theta, angle0, seqt, sums,
                phi, adt, gam, late, phiT,
                T, H, S, ch, C,
                delta.stride(0), delta.stride(1), trap.stride(0), trap.stride(1),
                theta.stride(0), theta.stride(1), seqt.stride(0))  # fmt: skip
        flags = dict(HAS_SEQ=seq is not None, BT=cfg.block_t, BLOCK_S=_s(S),
                     num_warps=cfg.fwd_warps)  # fmt: skip
        if C > 1:  # what each chunk but the last adds to the angle
            launch(_terms_fwd_kernel, (Bsz, H, C - 1), *args, SUMS=True, **flags)
        launch(_terms_fwd_kernel, (Bsz, H, C), *args, SUMS=False, **flags)
        if T > 0:
            launch(_turn_kernel, (-(-T // cfg.turn_block_t), Bsz, H),
                q, k, q_bias, k_bias, phi, qr, kr,
                T, H, G, N, S, q.stride(0), q.stride(1), q.stride(2),
                BT=cfg.turn_block_t, BLOCK_H2=_h2(N), num_warps=cfg.turn_warps,
            )  # fmt: skip
        ctx.save_for_backward(q, k, delta, A, trap, theta, q_bias, k_bias, seq, phi)
        ctx.dtypes, ctx.cfg = (q.dtype, k.dtype, trap.dtype, theta.dtype, angle0.dtype), cfg
        return phiT, qr, kr, adt, gam, late

    @staticmethod
    def backward(ctx, dphiT, dqr, dkr, dadt, dgam, dlate):
        q, k, delta, A, trap, theta, q_bias, k_bias, seq, phi = ctx.saved_tensors
        cfg = ctx.cfg
        Bsz, T, G, N = q.shape
        H, S = delta.shape[-1], theta.shape[-1]
        f = dict(device=q.device, dtype=torch.float32)

        def grad(t, shape):
            return torch.zeros(shape, **f) if t is None else t.float().contiguous()

        dqr, dkr = grad(dqr, (Bsz, T, H, N)), grad(dkr, (Bsz, T, H, N))
        dadt, dgam, dlate = (grad(t, (Bsz, T, H)) for t in (dadt, dgam, dlate))
        dphiT = dphiT.float().contiguous() if dphiT is not None else None
        # through the turn first: q and k per group, dphi per head, the biases' block sums
        nt = -(-T // cfg.turn_block_t)
        dqg, dkg = torch.empty(Bsz, T, G, N, **f), torch.empty(Bsz, T, G, N, **f)
        dphi = torch.empty(Bsz, T, H, S, **f)
        dqb, dkb = torch.empty(nt, Bsz, H, N, **f), torch.empty(nt, Bsz, H, N, **f)
        if T > 0:
            launch(_unturn_kernel, (nt, Bsz, G),
                q, k, q_bias, k_bias, phi, dqr, dkr, dqg, dkg, dphi, dqb, dkb,
                T, H, G, N, S, q.stride(0), q.stride(1), q.stride(2),
                BT=cfg.turn_block_t, BLOCK_H2=_h2(N), num_warps=cfg.unturn_warps,
            )  # fmt: skip
        ddelta, dA, dtrap = (torch.empty(Bsz, T, H, **f) for _ in range(3))
        dth = torch.empty(H, Bsz, T, S, **f)  # per head, summed below
        dangle0 = torch.empty(Bsz, H, S, **f)
        seqt = seq if seq is not None else delta
        ch, C = _chunks(T, cfg.block_t, cfg.bwd_chunk_blocks)
        sums = torch.empty(Bsz, H, C, S, **f)
        args = (delta, A, trap, theta, seqt, dphi, sums,
                dadt, dgam, dlate, dphiT if dphiT is not None else dangle0,
                ddelta, dA, dtrap, dth, dangle0,
                T, H, S, ch, C)  # fmt: skip
        strides = (delta.stride(0), delta.stride(1), trap.stride(0), trap.stride(1),
                   theta.stride(0), theta.stride(1), seqt.stride(0))  # fmt: skip
        flags = dict(HAS_SEQ=seq is not None, HAS_DPHIT=dphiT is not None, BT=cfg.block_t,
                     BLOCK_S=_s(S), num_warps=cfg.bwd_warps)  # fmt: skip
        if C > 1:  # what reaches each chunk's first step from inside it, all but the first
            launch(_terms_bwd_kernel, (Bsz, H, C - 1), *args, 1, *strides, SUMS=True, **flags)
        launch(_terms_bwd_kernel, (Bsz, H, C), *args, 0, *strides, SUMS=False, **flags)
        qd, kd, trd, thd, ad = ctx.dtypes
        dq, dk = dqg.to(qd), dkg.to(kd)
        dq_bias = dqb.sum((0, 1)).to(q_bias.dtype)
        dk_bias = dkb.sum((0, 1)).to(k_bias.dtype)
        # theta's gradient: the heads' in order, in one pass (torch's sum over the middle
        # dimension of [B, T, H, S] took 0.11 ms at 8 x 2048)
        dtheta = torch.empty(Bsz, T, S, device=q.device, dtype=thd)
        M = dtheta.numel()
        if M > 0:
            launch(sum_blocks_kernel, (-(-M // cfg.sum_block), 1), dth, dth, dtheta, dtheta, H,
                   M, BLOCK_E=cfg.sum_block)  # fmt: skip
        return (dq, dk, ddelta, dA, dtrap.to(trd), dtheta, dq_bias, dk_bias, dangle0.to(ad),
                None, None, None)  # fmt: skip


def token_terms_kernel(q, k, delta, A, trap, theta, q_bias, k_bias, angle0, seq,
                       turned=torch.float32, cfg: TermsConfig | None = None):  # fmt: skip
    """reference.token_terms(..., f=float32) on the kernels, but (phi_T [B, H, S], q~, k~,
    A delta, gamma, late): the final angle instead of every step's, q~ and k~ in `turned`
    (f32, or bf16 where the scan's products round them so). seq: int32 [B, T] contiguous
    document ids, or None. cfg: launch parameters other than the library's `CONFIG`."""
    return _Terms.apply(q, k, delta, A, trap, theta, q_bias, k_bias, angle0, seq, turned,
                        cfg or CONFIG)  # fmt: skip
