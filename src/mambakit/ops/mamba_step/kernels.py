"""Triton kernels of one decode step of a Mamba block: three launches per layer.

B batch, M = d_model, D = d_inner, N = d_state, R = dt_rank, K = d_conv,
J = R + 2N (the x_proj rows), P the channel blocks of the first kernel.

At small batch a decode step reads every weight once and does almost no
arithmetic: it is bound by weight streaming and, once the weights stream fast,
by launches. So each kernel streams one weight matrix (or two) and fuses all the
small work around it that needs no grid-wide reduction:

1. `_layer_in_kernel`, one program per D-block of channels: residual add and
   RMSNorm of the block's input (each program recomputes the row statistics:
   M values), the x and z rows of in_proj, the conv update (in place on the
   state) and SiLU -> u, and this block's share of x_proj: a partial sum
   part[p] = W_x[:, block] u[block] of the J values.
2. `_layer_ssm_kernel`, one program per (D-block, row): the sum of the P
   partials in a fixed order (deterministic; `_sum_parts_kernel` does it once
   per row instead when the batch is large), dt_proj, softplus, the state
   update (in place), the D skip and the SiLU(z) gate -> y.
3. `_linear_kernel`: out_proj (y W_out^T), and with an add+norm prologue the
   LM head on the final norm.

Values are rounded to the compute dtype wherever the unfused op chain stores
them (xz, u, x_proj's output, delta, y, out), so both paths agree up to the
summation order of each dot product. Matrix-vector products at batch 1 are
elementwise products summed once at the end (no padding of the batch to the
16 rows tensor cores need); at batch > 1 they are `tl.dot`s on BLOCK_B rows
(f32 inputs in IEEE precision, not TF32; under the interpreter every dtype
is widened to f32 first, since its bf16 `tl.dot` is wrong). Accumulation is f32.

No kernel is autotuned (two of them update the state in place) and none syncs
with the host, so a step can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..selective_scan.tiles import LOG2E, _softplus

# fmt: off


@triton.jit
def _dot_acc(acc, a, w, BLOCK_B: tl.constexpr, IEEE: tl.constexpr):
    """acc + a w^T for a [BLOCK_B, BK] and w [BN, BK]. At BLOCK_B == 1 the accumulator
    is [BN, BK] (elementwise products, summed by `_dot_done`); else [BLOCK_B, BN]."""
    if BLOCK_B == 1:
        return acc + w.to(tl.float32) * a.to(tl.float32)
    elif IEEE:
        return tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
    else:
        return tl.dot(a, tl.trans(w), acc)


@triton.jit
def _dot_done(acc, BLOCK_B: tl.constexpr):
    """The [BLOCK_B, BN] result of a `_dot_acc` accumulation."""
    if BLOCK_B == 1:
        return tl.sum(acc, axis=1)[None, :]
    else:
        return acc


@triton.jit
def _dot_zero(BLOCK_B: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    if BLOCK_B == 1:
        return tl.zeros([BN, BK], dtype=tl.float32)
    else:
        return tl.zeros([BLOCK_B, BN], dtype=tl.float32)


@triton.jit
def _row_rstd(x_ptr, rows, res_ptr, b, mb, M, eps, s_x, s_res, res_out_ptr, s_ro, WRITE_RES,
              HAS_RES: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_K: tl.constexpr):
    """1 / rms of r = x[rows] (+ residual[b]) per row, f32; writes r to res_out when asked."""
    ss = tl.zeros([BLOCK_B], dtype=tl.float32)
    for k0 in range(0, M, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        m = mb[:, None] & (k < M)[None, :]
        r = tl.load(x_ptr + rows[:, None] * s_x + k[None, :], mask=m, other=0.0).to(tl.float32)
        if HAS_RES:
            r += tl.load(res_ptr + b[:, None] * s_res + k[None, :], mask=m, other=0.0)
        ss += tl.sum(r * r, axis=1)
        if WRITE_RES:
            tl.store(res_out_ptr + b[:, None] * s_ro + k[None, :], r, mask=m)
    return 1.0 / tl.sqrt(ss / M + eps)


@triton.jit
def _normed_tile(x_ptr, rows, res_ptr, b, mb, k, M, rstd, nw_ptr, s_x, s_res,
                 HAS_RES: tl.constexpr, HAS_NORM: tl.constexpr, out_ty: tl.constexpr):
    """Columns k of the rows' (normed) input, rounded to the compute dtype: [BLOCK_B, BK]."""
    m = mb[:, None] & (k < M)[None, :]
    r = tl.load(x_ptr + rows[:, None] * s_x + k[None, :], mask=m, other=0.0).to(tl.float32)
    if HAS_RES:
        r += tl.load(res_ptr + b[:, None] * s_res + k[None, :], mask=m, other=0.0)
    if HAS_NORM:
        w = tl.load(nw_ptr + k, mask=k < M, other=0.0).to(tl.float32)
        r = r * rstd[:, None] * w[None, :]
    return r.to(out_ty)


