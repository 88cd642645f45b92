"""The Mamba-3 SISO decode step as one Triton kernel: the state advances in place.

B batch, H heads of P values, G groups of B/C rows (head h reads group h // (H / G)),
N = d_state, S rotary angles. One program per (row, head) does what
`mamba3_step_reference` does for it:

    phi   = (phi + pi tanh(theta) delta) mod 2 pi
    k~    = rot(k + k_bias, phi)        q~ = rot(q + q_bias, phi)
    S     = alpha S + beta x_prev k~_prev^T + gamma x k~^T
    y     = (S q~ + D x) * silu(z)

with alpha = exp(A delta), beta = (1 - lam) delta alpha, gamma = lam delta, lam =
sigmoid(trap). The state [P, N] is one tile, its rows contiguous; the turn acts on the
vectors k and q alone: column n reads its pair's partner n ^ 1 and the angle n // 2
(columns 2i, 2i + 1 share angle i; those of i >= S have angle 0, no turn). State and
arithmetic are f32; y is stored in x's dtype. No allocation but y, no host sync: a step
can be captured in a CUDA graph. `state_update_raw` (what `Mamba3.step_` runs) takes k, q,
delta and A as in_proj gives them and makes them in the kernel.

One program holds a head's whole state: the state of its last key and angle is read by
every row of the head's state, so a head split over programs would need them to agree on
who writes it after all have read. On sm_90+ the kernel is launched with programmatic
dependent launch: it loads the weights (biases, norm weights, D) while in_proj finishes
and waits for it before reading anything a kernel writes.
"""

from __future__ import annotations

import dataclasses

import torch

from ...state import Mamba3State
from .._triton import cdiv, launch, next_power_of_2, pdl_args, sm_count
from .step_kernels import _step_kernel


@dataclasses.dataclass(frozen=True)
class Mamba3StepConfig:
    """Launch parameters of the step kernel (not autotuned: it updates the state in place;
    `CONFIG` is the library's, scripts/m3_step_probe.py times others through `cfg=`)."""

    warps: int | None = None  # per program; None: `_warps`, by the state's size and programs


CONFIG = Mamba3StepConfig()


def state_update(
    state: Mamba3State,  # angle [B, H, S], ssm [B, H, P, N], k [B, H, N], x [B, H, P]: f32
    x: torch.Tensor,  # [B, H, P]
    q: torch.Tensor,  # [B, G, N]
    k: torch.Tensor,  # [B, G, N]
    delta: torch.Tensor,  # [B, H]
    A: torch.Tensor,  # [B, H]
    trap: torch.Tensor,  # [B, H]
    theta: torch.Tensor,  # [B, S]
    q_bias: torch.Tensor,  # [H, N]
    k_bias: torch.Tensor,  # [H, N]
    D: torch.Tensor | None,  # [H]
    z: torch.Tensor | None,  # [B, H, P]
    cfg: Mamba3StepConfig | None = None,
) -> torch.Tensor:
    """y [B, H, P] in x.dtype; `state` advances one token in place. Every tensor's last
    dim must have stride 1 (the views of in_proj's output and of stacked states do). cfg:
    launch parameters other than the library's `CONFIG`."""
    return _launch(state, x, q, k, delta, A, trap, theta, q_bias, k_bias, D, z, None, cfg)


def state_update_raw(
    state: Mamba3State,
    x: torch.Tensor,  # [B, H, P]
    C: torch.Tensor,  # [B, G, N], before C_norm
    B: torch.Tensor,  # [B, G, N], before B_norm
    dd_dt: torch.Tensor,  # [B, H]
    dd_A: torch.Tensor,  # [B, H]
    trap: torch.Tensor,  # [B, H]
    theta: torch.Tensor,  # [B, S]
    q_bias: torch.Tensor,  # [H, N]
    k_bias: torch.Tensor,  # [H, N]
    D: torch.Tensor | None,  # [H]
    z: torch.Tensor | None,  # [B, H, P]
    dt_bias: torch.Tensor,  # [H]
    A_floor: float,
    C_weight: torch.Tensor,  # [N]
    B_weight: torch.Tensor,  # [N]
    eps: float,
    cfg: Mamba3StepConfig | None = None,
) -> torch.Tensor:
    """`state_update` from in_proj's rows as they come: q, k, delta and A are made in the
    kernel as `Mamba3._inputs` makes them (the RMSNorms of C and B, softplus(dd_dt +
    dt_bias), -max(heavy_tail(dd_A), A_floor)), which would be a dozen small launches a
    layer and token otherwise."""
    raw = (_unit_last(dt_bias), _unit_last(C_weight), _unit_last(B_weight), A_floor, eps)
    return _launch(state, x, C, B, dd_dt, dd_A, trap, theta, q_bias, k_bias, D, z, raw, cfg)


