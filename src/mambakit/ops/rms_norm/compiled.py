"""The CPU body of `ops.rms_norm` where numba is: the fused add and norm as one autograd node
over `cpu_jit.rmsnorm`, for float32 and float64 rows whose weight (and residual) share
their dtype. It gives what `rms_norm_reference` gives (to the rounding of the sums), which
stays the body for everything else and the oracle of this one (tests/ops/test_rms_norm.py).
"""

from __future__ import annotations

import torch

_DTYPES = (torch.float32, torch.float64)


def compiles(x, weight, residual, out_dtype) -> bool:
    """Whether `rms_norm_compiled` takes these: plain CPU tensors of one float dtype (float32
    or float64; out_dtype that one or None), none empty, outside torch.compile and
    torch.func's transforms, numba there."""
    f = x.dtype
    if type(x) is not torch.Tensor or x.device.type != "cpu" or f not in _DTYPES:
        return False
    if weight.dtype != f or (residual is not None and residual.dtype != f):
        return False
    if (out_dtype is not None and out_dtype != f) or x.numel() == 0:
        return False
    if torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active():
        return False  # (torch.func's transforms: the PyTorch body, which they trace)
    from ..cpu_jit import available

    return available()


def rms_norm_compiled(x, weight, eps, residual):
    """(out, residual_out) of `rms_norm_reference(x, weight, eps, residual)`, compiled (where
    `compiles`): residual_out is x itself without a residual, as there."""
    if residual is None:
        return _Norm.apply(x, weight, eps), x
    return _AddNorm.apply(x, residual, weight, eps)


def _rows(t: torch.Tensor):
    """t [..., D] as an array [R, D] (a copy only where t is not contiguous)."""
    a = t.detach().numpy()
    if not a.flags.c_contiguous:
        a = a.copy()
    return a.reshape(-1, a.shape[-1])


def _grad_rows(g: torch.Tensor | None, like: torch.Tensor):
    return None if g is None else _rows(g if g.dtype == like.dtype else g.to(like.dtype))


class _AddNorm(torch.autograd.Function):
    """(out, r): r = x + residual, out = rmsnorm(r) w."""

    @staticmethod
    def forward(ctx, x, residual, weight, eps):
        from ..cpu_jit import param_array, rmsnorm

        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        r = torch.empty_like(out)
        k = rmsnorm.forward(_rows(x), _rows(residual), param_array(weight), eps, _rows(out),
                            _rows(r))  # fmt: skip
        ctx.save_for_backward(weight, r)
        ctx.k, ctx.eps = k, eps
        ctx.set_materialize_grads(False)
        return out, r

    @staticmethod
    def backward(ctx, g_out, g_r):
        from ..cpu_jit import param_array, rmsnorm

        weight, r = ctx.saved_tensors
        if torch.is_grad_enabled():  # a backward to be differentiated (create_graph)
            gin, gw = _differentiable_backward(g_out, g_r, r, weight, ctx.eps)
            return gin, gin, gw, None
        gin = torch.empty_like(r)
        gw = rmsnorm.backward(_grad_rows(g_out, r), _grad_rows(g_r, r), _rows(r), ctx.k,
                              param_array(weight), _rows(gin))  # fmt: skip
        return gin, gin, torch.from_numpy(gw), None


class _Norm(torch.autograd.Function):
    """out = rmsnorm(x) w."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        from ..cpu_jit import param_array, rmsnorm

        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        ctx.k = rmsnorm.forward(_rows(x), None, param_array(weight), eps, _rows(out), None)
        ctx.eps = eps
        ctx.save_for_backward(x, weight)
        ctx.set_materialize_grads(False)
        return out

    @staticmethod
    def backward(ctx, g_out):
        from ..cpu_jit import param_array, rmsnorm

        x, weight = ctx.saved_tensors
        if torch.is_grad_enabled():  # a backward to be differentiated (create_graph)
            gin, gw = _differentiable_backward(g_out, None, x, weight, ctx.eps)
            return gin, gw, None
        gin = torch.empty_like(x, memory_format=torch.contiguous_format)
        gw = rmsnorm.backward(_grad_rows(g_out, x), None, _rows(x), ctx.k,
                              param_array(weight), _rows(gin))  # fmt: skip
        return gin, torch.from_numpy(gw), None


def _differentiable_backward(g, gr, r, weight, eps):
    """(dL/dr, dL/dw) in PyTorch ops, for a backward that is itself differentiated (r: the
    saved residual stream or input, whose graph reaches the node's inputs)."""
    k = torch.rsqrt(r.square().mean(-1, keepdim=True) + eps)
    gin = torch.zeros_like(r) if g is None else k * g * weight
    if g is not None:
        gin = gin - k.pow(3) * r * (g * weight * r).mean(-1, keepdim=True)
        gw = (g * r * k).reshape(-1, r.shape[-1]).sum(0)
    else:
        gw = torch.zeros_like(weight)
    return (gin if gr is None else gin + gr), gw