@triton.jit
def _layer_in_kernel(
    x_ptr, res_ptr, nw_ptr, res_out_ptr,
    w_in_ptr, b_in_ptr, conv_ptr, cw_ptr, cb_ptr, w_x_ptr,
    z_ptr, u_ptr, part_ptr,
    Bsz, M, Dn, J, eps,
    s_x, s_res, s_ro, s_win, s_cs_b, s_cs_k, s_cs_d, s_cw_d, s_cw_k, s_wx,
    s_z, s_u, s_pp, s_pb,
    K: tl.constexpr, HAS_RES: tl.constexpr, HAS_IN_BIAS: tl.constexpr,
    HAS_CONV_BIAS: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_B: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_J: tl.constexpr,
):
    pid_d = tl.program_id(0)
    b = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)
    mb = b < Bsz
    rows = b.to(tl.int64)
    cdt = w_in_ptr.dtype.element_ty
    rstd = _row_rstd(x_ptr, rows, res_ptr, b, mb, M, eps, s_x, s_res, res_out_ptr, s_ro,
                     pid_d == 0, HAS_RES, BLOCK_B, BLOCK_K)

    # in_proj rows d (-> x) and D + d (-> z)
    d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    md = d < Dn
    acc_x = _dot_zero(BLOCK_B, BLOCK_D, BLOCK_K)
    acc_z = _dot_zero(BLOCK_B, BLOCK_D, BLOCK_K)
    for k0 in range(0, M, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        a = _normed_tile(x_ptr, rows, res_ptr, b, mb, k, M, rstd, nw_ptr, s_x, s_res,
                         HAS_RES, True, cdt)
        mw = md[:, None] & (k < M)[None, :]
        w_x = tl.load(w_in_ptr + d[:, None] * s_win + k[None, :], mask=mw, other=0.0)
        w_z = tl.load(w_in_ptr + (d + Dn)[:, None] * s_win + k[None, :], mask=mw, other=0.0)
        acc_x = _dot_acc(acc_x, a, w_x, BLOCK_B, IEEE)
        acc_z = _dot_acc(acc_z, a, w_z, BLOCK_B, IEEE)
    xin = _dot_done(acc_x, BLOCK_B)
    z = _dot_done(acc_z, BLOCK_B)
    if HAS_IN_BIAS:
        xin += tl.load(b_in_ptr + d, mask=md, other=0.0).to(tl.float32)[None, :]
        z += tl.load(b_in_ptr + Dn + d, mask=md, other=0.0).to(tl.float32)[None, :]
    mbd = mb[:, None] & md[None, :]
    tl.store(z_ptr + b[:, None] * s_z + d[None, :], z.to(cdt), mask=mbd)
    xin = xin.to(cdt).to(tl.float32)

    # conv update: window = [state rows 0..K-2, x]; the state keeps window rows 1..K-1
    p_s = conv_ptr + b[:, None].to(tl.int64) * s_cs_b + d[None, :] * s_cs_d
    c = xin * tl.load(cw_ptr + d * s_cw_d + (K - 1) * s_cw_k, mask=md, other=0.0
                      ).to(tl.float32)[None, :]
    if HAS_CONV_BIAS:
        c += tl.load(cb_ptr + d, mask=md, other=0.0).to(tl.float32)[None, :]
    prev = tl.load(p_s, mask=mbd, other=0.0)
    for k in tl.static_range(K - 1):
        w_k = tl.load(cw_ptr + d * s_cw_d + k * s_cw_k, mask=md, other=0.0).to(tl.float32)
        c += prev.to(tl.float32) * w_k[None, :]
        if k < K - 2:
            nxt = tl.load(p_s + (k + 1) * s_cs_k, mask=mbd, other=0.0)
            tl.store(p_s + k * s_cs_k, nxt, mask=mbd)
            prev = nxt
    tl.store(p_s + (K - 2) * s_cs_k, xin.to(conv_ptr.dtype.element_ty), mask=mbd)
    u = (c * tl.sigmoid(c)).to(cdt)
    tl.store(u_ptr + b[:, None] * s_u + d[None, :], u, mask=mbd)

    # this block's share of x_proj: part[pid_d, b, :] = u[b, block] W_x[:, block]^T
    j = tl.arange(0, BLOCK_J)
    w_p = tl.load(w_x_ptr + j[:, None] * s_wx + d[None, :],
                  mask=(j < J)[:, None] & md[None, :], other=0.0)
    if BLOCK_B == 1:
        part = tl.sum(w_p.to(tl.float32) * u.to(tl.float32), axis=1)[None, :]
    elif IEEE:
        part = tl.dot(u.to(tl.float32), tl.trans(w_p.to(tl.float32)), input_precision="ieee")
    else:
        part = tl.dot(u, tl.trans(w_p))
    tl.store(part_ptr + pid_d * s_pp + b[:, None] * s_pb + j[None, :], part,
             mask=mb[:, None] & (j < J)[None, :])


@triton.jit
def _sum_parts_kernel(part_ptr, out_ptr, P, J, s_pp, s_pb, s_ob,
                      BLOCK_P: tl.constexpr, BLOCK_J: tl.constexpr):
    """out[b, :] = sum over p of part[p, b, :], in a fixed order (one program per row)."""
    b = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BLOCK_J)
    acc = tl.zeros([BLOCK_J], dtype=tl.float32)
    for p0 in range(0, P, BLOCK_P):
        p = p0 + tl.arange(0, BLOCK_P)
        m = (p < P)[:, None] & (j < J)[None, :]
        acc += tl.sum(tl.load(part_ptr + p[:, None] * s_pp + b * s_pb + j[None, :], mask=m,
                              other=0.0), axis=0)
    tl.store(out_ptr + b * s_ob + j, acc, mask=j < J)