def _launch(state, x, q, k, delta, A, trap, theta, q_bias, k_bias, D, z, raw, cfg):
    for name, t in zip(state._fields, state):
        if t.dtype != torch.float32 or t.stride(-1) != 1:
            raise ValueError(
                f"state.{name}: the Triton step needs f32 with stride 1 in the last dim, got "
                f"{t.dtype} with strides {t.stride()}"
            )
    x, q, k, theta, q_bias, k_bias = map(_unit_last, (x, q, k, theta, q_bias, k_bias))
    delta, A, trap = map(_unit_last, (delta, A, trap))
    z = _unit_last(z) if z is not None else None
    D = _unit_last(D) if D is not None else None
    Bsz, H, P = x.shape
    G, N = q.shape[1], q.shape[2]
    S = theta.shape[1]
    y = torch.empty(Bsz, H, P, device=x.device, dtype=x.dtype)
    ang, ssm, kst, xst = state
    zz = z if z is not None else x
    dtb, qw, kw, A_floor, eps = raw if raw is not None else (delta, q, k, 0.0, 0.0)
    block_n = next_power_of_2(N)
    warps = (cfg or CONFIG).warps or _warps(next_power_of_2(P) * block_n, Bsz * H, x)
    launch(_step_kernel, (Bsz, H),
        x, zz, q, k, delta, A, trap, theta, q_bias, k_bias, D if D is not None else delta,
        ang, ssm, kst, xst, y, dtb, qw, kw,
        P, N, S, H // G, A_floor, eps,
        x.stride(0), x.stride(1), zz.stride(0), zz.stride(1), q.stride(0), q.stride(1),
        k.stride(0), k.stride(1), delta.stride(0), A.stride(0), trap.stride(0), theta.stride(0),
        q_bias.stride(0), k_bias.stride(0), ang.stride(0), ang.stride(1),
        ssm.stride(0), ssm.stride(1), ssm.stride(2), kst.stride(0), kst.stride(1),
        xst.stride(0), xst.stride(1), y.stride(0), y.stride(1),
        HAS_Z=z is not None, HAS_D=D is not None,
        BLOCK_P=next_power_of_2(P), BLOCK_N=block_n, RAW=raw is not None,
        num_warps=warps,
        **pdl_args(x),
    )  # fmt: skip
    return y


def _warps(values: int, programs: int, x: torch.Tensor) -> int:
    """Warps of a program holding `values` state values: 32 values a thread while the
    programs fit the SMs once, 64 up to twice, 128 beyond (more programs an SM, fewer
    registers on the vectors every thread repeats). H200, 130m-mamba3 layer (24 heads of
    64 x 128), us a layer (scripts/m3_step_probe.py; a copy of the state: 1.7, 5.0, 26.0):
    batch 1: 3.07 at 8 warps, 3.61 at 4; batch 8: 7.11 at 4, 9.77 at 8; batch 64: 34.6 at
    2, 38.0 at 4, 53.0 at 8."""
    per_sm = cdiv(programs, sm_count(x.device.index or 0)) if x.is_cuda else 1
    per_thread = 32 * min(4, next_power_of_2(per_sm))
    return max(1, min(16, values // (32 * per_thread)))


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    """t with stride 1 in its last dim (the kernel indexes it so)."""
    return t if t.stride(-1) == 1 else t.contiguous()
