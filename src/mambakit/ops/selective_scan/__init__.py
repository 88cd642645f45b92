"""Selective scan on the Triton backend, as `torch.library` custom ops.

`mambakit::selective_scan_fwd` / `_bwd` wrap the launchers of launch.py with an
autograd formula and fake implementations, so `torch.compile(fullgraph=True)`
traces through them; `mambakit::selective_state_update` is the decode step
(step.py's kernel, launched by launch.py). Triton is imported only inside the op
bodies: this package imports without it. Inputs are validated by `mambakit.ops`
before they get here.

Shapes: B batch, T time, D = d_inner, N = d_state.
"""

import torch

from .._dispatch import Op

_FWD_SCHEMA = (
    "(Tensor u, Tensor delta, Tensor A, Tensor B, Tensor C, Tensor? D, Tensor? z, "
    "Tensor? delta_bias, bool delta_softplus, Tensor? initial_state, Tensor? seq_idx, "
    "bool save_states) -> (Tensor, Tensor, Tensor)"
)
_BWD_SCHEMA = (
    "(Tensor gy, Tensor? g_final, Tensor u, Tensor delta, Tensor A, Tensor B, Tensor C, "
    "Tensor? D, Tensor? z, Tensor? delta_bias, bool delta_softplus, Tensor? initial_state, "
    "Tensor? seq_idx, Tensor states) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, "
    "Tensor, Tensor, Tensor)"
)
_STEP_SCHEMA = (
    "(Tensor(a!) ssm_state, Tensor u, Tensor delta, Tensor A, Tensor B, Tensor C, Tensor? D, "
    "Tensor? z, Tensor? delta_bias, bool delta_softplus) -> Tensor"
)


