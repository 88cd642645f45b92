"""Triton kernels for RMSNorm with a fused residual add, then their launchers.

M rows (the flattened leading dims), D features. Per row:

    r    = x + residual                        (f32: the residual stream)
    rstd = 1 / sqrt(mean(r^2) + eps)           (f32)
    out  = r * rstd * weight                   (cast to the compute dtype)

Backward, with g_out = dL/dout, g_r = dL/d residual_out and r_hat = r * rstd:

    dr      = rstd * (g_out*w - r_hat * mean(g_out*w * r_hat)) + g_r
    dx      = dr (in x.dtype),   dresidual = dr (in residual.dtype)
    dweight = sum_rows g_out * r_hat

The forward saves r (it is an output anyway, the next block's residual) and
rstd [M]; the backward reads r once instead of x and residual. Each program
holds a [BLOCK_M, BLOCK_N] tile with BLOCK_N = next_pow2(D) (the whole row) and
BLOCK_M rows, several for small D so that a program moves enough bytes. The
backward walks a fixed range of rows per program, keeps its dweight partial in
registers and writes it out; the partials are summed in a fixed order.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton
import triton.language as tl

from .._triton import cdiv, launch, next_power_of_2, sm_count, strides


@triton.jit
def _rms_fwd_kernel(
    p_x,
    p_res,
    p_w,
    p_out,
    p_rout,
    p_rstd,
    M,
    D,
    eps,
    s_x_m,
    s_res_m,
    s_out_m,
    s_rout_m,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_RES: tl.constexpr,
    STORE_RES: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < D)[None, :]
    b_r = tl.load(p_x + rows[:, None] * s_x_m + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        b_r += tl.load(p_res + rows[:, None] * s_res_m + cols[None, :], mask=mask, other=0.0).to(
            tl.float32
        )
    if STORE_RES:
        tl.store(p_rout + rows[:, None] * s_rout_m + cols[None, :], b_r, mask=mask)
    b_rstd = 1.0 / tl.sqrt(tl.sum(b_r * b_r, axis=1) / D + eps)  # [BLOCK_M]
    b_w = tl.load(p_w + cols, mask=cols < D, other=0.0).to(tl.float32)
    b_o = b_r * b_rstd[:, None] * b_w[None, :]
    tl.store(
        p_out + rows[:, None] * s_out_m + cols[None, :], b_o.to(p_out.dtype.element_ty), mask=mask
    )
    tl.store(p_rstd + rows, b_rstd, mask=rows < M)


@triton.jit
def _rms_bwd_kernel(
    p_rout,
    p_rstd,
    p_w,
    p_dout,
    p_drout,
    p_dx,
    p_dres,
    p_dw_part,
    M,
    D,
    N_ITER,
    s_rout_m,
    s_dout_m,
    s_dout_n,
    s_drout_m,
    s_drout_n,
    s_dx_m,
    s_dres_m,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_DOUT: tl.constexpr,
    HAS_DROUT: tl.constexpr,
    HAS_DRES: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    mask_n = cols < D
    b_w = tl.load(p_w + cols, mask=mask_n, other=0.0).to(tl.float32)
    b_dw = tl.zeros([BLOCK_N], dtype=tl.float32)
    for i in range(N_ITER):
        rows = (pid.to(tl.int64) * N_ITER + i) * BLOCK_M + tl.arange(0, BLOCK_M)
        mask_m = rows < M
        mask = mask_m[:, None] & mask_n[None, :]
        b_dr = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        if HAS_DOUT:
            b_r = tl.load(p_rout + rows[:, None] * s_rout_m + cols[None, :], mask=mask, other=0.0)
            b_rstd = tl.load(p_rstd + rows, mask=mask_m, other=0.0)
            b_rhat = b_r * b_rstd[:, None]
            b_g = tl.load(
                p_dout + rows[:, None] * s_dout_m + cols[None, :] * s_dout_n, mask=mask, other=0.0
            ).to(tl.float32)
            b_dw += tl.sum(b_g * b_rhat, axis=0)
            b_gw = b_g * b_w[None, :]
            b_c = tl.sum(b_gw * b_rhat, axis=1) / D  # [BLOCK_M]
            b_dr = (b_gw - b_rhat * b_c[:, None]) * b_rstd[:, None]
        if HAS_DROUT:
            b_dr += tl.load(
                p_drout + rows[:, None] * s_drout_m + cols[None, :] * s_drout_n,
                mask=mask,
                other=0.0,
            ).to(tl.float32)
        tl.store(
            p_dx + rows[:, None] * s_dx_m + cols[None, :],
            b_dr.to(p_dx.dtype.element_ty),
            mask=mask,
        )
        if HAS_DRES:
            tl.store(
                p_dres + rows[:, None] * s_dres_m + cols[None, :],
                b_dr.to(p_dres.dtype.element_ty),
                mask=mask,
            )
    tl.store(p_dw_part + pid * D + cols, b_dw, mask=mask_n)


# ---------------------------------------------------------------------------- launchers


@dataclasses.dataclass(frozen=True)
class NormConfig:
    """Launch parameters of the norm kernels for one width D; a program's tile is
    [rows, next_pow2(D)], the whole row (`config` gives the library's, scripts/rms_sweep.py
    times others)."""

    rows: int  # BLOCK_M: rows per tile
    warps: int


@functools.cache
def config(D: int) -> NormConfig:
    """Rows enough for ~4K elements a tile, 4 to 16 warps (cached: the same widths come
    back every layer and every call)."""
    block_n = next_power_of_2(max(D, 1))
    rows = max(1, min(16, 4096 // block_n))
    return NormConfig(rows=rows, warps=min(16, max(4, rows * block_n // 1024)))


def _n_sm(device: torch.device) -> int:
    if device.type == "cuda":
        return sm_count(device.index if device.index is not None else 0)
    return 4  # the interpreter: few programs, each looping over its rows


def _rows(t: torch.Tensor, D: int) -> torch.Tensor:
    """t [..., D] as [M, D] (a view whenever the strides allow one)."""
    return t.reshape(-1, D)


def rms_fwd(
    x: torch.Tensor,  # [..., D], stride 1 in D
    weight: torch.Tensor,  # [D]
    eps: float,
    residual: torch.Tensor | None,  # [..., D]
    out_dtype: torch.dtype,
    store_residual: bool = True,
    cfg: NormConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out [..., D] in out_dtype, residual_out [..., D] f32, rstd [M] f32); without
    store_residual, residual_out is not written (an empty tensor): the caller holds it.
    cfg: launch parameters other than the library's (`config(D)`)."""
    D = x.shape[-1]
    weight = weight.contiguous()
    x2 = _rows(x, D)
    M = x2.shape[0]
    res2 = _rows(residual, D) if residual is not None else None
    if res2 is not None and D > 1 and res2.stride(1) != 1:
        res2 = res2.contiguous()  # the kernel reads rows with stride 1
    out = torch.empty(x.shape, device=x.device, dtype=out_dtype)
    rshape = x.shape if store_residual else (0,)
    rout = torch.empty(rshape, device=x.device, dtype=torch.float32)
    rstd = torch.empty((M,), device=x.device, dtype=torch.float32)
    if M == 0 or D == 0:
        return out, rout, rstd
    cfg = cfg or config(D)
    BLOCK_M, BLOCK_N = cfg.rows, next_power_of_2(D)
    launch(_rms_fwd_kernel, (cdiv(M, BLOCK_M),),
        x2, res2 if res2 is not None else x2, weight, out, rout, rstd,
        M, D, eps,
        x2.stride(0), res2.stride(0) if res2 is not None else 0, D, D,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, HAS_RES=res2 is not None, STORE_RES=store_residual,
        num_warps=cfg.warps,
    )  # fmt: skip
    return out, rout, rstd


