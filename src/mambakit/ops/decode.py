"""The decode step's ops: one token through the scan, the conv, a Mamba block, a stack of
blocks, and the norm + linear head. Public through `mambakit.ops`; like every op there, each
checks its inputs before any kernel launches and picks its body by `resolve_backend`."""

from __future__ import annotations

import torch

from ._backend import resolve_backend
from ._checks import check_tensor, state_dtype
from .causal_conv1d.reference import causal_conv1d_update_reference
from .mamba_step import StepWeights
from .mamba_step.chain import layer_step, mixer_step
from .mamba_step.reference import mamba_layer_step_reference, norm_linear_reference
from .mamba_step.stack import decode_layers
from .selective_scan.reference import selective_state_update_reference


def selective_state_update(
    ssm_state: torch.Tensor,
    u: torch.Tensor,
    delta: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    delta_bias: torch.Tensor | None = None,
    delta_softplus: bool = True,
    backend: str = "auto",
) -> torch.Tensor:
    """One decode step of the scan: updates ssm_state [B, D, N] in place, returns y [B, D]."""
    check_tensor("u", u, (None, None), last_dim_contiguous=True)
    Bsz, Dn = u.shape
    check_tensor("ssm_state", ssm_state, (Bsz, Dn, None), device=u.device)
    N = ssm_state.shape[2]
    check_tensor("delta", delta, (Bsz, Dn), device=u.device)
    check_tensor("A", A, (Dn, N), device=u.device)
    check_tensor("B", B, (Bsz, N), device=u.device, last_dim_contiguous=True)
    check_tensor("C", C, (Bsz, N), device=u.device, last_dim_contiguous=True)
    for name, t in (("D", D), ("delta_bias", delta_bias)):
        if t is not None:
            check_tensor(name, t, (Dn,), device=u.device)
    if z is not None:
        check_tensor("z", z, (Bsz, Dn), device=u.device, last_dim_contiguous=True)
    args = (ssm_state, u, delta, A, B, C, D, z, delta_bias, delta_softplus)
    if resolve_backend(backend, u) == "triton":
        from .selective_scan import selective_state_update_triton

        return selective_state_update_triton(*args)
    return selective_state_update_reference(*args)


def causal_conv1d_update(
    conv_state: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = "silu",
    backend: str = "auto",
) -> torch.Tensor:
    """One decode step of the conv: shifts x [B, D] into conv_state [B, K-1, D] in place."""
    check_tensor("x", x, (None, None), last_dim_contiguous=True)
    Bsz, Dn = x.shape
    check_tensor("weight", weight, (Dn, None), device=x.device)
    K = weight.shape[1]
    check_tensor("conv_state", conv_state, (Bsz, K - 1, Dn), device=x.device)
    if bias is not None:
        check_tensor("bias", bias, (Dn,), device=x.device)
    if activation not in (None, "silu"):
        raise ValueError(f"activation must be 'silu' or None, got {activation!r}")
    args = (conv_state, x, weight, bias, activation)
    if resolve_backend(backend, x) == "triton":
        from .causal_conv1d import causal_conv1d_update_triton

        return causal_conv1d_update_triton(*args)
    return causal_conv1d_update_reference(*args)


