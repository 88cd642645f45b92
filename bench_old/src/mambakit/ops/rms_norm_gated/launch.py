"""Launchers of the gated RMSNorm kernels (kernels.py): `gated_fwd`, `gated_bwd`, and their tiles.

M rows (the flattened leading dims), D features in NG = D / G groups of G. A program's tile
is [BLOCK_M rows, next_pow2(G)], one group of its rows; `config(G)` gives the library's rows
and warps per group width, `GatedNormConfig` the type a sweep hands in as `cfg=`.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from .._triton import cdiv, launch, next_power_of_2, sm_count
from .kernels import _gated_bwd_kernel, _gated_fwd_kernel


@dataclasses.dataclass(frozen=True)
class GatedNormConfig:
    """Launch parameters of the gated norm kernels for one group width G; a program's tile is
    [rows, next_pow2(G)], a whole group of each of its rows."""

    rows: int  # forward BLOCK_M: rows per tile
    warps: int  # forward warps
    bwd_rows: int  # backward BLOCK_M
    bwd_warps: int
    per_sm: int  # backward programs per SM, over all groups (each loops over its row blocks)


# Backward (rows, warps) by tile width next_pow2(G), the fastest of a hand sweep on the H200
# (README.md, Kernels): ~16 elements a thread, 1 or 2 rows; narrower tiles take 2 rows, 4 warps
_BWD_TILES = {2048: (1, 4), 4096: (2, 16), 8192: (1, 16)}


@functools.cache
def config(G: int) -> GatedNormConfig:
    """The library's tiles for group width G. Forward: ~4K elements a tile and at least 2
    rows, 4 to 16 warps; backward: `_BWD_TILES`, 8 programs per SM. Cached: the same widths
    come back every layer and every call."""
    bn = next_power_of_2(max(G, 1))
    rows = min(16, max(2, 4096 // bn))
    bwd_rows, bwd_warps = _BWD_TILES.get(bn, (2, 4) if bn <= 1024 else (1, 16))
    return GatedNormConfig(
        rows=rows,
        warps=min(16, max(4, rows * bn // 1024)),
        bwd_rows=bwd_rows,
        bwd_warps=bwd_warps,
        per_sm=8,
    )


def _n_sm(device: torch.device) -> int:
    if device.type == "cuda":
        return sm_count(device.index if device.index is not None else 0)
    return 4  # the interpreter: few programs, each looping over its rows


def _rows(t: torch.Tensor, D: int) -> torch.Tensor:
    """t [..., D] as [M, D] with stride 1 in D (a view whenever the strides allow one)."""
    t2 = t.reshape(-1, D)
    return t2 if D <= 1 or t2.stride(1) == 1 else t2.contiguous()


def gated_fwd(
    x: torch.Tensor,  # [..., D], stride 1 in D
    z: torch.Tensor | None,  # [..., D], stride 1 in D
    weight: torch.Tensor | None,  # [D]
    eps: float,
    group_size: int,  # G, divides D
    norm_before_gate: bool,
    out_dtype: torch.dtype,
    cfg: GatedNormConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [..., D] in out_dtype, contiguous; rstd [M, D / G] f32). cfg: launch parameters
    other than the library's (`config(G)`)."""
    D, G = x.shape[-1], group_size
    x2 = _rows(x, D)
    M = x2.shape[0]
    NG = D // G if G else 0
    z2 = _rows(z, D) if z is not None else None
    w = weight.contiguous() if weight is not None else None
    out = torch.empty(x.shape, device=x.device, dtype=out_dtype)
    rstd = torch.empty((M, NG), device=x.device, dtype=torch.float32)
    if M == 0 or D == 0:
        return out, rstd
    cfg = cfg or config(G)
    BLOCK_M = cfg.rows
    launch(_gated_fwd_kernel, (cdiv(M, BLOCK_M), NG),
        x2, z2 if z2 is not None else x2, w if w is not None else x2, out, rstd,
        M, G, NG, eps,
        x2.stride(0), z2.stride(0) if z2 is not None else 0, D,
        BLOCK_M=BLOCK_M, BLOCK_N=next_power_of_2(G),
        HAS_Z=z2 is not None, HAS_W=w is not None, NORM_BEFORE_GATE=norm_before_gate,
        num_warps=cfg.warps,
    )  # fmt: skip
    return out, rstd


def gated_bwd(
    dout: torch.Tensor,  # [..., D], any strides (stride 0 from .sum() losses)
    x: torch.Tensor,  # [..., D], stride 1 in D (saved by the forward)
    z: torch.Tensor | None,  # [..., D], stride 1 in D
    weight: torch.Tensor | None,  # [D]
    rstd: torch.Tensor,  # [M, D / G] f32
    group_size: int,
    norm_before_gate: bool,
    cfg: GatedNormConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(dx in x.dtype, dz in z.dtype or None, dweight f32 [D] or None), dx and dz
    contiguous. cfg: as for `gated_fwd`."""
    D, G = x.shape[-1], group_size
    M, NG = rstd.shape
    dev = x.device
    dx = torch.empty(x.shape, device=dev, dtype=x.dtype)
    dz = torch.empty(z.shape, device=dev, dtype=z.dtype) if z is not None else None
    if M == 0 or D == 0:
        dw = torch.zeros((D,), device=dev, dtype=torch.float32) if weight is not None else None
        return dx, dz, dw
    x2 = _rows(x, D)
    z2 = _rows(z, D) if z is not None else None
    w = weight.contiguous() if weight is not None else None
    g2 = dout.reshape(-1, D)  # a stride-0 gradient stays a view: its strides go to the kernel
    cfg = cfg or config(G)
    BLOCK_M = cfg.bwd_rows
    n_blocks = cdiv(M, BLOCK_M)
    target = max(1, cfg.per_sm * _n_sm(dev) // NG)
    n_iter = cdiv(n_blocks, min(n_blocks, target))
    n_prog = cdiv(n_blocks, n_iter)
    dw_part = torch.empty((n_prog if w is not None else 0, D), device=dev, dtype=torch.float32)
    launch(_gated_bwd_kernel, (n_prog, NG),
        x2, z2 if z2 is not None else x2, w if w is not None else x2, rstd, g2,
        dx, dz if dz is not None else dx, dw_part,
        M, D, G, NG, n_iter,
        x2.stride(0), z2.stride(0) if z2 is not None else 0, g2.stride(0), g2.stride(1),
        BLOCK_M=BLOCK_M, BLOCK_N=next_power_of_2(G),
        HAS_Z=z2 is not None, HAS_W=w is not None, NORM_BEFORE_GATE=norm_before_gate,
        num_warps=cfg.bwd_warps,
    )  # fmt: skip
    return dx, dz, dw_part.sum(dim=0) if w is not None else None  # fixed-order sum
