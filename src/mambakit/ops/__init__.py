"""Pure tensor ops of a Mamba model, and the only place where an op's body is chosen.

Each op is one public function here (Mamba-3's in `ops.mamba3`, the decode step's in
`ops.decode`, re-exported): it checks its inputs, before any kernel launches, and runs the
reference body (PyTorch: the CPU path and the oracle) or the Triton body, as
`resolve_backend` (`_backend.py`) says. A private twin without the checks (`_rms_norm`,
`_mamba_inner`; `ops.decode._norm_linear`) serves callers that checked once for a whole
step or layer. `"triton"` on CPU tensors runs the kernels under
the Triton interpreter: that is how CI tests them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._backend import _TRITON_DTYPES, resolve_backend
from ._checks import (
    check_positions,
    check_same_dtype,
    check_seq_idx,
    check_states_at_no_grad,
    check_tensor,
)
from .causal_conv1d.reference import causal_conv1d_reference
from .cross_entropy.linear import LinearCrossEntropy
from .decode import (
    causal_conv1d_update,
    mamba_layer_step,
    mamba_stack_step,
    norm_linear,
    selective_state_update,
)
from .mamba_inner.reference import mamba_inner_chain
from .mamba_step import StepWeights
from .rms_norm.compiled import compiles as compiled_norm
from .rms_norm.compiled import rms_norm_compiled
from .rms_norm.reference import rms_norm_reference
from .rms_norm_gated.reference import rms_norm_gated_reference
from .selective_scan.reference import (
    selective_scan_reference,
    selective_scan_states_at_reference,
)

__all__ = [
    "selective_scan",
    "causal_conv1d",
    "rms_norm",
    "rms_norm_gated",
    "selective_state_update",
    "causal_conv1d_update",
    "mamba_layer_step",
    "mamba_stack_step",
    "norm_linear",
    "StepWeights",
    "linear_cross_entropy",
    "mamba_inner",
    "mamba_last",
    "resolve_backend",
]


def selective_scan(
    u: torch.Tensor,
    delta: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    delta_bias: torch.Tensor | None = None,
    delta_softplus: bool = True,
    initial_state: torch.Tensor | None = None,
    seq_idx: torch.Tensor | None = None,
    return_final_state: bool = False,
    backend: str = "auto",
    states_at: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """Selective scan over u, delta, z [B, T, D] and B, C [B, T, N] (see DESIGN.md section 1).

    A [D, N], D and delta_bias [D] are f32 (f64 on the oracle path); initial_state
    [B, D, N] f32; seq_idx [B, T] int32 resets the state where it changes. Returns y
    [B, T, D] in u.dtype, and the final state [B, D, N] f32 when return_final_state.

    `states_at` [B, k] int64, steps distinct within a row: also the state after each of
    those steps, [B, k, D, N] f32, as a third output (y, final state, states); without
    autograd on the Triton backend (one masked store in the forward's pass).
    """
    check_tensor("u", u, (None, None, None), last_dim_contiguous=True)
    Bsz, T, Dn = u.shape
    dev = u.device
    check_tensor("delta", delta, (Bsz, T, Dn), device=dev, last_dim_contiguous=True)
    check_tensor("A", A, (Dn, None), device=dev)
    N = A.shape[1]
    if N > 256:
        raise ValueError(f"A: d_state must be at most 256, got {N}")
    check_tensor("B", B, (Bsz, T, N), device=dev, last_dim_contiguous=True)
    check_tensor("C", C, (Bsz, T, N), device=dev, last_dim_contiguous=True)
    acts = {"u": u, "delta": delta, "B": B, "C": C}
    if z is not None:
        check_tensor("z", z, (Bsz, T, Dn), device=dev, last_dim_contiguous=True)
        acts["z"] = z
    check_same_dtype(acts)
    if D is not None:
        check_tensor("D", D, (Dn,), device=dev)
    if delta_bias is not None:
        check_tensor("delta_bias", delta_bias, (Dn,), device=dev)
    if initial_state is not None:
        check_tensor("initial_state", initial_state, (Bsz, Dn, N), device=dev)
    if seq_idx is not None:
        check_seq_idx(seq_idx, Bsz, T, dev)
    args = (u, delta, A, B, C, D, z, delta_bias, delta_softplus, initial_state, seq_idx)
    if states_at is not None:
        check_positions(states_at, Bsz, T, dev)
        if resolve_backend(backend, u) == "triton":
            check_states_at_no_grad(u, delta, A, B, C, D, z, delta_bias, initial_state)
            from .selective_scan import states_at_buffers
            from .selective_scan.launch import scan_fwd

            at = states_at_buffers(states_at, T, Dn, N, dev)
            y, hT, _ = scan_fwd(*args, False, at=at)
            return y, hT, at[2]
        return selective_scan_states_at_reference(*args, states_at)
    if resolve_backend(backend, u) == "triton":
        from .selective_scan import selective_scan_triton

        return selective_scan_triton(*args, return_final_state=return_final_state)
    return selective_scan_reference(*args, return_final_state=return_final_state)


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    seq_idx: torch.Tensor | None = None,
    activation: str | None = "silu",
    return_final_state: bool = False,
    backend: str = "auto",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv over x [B, T, D] with weight [D, K], optional SiLU.

    initial_state / final state: [B, K-1, D], the last K-1 inputs, oldest first.
    """
    check_tensor("x", x, (None, None, None), last_dim_contiguous=True)
    Bsz, T, Dn = x.shape
    dev = x.device
    check_tensor("weight", weight, (Dn, None), device=dev)
    K = weight.shape[1]
    if K < 2:
        raise ValueError(f"weight: d_conv must be at least 2, got {K}")
    if bias is not None:
        check_tensor("bias", bias, (Dn,), device=dev)
    if initial_state is not None:
        check_tensor("initial_state", initial_state, (Bsz, K - 1, Dn), device=dev)
    if seq_idx is not None:
        check_seq_idx(seq_idx, Bsz, T, dev)
    if activation not in (None, "silu"):
        raise ValueError(f"activation must be 'silu' or None, got {activation!r}")
    args = (x, weight, bias, initial_state, seq_idx, activation)
    if resolve_backend(backend, x) == "triton":
        from .causal_conv1d import causal_conv1d_triton

        return causal_conv1d_triton(*args, return_final_state=return_final_state)
    return causal_conv1d_reference(*args, return_final_state=return_final_state)


def mamba_inner(
    xz: torch.Tensor,  # [B, T, 2D], in_proj's output (x and z side by side)
    *,
    conv_weight: torch.Tensor,  # [D, K]
    conv_bias: torch.Tensor | None,  # [D]
    x_proj_weight: torch.Tensor,  # [R + 2N, D]
    dt_proj_weight: torch.Tensor,  # [D, R]
    A: torch.Tensor,  # [D, N] f32, = -exp(A_log)
    D: torch.Tensor,  # [D] f32
    dt_bias: torch.Tensor,  # [D] f32
    conv_state: torch.Tensor | None = None,  # [B, K-1, D]
    ssm_state: torch.Tensor | None = None,  # [B, D, N]
    seq_idx: torch.Tensor | None = None,  # [B, T] int32
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The Mamba mixer between in_proj and out_proj: conv, x_proj, dt_proj and the scan
    gated by silu(z). Returns (y [B, T, D] in xz.dtype, final conv state [B, K-1, D],
    final ssm state [B, D, N]); the projections run in xz.dtype, the states are f32 (f64
    on the oracle path). On "triton" one fused autograd node (ops/mamba_inner), on
    "reference" the chain of ops."""
    check_tensor("A", A, (None, None))
    Dn, N = A.shape
    check_tensor("xz", xz, (None, None, 2 * Dn), last_dim_contiguous=True)
    Bsz, dev = xz.shape[0], xz.device
    check_tensor("A", A, device=dev)
    check_tensor("conv_weight", conv_weight, (Dn, None), device=dev)
    check_tensor("dt_proj_weight", dt_proj_weight, (Dn, None), device=dev)
    K, R = conv_weight.shape[1], dt_proj_weight.shape[1]
    if K < 2:
        raise ValueError(f"conv_weight: d_conv must be at least 2, got {K}")
    check_tensor("x_proj_weight", x_proj_weight, (R + 2 * N, Dn), device=dev)
    for name, t in (("conv_bias", conv_bias), ("D", D), ("dt_bias", dt_bias)):
        if t is not None:
            check_tensor(name, t, (Dn,), device=dev)
    if conv_state is not None:
        check_tensor("conv_state", conv_state, (Bsz, K - 1, Dn), device=dev)
    if ssm_state is not None:
        check_tensor("ssm_state", ssm_state, (Bsz, Dn, N), device=dev)
    args = (conv_weight, conv_bias, x_proj_weight, dt_proj_weight, A, D, dt_bias)
    return _mamba_inner(xz, *args, conv_state, ssm_state, seq_idx, backend)


def _mamba_inner(
    xz, conv_weight, conv_bias, x_proj_weight, dt_proj_weight, A, D, dt_bias, conv_state,
    ssm_state, seq_idx, backend, states_at=None,
):  # fmt: skip
    """`mamba_inner` without the checks of the weights and states (the Mamba layer checked
    its input and states); seq_idx is checked here. `states_at` [B, k] int64 (distinct
    steps in [0, T), not checked: the caller's), without autograd: also the conv states
    [B, k, K-1, D] and ssm states [B, k, D, N] after those steps."""
    if seq_idx is not None:
        check_seq_idx(seq_idx, xz.shape[0], xz.shape[1], xz.device)
    args = (conv_weight, conv_bias, x_proj_weight, dt_proj_weight, A, D, dt_bias)
    if resolve_backend(backend, xz) == "triton":
        if states_at is not None:
            check_states_at_no_grad(xz, *args, conv_state, ssm_state)
            from .mamba_inner import mamba_inner_at_triton

            return mamba_inner_at_triton(xz, *args, conv_state, ssm_state, seq_idx, states_at)
        from .mamba_inner import mamba_inner_triton

        return mamba_inner_triton(xz, *args, conv_state, ssm_state, seq_idx)
    return mamba_inner_chain(
        xz, conv_weight=conv_weight, conv_bias=conv_bias, x_proj_weight=x_proj_weight,
        dt_proj_weight=dt_proj_weight, A=A, D=D, dt_bias=dt_bias, conv_state=conv_state,
        ssm_state=ssm_state, seq_idx=seq_idx, backend="reference", states_at=states_at,
    )  # fmt: skip


def mamba_last(
    x: torch.Tensor,  # [B, T, M], the mixer's (normed) input
    weights: StepWeights,  # the norm's fields are not read
    conv_state: torch.Tensor | None = None,  # [B, K-1, D]
    ssm_state: torch.Tensor | None = None,  # [B, D, N]
    seq_idx: torch.Tensor | None = None,  # [B, T] int32
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Mamba-1 mixer (in_proj to out_proj) when only the last step's output is read (a
    prefill's last layer), without autograd: (out at the last step [B, 1, M], final conv
    state, final ssm state). The caller (the Mamba layer) checked x and the states.

    Triton: in_proj's x half over every step and its z half (the gate) at the last step
    only; the scan keeps its segment summaries and gives h_T and y_T from them
    (`scan_last`), so neither its output pass nor out_proj runs over the other steps.
    Reference: the mixer over every step, the last row kept."""
    w = weights
    if seq_idx is not None:
        check_seq_idx(seq_idx, x.shape[0], x.shape[1], x.device)
    Dn = w.A.shape[0]
    if resolve_backend(backend, x) == "triton":
        from .mamba_inner import mamba_inner_last_triton

        b = w.in_b
        x_in = F.linear(x, w.in_w[:Dn], None if b is None else b[:Dn])
        z_last = F.linear(x[:, -1], w.in_w[Dn:], None if b is None else b[Dn:])
        y, conv_out, ssm_out = mamba_inner_last_triton(
            x_in, z_last, w.conv_w, w.conv_b, w.x_w, w.dt_w, w.A, w.D, w.dt_bias, conv_state,
            ssm_state, seq_idx,
        )  # fmt: skip
        return F.linear(y, w.out_w, w.out_b)[:, None], conv_out, ssm_out
    y, conv_out, ssm_out = mamba_inner_chain(
        F.linear(x, w.in_w, w.in_b), conv_weight=w.conv_w, conv_bias=w.conv_b,
        x_proj_weight=w.x_w, dt_proj_weight=w.dt_w, A=w.A, D=w.D, dt_bias=w.dt_bias,
        conv_state=conv_state, ssm_state=ssm_state, seq_idx=seq_idx, backend="reference",
    )  # fmt: skip
    return F.linear(y, w.out_w, w.out_b)[:, -1:], conv_out, ssm_out


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-5,
    residual: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, residual_out): residual_out = x + residual in f32, out = rmsnorm(residual_out)."""
    check_tensor("x", x, None, last_dim_contiguous=True)
    if x.dim() < 1:
        raise ValueError("x must have at least one dim")
    check_tensor("weight", weight, (x.shape[-1],), device=x.device)
    if residual is not None:
        check_tensor(
            "residual", residual, tuple(x.shape), device=x.device, last_dim_contiguous=True
        )
    if not eps > 0:
        raise ValueError(f"eps must be > 0, got {eps}")
    if out_dtype is not None and out_dtype not in _TRITON_DTYPES + (torch.float64,):
        raise TypeError(f"out_dtype must be a float dtype, got {out_dtype}")
    return _rms_norm(x, weight, eps, residual, out_dtype, backend)


def _rms_norm(x, weight, eps, residual, out_dtype, backend):
    """`rms_norm` without the checks: for callers that checked already (a decode step's
    norms, where the checks would cost more than the arithmetic)."""
    if resolve_backend(backend, x, residual) == "triton":
        from .rms_norm import rms_norm_triton

        return rms_norm_triton(x, weight, eps, residual, out_dtype)
    if compiled_norm(x, weight, residual, out_dtype):  # one call each way on the CPU
        return rms_norm_compiled(x, weight, eps, residual)
    return rms_norm_reference(x, weight, eps, residual, out_dtype)


def rms_norm_gated(
    x: torch.Tensor,  # [..., D]
    z: torch.Tensor | None = None,  # [..., D]
    weight: torch.Tensor | None = None,  # [D]
    eps: float = 1e-5,
    group_size: int | None = None,
    norm_before_gate: bool = False,
    out_dtype: torch.dtype | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Mamba-2's gated RMSNorm, statistics per group of `group_size` channels (None: D):
    out = rmsnorm(x * silu(z)) * weight, or rmsnorm(x) * weight * silu(z) when
    norm_before_gate (ops/rms_norm_gated/README.md). f32 arithmetic (f64 for f64 x or z),
    out [..., D] in out_dtype (default x.dtype), contiguous."""
    check_tensor("x", x, None, last_dim_contiguous=True)
    if x.dim() < 1:
        raise ValueError("x must have at least one dim")
    Dn = x.shape[-1]
    if z is not None:
        check_tensor("z", z, tuple(x.shape), device=x.device, last_dim_contiguous=True)
    if weight is not None:
        check_tensor("weight", weight, (Dn,), device=x.device)
    if group_size is not None:
        if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size <= 0:
            raise ValueError(f"group_size must be a positive int, got {group_size!r}")
        if Dn % group_size:
            raise ValueError(f"group_size must divide x's last dim {Dn}, got {group_size}")
    if not eps > 0:
        raise ValueError(f"eps must be > 0, got {eps}")
    if out_dtype is not None and out_dtype not in _TRITON_DTYPES + (torch.float64,):
        raise TypeError(f"out_dtype must be a float dtype, got {out_dtype}")
    return _rms_norm_gated(x, z, weight, eps, group_size, norm_before_gate, out_dtype, backend)


def _rms_norm_gated(x, z, weight, eps, group_size, norm_before_gate, out_dtype, backend):
    """`rms_norm_gated` without the checks: for callers that checked already (a layer that
    checked its input once)."""
    if resolve_backend(backend, x, z) == "triton":
        from .rms_norm_gated import rms_norm_gated_triton

        return rms_norm_gated_triton(x, z, weight, eps, group_size, norm_before_gate, out_dtype)
    return rms_norm_gated_reference(x, z, weight, eps, group_size, norm_before_gate, out_dtype)


def linear_cross_entropy(
    hidden: torch.Tensor,  # [..., M]
    weight: torch.Tensor,  # [V, M]
    targets: torch.Tensor,  # [...] int, -100 ignored
    chunk: int = 4096,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """Summed cross-entropy of `hidden @ weight.T` against `targets` (f32, f64 for f64), the
    logits computed and reduced `chunk` tokens at a time (never whole in memory).

    `backend` as for every op: "triton" reduces each chunk with a Triton kernel (CUDA, f32 /
    bf16 / f16 hidden), "reference" with PyTorch."""
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(
            f"targets must have shape {list(hidden.shape[:-1])}, got {list(targets.shape)}"
        )
    if weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight must be [V, {hidden.shape[-1]}], got {list(weight.shape)}")
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk <= 0:
        raise ValueError(f"chunk must be a positive int, got {chunk!r}")
    with_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    return LinearCrossEntropy.apply(
        hidden.reshape(-1, hidden.shape[-1]),
        weight,
        targets.reshape(-1).long(),
        chunk,
        resolve_backend(backend, hidden),
        with_grad,
    )
