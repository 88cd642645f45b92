"""The decode step of a Mamba-1 block as a chain of ops, on the backend the caller resolved:
what runs where the fused bodies do not (weights outside the compute dtype, autocast, norms
that differ in eps on the reference backend, a lone `Mamba.step`).

Each op of the chain is the body `ops` would pick for that backend, called directly: the
caller checked the inputs once for the whole step, and at batch 1 on a CPU a step is bound
by the cost of each call.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..causal_conv1d import causal_conv1d_update_triton
from ..causal_conv1d.reference import causal_conv1d_update_reference
from ..rms_norm import rms_norm_triton
from ..rms_norm.reference import rms_norm_reference
from ..selective_scan import selective_state_update_triton
from ..selective_scan.reference import selective_state_update_reference
from . import StepWeights

# each backend's bodies (the Triton ones import Triton only when they run)
_CONV = {"triton": causal_conv1d_update_triton, "reference": causal_conv1d_update_reference}
_SSM = {"triton": selective_state_update_triton, "reference": selective_state_update_reference}
_NORM = {"triton": rms_norm_triton, "reference": rms_norm_reference}


def mixer_step(
    x: torch.Tensor,  # [B, M], the normed input
    w: StepWeights,  # norm_w and eps are not read
    conv_state: torch.Tensor,  # [B, K-1, D], updated in place
    ssm_state: torch.Tensor,  # [B, D, N], updated in place
    backend: str,  # "reference" or "triton", resolved
) -> torch.Tensor:
    """The mixer's output [B, M] for one timestep, its states advanced in place."""
    conv_update, state_update = _CONV[backend], _SSM[backend]
    autocast = torch.is_autocast_enabled(x.device.type)
    Dn, N = w.A.shape
    R = w.dt_w.shape[1]
    xz = _project(x, w.in_w, w.in_b, autocast)  # [B, 2D]
    u = conv_update(conv_state, xz[:, :Dn], w.conv_w, w.conv_b, "silu")
    x_dbl = _project(u, w.x_w, None, autocast)  # [B, R + 2N]
    delta = _project(x_dbl[:, :R], w.dt_w, None, autocast)
    y = state_update(
        ssm_state, u, delta, w.A, x_dbl[:, R : R + N], x_dbl[:, R + N :], w.D, xz[:, Dn:],
        w.dt_bias, True,
    )  # fmt: skip
    return _project(y, w.out_w, w.out_b, autocast)


def layer_step(
    hidden: torch.Tensor,  # [B, M]
    residual: torch.Tensor | None,  # [B, M] f32
    w: StepWeights,
    conv_state: torch.Tensor,
    ssm_state: torch.Tensor,
    compute_dtype: torch.dtype,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the mixer's output, the residual) of one block: the add and norm, then `mixer_step`."""
    normed, residual = _NORM[backend](hidden, w.norm_w, w.eps, residual, compute_dtype)
    return mixer_step(normed, w, conv_state, ssm_state, backend), residual


def _project(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, autocast: bool):
    """F.linear(x, w, b) for 2-d x. Without autocast it is the mm / addmm that F.linear
    runs, called directly: its wrappers (linear, matmul) cost as much as a batch-1 GEMM on
    a CPU. Under autocast F.linear itself, since autocast reuses its cast of a parameter,
    not of a view."""
    if autocast:
        return F.linear(x, w, b)
    return torch.mm(x, w.t()) if b is None else torch.addmm(b, x, w.t())