def rms_bwd(
    dout: torch.Tensor | None,  # [..., D], any strides (stride 0 from .sum() losses)
    drout: torch.Tensor | None,  # [..., D], any strides
    rout: torch.Tensor,  # [..., D] f32, contiguous (saved by the forward)
    rstd: torch.Tensor,  # [M] f32
    weight: torch.Tensor,  # [D]
    x_dtype: torch.dtype,
    res_dtype: torch.dtype | None,  # None: the forward had no residual
    cfg: NormConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(dx in x_dtype, dresidual in res_dtype or None, dweight f32 [D]). cfg: as for
    `rms_fwd`."""
    D = rout.shape[-1]
    M = rstd.shape[0]
    weight = weight.contiguous()
    dev = rout.device
    dx = torch.empty(rout.shape, device=dev, dtype=x_dtype)
    dres = torch.empty(rout.shape, device=dev, dtype=res_dtype) if res_dtype is not None else None
    if M == 0 or D == 0:
        return dx, dres, torch.zeros((D,), device=dev, dtype=torch.float32)
    g2 = _rows(dout, D) if dout is not None else None
    gr2 = _rows(drout, D) if drout is not None else None
    cfg = cfg or config(D)
    BLOCK_M, BLOCK_N = cfg.rows, next_power_of_2(D)
    n_blocks = cdiv(M, BLOCK_M)
    n_iter = cdiv(n_blocks, min(n_blocks, 4 * _n_sm(dev)))
    n_prog = cdiv(n_blocks, n_iter)
    dw_part = torch.empty((n_prog, D), device=dev, dtype=torch.float32)
    launch(_rms_bwd_kernel, (n_prog,),
        rout, rstd, weight, g2 if g2 is not None else rout, gr2 if gr2 is not None else rout,
        dx, dres if dres is not None else dx, dw_part,
        M, D, n_iter,
        D, *strides(g2, 2), *strides(gr2, 2),
        D, D,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
        HAS_DOUT=g2 is not None, HAS_DROUT=gr2 is not None, HAS_DRES=dres is not None,
        num_warps=cfg.warps,
    )  # fmt: skip
    return dx, dres, dw_part.sum(dim=0)  # fixed-order sum of the partials
