"""Causal conv1d as torch.library custom ops over the Triton kernels, with autograd and fakes.

B batch, T time, D channels, K = d_conv taps. Triton is imported inside the op
bodies only, so CPU users can import this package without it. Inputs are
validated once, in `mambakit.ops`, before these ops run.

`mambakit::causal_conv1d_fwd` always returns (out, final_state); final_state is
an empty tensor unless asked for. The backward saves only the inputs and
recomputes the conv (cheaper than storing its [B, T, D] output).
"""

from __future__ import annotations

import torch

from .._dispatch import Op
from .reference import causal_conv1d_reference, causal_conv1d_update_reference

__all__ = [
    "causal_conv1d_reference",
    "causal_conv1d_update_reference",
    "causal_conv1d_triton",
    "causal_conv1d_update_triton",
]


@torch.library.custom_op("mambakit::causal_conv1d_fwd", mutates_args=())
def _conv_fwd_op(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    initial_state: torch.Tensor | None,
    seq_idx: torch.Tensor | None,
    silu: bool,
    return_final_state: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    from .launch import conv_fwd

    return conv_fwd(x, weight, bias, initial_state, seq_idx, silu, return_final_state)


@_conv_fwd_op.register_fake
def _(x, weight, bias, initial_state, seq_idx, silu, return_final_state):
    Bsz, T, D = x.shape
    K = weight.shape[1]
    out = x.new_empty((Bsz, T, D))
    fshape = (Bsz, K - 1, D) if return_final_state else (0,)
    return out, x.new_empty(fshape, dtype=torch.float32)


def _empty(like: torch.Tensor) -> torch.Tensor:
    """A fresh placeholder for an absent gradient (custom op outputs may not alias)."""
    return like.new_empty((0,), dtype=torch.float32)


@torch.library.custom_op("mambakit::causal_conv1d_bwd", mutates_args=())
def _conv_bwd_op(
    dout: torch.Tensor | None,
    dfinal: torch.Tensor | None,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    initial_state: torch.Tensor | None,
    seq_idx: torch.Tensor | None,
    silu: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dweight, dbias, dinitial_state) in the inputs' dtypes; absent inputs get empty grads."""
    from .launch import conv_bwd

    dx, dw, db, dinit = conv_bwd(dout, dfinal, x, weight, bias, initial_state, seq_idx, silu)
    return (
        dx,
        dw.to(weight.dtype),
        db.to(bias.dtype) if db is not None else _empty(x),
        dinit.to(initial_state.dtype) if dinit is not None else _empty(x),
    )


@_conv_bwd_op.register_fake
def _(dout, dfinal, x, weight, bias, initial_state, seq_idx, silu):
    return (
        torch.empty_like(x, memory_format=torch.contiguous_format),
        torch.empty_like(weight, memory_format=torch.contiguous_format),
        torch.empty_like(bias) if bias is not None else _empty(x),
        torch.empty_like(initial_state, memory_format=torch.contiguous_format)
        if initial_state is not None
        else _empty(x),
    )


def _setup_context(ctx, inputs, output):
    x, weight, bias, initial_state, seq_idx, silu, return_final_state = inputs
    ctx.save_for_backward(x, weight, bias, initial_state, seq_idx)
    ctx.silu = silu
    ctx.return_final_state = return_final_state
    ctx.set_materialize_grads(False)  # an unused output's gradient stays None


def _backward(ctx, dout, dfinal):
    x, weight, bias, initial_state, seq_idx = ctx.saved_tensors
    if not ctx.return_final_state or (dfinal is not None and dfinal.numel() == 0):
        dfinal = None
    dx, dw, db, dinit = conv_bwd_op(dout, dfinal, x, weight, bias, initial_state, seq_idx, ctx.silu)
    return (
        dx,
        dw,
        db if bias is not None else None,
        dinit if initial_state is not None else None,
        None,
        None,
        None,
    )


_conv_fwd_op.register_autograd(_backward, setup_context=_setup_context)
# the handles the package's callers use (eager calls skip the dispatcher: ops/_dispatch.py)
conv_fwd_op = Op(_conv_fwd_op, _setup_context, _backward)
conv_bwd_op = Op(_conv_bwd_op)


def causal_conv1d_triton(
    x: torch.Tensor,  # [B, T, D], stride 1 in D (a strided view is read in place)
    weight: torch.Tensor,  # [D, K]
    bias: torch.Tensor | None = None,  # [D]
    initial_state: torch.Tensor | None = None,  # [B, K-1, D]
    seq_idx: torch.Tensor | None = None,  # [B, T] int32
    activation: str | None = "silu",
    return_final_state: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Triton causal conv1d: out [B, T, D] in x.dtype, and final_state [B, K-1, D] f32."""
    out, final = conv_fwd_op(
        x, weight, bias, initial_state, seq_idx, activation == "silu", return_final_state
    )
    return (out, final) if return_final_state else out


@torch.library.custom_op("mambakit::causal_conv1d_update", mutates_args=("conv_state",))
def _conv_update_op(
    conv_state: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    silu: bool,
) -> torch.Tensor:
    from .launch import conv_update

    return conv_update(conv_state, x, weight, bias, silu)


@_conv_update_op.register_fake
def _(conv_state, x, weight, bias, silu):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


conv_update_op = Op(_conv_update_op)


def causal_conv1d_update_triton(
    conv_state: torch.Tensor,  # [B, K-1, D] f32, updated in place
    x: torch.Tensor,  # [B, D]
    weight: torch.Tensor,  # [D, K]
    bias: torch.Tensor | None = None,  # [D]
    activation: str | None = "silu",
) -> torch.Tensor:
    """One decode step: shifts x into conv_state in place, returns the conv output [B, D]."""
    return conv_update_op(conv_state, x, weight, bias, activation == "silu")
