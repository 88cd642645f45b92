"""Mamba-2's gated RMSNorm as a torch.library custom op over the Triton kernels.

Triton is imported inside the op bodies only, so CPU users can import this package
without it. Inputs are validated once, in `mambakit.ops`.

`mambakit::rms_norm_gated_fwd` returns (out, rstd); the backward saves x, z, weight and
rstd [M, D / G] f32 (no copy of the gated or normalised values: it recomputes them) and
returns the gradients of x, z and weight (z's and weight's empty when absent).
"""

from __future__ import annotations

import torch

from .._dispatch import Op
from .reference import rms_norm_gated_reference

__all__ = ["rms_norm_gated_reference", "rms_norm_gated_triton"]


@torch.library.custom_op("mambakit::rms_norm_gated_fwd", mutates_args=())
def _gated_fwd_op(
    x: torch.Tensor,
    z: torch.Tensor | None,
    weight: torch.Tensor | None,
    eps: float,
    group_size: int,
    norm_before_gate: bool,
    out_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    from .launch import gated_fwd

    return gated_fwd(x, z, weight, eps, group_size, norm_before_gate, out_dtype)


@_gated_fwd_op.register_fake
def _(x, z, weight, eps, group_size, norm_before_gate, out_dtype):
    D = x.shape[-1]
    M = x.numel() // D if D else 0
    return (
        x.new_empty(x.shape, dtype=out_dtype),
        x.new_empty((M, D // group_size if group_size else 0), dtype=torch.float32),
    )


@torch.library.custom_op("mambakit::rms_norm_gated_bwd", mutates_args=())
def _gated_bwd_op(
    dout: torch.Tensor,
    x: torch.Tensor,
    z: torch.Tensor | None,
    weight: torch.Tensor | None,
    rstd: torch.Tensor,
    group_size: int,
    norm_before_gate: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dz, dweight); dz and dweight are empty where the forward had no z, no weight."""
    from .launch import gated_bwd

    dx, dz, dw = gated_bwd(dout, x, z, weight, rstd, group_size, norm_before_gate)
    dz = dz if dz is not None else dx.new_empty((0,))
    dw = dw.to(weight.dtype) if dw is not None else dx.new_empty((0,))
    return dx, dz, dw


@_gated_bwd_op.register_fake
def _(dout, x, z, weight, rstd, group_size, norm_before_gate):
    return (
        x.new_empty(x.shape),
        z.new_empty(z.shape) if z is not None else x.new_empty((0,)),
        torch.empty_like(weight, memory_format=torch.contiguous_format)
        if weight is not None
        else x.new_empty((0,)),
    )


def _setup_context(ctx, inputs, output):
    x, z, weight, eps, group_size, norm_before_gate, out_dtype = inputs
    _, rstd = output
    ctx.save_for_backward(x, z, weight, rstd)
    ctx.group_size = group_size
    ctx.norm_before_gate = norm_before_gate
    ctx.mark_non_differentiable(rstd)  # read by the backward, never a loss's input
    ctx.set_materialize_grads(False)


def _backward(ctx, dout, _drstd):
    x, z, weight, rstd = ctx.saved_tensors
    if dout is None:
        return None, None, None, None, None, None, None
    dx, dz, dw = gated_bwd_op(dout, x, z, weight, rstd, ctx.group_size, ctx.norm_before_gate)
    dz = dz if z is not None else None
    dw = dw if weight is not None else None
    return dx, dz, dw, None, None, None, None


_gated_fwd_op.register_autograd(_backward, setup_context=_setup_context)
# the handles the package's callers use (eager calls skip the dispatcher: ops/_dispatch.py)
gated_fwd_op = Op(_gated_fwd_op, _setup_context, _backward)
gated_bwd_op = Op(_gated_bwd_op)


def rms_norm_gated_triton(
    x: torch.Tensor,  # [..., D], stride 1 in D
    z: torch.Tensor | None = None,  # [..., D], stride 1 in D
    weight: torch.Tensor | None = None,  # [D]
    eps: float = 1e-5,
    group_size: int | None = None,  # divides D; None: D
    norm_before_gate: bool = False,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """out [..., D] in out_dtype or x.dtype, contiguous."""
    G = group_size or x.shape[-1]
    out, _ = gated_fwd_op(x, z, weight, float(eps), G, bool(norm_before_gate), out_dtype or x.dtype)
    return out
