"""Triton kernels for the depthwise causal conv1d (channels-last), then their launchers.

B batch, T time, D channels, K = d_conv taps. Tap k of output t reads the input
at time t - (K-1-k); negative times read `initial_state` row K-1+t (oldest
first); with `seq_idx` a tap reading another document reads zero, and times
before 0 belong to the document of t = 0.

Forward: one program per (T-block, D-block, batch row). The K shifted loads of a
[BLOCK_T, BLOCK_D] tile overlap in all but K-1 rows, so DRAM traffic is one
read of x and one write of out; the overlap is served from L1/L2.

Backward: with c the pre-activation and dc = dout * silu'(c),

    dx_s      = sum_{j<K} w[K-1-j] * dc_{s+j} * same(s, s+j)   (+ d final_state)
    dw[k]     = sum_{b,t} dc_t * x_{t-(K-1-k)} * same(t-(K-1-k), t)
    dbias     = sum_{b,t} dc_t

and d initial_state is dx at the negative times. Each program owns a chunk of
time of one row and one D-block; it recomputes c (and so dc) for its times and
the K-1 times after each block (a halo), so nothing but x, dout and dx crosses
DRAM. dw and dbias are written as per-program partials and summed in a fixed
order on the host: no atomics, bit-identical runs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


# fmt: off
@triton.jit
def _load_src(
    p_x, p_init, pos, offs_d, mask_d, T, stride_xt, stride_it, stride_id,
    K: tl.constexpr, HAS_INIT: tl.constexpr,
):
    """The conv input at times pos [BT] and channels offs_d [BD], in f32."""
    in_x = (pos >= 0) & (pos < T)
    t_x = tl.where(in_x, pos, 0)
    b_x = tl.load(
        p_x + t_x[:, None] * stride_xt + offs_d[None, :],
        mask=in_x[:, None] & mask_d[None, :], other=0.0,
    ).to(tl.float32)
    if HAS_INIT:
        in_s = (pos < 0) & (pos >= 1 - K)
        t_s = tl.where(in_s, pos + K - 1, 0)
        b_x += tl.load(
            p_init + t_s[:, None] * stride_it + offs_d[None, :] * stride_id,
            mask=in_s[:, None] & mask_d[None, :], other=0.0,
        ).to(tl.float32)
    return b_x


@triton.jit
def _load_seq(p_seq, pos, T, stride_st):
    """seq_idx at times pos, where times before 0 read seq_idx[0] (and past T-1 read T-1)."""
    t = tl.minimum(tl.maximum(pos, 0), T - 1)
    return tl.load(p_seq + t * stride_st)


@triton.jit
def _conv_pre(
    p_x, p_init, p_w, p_b, p_seq, q, seq_q, offs_d, mask_d, T,
    stride_xt, stride_it, stride_id, stride_wd, stride_wk, stride_st,
    K: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_INIT: tl.constexpr, HAS_SEQ: tl.constexpr,
):
    """Pre-activation conv output at times q [BT] (any q; the caller masks q outside [0, T))."""
    acc = tl.zeros([BT, BD], dtype=tl.float32)
    for k in tl.static_range(K):
        pos = q - (K - 1 - k)
        b_x = _load_src(p_x, p_init, pos, offs_d, mask_d, T, stride_xt, stride_it, stride_id, K, HAS_INIT)
        if HAS_SEQ:
            if k < K - 1:
                same = _load_seq(p_seq, pos, T, stride_st) == seq_q
                b_x = tl.where(same[:, None], b_x, 0.0)
        b_w = tl.load(p_w + offs_d * stride_wd + k * stride_wk, mask=mask_d, other=0.0).to(tl.float32)
        acc += b_x * b_w[None, :]
    if HAS_BIAS:
        acc += tl.load(p_b + offs_d, mask=mask_d, other=0.0).to(tl.float32)[None, :]
    return acc


@triton.jit
def _conv_fwd_kernel(
    p_x, p_w, p_b, p_init, p_seq, p_out, p_final,
    T, D,
    stride_xb, stride_xt,
    stride_wd, stride_wk,
    stride_ib, stride_it, stride_id,
    stride_sb, stride_st,
    stride_ob, stride_ot,
    stride_fb, stride_ft,
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
    p_x += pid_b * stride_xb
    p_init += pid_b * stride_ib
    p_seq += pid_b * stride_sb

    seq_t = offs_t
    if HAS_SEQ:
        seq_t = _load_seq(p_seq, offs_t, T, stride_st)
    acc = _conv_pre(
        p_x, p_init, p_w, p_b, p_seq, offs_t, seq_t, offs_d, mask_d, T,
        stride_xt, stride_it, stride_id, stride_wd, stride_wk, stride_st,
        K, BLOCK_T, BLOCK_D, HAS_BIAS, HAS_INIT, HAS_SEQ,
    )
    if SILU:
        acc = acc / (1.0 + tl.exp(-acc))
    p_o = p_out + pid_b * stride_ob + offs_t[:, None] * stride_ot + offs_d[None, :]
    tl.store(p_o, acc.to(p_out.dtype.element_ty), mask=mask_t[:, None] & mask_d[None, :])

    if STORE_FINAL:
        if pid_t == tl.num_programs(0) - 1:
            # final state row j = the input at time T-(K-1)+j, zero outside the last document
            offs_j = tl.arange(0, BLOCK_K)
            mask_j = offs_j < K - 1
            pos = (T - (K - 1) + offs_j).to(tl.int64)
            b_f = _load_src(p_x, p_init, pos, offs_d, mask_d, T, stride_xt, stride_it, stride_id, K, HAS_INIT)
            if HAS_SEQ:
                seq_last = tl.load(p_seq + (T - 1) * stride_st)
                same = _load_seq(p_seq, pos, T, stride_st) == seq_last
                b_f = tl.where(same[:, None], b_f, 0.0)
            p_f = p_final + pid_b * stride_fb + offs_j[:, None] * stride_ft + offs_d[None, :]
            tl.store(p_f, b_f, mask=mask_j[:, None] & mask_d[None, :])


@triton.jit
def _conv_dc(
    p_x, p_init, p_w, p_b, p_seq, p_dout, q, offs_d, mask_d, T,
    stride_xt, stride_it, stride_id, stride_wd, stride_wk, stride_st, stride_gt, stride_gd,
    K: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_INIT: tl.constexpr, HAS_SEQ: tl.constexpr, SILU: tl.constexpr,
    p_dc, stride_ct, FROM_BUF: tl.constexpr,
):
    """dL/dc at times q [BT]: dout through the activation; zero outside [0, T). FROM_BUF: read
    it from p_dc ([T, D] f32 of this row, filled by `_conv_dc_kernel`) instead."""
    in_q = (q >= 0) & (q < T)
    t_q = tl.where(in_q, q, 0)
    if FROM_BUF:
        return tl.load(p_dc + t_q[:, None] * stride_ct + offs_d[None, :],
                       mask=in_q[:, None] & mask_d[None, :], other=0.0)
    dc = tl.load(
        p_dout + t_q[:, None] * stride_gt + offs_d[None, :] * stride_gd,
        mask=in_q[:, None] & mask_d[None, :], other=0.0,
    ).to(tl.float32)
    if SILU:
        seq_q = q
        if HAS_SEQ:
            seq_q = _load_seq(p_seq, q, T, stride_st)
        c = _conv_pre(
            p_x, p_init, p_w, p_b, p_seq, q, seq_q, offs_d, mask_d, T,
            stride_xt, stride_it, stride_id, stride_wd, stride_wk, stride_st,
            K, BT, BD, HAS_BIAS, HAS_INIT, HAS_SEQ,
        )
        sig = 1.0 / (1.0 + tl.exp(-c))
        dc = dc * sig * (1.0 + c * (1.0 - sig))
    return dc


@triton.jit
def _conv_dx(
    p_x, p_init, p_w, p_b, p_seq, p_dout, p_dfinal, s, dc0, offs_d, mask_d, T,
    stride_xt, stride_it, stride_id, stride_wd, stride_wk, stride_st, stride_gt, stride_gd,
    stride_ft, stride_fd,
    K: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_INIT: tl.constexpr, HAS_SEQ: tl.constexpr, SILU: tl.constexpr,
    HAS_DFINAL: tl.constexpr, p_dc, stride_ct, FROM_BUF: tl.constexpr,
):
    """dL/d input at times s [BT] (negative s: the initial state), given dc0 = dL/dc at s."""
    b_w = tl.load(p_w + offs_d * stride_wd + (K - 1) * stride_wk, mask=mask_d, other=0.0)
    acc = dc0 * b_w.to(tl.float32)[None, :]
    seq_s = s
    if HAS_SEQ:
        seq_s = _load_seq(p_seq, s, T, stride_st)
    for j in tl.static_range(1, K):
        q = s + j
        dc = _conv_dc(
            p_x, p_init, p_w, p_b, p_seq, p_dout, q, offs_d, mask_d, T,
            stride_xt, stride_it, stride_id, stride_wd, stride_wk, stride_st, stride_gt, stride_gd,
            K, BT, BD, HAS_BIAS, HAS_INIT, HAS_SEQ, SILU, p_dc, stride_ct, FROM_BUF,
        )
        if HAS_SEQ:
            same = _load_seq(p_seq, q, T, stride_st) == seq_s
            dc = tl.where(same[:, None], dc, 0.0)
        b_w = tl.load(p_w + offs_d * stride_wd + (K - 1 - j) * stride_wk, mask=mask_d, other=0.0)
        acc += dc * b_w.to(tl.float32)[None, :]
    if HAS_DFINAL:
        # time s is final-state row s - (T-(K-1)) when it lies in the last document
        j_f = s - (T - (K - 1))
        in_f = (j_f >= 0) & (s < T)
        if HAS_SEQ:
            in_f = in_f & (seq_s == tl.load(p_seq + (T - 1) * stride_st))
        j_f = tl.where(in_f, j_f, 0)
        acc += tl.load(
            p_dfinal + j_f[:, None] * stride_ft + offs_d[None, :] * stride_fd,
            mask=in_f[:, None] & mask_d[None, :], other=0.0,
        ).to(tl.float32)
    return acc


@triton.jit
def _conv_dc_kernel(
    p_x, p_w, p_b, p_init, p_seq, p_dout, p_dc,
    T, D,
    stride_xb, stride_xt,
    stride_wd, stride_wk,
    stride_ib, stride_it, stride_id,
    stride_sb, stride_st,
    stride_gb, stride_gt, stride_gd,
    K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_INIT: tl.constexpr, HAS_SEQ: tl.constexpr, SILU: tl.constexpr,
):
    """dL/dc for every time, once, into p_dc [B, T, D] f32: the backward then reads its K
    shifted copies instead of recomputing the conv K times."""
    pid_t = tl.program_id(0)
    pid_d = tl.program_id(1)
    pid_b = tl.program_id(2).to(tl.int64)
    q = (pid_t * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    dc = _conv_dc(
        p_x + pid_b * stride_xb, p_init + pid_b * stride_ib, p_w, p_b, p_seq + pid_b * stride_sb,
        p_dout + pid_b * stride_gb, q, offs_d, mask_d, T,
        stride_xt, stride_it, stride_id, stride_wd, stride_wk, stride_st, stride_gt, stride_gd,
        K, BLOCK_T, BLOCK_D, HAS_BIAS, HAS_INIT, HAS_SEQ, SILU, p_dc, D, False,
    )
    p_o = p_dc + pid_b * T * D + q[:, None] * D + offs_d[None, :]
    tl.store(p_o, dc, mask=(q < T)[:, None] & mask_d[None, :])


@triton.jit
def _conv_bwd_kernel(
    p_x, p_w, p_b, p_init, p_seq, p_dout, p_dfinal, p_dc,
    p_dx, p_dinit, p_dw_part, p_db_part,
    T, D, N_TBLK,
    stride_xb, stride_xt,
    stride_wd, stride_wk,
    stride_ib, stride_it, stride_id,
    stride_sb, stride_st,
    stride_gb, stride_gt, stride_gd,
    stride_fb, stride_ft, stride_fd,
    K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_INIT: tl.constexpr, HAS_SEQ: tl.constexpr,
    SILU: tl.constexpr, HAS_DFINAL: tl.constexpr, FROM_BUF: tl.constexpr,
):
    # dx, dinit: contiguous [B, T, D], [B, K-1, D]; partials: [B, n_chunks, K, D], [B, n_chunks, D]
    pid_c = tl.program_id(0)
    pid_d = tl.program_id(1)
    pid_b = tl.program_id(2).to(tl.int64)
    n_chunks = tl.num_programs(0)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    offs_k = tl.arange(0, BLOCK_K)
    p_x += pid_b * stride_xb
    p_init += pid_b * stride_ib
    p_seq += pid_b * stride_sb
    p_dout += pid_b * stride_gb
    p_dfinal += pid_b * stride_fb
    p_dc += pid_b * T * D  # FROM_BUF: dL/dc of this row, [T, D] f32

    b_dw = tl.zeros([BLOCK_K, BLOCK_D], dtype=tl.float32)
    b_db = tl.zeros([BLOCK_D], dtype=tl.float32)
    for i in range(N_TBLK):
        s = ((pid_c * N_TBLK + i) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
        mask_s = s < T
        dc0 = _conv_dc(
            p_x, p_init, p_w, p_b, p_seq, p_dout, s, offs_d, mask_d, T,
            stride_xt, stride_it, stride_id, stride_wd, stride_wk, stride_st, stride_gt, stride_gd,
            K, BLOCK_T, BLOCK_D, HAS_BIAS, HAS_INIT, HAS_SEQ, SILU, p_dc, D, FROM_BUF,
        )
        b_dx = _conv_dx(
            p_x, p_init, p_w, p_b, p_seq, p_dout, p_dfinal, s, dc0, offs_d, mask_d, T,
            stride_xt, stride_it, stride_id, stride_wd, stride_wk, stride_st, stride_gt, stride_gd,
            stride_ft, stride_fd,
            K, BLOCK_T, BLOCK_D, HAS_BIAS, HAS_INIT, HAS_SEQ, SILU, HAS_DFINAL, p_dc, D, FROM_BUF,
        )
        p_o = p_dx + pid_b * T * D + s[:, None] * D + offs_d[None, :]
        tl.store(p_o, b_dx.to(p_dx.dtype.element_ty), mask=mask_s[:, None] & mask_d[None, :])

        b_db += tl.sum(dc0, axis=0)
        seq_s = s
        if HAS_SEQ:
            seq_s = _load_seq(p_seq, s, T, stride_st)
        for k in tl.static_range(K):
            pos = s - (K - 1 - k)
            b_x = _load_src(p_x, p_init, pos, offs_d, mask_d, T, stride_xt, stride_it, stride_id, K, HAS_INIT)
            if HAS_SEQ:
                if k < K - 1:
                    same = _load_seq(p_seq, pos, T, stride_st) == seq_s
                    b_x = tl.where(same[:, None], b_x, 0.0)
            b_dw += tl.where(offs_k[:, None] == k, tl.sum(dc0 * b_x, axis=0)[None, :], 0.0)

    part = pid_b * n_chunks + pid_c
    p_pw = p_dw_part + part * K * D + offs_k[:, None] * D + offs_d[None, :]
    tl.store(p_pw, b_dw, mask=(offs_k[:, None] < K) & mask_d[None, :])
    tl.store(p_db_part + part * D + offs_d, b_db, mask=mask_d)

    if HAS_INIT:
        if pid_c == 0:
            s_h = tl.arange(0, BLOCK_K) - (K - 1)  # the initial state's times
            dc_h = tl.zeros([BLOCK_K, BLOCK_D], dtype=tl.float32)
            b_di = _conv_dx(
                p_x, p_init, p_w, p_b, p_seq, p_dout, p_dfinal, s_h, dc_h, offs_d, mask_d, T,
                stride_xt, stride_it, stride_id, stride_wd, stride_wk, stride_st, stride_gt, stride_gd,
                stride_ft, stride_fd,
                K, BLOCK_K, BLOCK_D, HAS_BIAS, HAS_INIT, HAS_SEQ, SILU, HAS_DFINAL, p_dc, D,
                FROM_BUF,
            )
            p_o = p_dinit + pid_b * (K - 1) * D + (s_h[:, None] + K - 1) * D + offs_d[None, :]
            tl.store(p_o, b_di, mask=(s_h < 0)[:, None] & mask_d[None, :])
# fmt: on


# ---------------------------------------------------------------------------- launchers


def _blocks(T: int, D: int, block_t: int, block_d: int) -> tuple[int, int]:
    return min(block_t, triton.next_power_of_2(max(T, 1))), min(block_d, triton.next_power_of_2(D))


def _opt(t: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """A stand-in pointer for an absent optional input (never dereferenced)."""
    return t if t is not None else like


def _strides(t: torch.Tensor | None, n: int) -> tuple[int, ...]:
    return tuple(t.stride()) if t is not None else (0,) * n


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
    BLOCK_T, BLOCK_D = _blocks(T, D, 64, 128)
    BLOCK_K = triton.next_power_of_2(K - 1)
    grid = (triton.cdiv(T, BLOCK_T), triton.cdiv(D, BLOCK_D), Bsz)
    _conv_fwd_kernel[grid](
        x, weight, _opt(bias, weight), _opt(initial_state, x), _opt(seq_idx, x), out, final,
        T, D,
        x.stride(0), x.stride(1),
        weight.stride(0), weight.stride(1),
        *_strides(initial_state, 3),
        *_strides(seq_idx, 2),
        out.stride(0), out.stride(1),
        *(final.stride()[:2] if return_final_state else (0, 0)),
        K=K, BLOCK_T=BLOCK_T, BLOCK_D=BLOCK_D, BLOCK_K=BLOCK_K,
        HAS_BIAS=bias is not None, HAS_INIT=initial_state is not None,
        HAS_SEQ=seq_idx is not None, SILU=silu, STORE_FINAL=return_final_state,
        num_warps=4,
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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(dx in x.dtype, dweight f32 [D, K], dbias f32 [D] or None, dinit f32 or None)."""
    Bsz, T, D = x.shape
    K = weight.shape[1]
    dev = x.device
    bias = bias.contiguous() if bias is not None else None
    dx = torch.empty((Bsz, T, D), device=dev, dtype=x.dtype)
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
    BLOCK_T, BLOCK_D = _blocks(T, D, 64, 64)
    BLOCK_K = triton.next_power_of_2(K)
    n_tblk = triton.cdiv(T, BLOCK_T)
    tblk_per_chunk = min(n_tblk, 4)
    n_chunks = triton.cdiv(n_tblk, tblk_per_chunk)
    dw_part = torch.empty((Bsz, n_chunks, K, D), device=dev, dtype=torch.float32)
    common = (
        x.stride(0), x.stride(1),
        weight.stride(0), weight.stride(1),
        *_strides(initial_state, 3),
        *_strides(seq_idx, 2),
        *dout.stride(),
    )  # fmt: skip
    # with the activation, dL/dc costs a K-tap conv: compute it once into a buffer (f32,
    # B T D 4 bytes, freed on return) rather than K times inside the backward
    from_buf = bool(silu)
    dc = torch.empty((Bsz, T, D), device=dev, dtype=torch.float32) if from_buf else x
    if from_buf:
        bt, bd = _blocks(T, D, 64, 128)
        _conv_dc_kernel[(triton.cdiv(T, bt), triton.cdiv(D, bd), Bsz)](
            x, weight, _opt(bias, weight), _opt(initial_state, x), _opt(seq_idx, x), dout, dc,
            T, D, *common,
            K=K, BLOCK_T=bt, BLOCK_D=bd,
            HAS_BIAS=bias is not None, HAS_INIT=initial_state is not None,
            HAS_SEQ=seq_idx is not None, SILU=True, num_warps=4,
        )  # fmt: skip
    db_part = torch.empty((Bsz, n_chunks, D), device=dev, dtype=torch.float32)
    grid = (n_chunks, triton.cdiv(D, BLOCK_D), Bsz)
    _conv_bwd_kernel[grid](
        x, weight, _opt(bias, weight), _opt(initial_state, x), _opt(seq_idx, x),
        dout, _opt(dfinal, x), dc,
        dx, _opt(dinit, x), dw_part, db_part,
        T, D, tblk_per_chunk,
        x.stride(0), x.stride(1),
        weight.stride(0), weight.stride(1),
        *_strides(initial_state, 3),
        *_strides(seq_idx, 2),
        *dout.stride(),
        *_strides(dfinal, 3),
        K=K, BLOCK_T=BLOCK_T, BLOCK_D=BLOCK_D, BLOCK_K=BLOCK_K,
        HAS_BIAS=bias is not None, HAS_INIT=initial_state is not None,
        HAS_SEQ=seq_idx is not None, SILU=silu, HAS_DFINAL=dfinal is not None,
        FROM_BUF=from_buf, num_warps=4,
    )  # fmt: skip
    # fixed-order reductions of the per-program partials (deterministic)
    dw = dw_part.sum(dim=(0, 1)).t().contiguous()  # [D, K]
    db = db_part.sum(dim=(0, 1)) if bias is not None else None
    return dx, dw, db, dinit