def mamba_layer_step(
    hidden: torch.Tensor,
    residual: torch.Tensor | None,
    weights: StepWeights,
    conv_state: torch.Tensor,
    ssm_state: torch.Tensor,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step of a whole Mamba block (add, norm, mixer), the states in place.

    hidden [B, M] is the previous block's output (or the embedded input), residual
    [B, M] f32 (None at the first block).
    Returns (out [B, M] in the weights' dtype, the new residual [B, M] f32). The
    residual and states are f32 (f64 with float64 weights: the oracle). On
    the Triton backend it is three kernels (mamba_step/launch.py launches them)."""
    w = weights
    if not isinstance(w, StepWeights):
        raise TypeError(f"weights must be a StepWeights, got {type(w).__name__}")
    M = w.norm_w.shape[0]
    Dn, N = w.A.shape
    check_tensor("hidden", hidden, (None, M), last_dim_contiguous=True)
    Bsz = hidden.shape[0]
    _check_step_weights(w, M, Dn, N, hidden.device)
    f = state_dtype(w.in_w)
    if residual is not None:
        check_tensor("residual", residual, (Bsz, M), device=hidden.device,
                     last_dim_contiguous=True)  # fmt: skip
        if residual.dtype != f:
            raise TypeError(f"residual must be {f}, got {residual.dtype}")
    K = w.conv_w.shape[1]
    check_tensor("conv_state", conv_state, (Bsz, K - 1, Dn), device=hidden.device)
    check_tensor("ssm_state", ssm_state, (Bsz, Dn, N), device=hidden.device,
                 last_dim_contiguous=True)  # fmt: skip
    for name, t in (("conv_state", conv_state), ("ssm_state", ssm_state)):
        if t.dtype != f:
            raise TypeError(f"{name} must be {f}, got {t.dtype}")
    if resolve_backend(backend, w.in_w) == "triton":
        from .mamba_step import mamba_layer_step_triton

        return mamba_layer_step_triton(hidden, residual, w, conv_state, ssm_state)
    return mamba_layer_step_reference(hidden, residual, w, conv_state, ssm_state)


def _check_step_weights(w: StepWeights, M: int, Dn: int, N: int, device) -> None:
    """Each of a block's decode weights has its shape, the device and stride 1 in its last
    dim (the fused kernels index rows of the projections, A and the vectors densely)."""
    dt_w = w.dt_w
    R = dt_w.shape[1] if isinstance(dt_w, torch.Tensor) and dt_w.dim() == 2 else None
    shapes = {
        "norm_w": (M,), "in_w": (2 * Dn, M), "in_b": (2 * Dn,), "conv_w": (Dn, None),
        "conv_b": (Dn,), "dt_w": (Dn, None), "x_w": (None if R is None else R + 2 * N, Dn),
        "dt_bias": (Dn,), "A": (Dn, N), "D": (Dn,), "out_w": (M, Dn), "out_b": (M,),
    }  # fmt: skip
    for name, shape in shapes.items():
        t = getattr(w, name)
        if t is not None or name not in ("in_b", "conv_b", "out_b"):
            check_tensor(f"weights.{name}", t, shape, device=device,
                         last_dim_contiguous=name != "conv_w")  # fmt: skip


def _mamba_mixer_step(x, weights, conv_state, ssm_state, backend):
    """One decode step of a Mamba-1 mixer on its weights (`StepWeights`; the norm's are not
    read), without checks: the op chain on the backend's bodies, the states in place."""
    return mixer_step(x, weights, conv_state, ssm_state, resolve_backend(backend, x))


def mamba_stack_step(
    hidden: torch.Tensor,  # [B, M], the embedded input
    layers,  # every block's StepWeights, in order: a list, or () -> the list (a plan)
    conv_state: torch.Tensor,  # [L, B, K-1, D], updated in place
    ssm_state: torch.Tensor,  # [L, B, D, N], updated in place
    compute_dtype: torch.dtype,
    backend: str = "auto",
    stack=None,  # () -> the reference body's whole-stack weights (`mamba_step.stack`) or None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One decode step through a stack of Mamba-1 blocks whose weights the caller holds
    (the model's decode plans): (the last block's output, the residual stream [B, M] f32;
    or the residual stream and None where the body carries it as the output). The caller
    checked the input and the state. Given as functions, the weights are asked for only by
    the body that reads them (a plan's freshness check costs as much as a small op).

    Triton: `mamba_layer_step` per block (three kernels) where its weights are in the
    compute dtype, else the op chain on the Triton ops. Reference: with the input, the
    weights and the state in one dtype, the whole stack in as few PyTorch calls as it
    takes (`mamba_step/stack.py`, on the weights `stack()` derives once per plan); else
    the op chain per block."""
    cdt = compute_dtype
    if resolve_backend(backend, hidden) == "triton":
        from .mamba_step import mamba_layer_step_triton

        residual = None
        layers = layers() if callable(layers) else layers
        for w, conv, ssm in zip(layers, conv_state.unbind(0), ssm_state.unbind(0)):
            if w.in_w.dtype == cdt:
                hidden, residual = mamba_layer_step_triton(hidden, residual, w, conv, ssm)
            else:
                hidden, residual = layer_step(hidden, residual, w, conv, ssm, cdt, "triton")
        return hidden, residual
    if stack is not None and hidden.dtype == cdt == conv_state.dtype:
        weights = stack()
        if weights is not None and weights.blocks[0].in_wT.dtype == cdt:
            return decode_layers(hidden, weights, conv_state, ssm_state), None
    residual = None
    layers = layers() if callable(layers) else layers
    for w, conv, ssm in zip(layers, conv_state.unbind(0), ssm_state.unbind(0)):
        hidden, residual = layer_step(hidden, residual, w, conv, ssm, cdt, "reference")
    return hidden, residual


def norm_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-5,
    backend: str = "auto",
) -> torch.Tensor:
    """rmsnorm(x + residual) W^T (+ bias) for x [B, K] at decode batch sizes (or x W^T
    without `norm_weight`), in the weight's dtype; W [Nout, K] streams once."""
    check_tensor("weight", weight, (None, None), last_dim_contiguous=True)
    Kin = weight.shape[1]
    check_tensor("x", x, (None, Kin), device=weight.device, last_dim_contiguous=True)
    if residual is not None:
        check_tensor("residual", residual, (x.shape[0], Kin), device=weight.device,
                     last_dim_contiguous=True)  # fmt: skip
    if norm_weight is not None:
        check_tensor("norm_weight", norm_weight, (Kin,), device=weight.device)
    if bias is not None:
        check_tensor("bias", bias, (weight.shape[0],), device=weight.device)
    return _norm_linear(x, weight, bias, residual, norm_weight, eps, backend)


def _norm_linear(x, weight, bias, residual, norm_weight, eps, backend):
    """`norm_linear` without the checks (the model's head, its inputs checked once)."""
    if resolve_backend(backend, weight) == "triton":
        from .mamba_step import norm_linear_triton

        return norm_linear_triton(x, weight, bias, residual, norm_weight, eps)
    return norm_linear_reference(x, weight, bias, residual, norm_weight, eps)
