"""Triton kernels of one decode step of a Mamba block.

B batch, M = d_model, D = d_inner, N = d_state, R = dt_rank, K = d_conv,
J = R + 2N (the x_proj rows).

At small batch a decode step reads every weight once and does almost no
arithmetic, so its time is that of the weights' round trips from memory, and,
once they stream fast, of its launches. Each matrix-vector kernel here gives a
program one slab of the weight, [BLOCK_N rows, all K columns] (`StepConfig.tile` elements,
32 KB in bf16), loaded before anything else so that every program's weights
are in flight at once (one memory round trip, not one per K block), and loops
over its batch rows with the slab in registers. At batch <= `rows_max_batch`
(1: a loop over rows serialises their memory round trips, since a row's loads
cannot move above the previous row's stores) a block is four launches:

1. `_layer_in_kernel`: the x and z rows of in_proj for a block of channels,
   the conv update of those channels (in place on the state) and SiLU -> u.
   At batch 1 the residual add and RMSNorm are its prologue (each program
   recomputes the row's statistics: M values); above, one `rms_norm` launch
   before it normalises every row once.
2. `_linear_kernel`: x_proj, u W_x^T -> (dt_low, B, C).
3. `_layer_ssm_kernel`: dt_proj, softplus, the state update (in place), the
   D skip and the SiLU(z) gate -> y.
4. `_linear_kernel`: out_proj. With the add+norm prologue, the LM head.

Above `rows_max_batch` rows the projections go to cuBLAS (`F.linear`) and the
small work between them stays fused: the norm, the conv update, then dt_proj
(while row blocks x its weight <= `dt_proj_fused_bytes`) + state update + gate in
`_layer_ssm_kernel`, `ssm_rows` rows per program.

Values are rounded to the compute dtype wherever the unfused op chain stores
them (xz, u, x_proj's output, delta, y, out), so both paths agree up to the
summation order of each dot product; accumulation is f32.

On sm_90+ the kernels are launched with programmatic dependent launch: each
lets the next one start as soon as all its programs are running, and waits
for its predecessor (`gdc_wait`) only after loading its own weights, so a
kernel's weight stream overlaps the previous kernel's tail and launch gap.

No kernel is
autotuned (two update the state in place) and none syncs with the host, so a
step can be captured in a CUDA graph.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .._triton import cdiv, launch, next_power_of_2, pdl_args, pdl_start, pdl_wait
from ..causal_conv1d.launch import conv_update
from ..rms_norm.launch import rms_fwd
from ..selective_scan.tiles import LOG2E, _softplus


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """Launch parameters of the decode step's kernels (not autotuned: two update the state
    in place; `config` gives the library's, scripts/step_sweep.py times others).

    tile: H200, batch-1 graph step: 1.4b 1124 us at 8192, 1068 at 16384 (32768: 1068, 4096:
    1096); 130m 213-218 us at any of them. ssm_rows: H200, graph step at batch 64: 130m 675.5
    us at 2 (1: 699.2; 4: 852.9, 8: 718.1, registers spilled by the [rows, channels, R]
    dt_proj product); 1.4b 2652.7 at 2 (1: 2712.2)."""

    tile: int = 16384  # elements of a program's weight slab (32 KB in bf16)
    rows_max_batch: int = 1  # up to this batch the weights stream through here; above, cuBLAS
    dt_proj_fused_bytes: int = 16 << 20  # row blocks x dt_proj weight bytes fused, at most
    ssm_rows: int = 2  # batch rows per program of _layer_ssm_kernel
    ssm_block_d: int = 32  # channels per program of _layer_ssm_kernel
    ssm_warps: int = 4  # warps per program of _layer_ssm_kernel


_GPU = StepConfig()
_INTERPRETED = StepConfig(ssm_block_d=16)


def config(interpret: bool) -> StepConfig:
    """The library's launch parameters: on the GPU, or under the interpreter."""
    return _INTERPRETED if interpret else _GPU


