"""The causal conv1d's forward kernels (channels-last); launched by `kernels.conv_fwd`.

B batch, T time, D channels, K = d_conv taps. Tap k of output t reads the input
at time t - (K-1-k); negative times read `initial_state` row K-1+t (oldest
first); with `seq_idx` a tap reading another document reads zero, and times
before 0 belong to the document of t = 0.

`_conv_fwd_kernel`: one program per (T-block, D-block, batch row). The K shifted loads of
a [BLOCK_T, BLOCK_D] tile overlap in all but K-1 rows, so DRAM traffic is one read of x
and one write of out; the overlap is served from L1/L2. `_conv_fwd_quad_kernel`, for
K <= 4 without seq_idx (the model's case): a program holds its times as groups of 4 and
loads the seven tiles at q - 3 .. q + 3 of its group starts q once for all four outputs
of a group.
"""

import triton
import triton.language as tl

from .._triton import fast_sigmoid


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
        x_m2 = _load_src(
            p_x, p_init, q - 2, offs_d, mask_d, T, s_x_t, s_init_t, s_init_d, K, HAS_INIT
        )
    if K >= 4:
        x_m3 = _load_src(
            p_x, p_init, q - 3, offs_d, mask_d, T, s_x_t, s_init_t, s_init_d, K, HAS_INIT
        )
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


# fmt: on
