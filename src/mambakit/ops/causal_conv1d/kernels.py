"""Triton kernels for the depthwise causal conv1d (channels-last), then their launchers.

B batch, T time, D channels, K = d_conv taps. Tap k of output t reads the input
at time t - (K-1-k); negative times read `initial_state` row K-1+t (oldest
first); with `seq_idx` a tap reading another document reads zero, and times
before 0 belong to the document of t = 0.

Forward: one program per (T-block, D-block, batch row). The K shifted loads of a
[BLOCK_T, BLOCK_D] tile overlap in all but K-1 rows, so DRAM traffic is one
read of x and one write of out; the overlap is served from L1/L2. For K <= 4
without seq_idx (the model's case) a program instead holds its times as groups
of 4 and loads the seven tiles at q - 3 .. q + 3 of its group starts q once
for all four outputs of a group (`_conv_fwd_quad_kernel`).

Backward: with c the pre-activation, dc = dout * silu'(c) and lag = K-1-k,

    dx_s      = sum_{k<K} w[k] * dc_{s+lag} * same(s, s+lag)   (+ d final_state)
    dw[k]     = sum_{b,s} dc_{s+lag} * x_s * same(s, s+lag)
    dbias     = sum_{b,t} dc_t

and d initial_state is dx at the negative times. One kernel: a program owns one
row, one D-block and a chunk of time, walked in tiles of 32 times (one per lane
of a warp) whose last K-1 times only feed the others. Per tile it loads the K
taps of x (cache hits but for the new rows) and dout, computes c and dc once per
time, and moves dc_{s+lag} between lanes with a gather (warp shuffles), so x,
dout and dx cross DRAM once each and nothing else does. dw and dbias accumulate
elementwise in registers, are reduced over time once per program into
per-program partials, and summed in a fixed order on the host: no atomics,
bit-identical runs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._triton import cdiv, fast_sigmoid, launch, next_power_of_2, opt, strides


# fmt: off
@triton.jit
def _load_src(
    p_x, p_init, pos, offs_d, mask_d, T, s_x_t, s_init_t, s_init_d,
    K: tl.constexpr, HAS_INIT: tl.constexpr,
):
    """The conv input at times pos [BT] and channels offs_d [BD], in f32."""
    in_x = (pos >= 0) & (pos < T)
    t_x = tl.where(in_x, pos, 0)
    b_x = tl.load(
        p_x + t_x[:, None] * s_x_t + offs_d[None, :],
        mask=in_x[:, None] & mask_d[None, :], other=0.0,
    ).to(tl.float32)
    if HAS_INIT:
        in_s = (pos < 0) & (pos >= 1 - K)
        t_s = tl.where(in_s, pos + K - 1, 0)
        b_x += tl.load(
            p_init + t_s[:, None] * s_init_t + offs_d[None, :] * s_init_d,
            mask=in_s[:, None] & mask_d[None, :], other=0.0,
        ).to(tl.float32)
    return b_x


@triton.jit
def _load_seq(p_seq, pos, T, s_seq_t):
    """seq_idx at times pos, where times before 0 read seq_idx[0] (and past T-1 read T-1)."""
    t = tl.minimum(tl.maximum(pos, 0), T - 1)
    return tl.load(p_seq + t * s_seq_t)


@triton.jit
def _conv_pre(
    p_x, p_init, p_w, p_b, p_seq, q, seq_q, offs_d, mask_d, T,
    s_x_t, s_init_t, s_init_d, s_w_d, s_w_k, s_seq_t,
    K: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_INIT: tl.constexpr, HAS_SEQ: tl.constexpr,
):
    """Pre-activation conv output at times q [BT] (any q; the caller masks q outside [0, T))."""
    acc = tl.zeros([BT, BD], dtype=tl.float32)
    for k in tl.static_range(K):
        pos = q - (K - 1 - k)
        b_x = _load_src(p_x, p_init, pos, offs_d, mask_d, T, s_x_t, s_init_t, s_init_d, K, HAS_INIT)
        if HAS_SEQ:
            if k < K - 1:
                same = _load_seq(p_seq, pos, T, s_seq_t) == seq_q
                b_x = tl.where(same[:, None], b_x, 0.0)
        b_w = tl.load(p_w + offs_d * s_w_d + k * s_w_k, mask=mask_d, other=0.0).to(tl.float32)
        acc += b_x * b_w[None, :]
    if HAS_BIAS:
        acc += tl.load(p_b + offs_d, mask=mask_d, other=0.0).to(tl.float32)[None, :]
    return acc


@triton.jit
def _conv_fwd_kernel(
    p_x, p_w, p_b, p_init, p_seq, p_out, p_final,
    T, D,
    s_x_b, s_x_t,
    s_w_d, s_w_k,
    s_init_b, s_init_t, s_init_d,
    s_seq_b, s_seq_t,
    s_out_b, s_out_t,
    s_final_b, s_final_t,
    K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_INIT: tl.constexpr, HAS_SEQ: tl.constexpr,
    SILU: tl.constexpr, STORE_FINAL: tl.constexpr,
):
    pid_t = tl.program_id(0)
    pid_d = tl.program_id(1)
    pid_b = tl.program_id(2).to(tl.int64)
    offs_t = (pid_t * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)  # t * stride may pass 2^31
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_t = offs_t < T
    mask_d = offs_d < D
    p_x += pid_b * s_x_b
    p_init += pid_b * s_init_b
    p_seq += pid_b * s_seq_b

    seq_t = offs_t
    if HAS_SEQ:
        seq_t = _load_seq(p_seq, offs_t, T, s_seq_t)
    acc = _conv_pre(
        p_x, p_init, p_w, p_b, p_seq, offs_t, seq_t, offs_d, mask_d, T,
        s_x_t, s_init_t, s_init_d, s_w_d, s_w_k, s_seq_t,
        K, BLOCK_T, BLOCK_D, HAS_BIAS, HAS_INIT, HAS_SEQ,
    )
    if SILU:
        acc = acc * fast_sigmoid(acc)
    p_o = p_out + pid_b * s_out_b + offs_t[:, None] * s_out_t + offs_d[None, :]
    tl.store(p_o, acc.to(p_out.dtype.element_ty), mask=mask_t[:, None] & mask_d[None, :])

    if STORE_FINAL:
        if pid_t == tl.num_programs(0) - 1:
            seq_last = 0
            if HAS_SEQ:
                seq_last = tl.load(p_seq + (T - 1) * s_seq_t)
            _store_final(p_x, p_init, p_final + pid_b * s_final_b, p_seq, seq_last, offs_d, mask_d,
                         T, s_x_t, s_init_t, s_init_d, s_seq_t, s_final_t, K, BLOCK_K, HAS_INIT,
                         HAS_SEQ)


@triton.jit
def _tap(bias, w0, w1, w2, w3, x0, x1, x2, x3,
         K: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr):
    """Outputs from the inputs x_i at lag i (tap w_i = weight[:, K-1-i]; none past lag K-1)."""
    if HAS_BIAS:
        c = w0 * x0 + bias
        c += w1 * x1
    else:
        c = w0 * x0 + w1 * x1
    if K >= 3:
        c += w2 * x2
    if K >= 4:
        c += w3 * x3
    if SILU:
        c = c * fast_sigmoid(c)
    return c


@triton.jit
def _conv_fwd_quad_kernel(
    p_x, p_w, p_b, p_init, p_out, p_final,
    T, D,
    s_x_b, s_x_t,
    s_w_d, s_w_k,
    s_init_b, s_init_t, s_init_d,
    s_out_b, s_out_t,
    s_final_b, s_final_t,
    K: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_INIT: tl.constexpr, SILU: tl.constexpr,
    STORE_FINAL: tl.constexpr,
):
    # K <= 4, no seq_idx. A program owns 4 BLOCK_G times as BLOCK_G groups of 4 (times
    # q + j, q = 4 g, j < 4) and BLOCK_D channels. Output j of a group reads the inputs at
    # q + j - lag; the seven [BLOCK_G, BLOCK_D] tiles of inputs at q - 3 .. q + 3 serve all
    # four, so each time is loaded and converted 7/4 times per output instead of K.
    pid_t = tl.program_id(0)
    pid_d = tl.program_id(1)
    pid_b = tl.program_id(2).to(tl.int64)
    q = (pid_t * 4 * BLOCK_G + 4 * tl.arange(0, BLOCK_G)).to(tl.int64)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    p_x += pid_b * s_x_b
    p_init += pid_b * s_init_b

    w0 = tl.load(p_w + offs_d * s_w_d + (K - 1) * s_w_k, mask=mask_d, other=0.0).to(tl.float32)
    w1 = tl.load(p_w + offs_d * s_w_d + (K - 2) * s_w_k, mask=mask_d, other=0.0).to(tl.float32)
    w2 = w1
    w3 = w1
    if K >= 3:
        w2 = tl.load(p_w + offs_d * s_w_d + (K - 3) * s_w_k, mask=mask_d, other=0.0).to(tl.float32)
    if K >= 4:
        w3 = tl.load(p_w + offs_d * s_w_d + (K - 4) * s_w_k, mask=mask_d, other=0.0).to(tl.float32)
    w0 = w0[None, :]
    w1 = w1[None, :]
    w2 = w2[None, :]
    w3 = w3[None, :]
    bias = w0
    if HAS_BIAS:
        bias = tl.load(p_b + offs_d, mask=mask_d, other=0.0).to(tl.float32)[None, :]
    x_m1 = _load_src(p_x, p_init, q - 1, offs_d, mask_d, T, s_x_t, s_init_t, s_init_d, K, HAS_INIT)
    x_m2 = x_m1  # (stand-ins for the lags that K leaves out: _tap skips them)
    x_m3 = x_m1
    if K >= 3:
        x_m2 = _load_src(p_x, p_init, q - 2, offs_d, mask_d, T, s_x_t, s_init_t, s_init_d, K, HAS_INIT)
    if K >= 4:
        x_m3 = _load_src(p_x, p_init, q - 3, offs_d, mask_d, T, s_x_t, s_init_t, s_init_d, K, HAS_INIT)
    x0 = _load_src(p_x, p_init, q, offs_d, mask_d, T, s_x_t, s_init_t, s_init_d, K, False)
    x1 = _load_src(p_x, p_init, q + 1, offs_d, mask_d, T, s_x_t, s_init_t, s_init_d, K, False)
    x2 = _load_src(p_x, p_init, q + 2, offs_d, mask_d, T, s_x_t, s_init_t, s_init_d, K, False)
    x3 = _load_src(p_x, p_init, q + 3, offs_d, mask_d, T, s_x_t, s_init_t, s_init_d, K, False)

    p_o = p_out + pid_b * s_out_b + q[:, None] * s_out_t + offs_d[None, :]
    ty = p_out.dtype.element_ty
    o = _tap(bias, w0, w1, w2, w3, x0, x_m1, x_m2, x_m3, K, HAS_BIAS, SILU)
    tl.store(p_o, o.to(ty), mask=(q < T)[:, None] & mask_d[None, :])
    o = _tap(bias, w0, w1, w2, w3, x1, x0, x_m1, x_m2, K, HAS_BIAS, SILU)
    tl.store(p_o + s_out_t, o.to(ty), mask=(q + 1 < T)[:, None] & mask_d[None, :])
    o = _tap(bias, w0, w1, w2, w3, x2, x1, x0, x_m1, K, HAS_BIAS, SILU)
    tl.store(p_o + 2 * s_out_t, o.to(ty), mask=(q + 2 < T)[:, None] & mask_d[None, :])
    o = _tap(bias, w0, w1, w2, w3, x3, x2, x1, x0, K, HAS_BIAS, SILU)
    tl.store(p_o + 3 * s_out_t, o.to(ty), mask=(q + 3 < T)[:, None] & mask_d[None, :])

    if STORE_FINAL:
        if pid_t == tl.num_programs(0) - 1:
            _store_final(p_x, p_init, p_final + pid_b * s_final_b, p_x, 0, offs_d, mask_d, T,
                         s_x_t, s_init_t, s_init_d, 0, s_final_t, K, BLOCK_K, HAS_INIT, False)


@triton.jit
def _store_final(
    p_x, p_init, p_final, p_seq, seq_last, offs_d, mask_d, T,
    s_x_t, s_init_t, s_init_d, s_seq_t, s_final_t,
    K: tl.constexpr, BLOCK_K: tl.constexpr, HAS_INIT: tl.constexpr, HAS_SEQ: tl.constexpr,
):
    """final state row j = the input at time T-(K-1)+j, zero outside the last document."""
    offs_j = tl.arange(0, BLOCK_K)
    mask_j = offs_j < K - 1
    pos = (T - (K - 1) + offs_j).to(tl.int64)
    b_f = _load_src(p_x, p_init, pos, offs_d, mask_d, T, s_x_t, s_init_t, s_init_d, K, HAS_INIT)
    if HAS_SEQ:
        same = _load_seq(p_seq, pos, T, s_seq_t) == seq_last
        b_f = tl.where(same[:, None], b_f, 0.0)
    p_f = p_final + offs_j[:, None] * s_final_t + offs_d[None, :]
    tl.store(p_f, b_f, mask=mask_j[:, None] & mask_d[None, :])


@triton.jit
def _load_x(
    p_x, p_init, pos, offs_d, mask, T, s_x_t, s_init_t, s_init_d,
    K: tl.constexpr, HAS_INIT: tl.constexpr, pos0,
):
    """The conv input in f32 at times pos [BT] (none before pos0) and channels offs_d [VEC]
    as [BT, VEC] (mask: the elements wanted), negative times reading the initial state."""
    b_x = tl.load(
        p_x + pos.to(tl.int64)[:, None] * s_x_t + offs_d[None, :],
        mask=mask & ((pos >= 0) & (pos < T))[:, None], other=0.0,
    ).to(tl.float32)
    if HAS_INIT:
        if pos0 < 0:
            t_s = pos + (K - 1)
            b_x += tl.load(
                p_init + t_s[:, None] * s_init_t + offs_d[None, :] * s_init_d,
                mask=mask & ((pos < 0) & (t_s >= 0))[:, None], other=0.0,
            ).to(tl.float32)
    return b_x


@triton.jit
def _conv_bwd_kernel(
    p_x, p_w, p_b, p_init, p_seq, p_dout, p_dfinal,
    p_dx, p_dinit, p_dw_part, p_db_part,
    T, D, N_TBLK,
    s_x_b, s_x_t,
    s_w_d, s_w_k,
    s_init_b, s_init_t, s_init_d,
    s_seq_b, s_seq_t,
    s_dout_b, s_dout_t, s_dout_d,
    s_final_b, s_final_t, s_final_d,
    s_dx_b, s_dx_t,
    K: tl.constexpr, BLOCK_T: tl.constexpr, VEC: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_INIT: tl.constexpr, HAS_SEQ: tl.constexpr,
    SILU: tl.constexpr, HAS_DFINAL: tl.constexpr,
):
    # One warp: a tile of BLOCK_T (32) times by VEC channels, one time per lane and VEC
    # channels per thread (a [BT, VEC] load with VEC contiguous gets this layout), so the
    # shift in time is a gather made of warp shuffles; per-tap values add an axis k < BLOCK_K
    # that stays within the thread. A tile owns (writes dx for) its first BLOCK_T - (K-1)
    # times; the last K-1 only supply dc to them. Tiles start at -(K-1) when there is an
    # initial state: dx there is d initial_state.
    # dx: [B, T, D] with stride 1 in D; dinit: contiguous [B, K-1, D]; partials: [B, n_chunks, K, D], [B, n_chunks, D]
    pid_c = tl.program_id(0)
    pid_d = tl.program_id(1)
    pid_b = tl.program_id(2).to(tl.int64)
    n_chunks = tl.num_programs(0)
    offs_d = pid_d * VEC + tl.arange(0, VEC)
    mask_d = offs_d < D
    offs_k = tl.arange(0, BLOCK_K)
    mask_k = offs_k < K
    lag = tl.where(mask_k, K - 1 - offs_k, 0)  # tap k: c_t reads x_{t-lag}, dx_s reads dc_{s+lag}
    offs_r = tl.arange(0, BLOCK_T)
    own_r = offs_r < BLOCK_T - (K - 1)
    p_x += pid_b * s_x_b
    p_init += pid_b * s_init_b
    p_seq += pid_b * s_seq_b
    p_dout += pid_b * s_dout_b
    p_dfinal += pid_b * s_final_b
    p_dx += pid_b * s_dx_b
    p_dinit += pid_b * (K - 1) * D
    s_begin = 0
    if HAS_INIT:
        s_begin = 1 - K
    b_w = tl.load(
        p_w + offs_d[:, None] * s_w_d + offs_k[None, :] * s_w_k,
        mask=mask_d[:, None] & mask_k[None, :], other=0.0,
    ).to(tl.float32)[None, :, :]  # [1, VEC, BK]
    b_bias = tl.zeros([VEC], dtype=tl.float32)
    if HAS_BIAS:
        b_bias += tl.load(p_b + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    # dweight and dbias terms summed elementwise over the program's tiles, over time at the end
    b_dw = tl.zeros([BLOCK_T, VEC, BLOCK_K], dtype=tl.float32)
    b_db = tl.zeros([BLOCK_T, VEC], dtype=tl.float32)
    for i in range(N_TBLK):
        q0 = s_begin + (pid_c * N_TBLK + i) * (BLOCK_T - (K - 1))
        q = q0 + offs_r  # [BT]
        in_q = (q >= 0) & (q < T)
        seq_q = q
        if HAS_SEQ:
            seq_q = _load_seq(p_seq, q, T, s_seq_t)
        b_dc = tl.load(
            p_dout + q.to(tl.int64)[:, None] * s_dout_t + offs_d[None, :] * s_dout_d,
            mask=in_q[:, None] & mask_d[None, :], other=0.0,
        ).to(tl.float32)
        if SILU:
            # c as in the forward: the K taps of x are one tile read K times (cache hits but
            # for the new rows)
            c = tl.zeros([BLOCK_T, VEC], dtype=tl.float32) + b_bias[None, :]
            for k in tl.static_range(K):
                pos = q - (K - 1 - k)
                b_x = _load_x(
                    p_x, p_init, pos, offs_d, mask_d[None, :], T, s_x_t, s_init_t, s_init_d,
                    K, HAS_INIT, q0 - (K - 1),
                )
                if HAS_SEQ:
                    if k < K - 1:
                        b_x = tl.where((_load_seq(p_seq, pos, T, s_seq_t) == seq_q)[:, None], b_x, 0.0)
                c += b_x * tl.sum(tl.where(offs_k[None, None, :] == k, b_w, -0.0), axis=2)
            sig = fast_sigmoid(c)
            b_dc = b_dc * sig * (1.0 + c * (1.0 - sig))

        # dc at s + lag for every tap (within the tile for the owned s)
        shape: tl.constexpr = [BLOCK_T, VEC, BLOCK_K]
        idx = tl.minimum(offs_r[:, None] + lag[None, :], BLOCK_T - 1)
        b_dck = tl.gather(
            tl.broadcast_to(tl.reshape(b_dc, [BLOCK_T, VEC, 1]), shape),
            tl.broadcast_to(idx[:, None, :], shape), axis=0,
        )
        if HAS_SEQ:
            same = _load_seq(p_seq, q[:, None] + lag[None, :], T, s_seq_t) == seq_q[:, None]
            b_dck = tl.where(same[:, None, :], b_dck, 0.0)
        b_dx = tl.sum(b_dck * b_w, axis=2)
        # dweight[k] = sum over the owned s of dc_{s+lag} x_s same(s, s+lag); x_s is a cache hit,
        # loaded masked to the owned times so that the sum stays a fused multiply-add
        b_xo = _load_x(
            p_x, p_init, q, offs_d, own_r[:, None] & mask_d[None, :], T, s_x_t, s_init_t, s_init_d,
            K, HAS_INIT, q0,
        )
        b_dw += b_dck * tl.reshape(b_xo, [BLOCK_T, VEC, 1])
        b_db += tl.where(own_r[:, None], b_dc, 0.0)
        if HAS_DFINAL:
            if q0 + BLOCK_T > T - (K - 1):
                # time q is final-state row q - (T-(K-1)) when it lies in the last document
                j_f = q - (T - (K - 1))
                in_f = (j_f >= 0) & (q < T)
                if HAS_SEQ:
                    in_f = in_f & (seq_q == tl.load(p_seq + (T - 1) * s_seq_t))
                b_dx += tl.load(
                    p_dfinal + j_f[:, None] * s_final_t + offs_d[None, :] * s_final_d,
                    mask=in_f[:, None] & mask_d[None, :], other=0.0,
                ).to(tl.float32)
        own = own_r & (q < T)
        p_o = p_dx + q.to(tl.int64)[:, None] * s_dx_t + offs_d[None, :]
        m_o = own[:, None] & mask_d[None, :]
        tl.store(p_o, b_dx.to(p_dx.dtype.element_ty), mask=m_o & (q >= 0)[:, None])
        if HAS_INIT:
            p_o = p_dinit + (q + K - 1)[:, None] * D + offs_d[None, :]
            tl.store(p_o, b_dx, mask=m_o & (q < 0)[:, None])

    part = pid_b * n_chunks + pid_c
    p_pw = p_dw_part + part * K * D + offs_k[None, :] * D + offs_d[:, None]
    tl.store(p_pw, tl.sum(b_dw, axis=0), mask=mask_d[:, None] & mask_k[None, :])
    tl.store(p_db_part + part * D + offs_d, tl.sum(b_db, axis=0), mask=mask_d)


# fmt: on


# ---------------------------------------------------------------------------- launchers

# launch parameters (scripts/conv_sweep.py times others by replacing these), measured on the
# H200 at 8x2048x1536: forward tiles 32 x 128, 4 warps 45 us (64 x 128: 51); backward 16-byte
# channel vectors 151 us (32-byte: 182). Backward designs with channels along the lanes were
# slower in Triton: dc shifted in time through a per-program scratch 248-355 us; two passes
# (dc, then dx from row-shifted loads of dc) 270-535 us. The K <= 4 forward: 8 groups of 4
# times x 128 channels, 4 warps, 32.2 us there (general kernel 40.6), 7.3-7.8 us at 1 x 4096 x
# 1536 (9.3) and the fastest of six settings inside the 130m graph prefill (README.md).
FWD_BLOCK_T, FWD_BLOCK_D, FWD_WARPS = 32, 128, 4
QUAD_BLOCK_G, QUAD_BLOCK_D, QUAD_WARPS = 8, 128, 4  # K <= 4 without seq_idx; groups 0: off
BWD_VEC_BYTES = 16  # channels per backward thread, in bytes of x


def _blocks(T: int, D: int, block_t: int, block_d: int) -> tuple[int, int]:
    return min(block_t, next_power_of_2(max(T, 1))), min(block_d, next_power_of_2(D))


def conv_fwd(
    x: torch.Tensor,  # [B, T, D], stride 1 in D
    weight: torch.Tensor,  # [D, K]
    bias: torch.Tensor | None,  # [D]
    initial_state: torch.Tensor | None,  # [B, K-1, D]
    seq_idx: torch.Tensor | None,  # [B, T] int32
    silu: bool,
    return_final_state: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [B, T, D] in x.dtype, final_state [B, K-1, D] f32, or an empty tensor)."""
    Bsz, T, D = x.shape
    K = weight.shape[1]
    bias = bias.contiguous() if bias is not None else None
    out = torch.empty((Bsz, T, D), device=x.device, dtype=x.dtype)
    if return_final_state:
        final = torch.empty((Bsz, K - 1, D), device=x.device, dtype=torch.float32)
    else:
        final = torch.empty((0,), device=x.device, dtype=torch.float32)
    if Bsz == 0 or D == 0:
        return out, final
    if T == 0:
        if return_final_state:
            final.copy_(initial_state if initial_state is not None else torch.zeros_like(final))
        return out, final
    BLOCK_K = next_power_of_2(K - 1)
    if K <= 4 and seq_idx is None and QUAD_BLOCK_G > 0:  # groups of 4 times
        BLOCK_G, BLOCK_D = _blocks(cdiv(T, 4), D, QUAD_BLOCK_G, QUAD_BLOCK_D)
        grid = (cdiv(T, 4 * BLOCK_G), cdiv(D, BLOCK_D), Bsz)
        launch(_conv_fwd_quad_kernel, grid,
            x, weight, opt(bias, weight), opt(initial_state, x), out, final,
            T, D,
            x.stride(0), x.stride(1),
            weight.stride(0), weight.stride(1),
            *strides(initial_state, 3),
            out.stride(0), out.stride(1),
            *(final.stride()[:2] if return_final_state else (0, 0)),
            K=K, BLOCK_G=BLOCK_G, BLOCK_D=BLOCK_D, BLOCK_K=BLOCK_K,
            HAS_BIAS=bias is not None, HAS_INIT=initial_state is not None,
            SILU=silu, STORE_FINAL=return_final_state,
            num_warps=QUAD_WARPS,
        )  # fmt: skip
        return out, final
    BLOCK_T, BLOCK_D = _blocks(T, D, FWD_BLOCK_T, FWD_BLOCK_D)
    grid = (cdiv(T, BLOCK_T), cdiv(D, BLOCK_D), Bsz)
    launch(_conv_fwd_kernel, grid,
        x, weight, opt(bias, weight), opt(initial_state, x), opt(seq_idx, x), out, final,
        T, D,
        x.stride(0), x.stride(1),
        weight.stride(0), weight.stride(1),
        *strides(initial_state, 3),
        *strides(seq_idx, 2),
        out.stride(0), out.stride(1),
        *(final.stride()[:2] if return_final_state else (0, 0)),
        K=K, BLOCK_T=BLOCK_T, BLOCK_D=BLOCK_D, BLOCK_K=BLOCK_K,
        HAS_BIAS=bias is not None, HAS_INIT=initial_state is not None,
        HAS_SEQ=seq_idx is not None, SILU=silu, STORE_FINAL=return_final_state,
        num_warps=FWD_WARPS,
    )  # fmt: skip
    return out, final