# fmt: off


@triton.jit
def _load_row(p_x, p_res, b, k, mk, s_x, s_res, HAS_RES: tl.constexpr):
    """Row b of x (+ residual) in f32."""
    r = tl.load(p_x + b * s_x + k, mask=mk, other=0.0).to(tl.float32)
    if HAS_RES:
        r += tl.load(p_res + b * s_res + k, mask=mk, other=0.0)
    return r


@triton.jit
def _norm_row(r, nw, M, eps, cdt: tl.constexpr):
    """RMSNorm of one f32 row, rounded to the compute dtype (and back to f32)."""
    rstd = 1.0 / tl.sqrt(tl.sum(r * r, axis=0) / M + eps)
    return (r * rstd * nw).to(cdt).to(tl.float32)


@triton.jit
def _layer_in_kernel(
    p_x, p_res, p_nw, p_res_out, p_w_in, p_b_in, p_conv, p_cw, p_cb,
    p_z, p_u,
    Bsz, M, Dn, eps,
    s_x, s_res, s_ro, s_win, s_cs_b, s_cs_k, s_cs_d, s_cw_d, s_cw_k, s_z, s_u,
    K: tl.constexpr, HAS_NORM: tl.constexpr, HAS_RES: tl.constexpr,
    HAS_IN_BIAS: tl.constexpr, HAS_CONV_BIAS: tl.constexpr,
    BLOCK_B: tl.constexpr, BLOCK_D: tl.constexpr, K_PAD: tl.constexpr, KC: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_start(PDL)
    pid_b = tl.program_id(0)
    pid_d = tl.program_id(1)
    cdt: tl.constexpr = p_w_in.dtype.element_ty
    d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    md = d < Dn
    k = tl.arange(0, K_PAD)
    mk = k < M
    mw = md[:, None] & mk[None, :]
    # the slabs first: every program's weights in flight before any other load
    w_x = tl.load(p_w_in + d[:, None] * s_win + k[None, :], mask=mw, other=0.0)
    w_z = tl.load(p_w_in + (d + Dn)[:, None] * s_win + k[None, :], mask=mw, other=0.0)
    if HAS_NORM:
        nw = tl.load(p_nw + k, mask=mk, other=0.0).to(tl.float32)
    cw_last = tl.load(p_cw + d * s_cw_d + (K - 1) * s_cw_k, mask=md, other=0.0).to(tl.float32)
    j = tl.arange(0, KC)  # conv taps 0..K-2 are the history rows of the state
    mh = (j < K - 1)[:, None] & md[None, :]
    cw_hist = tl.load(p_cw + d[None, :] * s_cw_d + j[:, None] * s_cw_k, mask=mh, other=0.0
                      ).to(tl.float32)
    pdl_wait(PDL)
    for i in tl.static_range(BLOCK_B):
        b = pid_b * BLOCK_B + i
        if b < Bsz:
            r = _load_row(p_x, p_res, b, k, mk, s_x, s_res, HAS_RES)
            if HAS_NORM:
                if pid_d == 0:
                    tl.store(p_res_out + b * s_ro + k, r, mask=mk)
                a = _norm_row(r, nw, M, eps, cdt)
            else:
                a = r
            xin = tl.sum(w_x.to(tl.float32) * a[None, :], axis=1)
            z = tl.sum(w_z.to(tl.float32) * a[None, :], axis=1)
            if HAS_IN_BIAS:
                xin += tl.load(p_b_in + d, mask=md, other=0.0).to(tl.float32)
                z += tl.load(p_b_in + Dn + d, mask=md, other=0.0).to(tl.float32)
            tl.store(p_z + b * s_z + d, z.to(cdt), mask=md)
            xin = xin.to(cdt).to(tl.float32)
            # conv update: window = [state rows 0..K-2, x]; the state keeps rows 1..K-1.
            # A channel's value may sit in several threads (a small BLOCK_D): all of
            # them load the history before any of them stores its shift.
            p_s = p_conv + b * s_cs_b + j[:, None] * s_cs_k + d[None, :] * s_cs_d
            hist = tl.load(p_s, mask=mh, other=0.0)
            c = tl.sum(hist.to(tl.float32) * cw_hist, axis=0) + xin * cw_last
            if HAS_CONV_BIAS:
                c += tl.load(p_cb + d, mask=md, other=0.0).to(tl.float32)
            tl.debug_barrier()
            tl.store(p_s - s_cs_k, hist, mask=mh & (j >= 1)[:, None])
            tl.store(p_conv + b * s_cs_b + (K - 2) * s_cs_k + d * s_cs_d,
                     xin.to(p_conv.dtype.element_ty), mask=md)
            tl.store(p_u + b * s_u + d, (c * tl.sigmoid(c)).to(cdt), mask=md)


@triton.jit
def _layer_ssm_kernel(
    p_xd, p_w_dt, p_delta, p_dtb, p_A, p_Dv, p_u, p_z, p_h, p_y,
    Bsz, Dn, R, N,
    s_xd, s_wdt, s_delta, s_A, s_u, s_z, s_hb, s_hd, s_y,
    DT_PROJ: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr,
):
    """y = state update(u, delta, B, C) * silu(z) for BLOCK_B rows x BLOCK_D channels, delta
    = x_dbl[:, :R] W_dt^T computed here (DT_PROJ) or read from p_delta. The rows are one
    tile dimension, not a loop: every row's loads are issued before any store, and A and
    W_dt are read once per BLOCK_B rows."""
    pdl_start(PDL)
    pid_b = tl.program_id(0)
    pid_d = tl.program_id(1)
    cdt: tl.constexpr = p_w_dt.dtype.element_ty
    rb = pid_b * BLOCK_B + tl.arange(0, BLOCK_B)
    mb = rb < Bsz
    rb = rb.to(tl.int64)
    d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    md = d < Dn
    r = tl.arange(0, BLOCK_R)
    n = tl.arange(0, BLOCK_N)
    mn = n < N
    if DT_PROJ:
        w_dt = tl.load(p_w_dt + d[:, None] * s_wdt + r[None, :],
                       mask=md[:, None] & (r < R)[None, :], other=0.0).to(tl.float32)
    A = tl.load(p_A + d[:, None] * s_A + n[None, :], mask=md[:, None] & mn[None, :],
                other=0.0) * LOG2E
    dt_bias = tl.load(p_dtb + d, mask=md, other=0.0)
    Dv = tl.load(p_Dv + d, mask=md, other=0.0)
    pdl_wait(PDL)
    mbd = mb[:, None] & md[None, :]  # [BLOCK_B, BLOCK_D]
    mbn = mb[:, None] & mn[None, :]  # [BLOCK_B, BLOCK_N]
    # x_proj's output of the rows: dt_low [R], B [N], C [N]
    Bv = tl.load(p_xd + rb[:, None] * s_xd + R + n[None, :], mask=mbn, other=0.0)
    Cv = tl.load(p_xd + rb[:, None] * s_xd + R + N + n[None, :], mask=mbn, other=0.0)
    p_h_tile = p_h + rb[:, None, None] * s_hb + d[None, :, None] * s_hd + n[None, None, :]
    m_h = mbd[:, :, None] & mn[None, None, :]
    h = tl.load(p_h_tile, mask=m_h, other=0.0)
    u = tl.load(p_u + rb[:, None] * s_u + d[None, :], mask=mbd, other=0.0).to(tl.float32)
    zv = tl.load(p_z + rb[:, None] * s_z + d[None, :], mask=mbd, other=0.0).to(tl.float32)
    if DT_PROJ:  # [BLOCK_B, BLOCK_D, R] products summed over R
        dt_low = tl.load(p_xd + rb[:, None] * s_xd + r[None, :],
                         mask=mb[:, None] & (r < R)[None, :], other=0.0).to(tl.float32)
        raw = tl.sum(w_dt[None, :, :] * dt_low[:, None, :], axis=2)
        raw = raw.to(cdt).to(tl.float32)  # rounded as the GEMM's output would be
    else:
        raw = tl.load(p_delta + rb[:, None] * s_delta + d[None, :], mask=mbd,
                      other=0.0).to(tl.float32)
    dt = _softplus(raw + dt_bias[None, :])
    h = (tl.exp2(dt[:, :, None] * A[None, :, :]) * h
         + (dt * u)[:, :, None] * Bv.to(tl.float32)[:, None, :])
    tl.debug_barrier()  # every copy of a state element is loaded before one is stored
    tl.store(p_h_tile, h, mask=m_h)
    y = tl.sum(h * Cv.to(tl.float32)[:, None, :], axis=2) + Dv[None, :] * u
    y = y * zv * tl.sigmoid(zv)
    tl.store(p_y + rb[:, None] * s_y + d[None, :], y.to(cdt), mask=mbd)


@triton.jit
def _linear_kernel(
    p_x, p_res, p_nw, p_w, p_bias, p_out, p_res_out,
    Bsz, Nout, Kin, eps,
    s_x, s_res, s_w, s_o, s_ro,
    HAS_RES: tl.constexpr, HAS_NORM: tl.constexpr, HAS_BIAS: tl.constexpr,
    RES_OUT: tl.constexpr,
    BLOCK_B: tl.constexpr, BLOCK_N: tl.constexpr, K_PAD: tl.constexpr, PDL: tl.constexpr,
):
    """out = rmsnorm(x + residual) W^T (+ bias), or x W^T (+ bias) without the norm.
    RES_OUT: the first column block's programs also store x + residual (f32)."""
    pdl_start(PDL)
    pid_b = tl.program_id(0)
    pid_n = tl.program_id(1)
    cdt: tl.constexpr = p_w.dtype.element_ty
    nn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mn = nn < Nout
    k = tl.arange(0, K_PAD)
    mk = k < Kin
    w = tl.load(p_w + nn[:, None].to(tl.int64) * s_w + k[None, :],
                mask=mn[:, None] & mk[None, :], other=0.0)
    if HAS_NORM:
        nw = tl.load(p_nw + k, mask=mk, other=0.0).to(tl.float32)
    if HAS_BIAS:
        bias = tl.load(p_bias + nn, mask=mn, other=0.0).to(tl.float32)
    pdl_wait(PDL)
    for i in tl.static_range(BLOCK_B):
        b = pid_b * BLOCK_B + i
        if b < Bsz:
            a = _load_row(p_x, p_res, b, k, mk, s_x, s_res, HAS_RES)
            if RES_OUT:
                if pid_n == 0:
                    tl.store(p_res_out + b * s_ro + k, a, mask=mk)
            if HAS_NORM:
                a = _norm_row(a, nw, Kin, eps, cdt)
            out = tl.sum(w.to(tl.float32) * a[None, :], axis=1)
            if HAS_BIAS:
                out += bias
            tl.store(p_out + b * s_o + nn, out.to(p_out.dtype.element_ty), mask=mn)


# fmt: on


def _rows_per_program(n_rows: int, k_pad: int, tile: int, interp: bool) -> int:
    """Weight rows per program: a `tile`-element slab, fewer while that leaves under two
    programs per SM (more programs keep more of the weight in flight)."""
    block = max(1, tile // k_pad)
    if interp:
        return min(block, 4)
    while block > 1 and cdiv(n_rows, block) < 264:
        block //= 2
    return block


def _block_b(batch: int) -> int:
    return min(16, next_power_of_2(batch))


def _warps(tile: int) -> int:
    return 8 if tile >= 8192 else 4


def layer_step(
    hidden: torch.Tensor,  # [B, M]
    residual: torch.Tensor | None,  # [B, M] f32
    w,  # StepWeights
    conv_state: torch.Tensor,  # [B, K-1, D] f32, updated in place
    ssm_state: torch.Tensor,  # [B, D, N] f32, updated in place
    cfg: StepConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step of a Mamba block: (out [B, M] in the compute dtype, residual [B, M] f32).
    cfg: launch parameters other than the library's (`config`)."""
    Bsz, M = hidden.shape
    Dn = w.A.shape[0]
    K = w.conv_w.shape[1]
    dev, cdt = hidden.device, w.in_w.dtype
    interp = not hidden.is_cuda
    cfg = cfg or (_INTERPRETED if interp else _GPU)
    tile = cfg.tile
    k_pad = next_power_of_2(M)
    if Bsz > cfg.rows_max_batch or k_pad > tile:
        normed, res_out, _ = rms_fwd(hidden, w.norm_w, w.eps, residual, cdt)
        xz = F.linear(normed, w.in_w, w.in_b)
        u = conv_update(conv_state, xz[:, :Dn], w.conv_w, w.conv_b, silu=True)
        z = xz[:, Dn:]
        x_dbl = F.linear(u, w.x_w)
        y = _ssm(x_dbl, w, u, z, ssm_state, cfg)
        return F.linear(y, w.out_w, w.out_b), res_out
    fuse_norm = Bsz == 1
    if fuse_norm:
        res_out = torch.empty(Bsz, M, device=dev, dtype=torch.float32)
        x, x_res = hidden, residual
    else:
        x, res_out, _ = rms_fwd(hidden, w.norm_w, w.eps, residual, cdt)
        x_res = None
    z = torch.empty(Bsz, Dn, device=dev, dtype=cdt)
    u = torch.empty(Bsz, Dn, device=dev, dtype=cdt)
    block_b = _block_b(Bsz)
    # two slabs (x and z rows) of `tile` elements: at d_model 2048 that halves the
    # programs, so half as many reloads of the row for the norm prologue
    block_d = _rows_per_program(Dn, k_pad, tile, interp)
    launch(_layer_in_kernel, (cdiv(Bsz, block_b), cdiv(Dn, block_d)),
        x, x_res if x_res is not None else x, w.norm_w, res_out,
        w.in_w, w.in_b if w.in_b is not None else w.in_w,
        conv_state, w.conv_w, w.conv_b if w.conv_b is not None else w.conv_w,
        z, u,
        Bsz, M, Dn, w.eps,
        x.stride(0), x_res.stride(0) if x_res is not None else 0, res_out.stride(0),
        w.in_w.stride(0), *conv_state.stride(), *w.conv_w.stride(), z.stride(0), u.stride(0),
        K=K, HAS_NORM=fuse_norm, HAS_RES=x_res is not None,
        HAS_IN_BIAS=w.in_b is not None, HAS_CONV_BIAS=w.conv_b is not None,
        BLOCK_B=block_b, BLOCK_D=block_d, K_PAD=k_pad, KC=next_power_of_2(K),
        num_warps=_warps(2 * block_d * k_pad), **pdl_args(x),
    )  # fmt: skip
    x_dbl = linear(u, w.x_w, cfg=cfg)
    y = _ssm(x_dbl, w, u, z, ssm_state, cfg)
    return linear(y, w.out_w, w.out_b, cfg=cfg), res_out


def _ssm(x_dbl, w, u, z, ssm_state, cfg: StepConfig) -> torch.Tensor:
    """dt_proj + softplus + state update + D skip + gate: y [B, D] in the compute dtype.

    cfg.ssm_rows rows per program (fewer at a smaller batch), as one tile dimension. When
    the programs' reads of dt_proj's weight (one per row block) exceed
    cfg.dt_proj_fused_bytes, dt_proj is a cuBLAS GEMM."""
    Bsz, Dn = u.shape
    N, R = w.A.shape[1], w.dt_w.shape[1]
    y = torch.empty(Bsz, Dn, device=u.device, dtype=u.dtype)
    block_b = min(cfg.ssm_rows, next_power_of_2(Bsz))
    row_blocks = cdiv(Bsz, block_b)
    # each row block's programs read dt_proj's weight again (from L2): worth it while that
    # stays small; a cuBLAS GEMM of a few rows costs ~5 us
    dt_proj = row_blocks * w.dt_w.numel() * w.dt_w.element_size() <= cfg.dt_proj_fused_bytes
    delta = y if dt_proj else F.linear(x_dbl[:, :R], w.dt_w)
    block_d = cfg.ssm_block_d
    launch(_layer_ssm_kernel, (row_blocks, cdiv(Dn, block_d)),
        x_dbl, w.dt_w, delta, w.dt_bias, w.A, w.D, u, z, ssm_state, y,
        Bsz, Dn, R, N,
        x_dbl.stride(0), w.dt_w.stride(0), delta.stride(0), w.A.stride(0), u.stride(0),
        z.stride(0), ssm_state.stride(0), ssm_state.stride(1), y.stride(0),
        DT_PROJ=dt_proj, BLOCK_B=block_b, BLOCK_D=block_d,
        BLOCK_R=max(2, next_power_of_2(R)), BLOCK_N=max(2, next_power_of_2(N)),
        num_warps=cfg.ssm_warps, **pdl_args(u),
    )  # fmt: skip
    return y


def linear(
    x: torch.Tensor,  # [B, K]
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,
    *,
    residual: torch.Tensor | None = None,  # [B, K] f32
    norm_weight: torch.Tensor | None = None,  # [K]: RMSNorm (of x + residual) first
    eps: float = 1e-5,
    return_residual: bool = False,
    cfg: StepConfig | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x W^T (+ bias) at small batch, streaming W once; optionally on rmsnorm(x + residual).
    return_residual (with norm_weight): (out, x + residual in f32), the block's next
    residual, stored by the same kernel. cfg: as for `layer_step`."""
    if return_residual and norm_weight is None:
        raise ValueError(
            "linear: return_residual needs norm_weight (the residual is the norm's input)"
        )
    Bsz = x.shape[0]
    Nout, Kin = weight.shape
    cdt = weight.dtype
    cfg = cfg or _GPU  # (the interpreter's differs in the SSM kernel's fields alone)
    tile = cfg.tile
    k_pad = next_power_of_2(Kin)
    res_out = None
    if norm_weight is not None and (Bsz > 1 or k_pad > tile):
        x, res_out, _ = rms_fwd(x, norm_weight, eps, residual, cdt, store_residual=return_residual)
        residual = norm_weight = None
    if Bsz > cfg.rows_max_batch or k_pad > tile:
        out = F.linear(x if x.dtype == cdt else x.to(cdt), weight, bias)
        return (out, res_out) if return_residual else out
    out = torch.empty(Bsz, Nout, device=x.device, dtype=cdt)
    if return_residual and res_out is None:
        res_out = torch.empty(Bsz, Kin, device=x.device, dtype=torch.float32)
    store_res = return_residual and norm_weight is not None
    block_b = _block_b(Bsz)
    block_n = _rows_per_program(Nout, k_pad, tile, not x.is_cuda)
    launch(_linear_kernel, (cdiv(Bsz, block_b), cdiv(Nout, block_n)),
        x, residual if residual is not None else out,
        norm_weight if norm_weight is not None else weight, weight,
        bias if bias is not None else weight, out, res_out if store_res else out,
        Bsz, Nout, Kin, eps,
        x.stride(0), residual.stride(0) if residual is not None else 0, weight.stride(0),
        out.stride(0), res_out.stride(0) if store_res else 0,
        HAS_RES=residual is not None, HAS_NORM=norm_weight is not None,
        HAS_BIAS=bias is not None, RES_OUT=store_res,
        BLOCK_B=block_b, BLOCK_N=block_n, K_PAD=k_pad, num_warps=_warps(block_n * k_pad),
        **pdl_args(x),
    )  # fmt: skip
    return (out, res_out) if return_residual else out
