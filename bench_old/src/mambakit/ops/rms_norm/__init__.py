"""RMSNorm with a fused residual add as a torch.library custom op over the Triton kernels.

Triton is imported inside the op bodies only, so CPU users can import this
package without it. Inputs are validated once, in `mambakit.ops`.

`mambakit::rms_norm_fwd` returns (out, residual_out, rstd); the backward saves
residual_out and rstd (no copy of x or residual) and takes gradients for both
public outputs, either of which may be absent.
"""

from __future__ import annotations

import torch

from .._dispatch import Op
from .reference import rms_norm_reference

__all__ = ["rms_norm_reference", "rms_norm_triton"]


@torch.library.custom_op("mambakit::rms_norm_fwd", mutates_args=())
def _rms_fwd_op(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from .launch import rms_fwd

    return rms_fwd(x, weight, eps, residual, out_dtype)


@_rms_fwd_op.register_fake
def _(x, weight, eps, residual, out_dtype):
    M = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return (
        x.new_empty(x.shape, dtype=out_dtype),
        x.new_empty(x.shape, dtype=torch.float32),
        x.new_empty((M,), dtype=torch.float32),
    )


@torch.library.custom_op("mambakit::rms_norm_bwd", mutates_args=())
def _rms_bwd_op(
    dout: torch.Tensor | None,
    dresidual_out: torch.Tensor | None,
    residual_out: torch.Tensor,
    rstd: torch.Tensor,
    weight: torch.Tensor,
    x_dtype: torch.dtype,
    res_dtype: torch.dtype | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dresidual, dweight); dresidual is empty when the forward had no residual."""
    from .launch import rms_bwd

    dx, dres, dw = rms_bwd(dout, dresidual_out, residual_out, rstd, weight, x_dtype, res_dtype)
    if dres is None:
        dres = dx.new_empty((0,))
    return dx, dres, dw.to(weight.dtype)


@_rms_bwd_op.register_fake
def _(dout, dresidual_out, residual_out, rstd, weight, x_dtype, res_dtype):
    shape = residual_out.shape
    return (
        residual_out.new_empty(shape, dtype=x_dtype),
        residual_out.new_empty(
            shape if res_dtype is not None else (0,), dtype=res_dtype or x_dtype
        ),
        torch.empty_like(weight, memory_format=torch.contiguous_format),
    )


def _setup_context(ctx, inputs, output):
    x, weight, eps, residual, out_dtype = inputs
    _, residual_out, rstd = output
    ctx.save_for_backward(residual_out, rstd, weight)
    ctx.x_dtype = x.dtype
    ctx.res_dtype = residual.dtype if residual is not None else None
    # an unused output (the last layer's residual_out, rstd) gets None, not a zero tensor
    ctx.set_materialize_grads(False)


def _backward(ctx, dout, dresidual_out, _drstd):
    residual_out, rstd, weight = ctx.saved_tensors
    dx, dres, dw = rms_bwd_op(
        dout, dresidual_out, residual_out, rstd, weight, ctx.x_dtype, ctx.res_dtype
    )
    return dx, dw, None, dres if ctx.res_dtype is not None else None, None


_rms_fwd_op.register_autograd(_backward, setup_context=_setup_context)
# the handles the package's callers use (eager calls skip the dispatcher: ops/_dispatch.py)
rms_fwd_op = Op(_rms_fwd_op, _setup_context, _backward)
rms_bwd_op = Op(_rms_bwd_op)


def rms_norm_triton(
    x: torch.Tensor,  # [..., D], stride 1 in D
    weight: torch.Tensor,  # [D]
    eps: float = 1e-5,
    residual: torch.Tensor | None = None,  # [..., D]
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out in out_dtype or x.dtype, residual_out = x + residual in f32)."""
    out, residual_out, _ = rms_fwd_op(x, weight, float(eps), residual, out_dtype or x.dtype)
    return out, residual_out
