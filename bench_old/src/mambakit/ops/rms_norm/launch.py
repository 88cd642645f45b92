"""Launchers of the RMSNorm kernels (kernels.py): `rms_fwd`, `rms_bwd`, and their tiles.

M rows (the flattened leading dims), D features. A program's tile is [BLOCK_M rows, the whole
row]; `config(D)` gives the library's rows and warps per width, `NormConfig` the type a sweep
hands in as `cfg=`.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from .._triton import cdiv, launch, next_power_of_2, sm_count, strides
from .kernels import _rms_bwd_kernel, _rms_fwd_kernel


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
