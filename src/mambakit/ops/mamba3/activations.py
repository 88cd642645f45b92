"""The Mamba-3 layer's step size and decay from in_proj's rows in one kernel each way:

    delta = softplus(dd_dt + dt_bias)                  (torch's: u itself above 20)
    A     = -max(f(dd_A), A_floor),  f = `reference.heavy_tail`

in f32 from dd_dt, dd_A [..., H] (two views of in_proj's output with one row stride).
As PyTorch ops that chain is about a dozen launches forward and as many backward, each of
a few microseconds on the device and more than that on the host (an eager Mamba-3 layer's
forward + backward at 8 x 2048 is about 90 launches). `_dt_A_fwd_kernel` writes delta and A
[R, H]; `_dt_A_bwd_kernel` writes dd_dt's and dd_A's gradients in their dtype and each
program's share of dt_bias's gradient [programs, H] (summed after, in a fixed order). The
gradients are the chain's autograd's, ties included: clamp passes its gradient where the
input equals the bound, so f'(0) = 2 (both of f's pieces), and A's clamp passes it where
f(dd_A) = A_floor. A NaN in dd_dt or dd_A stays NaN (the clamps are selects, not min/max).
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from .._triton import launch, next_power_of_2
from .activations_kernels import _dt_A_bwd_kernel, _dt_A_fwd_kernel

BLOCK_R = 64  # rows (tokens) per program


def _rows(t: torch.Tensor) -> int | None:
    """The stride between t's rows when its leading dims read as one and its last is
    contiguous, else None."""
    if t.stride(-1) != 1 and t.shape[-1] > 1:
        return None
    stride = t.stride(-2) if t.dim() > 1 else t.shape[-1]
    expect = stride
    for size, s in zip(reversed(t.shape[:-1]), reversed(t.stride()[:-1])):
        if size > 1 and s != expect:
            return None
        expect *= size
    return stride


def fusable(dd_dt: torch.Tensor, dd_A: torch.Tensor) -> bool:
    """The kernels read dd_dt and dd_A (same shape, one row stride, rows contiguous); under
    torch.compile the chain is compiled instead."""
    if torch.compiler.is_compiling() or dd_dt.shape != dd_A.shape or dd_dt.dim() == 0:
        return False
    stride = _rows(dd_dt)
    return stride is not None and stride == _rows(dd_A)


class _DtA(torch.autograd.Function):
    @staticmethod
    def forward(ctx, dd_dt, dd_A, dt_bias, A_floor):
        dt_bias = dt_bias.contiguous()  # read as [H]
        s_r = _rows(dd_dt)
        H = dd_dt.shape[-1]
        R = dd_dt.numel() // max(H, 1)
        f32 = dict(device=dd_dt.device, dtype=torch.float32)
        delta, A = torch.empty(dd_dt.shape, **f32), torch.empty(dd_dt.shape, **f32)
        if R > 0 and H > 0:
            launch(_dt_A_fwd_kernel, (-(-R // BLOCK_R),), dd_dt, dd_A, dt_bias, delta, A, R, H,
                   s_r, float(A_floor), BLOCK_R=BLOCK_R,
                   BLOCK_H=next_power_of_2(H))  # fmt: skip
        ctx.save_for_backward(dd_dt, dd_A, dt_bias)
        ctx.A_floor, ctx.s_r = float(A_floor), s_r
        return delta, A

    @staticmethod
    @once_differentiable
    def backward(ctx, g_delta, g_A):
        dd_dt, dd_A, dt_bias = ctx.saved_tensors
        H = dd_dt.shape[-1]
        R = dd_dt.numel() // max(H, 1)
        P = -(-R // BLOCK_R)
        d_dt = torch.empty(dd_dt.shape, device=dd_dt.device, dtype=dd_dt.dtype)
        d_A = torch.empty(dd_A.shape, device=dd_A.device, dtype=dd_A.dtype)
        shares = torch.empty(P, H, device=dd_dt.device, dtype=torch.float32)
        if R > 0 and H > 0:
            launch(_dt_A_bwd_kernel, (P,), dd_dt, dd_A, dt_bias, g_delta.contiguous(),
                   g_A.contiguous(), d_dt, d_A, shares, R, H, ctx.s_r, ctx.A_floor,
                   BLOCK_R=BLOCK_R, BLOCK_H=next_power_of_2(H))  # fmt: skip
        d_bias = shares.sum(0).to(dt_bias.dtype)
        return d_dt, d_A, d_bias, None


def dt_and_A(dd_dt: torch.Tensor, dd_A: torch.Tensor, dt_bias: torch.Tensor, A_floor: float):
    """(delta, A) in f32, shaped like dd_dt: the module docstring's; differentiable in dd_dt,
    dd_A and dt_bias [H]. Needs `fusable(dd_dt, dd_A)`."""
    return _DtA.apply(dd_dt, dd_A, dt_bias, A_floor)
