"""The Mamba mixer between in_proj and out_proj as one op: conv -> x_proj -> dt_proj -> scan.

B batch, T time, D = d_inner, N = d_state, K = d_conv, R = dt_rank.

    x_in, z    = split(xz)                          xz [B, T, 2D], the in_proj output
    u          = silu(conv(x_in))                   [B, T, D]
    dt_r, B, C = split(u @ W_x^T, [R, N, N])        x_dbl [B, T, R + 2N]
    delta      = dt_r @ W_dt^T                      [B, T, D]; bias and softplus in the scan
    y          = scan(u, delta, A, B, C, D, z)      [B, T, D], gated by silu(z)

On the Triton backend one autograd node covers all of it and chooses what the
backward keeps: xz, x_dbl and the scan's state every KS TC steps. dt_proj is a kernel
of ours (kernels.py) that also adds the bias and applies softplus, once, for both
of the scan's passes. The backward recomputes u (one conv launch) and raw delta
(the same kernel, the same bits) instead of storing two [B, T, D] activations, as
mamba_ssm's `mamba_inner_fn` (checkpoint_lvl=1) does (`mamba_inner_triton` here). The
reference (reference.py) composes the ops, each with its own autograd; it is the CPU
path and, run with the Triton ops, the oracle of the fused node. `mambakit.ops.mamba_inner`
picks between them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from .._dispatch import Op
from ..causal_conv1d import conv_fwd_op
from ..selective_scan import scan_fwd_op


def _as(w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """w in dtype; w itself when it is already (a no-op `.to` still costs a dispatch)."""
    return w if w.dtype == dtype else w.to(dtype)


@torch.library.custom_op("mambakit::dt_proj", mutates_args=())
def _dt_proj_op(
    x_dbl: torch.Tensor, dt_proj_weight: torch.Tensor, dt_bias: torch.Tensor | None, softplus: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """dt_proj for the scan (kernels.py): (softplus(raw + dt_bias) f32, B and C in f32), or
    (raw, empty) without softplus."""
    from .launch import dt_proj

    return dt_proj(x_dbl, dt_proj_weight, dt_bias, softplus)


@_dt_proj_op.register_fake
def _(x_dbl, dt_proj_weight, dt_bias, softplus):
    Bsz, T, W = x_dbl.shape
    D, R = dt_proj_weight.shape
    f32 = torch.float32
    if not softplus:
        return x_dbl.new_empty((Bsz, T, D)), x_dbl.new_empty((0,), dtype=f32)
    return x_dbl.new_empty((Bsz, T, D), dtype=f32), x_dbl.new_empty((Bsz, T, W - R), dtype=f32)


dt_proj_op = Op(_dt_proj_op)


def _scan_inputs(
    x_in, conv_weight, conv_bias, x_proj_weight, dt_proj_weight, dt_bias, conv_state, seq_idx
):  # fmt: skip
    """(u, final conv state, x_dbl, delta, B and C in f32): the conv, x_proj, and dt_proj with
    the bias and softplus (delta in f32), over every step."""
    u, conv_out = conv_fwd_op(x_in, conv_weight, conv_bias, conv_state, seq_idx, True, True)
    with torch.autocast(u.device.type, enabled=False):
        x_dbl = F.linear(u, _as(x_proj_weight, u.dtype))
    delta, bc = dt_proj_op(x_dbl, dt_proj_weight, dt_bias, True)
    return u, conv_out, x_dbl, delta, bc


def _inner_forward(
    xz, conv_weight, conv_bias, x_proj_weight, dt_proj_weight, A, D, dt_bias, conv_state,
    ssm_state, seq_idx, save: bool,
):  # fmt: skip
    """(y, final conv state, final ssm state, x_dbl, the scan's saved states): conv, x_proj,
    dt_proj with the bias and softplus (delta in f32), and the scan; `save`: the scan keeps
    its states for a backward."""
    Dn, N = A.shape
    x_in, z = xz[..., :Dn], xz[..., Dn:]
    u, conv_out, x_dbl, delta, bc = _scan_inputs(
        x_in, conv_weight, conv_bias, x_proj_weight, dt_proj_weight, dt_bias, conv_state, seq_idx
    )
    y, ssm_out, states = scan_fwd_op(
        u, delta, A, bc[..., :N], bc[..., N:], D, z, None, False, ssm_state, seq_idx, save
    )
    return y, conv_out, ssm_out, x_dbl, states


def mamba_inner_triton(
    xz, conv_weight, conv_bias, x_proj_weight, dt_proj_weight, A, D, dt_bias, conv_state,
    ssm_state, seq_idx,
):  # fmt: skip
    """(y, final conv state, final ssm state) by the fused node: one autograd node when a
    gradient is needed, the same ops without one otherwise (its apply() costs ~40 us of
    host time per layer)."""
    weights = (conv_weight, conv_bias, x_proj_weight, dt_proj_weight, A, D, dt_bias)
    inputs = (xz, *weights, conv_state, ssm_state)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in inputs):
        return _FusedInner.apply(xz, *weights, conv_state, ssm_state, seq_idx)
    return _inner_forward(xz, *weights, conv_state, ssm_state, seq_idx, False)[:3]


def mamba_inner_at_triton(
    xz, conv_weight, conv_bias, x_proj_weight, dt_proj_weight, A, D, dt_bias, conv_state,
    ssm_state, seq_idx, positions,
):  # fmt: skip
    """(y, final conv state, final ssm state, conv states [B, k, K-1, D] and ssm states
    [B, k, D, N] after the steps `positions` [B, k]), without autograd: `_inner_forward`
    whose scan also stores the states asked for (one masked store in its pass), and the
    conv states gathered from x_in (one launch)."""
    from ..causal_conv1d.states_at import conv_states_at_triton
    from ..selective_scan import states_at_buffers
    from ..selective_scan.launch import scan_fwd

    Dn, N = A.shape
    x_in, z = xz[..., :Dn], xz[..., Dn:]
    u, conv_out, _, delta, bc = _scan_inputs(
        x_in, conv_weight, conv_bias, x_proj_weight, dt_proj_weight, dt_bias, conv_state, seq_idx
    )
    at = states_at_buffers(positions, xz.shape[1], Dn, N, xz.device)
    y, ssm_out, _ = scan_fwd(
        u, delta, A, bc[..., :N], bc[..., N:], D, z, None, False, ssm_state, seq_idx, False,
        at=at,
    )  # fmt: skip
    conv_at = conv_states_at_triton(x_in, positions, conv_weight.shape[1], conv_state, seq_idx)
    return y, conv_out, ssm_out, conv_at, at[2]


def mamba_inner_last_triton(
    x_in, z_last, conv_weight, conv_bias, x_proj_weight, dt_proj_weight, A, D, dt_bias,
    conv_state, ssm_state, seq_idx,
):  # fmt: skip
    """(y at the last step [B, D], final conv state, final ssm state) from in_proj's x half
    x_in [B, T, D] and its z half at the last step z_last [B, D], without autograd: a
    prefill's last layer, where only the last position's output is read. The conv, x_proj
    and dt_proj run over every step (the scan's summaries need them); the scan keeps its
    segment summaries and takes h_T and y_T from them (`scan_last`), so neither its output
    pass nor out_proj runs over the other steps."""
    from ..selective_scan.launch import scan_last

    N = A.shape[1]
    u, conv_out, _, delta, bc = _scan_inputs(
        x_in, conv_weight, conv_bias, x_proj_weight, dt_proj_weight, dt_bias, conv_state, seq_idx
    )
    y, ssm_out = scan_last(u, delta, A, bc[..., :N], bc[..., N:], D, z_last, ssm_state, seq_idx)
    return y, conv_out, ssm_out


class _FusedInner(torch.autograd.Function):
    """One autograd node over conv, x_proj, dt_proj and the scan (Triton custom ops).

    Saved per token: xz (2D), x_dbl (R + 2N) in the compute dtype and the scan's
    state every KS TC steps (4 D N / (KS TC) bytes, `state_chunk`); u and delta are
    recomputed."""

    @staticmethod
    def forward(
        ctx,
        xz,
        conv_weight,
        conv_bias,
        x_proj_weight,
        dt_proj_weight,
        A,
        D,
        dt_bias,
        conv_state,
        ssm_state,
        seq_idx,
    ):
        y, conv_out, ssm_out, x_dbl, states = _inner_forward(
            xz, conv_weight, conv_bias, x_proj_weight, dt_proj_weight, A, D, dt_bias,
            conv_state, ssm_state, seq_idx, True,
        )  # fmt: skip
        # in the order mamba_inner_bwd takes them after the three output gradients
        ctx.save_for_backward(
            xz, x_dbl, conv_weight, conv_bias, x_proj_weight, dt_proj_weight, A, D, dt_bias,
            conv_state, ssm_state, seq_idx, states,
        )  # fmt: skip
        # which inputs get a gradient (the backward op returns empty tensors for the absent)
        ctx.present = (True, True, conv_bias is not None, True, True, True, True, True)
        ctx.present += (conv_state is not None, ssm_state is not None)
        ctx.set_materialize_grads(False)
        return y, conv_out, ssm_out

    @staticmethod
    @once_differentiable
    def backward(ctx, gy, g_conv_out, g_ssm_out):
        grads = inner_bwd_op(gy, g_conv_out, g_ssm_out, *ctx.saved_tensors)
        return *(g if p else None for g, p in zip(grads, ctx.present)), None


@torch.library.custom_op("mambakit::mamba_inner_bwd", mutates_args=())
def _inner_bwd(
    gy: torch.Tensor | None,
    g_conv_out: torch.Tensor | None,
    g_ssm_out: torch.Tensor | None,
    xz: torch.Tensor,
    x_dbl: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_bias: torch.Tensor | None,
    x_proj_weight: torch.Tensor,
    dt_proj_weight: torch.Tensor,
    A: torch.Tensor,
    D: torch.Tensor,
    dt_bias: torch.Tensor,
    conv_state: torch.Tensor | None,
    ssm_state: torch.Tensor | None,
    seq_idx: torch.Tensor | None,
    states: torch.Tensor,
) -> tuple[
    torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
    torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
]:  # fmt: skip
    """The fused node's backward as one op: (d xz, d conv_weight, d conv_bias, d x_proj_weight,
    d dt_proj_weight, dA, dD, d dt_bias, d conv_state, d ssm_state), an absent input's
    gradient an empty tensor. The scan writes dz and the conv dx_in straight into the two
    halves of d xz (no concatenation)."""
    from ..causal_conv1d.launch import conv_bwd, conv_fwd
    from ..selective_scan.launch import scan_bwd
    from .launch import dt_proj

    Dn, N = A.shape
    x_in, z = xz[..., :Dn], xz[..., Dn:]
    u, _ = conv_fwd(x_in, conv_weight, conv_bias, conv_state, seq_idx, True, False)
    R = dt_proj_weight.shape[1]
    dt_r, B, C = x_dbl.split([R, N, N], dim=-1)
    delta, _ = dt_proj(x_dbl, dt_proj_weight, None, False)  # raw: the forward's bits
    if gy is None:
        gy = torch.zeros_like(u)
    dxz = torch.empty(xz.shape, dtype=xz.dtype, device=xz.device)
    du, ddelta, dA, dB, dC, dD, _, d_dt_bias, d_ssm_state = scan_bwd(
        gy, g_ssm_out, u, delta, A, B, C, D, z, dt_bias, True, ssm_state, seq_idx, states,
        dz_out=dxz[..., Dn:],
    )  # fmt: skip
    # the GEMMs' backward in the compute dtype, as autograd runs them on the unfused chain
    cdt = u.dtype
    with torch.autocast(u.device.type, enabled=False):
        d_dt_r = ddelta @ dt_proj_weight.to(cdt)  # [B, T, R]
        d_dt_proj_weight = ddelta.flatten(0, 1).t() @ dt_r.flatten(0, 1)  # [D, R]
        g_x_dbl = torch.cat([d_dt_r, dB, dC], dim=-1)  # [B, T, R + 2N]
        d_x_proj_weight = g_x_dbl.flatten(0, 1).t() @ u.flatten(0, 1)  # [R + 2N, D]
        # in place, one rounding: no separate [B, T, D] add
        du.view(-1, Dn).addmm_(g_x_dbl.flatten(0, 1), x_proj_weight.to(cdt))
    _, d_conv_weight, d_conv_bias, d_conv_state = conv_bwd(
        du, g_conv_out, x_in, conv_weight, conv_bias, conv_state, seq_idx, True,
        dx_out=dxz[..., :Dn],
    )  # fmt: skip
    empty = xz.new_empty(0)
    return (
        dxz,
        d_conv_weight.to(conv_weight.dtype),
        d_conv_bias.to(conv_bias.dtype) if conv_bias is not None else empty,
        d_x_proj_weight.to(x_proj_weight.dtype),
        d_dt_proj_weight.to(dt_proj_weight.dtype),
        dA,
        dD,
        d_dt_bias,
        d_conv_state.to(conv_state.dtype) if conv_state is not None else empty.clone(),
        d_ssm_state if ssm_state is not None else empty.clone(),
    )


@_inner_bwd.register_fake
def _(gy, g_conv_out, g_ssm_out, xz, x_dbl, conv_weight, conv_bias, x_proj_weight,
      dt_proj_weight, A, D, dt_bias, conv_state, ssm_state, seq_idx, states):  # fmt: skip
    f32 = torch.float32
    e = xz.new_empty(0)
    return (
        xz.new_empty(xz.shape),
        torch.empty_like(conv_weight, memory_format=torch.contiguous_format),
        torch.empty_like(conv_bias) if conv_bias is not None else e,
        torch.empty_like(x_proj_weight, memory_format=torch.contiguous_format),
        torch.empty_like(dt_proj_weight, memory_format=torch.contiguous_format),
        A.new_empty(A.shape, dtype=f32),
        D.new_empty(D.shape, dtype=f32),
        dt_bias.new_empty(dt_bias.shape, dtype=f32),
        torch.empty_like(conv_state, memory_format=torch.contiguous_format)
        if conv_state is not None
        else e.clone(),
        ssm_state.new_empty(ssm_state.shape, dtype=f32) if ssm_state is not None else e.clone(),
    )


inner_bwd_op = Op(_inner_bwd)  # eager calls skip the dispatcher (ops/_dispatch.py)