@triton.jit
def _part_sum(part_ptr, b, P, s_pp, s_pb, off, n, BLOCK_P: tl.constexpr, BLOCK: tl.constexpr):
    """sum over p of part[p, b, off:off + n] as [BLOCK], rounded like x_proj's output."""
    i = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for p0 in range(0, P, BLOCK_P):
        p = p0 + tl.arange(0, BLOCK_P)
        m = (p < P)[:, None] & (i < n)[None, :]
        acc += tl.sum(tl.load(part_ptr + p[:, None] * s_pp + b * s_pb + off + i[None, :],
                              mask=m, other=0.0), axis=0)
    return acc


@triton.jit
def _layer_ssm_kernel(
    part_ptr, w_dt_ptr, dtb_ptr, A_ptr, Dv_ptr, u_ptr, z_ptr, h_ptr, y_ptr,
    P, Dn, R, N,
    s_pp, s_pb, s_wdt, s_A, s_u, s_z, s_hb, s_hd, s_y,
    BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid_d = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    cdt = w_dt_ptr.dtype.element_ty
    # x_proj's output for row b: dt_low [R], B [N], C [N], in the compute dtype
    dt_low = _part_sum(part_ptr, b, P, s_pp, s_pb, 0, R, BLOCK_P, BLOCK_R).to(cdt)
    Bv = _part_sum(part_ptr, b, P, s_pp, s_pb, R, N, BLOCK_P, BLOCK_N).to(cdt).to(tl.float32)
    Cv = _part_sum(part_ptr, b, P, s_pp, s_pb, R + N, N, BLOCK_P, BLOCK_N).to(cdt).to(tl.float32)

    d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    md = d < Dn
    r = tl.arange(0, BLOCK_R)
    w_dt = tl.load(w_dt_ptr + d[:, None] * s_wdt + r[None, :],
                   mask=md[:, None] & (r < R)[None, :], other=0.0)
    raw = tl.sum(w_dt.to(tl.float32) * dt_low.to(tl.float32)[None, :], axis=1)
    dt = raw.to(cdt).to(tl.float32) + tl.load(dtb_ptr + d, mask=md, other=0.0)
    dt = _softplus(dt)

    n = tl.arange(0, BLOCK_N)
    mdn = md[:, None] & (n < N)[None, :]
    p_h = h_ptr + b * s_hb + d[:, None] * s_hd + n[None, :]
    h = tl.load(p_h, mask=mdn, other=0.0)
    A = tl.load(A_ptr + d[:, None] * s_A + n[None, :], mask=mdn, other=0.0)
    u = tl.load(u_ptr + b * s_u + d, mask=md, other=0.0).to(tl.float32)
    h = tl.exp2(dt[:, None] * A * LOG2E) * h + (dt * u)[:, None] * Bv[None, :]
    tl.store(p_h, h, mask=mdn)
    y = tl.sum(h * Cv[None, :], axis=1) + tl.load(Dv_ptr + d, mask=md, other=0.0) * u
    zv = tl.load(z_ptr + b * s_z + d, mask=md, other=0.0).to(tl.float32)
    y = y * zv * tl.sigmoid(zv)
    tl.store(y_ptr + b * s_y + d, y.to(cdt), mask=md)


@triton.jit
def _linear_kernel(
    x_ptr, res_ptr, nw_ptr, w_ptr, bias_ptr, out_ptr,
    Bsz, Nout, Kin, eps,
    s_x, s_res, s_w, s_o,
    HAS_RES: tl.constexpr, HAS_NORM: tl.constexpr,
    HAS_BIAS: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_B: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """out = norm(x (+ residual)) W^T (+ bias), or x W^T (+ bias) without the norm."""
    pid_n = tl.program_id(0)
    b = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)
    mb = b < Bsz
    rows = b.to(tl.int64)
    cdt = w_ptr.dtype.element_ty
    if HAS_NORM:
        rstd = _row_rstd(x_ptr, rows, res_ptr, b, mb, Kin, eps, s_x, s_res, out_ptr, 0, False,
                         HAS_RES, BLOCK_B, BLOCK_K)
    else:
        rstd = tl.zeros([BLOCK_B], dtype=tl.float32)
    nn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mn = nn < Nout
    acc = _dot_zero(BLOCK_B, BLOCK_N, BLOCK_K)
    for k0 in range(0, Kin, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        a = _normed_tile(x_ptr, rows, res_ptr, b, mb, k, Kin, rstd, nw_ptr, s_x, s_res,
                         HAS_RES, HAS_NORM, cdt)
        w = tl.load(w_ptr + nn[:, None].to(tl.int64) * s_w + k[None, :],
                    mask=mn[:, None] & (k < Kin)[None, :], other=0.0)
        acc = _dot_acc(acc, a, w, BLOCK_B, IEEE)
    out = _dot_done(acc, BLOCK_B)
    if HAS_BIAS:
        out += tl.load(bias_ptr + nn, mask=mn, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + b[:, None] * s_o + nn[None, :], out.to(out_ptr.dtype.element_ty),
             mask=mb[:, None] & mn[None, :])


# fmt: on


def _block_b(batch: int) -> int:
    """Rows per program: 1 (elementwise products), else a tensor-core tile of 16 to 64."""
    if batch == 1:
        return 1
    return min(64, max(16, triton.next_power_of_2(batch)))


def _ieee(w: torch.Tensor) -> bool:
    """Dot products in f32 IEEE precision: f32 weights (not TF32), and every dtype under
    the interpreter (its bf16/f16 `tl.dot` returns garbage)."""
    return w.dtype == torch.float32 or not w.is_cuda


def layer_step(
    hidden: torch.Tensor,  # [B, M]
    residual: torch.Tensor | None,  # [B, M] f32
    w,  # StepWeights
    conv_state: torch.Tensor,  # [B, K-1, D] f32, updated in place
    ssm_state: torch.Tensor,  # [B, D, N] f32, updated in place
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step of a Mamba block: (out [B, M] in the compute dtype, residual [B, M] f32)."""
    Bsz, M = hidden.shape
    Dn, N, R = w.A.shape[0], w.A.shape[1], w.dt_w.shape[1]
    J = R + 2 * N
    K = w.conv_w.shape[1]
    dev, cdt = hidden.device, w.in_w.dtype
    res_out = torch.empty(Bsz, M, device=dev, dtype=torch.float32)
    z = torch.empty(Bsz, Dn, device=dev, dtype=cdt)
    u = torch.empty(Bsz, Dn, device=dev, dtype=cdt)
    y = torch.empty(Bsz, Dn, device=dev, dtype=cdt)
    interp = not hidden.is_cuda
    block_b = _block_b(Bsz)
    block_d = 16 if (block_b > 1 or interp) else 8
    block_k = 32 if interp else (256 if block_b == 1 else 128)
    P = triton.cdiv(Dn, block_d)
    part = torch.empty(P, Bsz, J, device=dev, dtype=torch.float32)
    block_j = max(16, triton.next_power_of_2(J))
    _layer_in_kernel[(P, triton.cdiv(Bsz, block_b))](
        hidden,
        residual if residual is not None else res_out, w.norm_w, res_out,
        w.in_w, w.in_b if w.in_b is not None else w.in_w,
        conv_state, w.conv_w, w.conv_b if w.conv_b is not None else w.conv_w, w.x_w,
        z, u, part,
        Bsz, M, Dn, J, w.eps,
        hidden.stride(0), residual.stride(0) if residual is not None else 0, res_out.stride(0),
        w.in_w.stride(0), *conv_state.stride(), *w.conv_w.stride(), w.x_w.stride(0),
        z.stride(0), u.stride(0), part.stride(0), part.stride(1),
        K=K, HAS_RES=residual is not None,
        HAS_IN_BIAS=w.in_b is not None, HAS_CONV_BIAS=w.conv_b is not None, IEEE=_ieee(w.in_w),
        BLOCK_B=block_b, BLOCK_D=block_d, BLOCK_K=block_k, BLOCK_J=block_j,
        num_warps=4,
    )  # fmt: skip
    if Bsz > 16:  # reduce the partials once per row, not once per (row, D-block)
        x_dbl = torch.empty(Bsz, J, device=dev, dtype=torch.float32)
        _sum_parts_kernel[(Bsz,)](
            part, x_dbl, P, J, part.stride(0), part.stride(1), x_dbl.stride(0),
            BLOCK_P=32, BLOCK_J=block_j, num_warps=4,
        )  # fmt: skip
        part, P = x_dbl.unsqueeze(0), 1
    block_ds = 16 if interp else 32
    block_n = max(2, triton.next_power_of_2(N))
    _layer_ssm_kernel[(triton.cdiv(Dn, block_ds), Bsz)](
        part, w.dt_w, w.dt_bias, w.A, w.D, u, z, ssm_state, y,
        P, Dn, R, N,
        part.stride(0), part.stride(1), w.dt_w.stride(0), w.A.stride(0), u.stride(0),
        z.stride(0), ssm_state.stride(0), ssm_state.stride(1), y.stride(0),
        BLOCK_P=min(64, triton.next_power_of_2(P)), BLOCK_D=block_ds,
        BLOCK_R=max(2, triton.next_power_of_2(R)), BLOCK_N=block_n, num_warps=4,
    )  # fmt: skip
    out = linear(y, w.out_w, w.out_b)
    return out, res_out


def linear(
    x: torch.Tensor,  # [B, K]
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,
    *,
    residual: torch.Tensor | None = None,  # [B, K] f32
    norm_weight: torch.Tensor | None = None,  # [K]: RMSNorm (of x + residual) first
    eps: float = 1e-5,
) -> torch.Tensor:
    """x W^T (+ bias) at small batch, streaming W once; optionally on rmsnorm(x + residual)."""
    Bsz = x.shape[0]
    Nout, Kin = weight.shape
    out = torch.empty(Bsz, Nout, device=x.device, dtype=weight.dtype)
    interp = not x.is_cuda
    block_b = _block_b(Bsz)
    block_n = 16 if (block_b > 1 or interp or Nout >= 8192) else 8
    if Nout >= 8192 and not interp:
        block_n = 64 if block_b == 1 else 32
    block_k = 32 if interp else (256 if block_b == 1 else 128)
    if block_b == 1 and block_n * block_k > 4096:
        block_k = 4096 // block_n
    _linear_kernel[(triton.cdiv(Nout, block_n), triton.cdiv(Bsz, block_b))](
        x, residual if residual is not None else out,
        norm_weight if norm_weight is not None else weight, weight,
        bias if bias is not None else weight, out,
        Bsz, Nout, Kin, eps,
        x.stride(0), residual.stride(0) if residual is not None else 0, weight.stride(0),
        out.stride(0),
        HAS_RES=residual is not None, HAS_NORM=norm_weight is not None,
        HAS_BIAS=bias is not None, IEEE=_ieee(weight),
        BLOCK_B=block_b, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4,
    )  # fmt: skip
    return out