def conv_bwd(
    dout: torch.Tensor | None,  # [B, T, D], any strides (stride 0 from .sum() losses)
    dfinal: torch.Tensor | None,  # [B, K-1, D], any strides
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    initial_state: torch.Tensor | None,
    seq_idx: torch.Tensor | None,
    silu: bool,
    dx_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(dx in x.dtype, dweight f32 [D, K], dbias f32 [D] or None, dinit f32 or None).
    dx_out: a [B, T, D] tensor of x's dtype (any row strides, stride 1 in D) that receives
    dx, returned as dx."""
    Bsz, T, D = x.shape
    K = weight.shape[1]
    dev = x.device
    bias = bias.contiguous() if bias is not None else None
    dx = dx_out if dx_out is not None else torch.empty((Bsz, T, D), device=dev, dtype=x.dtype)
    dinit = (
        torch.empty((Bsz, K - 1, D), device=dev, dtype=torch.float32)
        if initial_state is not None
        else None
    )
    if T == 0 or Bsz == 0 or D == 0:
        if dinit is not None:
            dinit.copy_(dfinal if dfinal is not None and T == 0 else torch.zeros_like(dinit))
        dw = torch.zeros((D, K), device=dev, dtype=torch.float32)
        db = torch.zeros((D,), device=dev, dtype=torch.float32) if bias is not None else None
        return dx, dw, db, dinit
    if dout is None:
        dout = torch.zeros((), device=dev, dtype=x.dtype).expand(Bsz, T, D)
    s_begin = -(K - 1) if initial_state is not None else 0  # dinit: dx at the state's times
    # a program: one warp, VEC channels (16-byte loads), tiles of up to 32 times (one per
    # lane; a tile owns all but its last K-1)
    BLOCK_T = min(32, next_power_of_2(T - s_begin + K - 1))
    VEC = min(max(BWD_VEC_BYTES // x.element_size(), 1), next_power_of_2(D))
    n_tblk = cdiv(T - s_begin, BLOCK_T - (K - 1))
    n_chunks = cdiv(n_tblk, 16)  # programs along time: ~16 tiles each, evenly split
    tblk_per_chunk = cdiv(n_tblk, n_chunks)
    dw_part = torch.empty((Bsz, n_chunks, K, D), device=dev, dtype=torch.float32)
    db_part = torch.empty((Bsz, n_chunks, D), device=dev, dtype=torch.float32)
    grid = (n_chunks, cdiv(D, VEC), Bsz)
    launch(_conv_bwd_kernel, grid,
        x, weight, opt(bias, weight), opt(initial_state, x), opt(seq_idx, x),
        dout, opt(dfinal, x),
        dx, opt(dinit, x), dw_part, db_part,
        T, D, tblk_per_chunk,
        x.stride(0), x.stride(1),
        weight.stride(0), weight.stride(1),
        *strides(initial_state, 3),
        *strides(seq_idx, 2),
        *dout.stride(),
        *strides(dfinal, 3),
        dx.stride(0), dx.stride(1),
        K=K, BLOCK_T=BLOCK_T, VEC=VEC, BLOCK_K=next_power_of_2(K),
        HAS_BIAS=bias is not None, HAS_INIT=initial_state is not None,
        HAS_SEQ=seq_idx is not None, SILU=silu, HAS_DFINAL=dfinal is not None,
        num_warps=1,
    )  # fmt: skip
    # fixed-order reductions of the per-program partials (deterministic)
    dw = dw_part.sum(dim=(0, 1)).t().contiguous()  # [D, K]
    db = db_part.sum(dim=(0, 1)) if bias is not None else None
    return dx, dw, db, dinit