def _ntiles(T: int, Dn: int, is_cuda: bool) -> int:
    """How many states the forward saves (one every KS TC steps: `state_chunk`)."""
    from .launch import state_chunk

    return -(-T // state_chunk(Dn, is_cuda))


@torch.library.custom_op("mambakit::selective_scan_fwd", mutates_args=(), schema=_FWD_SCHEMA)
def _scan_fwd(
    u, delta, A, B, C, D, z, delta_bias, delta_softplus, initial_state, seq_idx, save_states
):
    from .launch import scan_fwd

    return scan_fwd(
        u, delta, A, B, C, D, z, delta_bias, delta_softplus, initial_state, seq_idx,
        save_states,
    )  # fmt: skip


@_scan_fwd.register_fake
def _(u, delta, A, B, C, D, z, delta_bias, delta_softplus, initial_state, seq_idx, save_states):
    Bsz, T, Dn = u.shape
    N = A.shape[1]
    f32 = torch.float32
    y = u.new_empty(Bsz, T, Dn)
    hT = u.new_empty(Bsz, Dn, N, dtype=f32)
    shape = (Bsz, _ntiles(T, Dn, u.is_cuda), Dn, N) if save_states else (0,)
    states = u.new_empty(shape, dtype=f32)
    return y, hT, states


@torch.library.custom_op("mambakit::selective_scan_bwd", mutates_args=(), schema=_BWD_SCHEMA)
def _scan_bwd(
    gy,
    g_final,
    u,
    delta,
    A,
    B,
    C,
    D,
    z,
    delta_bias,
    delta_softplus,
    initial_state,
    seq_idx,
    states,
):
    from .launch import scan_bwd

    grads = scan_bwd(
        gy, g_final, u, delta, A, B, C, D, z, delta_bias, delta_softplus, initial_state,
        seq_idx, states,
    )  # fmt: skip
    # custom ops return tensors only: an absent input's gradient is an empty tensor
    return tuple(g if g is not None else u.new_empty(0) for g in grads)


@_scan_bwd.register_fake
def _(
    gy,
    g_final,
    u,
    delta,
    A,
    B,
    C,
    D,
    z,
    delta_bias,
    delta_softplus,
    initial_state,
    seq_idx,
    states,
):
    e = u.new_empty(0)
    f32 = torch.float32
    return (
        torch.empty_like(u, memory_format=torch.contiguous_format),
        torch.empty_like(delta, memory_format=torch.contiguous_format),
        torch.empty_like(A, dtype=f32, memory_format=torch.contiguous_format),
        B.new_empty(B.shape),
        C.new_empty(C.shape),
        D.new_empty(D.shape, dtype=f32) if D is not None else e,
        z.new_empty(z.shape) if z is not None else e,
        delta_bias.new_empty(delta_bias.shape, dtype=f32) if delta_bias is not None else e,
        initial_state.new_empty(initial_state.shape, dtype=f32) if initial_state is not None else e,
    )


def _setup_context(ctx, inputs, output):
    u, delta, A, B, C, D, z, delta_bias, delta_softplus, initial_state, seq_idx, _ = inputs
    ctx.delta_softplus = delta_softplus
    # unused outputs (the final state, the saved states) get None, not zeros: no 400 MB fill
    # of the states' shape, and no zero carry loaded into the backward
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(u, delta, A, B, C, D, z, delta_bias, initial_state, seq_idx, output[2])


def _backward(ctx, gy, g_final, _g_states):
    u, delta, A, B, C, D, z, delta_bias, initial_state, seq_idx, states = ctx.saved_tensors
    if gy is None:
        gy = torch.zeros_like(u)
    du, ddt, dA, dB, dC, dD, dz, dbias, dh0 = scan_bwd_op(
        gy, g_final, u, delta, A, B, C, D, z, delta_bias, ctx.delta_softplus, initial_state,
        seq_idx, states,
    )  # fmt: skip
    return (
        du,
        ddt,
        dA,
        dB,
        dC,
        dD if D is not None else None,
        dz if z is not None else None,
        dbias if delta_bias is not None else None,
        None,
        dh0 if initial_state is not None else None,
        None,
        None,
    )


_scan_fwd.register_autograd(_backward, setup_context=_setup_context)
# the handles the package's callers use (eager calls skip the dispatcher: ops/_dispatch.py)
scan_fwd_op = Op(_scan_fwd, _setup_context, _backward)
scan_bwd_op = Op(_scan_bwd)


def states_at_buffers(
    positions: torch.Tensor, T: int, Dn: int, N: int, device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What the forward kernel takes for `states_at` [B, k]: slot int32 [B, T] (j at step
    positions[b, j], -1 elsewhere), tiles int32 [B, T / TC] (the largest slot of each
    forward tile: -1 where the tile keeps no state, so a tile checks one number) and the
    output [B, k, D, N] f32 it writes."""
    from .launch import tile_slots
    from .scan_config import config

    Bsz, k = positions.shape
    slot = torch.full((Bsz, T), -1, dtype=torch.int32, device=device)
    rank = torch.arange(k, dtype=torch.int32, device=device).expand(Bsz, k)
    slot.scatter_(1, positions, rank)
    tiles = tile_slots(slot, config(Dn, device.type != "cuda").fwd_tile)
    return slot, tiles, torch.empty(Bsz, k, Dn, N, dtype=torch.float32, device=device)


def selective_scan_triton(
    u: torch.Tensor,  # [B, T, D]
    delta: torch.Tensor,  # [B, T, D]
    A: torch.Tensor,  # [D, N] f32
    B: torch.Tensor,  # [B, T, N]
    C: torch.Tensor,  # [B, T, N]
    D: torch.Tensor | None,  # [D] f32
    z: torch.Tensor | None,  # [B, T, D]
    delta_bias: torch.Tensor | None,  # [D] f32
    delta_softplus: bool,
    initial_state: torch.Tensor | None,  # [B, D, N] f32
    seq_idx: torch.Tensor | None,  # [B, T] int32
    return_final_state: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """y [B, T, D] in u.dtype, or (y, final state [B, D, N] f32); same contract as the reference.

    Chunk-boundary states are kept for the backward only when a gradient can flow.
    """
    tensors = (u, delta, A, B, C, D, z, delta_bias, initial_state)
    save = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
    y, hT, _ = scan_fwd_op(
        u, delta, A, B, C, D, z, delta_bias, bool(delta_softplus), initial_state, seq_idx, save
    )
    return (y, hT) if return_final_state else y


@torch.library.custom_op(
    "mambakit::selective_state_update", mutates_args=("ssm_state",), schema=_STEP_SCHEMA
)
def _state_update(ssm_state, u, delta, A, B, C, D, z, delta_bias, delta_softplus):
    from .launch import state_update

    return state_update(ssm_state, u, delta, A, B, C, D, z, delta_bias, delta_softplus)


@_state_update.register_fake
def _(ssm_state, u, delta, A, B, C, D, z, delta_bias, delta_softplus):
    return u.new_empty(u.shape)


state_update_op = Op(_state_update)


def selective_state_update_triton(
    ssm_state: torch.Tensor,  # [B, D, N] f32, updated in place
    u: torch.Tensor,  # [B, D]
    delta: torch.Tensor,  # [B, D]
    A: torch.Tensor,  # [D, N]
    B: torch.Tensor,  # [B, N]
    C: torch.Tensor,  # [B, N]
    D: torch.Tensor | None = None,  # [D]
    z: torch.Tensor | None = None,  # [B, D]
    delta_bias: torch.Tensor | None = None,  # [D]
    delta_softplus: bool = True,
) -> torch.Tensor:
    """One decode step: h = exp(delta A) h + delta u B in place; returns y [B, D] in u.dtype."""
    return state_update_op(ssm_state, u, delta, A, B, C, D, z, delta_bias, bool(delta_softplus))


__all__ = ["selective_scan_triton", "selective_state_update_triton"]
