"""Mamba-3 SISO: the mixer's family of ops, each with its reference body (reference.py, on
the readable oracle naive.py) and its Triton body, chosen here only.

- `mamba3_scan`: the sequence forward (and its backward), state in and out, `seq_idx`;
  Triton: the terms kernels (terms.py) and the chunk kernels (chunk.py), as the custom
  ops `mambakit::mamba3_scan_fwd`, `mamba3_scan_train` and `mamba3_scan_bwd` (so
  torch.compile traces them: `_dispatch.Op` calls their bodies directly in eager mode).
- `mamba3_state_update`: one decode step on made inputs (q, k, delta, A), the state in
  place; Triton: one kernel (step.py).
- `mamba3_step_raw`: one decode step from in_proj's output as it comes (the B and C norms,
  softplus and A made inside), the state in place; Triton: the same kernel.
- `mamba3_stack_step`: one decode step through a stack of blocks whose weights the caller
  holds (add, norm, in_proj, the step, out_proj per block).

The public ops check their inputs; their private twins (`_mamba3_scan`, ...) serve the
layers, which checked once. README.md says which kernel runs where.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from ...state import Mamba3State
from .._backend import resolve_backend
from .._checks import check_seq_idx, check_tensor
from .._dispatch import Op
from ..rms_norm.reference import rms_norm_reference
from .reference import (
    CHUNK,
    heavy_tail,
    mamba3_scan_reference,
    mamba3_step_reference,
    rotate_pairs,
)
from .stack import decode_layers

__all__ = [
    "Mamba3State",
    "Mamba3StepWeights",
    "heavy_tail",
    "mamba3_scan",
    "mamba3_scan_reference",
    "mamba3_stack_step",
    "mamba3_state_update",
    "mamba3_step_raw",
    "mamba3_step_reference",
    "rotate_pairs",
]


class Mamba3StepWeights(NamedTuple):
    """What a decode step of a Mamba-3 block reads (views of its parameters)."""

    norm_w: torch.Tensor  # [M] the block's RMSNorm weight
    eps: float
    # in_proj's and out_proj's weights, in the compute dtype; None where a layer's own step
    # calls the modules (`Mamba3.decode_weights(projections=False)`)
    in_w: torch.Tensor | None  # [2E + 2GN + 3H + S, M]
    out_w: torch.Tensor | None  # [M, E]
    q_bias: torch.Tensor  # [H, N] (C_bias)
    k_bias: torch.Tensor  # [H, N] (B_bias)
    D: torch.Tensor  # [H]
    dt_bias: torch.Tensor  # [H]
    A_floor: float
    q_norm_w: torch.Tensor  # [N] (C_norm)
    k_norm_w: torch.Tensor  # [N] (B_norm)
    qk_eps: float  # the B and C norms' eps
    sizes: tuple[int, int, int, int, int, int]  # (E, N, G, H, P, S)


def mamba3_scan(
    x: torch.Tensor,  # [B, T, H, P]
    q: torch.Tensor,  # [B, T, G, N] normalised C rows
    k: torch.Tensor,  # [B, T, G, N] normalised B rows
    delta: torch.Tensor,  # [B, T, H] > 0
    A: torch.Tensor,  # [B, T, H] < 0
    trap: torch.Tensor,  # [B, T, H]
    theta: torch.Tensor,  # [B, T, S]
    q_bias: torch.Tensor,  # [H, N]
    k_bias: torch.Tensor,  # [H, N]
    D: torch.Tensor | None = None,  # [H]
    z: torch.Tensor | None = None,  # [B, T, H, P]
    initial_state: Mamba3State | None = None,
    seq_idx: torch.Tensor | None = None,  # [B, T] int32
    chunk: int = CHUNK,
    backend: str = "auto",
) -> tuple[torch.Tensor, Mamba3State]:
    """(y [B, T, H, P] in x.dtype, the final state), differentiable in every input and the
    initial state (reference.py gives the math). `chunk`: the reference body's block."""
    check_tensor("x", x, (None, None, None, None))
    Bsz, T, H, P = x.shape
    dev = x.device
    check_tensor("q", q, (Bsz, T, None, None), device=dev)
    G, N = q.shape[2:]
    if H % G:
        raise ValueError(f"q: {G} groups do not divide the {H} heads of x")
    check_tensor("k", k, (Bsz, T, G, N), device=dev)
    for name, t in (("delta", delta), ("A", A), ("trap", trap)):
        check_tensor(name, t, (Bsz, T, H), device=dev)
    check_tensor("theta", theta, (Bsz, T, None), device=dev)
    S = theta.shape[2]
    if 2 * S > N:
        raise ValueError(f"theta: {S} angles turn more than the {N} state dims of q")
    check_tensor("q_bias", q_bias, (H, N), device=dev)
    check_tensor("k_bias", k_bias, (H, N), device=dev)
    if D is not None:
        check_tensor("D", D, (H,), device=dev)
    if z is not None:
        check_tensor("z", z, (Bsz, T, H, P), device=dev)
    if initial_state is not None:
        check_mamba3_state("initial_state", initial_state, Bsz, H, P, N, S, dev)
    if seq_idx is not None:
        check_seq_idx(seq_idx, Bsz, T, dev)
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk <= 0:
        raise ValueError(f"chunk must be a positive int, got {chunk!r}")
    args = (x, q, k, delta, A, trap, theta, q_bias, k_bias, D, z)
    return _mamba3_scan(*args, initial_state, seq_idx, chunk, backend)


def _mamba3_scan(x, q, k, delta, A, trap, theta, q_bias, k_bias, D, z, initial_state, seq_idx,
                 chunk, backend):  # fmt: skip
    """`mamba3_scan` without the checks. Triton: the kernels, outside torch.compile (which
    traces the reference) and with an f32 state."""
    args = (x, q, k, delta, A, trap, theta, q_bias, k_bias, D, z)
    if _kernels(x, backend, initial_state, compiles=True):
        return mamba3_scan_kernel(*args, initial_state=initial_state, seq_idx=seq_idx)
    return mamba3_scan_reference(*args, initial_state=initial_state, seq_idx=seq_idx, chunk=chunk)


def mamba3_scan_kernel(x, q, k, delta, A, trap, theta, q_bias, k_bias, D=None, z=None,
                       initial_state=None, seq_idx=None, cfg=None):  # fmt: skip
    """The Triton body of `mamba3_scan` (its inputs checked), differentiable in every input
    and the initial state: (y in x.dtype, the final f32 state). Outside autograd one custom
    op, `mambakit::mamba3_scan_fwd` (chunk.py's `mamba3_scan_fwd`: D and the gate inside the
    kernel); under autograd `mambakit::mamba3_scan_train`, the per-token terms and the scan
    as one node, with `mambakit::mamba3_scan_bwd` its backward. cfg: launch parameters
    other than the library's (scan_config.py's `Mamba3ScanConfig`)."""
    Bsz, T, H, P = x.shape
    N, S = q.shape[-1], theta.shape[-1]
    if initial_state is None:  # views of one buffer: one launch (they never leave this call)
        shapes = Mamba3State.shapes(Bsz, H, P, N, S)
        sizes = [-(-math.prod(v) // 4) * 4 for v in shapes.values()]  # each 16-byte aligned
        flat = torch.zeros(sum(sizes), device=x.device, dtype=torch.float32)
        parts = dict(zip(shapes, flat.split(sizes)))
        initial_state = Mamba3State(
            **{k: parts[k][: math.prod(v)].view(v) for k, v in shapes.items()}
        )
    if T == 0:
        return x.new_empty(x.shape), Mamba3State(*(t.float().clone() for t in initial_state))
    seq = seq_idx.to(torch.int32).contiguous() if seq_idx is not None else None
    xs = x if x.stride(-1) == 1 else x.contiguous()
    zs = z if z is None or z.stride(-1) == 1 else z.contiguous()
    angle0, s0, k0, x0 = (t.float().contiguous() for t in initial_state)
    D = D.contiguous() if D is not None else None  # the kernels read D[h] with unit stride
    args = (xs, q, k, delta, A, trap, theta, q_bias, k_bias, angle0, s0, k0, x0, D, zs, seq,
            _config_id(cfg))  # fmt: skip
    tensors = (x, q, k, delta, A, trap, theta, q_bias, k_bias, D, z, *initial_state)
    if not torch.is_grad_enabled() or not any(t is not None and t.requires_grad for t in tensors):
        y, *final = _SCAN_FWD(*args)
        return y, Mamba3State(*final)
    y, phi_T, sT, kT, *_ = _SCAN_TRAIN(*args)
    return y, Mamba3State(phi_T, sT, kT, x[:, -1].float())


def mamba3_state_update(
    state: Mamba3State,  # advanced in place
    x: torch.Tensor,  # [B, H, P]
    q: torch.Tensor,  # [B, G, N]
    k: torch.Tensor,  # [B, G, N]
    delta: torch.Tensor,  # [B, H]
    A: torch.Tensor,  # [B, H]
    trap: torch.Tensor,  # [B, H]
    theta: torch.Tensor,  # [B, S]
    q_bias: torch.Tensor,  # [H, N]
    k_bias: torch.Tensor,  # [H, N]
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """One decode step with `state` advanced in place, without autograd: y [B, H, P] in
    x.dtype. The caller checked the inputs (the Mamba-3 layer)."""
    args = (x, q, k, delta, A, trap, theta, q_bias, k_bias, D, z)
    if _kernels(x, backend, state):
        from .step import state_update

        return state_update(state, *args)
    y, new = mamba3_step_reference(*args, state)
    _copy_into(state, new)
    return y


def mamba3_step_raw(
    state: Mamba3State,  # advanced in place
    zxbc: torch.Tensor,  # [B, in_proj rows], in_proj's output
    w: Mamba3StepWeights,
    backend: str = "auto",
) -> torch.Tensor:
    """One decode step from in_proj's output, without autograd: y [B, H, P] (gated, before
    out_proj), `state` advanced in place. q, k, delta and A are made as the layer makes them
    (the RMSNorms of C and B, softplus(dd_dt + dt_bias), -max(heavy_tail(dd_A), A_floor)):
    inside the kernel on Triton, a dozen small launches a layer and token otherwise. The
    caller checked the inputs."""
    z, x, B, C, dd_dt, dd_A, trap, theta = _split(zxbc, w.sizes)
    if _kernels(x, backend, state):
        from .step import state_update_raw

        return state_update_raw(
            state, x, C, B, dd_dt, dd_A, trap, theta, w.q_bias, w.k_bias, w.D, z, w.dt_bias,
            w.A_floor, w.q_norm_w, w.k_norm_w, w.qk_eps,
        )  # fmt: skip
    f = state.ssm.dtype
    q = rms_norm_reference(C, w.q_norm_w, w.qk_eps, None, C.dtype)[0]
    k = rms_norm_reference(B, w.k_norm_w, w.qk_eps, None, B.dtype)[0]
    A = -heavy_tail(dd_A.to(f)).clamp(min=w.A_floor)
    delta = F.softplus(dd_dt.to(f) + w.dt_bias.to(f))
    y, new = mamba3_step_reference(x, q, k, delta, A, trap, theta, w.q_bias, w.k_bias, w.D, z,
                                   state)  # fmt: skip
    _copy_into(state, new)
    return y


def mamba3_stack_step(
    hidden: torch.Tensor,  # [B, M], the embedded input
    layers,  # every block's Mamba3StepWeights, in order: a list, or () -> the list (a plan)
    states: list[Mamba3State],  # every block's, advanced in place
    compute_dtype: torch.dtype,
    backend: str = "auto",
    stack=None,  # () -> the reference body's whole-stack weights (`mamba3/stack.py`) or None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One decode step through a stack of Mamba-3 blocks whose weights the caller holds
    (the model's decode plan; a list, or () -> the list), without autograd: (the last
    block's output [B, M], the residual stream [B, M] f32; or the residual stream and None
    where the body carries it as the output). The caller checked the input and the states.

    Triton, with the projections in the compute dtype and f32 states: per block, at batch 1
    three kernels chained by programmatic dependent launch (the add, the norm and in_proj
    streaming its weight, which also stores the residual; the step kernel; out_proj
    streamed), at 2 rows of short rows the same with a norm launch first, above (up to 16
    rows of small float32 weights: the RL models, streamed still) a norm launch, cuBLAS,
    the step kernel, cuBLAS (`mamba_step.launch.linear` picks). Otherwise the add and norm,
    F.linear, the step and F.linear, each on the backend's body. Reference, with the input,
    the weights and the states in one dtype: the whole stack in as few PyTorch calls as it
    takes (`mamba3/stack.py`, on the weights `stack()` derives once per plan)."""
    cdt = compute_dtype
    triton = resolve_backend(backend, hidden) == "triton"
    norm = rms_norm_reference
    if triton:  # once per step, not per layer (the launchers import Triton)
        from ..mamba_step.launch import linear
        from ..rms_norm import rms_norm_triton as norm
    elif stack is not None and hidden.dtype == cdt == states[0].ssm.dtype:
        weights = stack()
        if weights is not None and weights.blocks[0].in_wT.dtype == cdt:
            return decode_layers(hidden, weights, states), None
    layers = layers() if callable(layers) else layers
    residual = None
    for w, state in zip(layers, states):
        if triton and w.in_w.dtype == w.out_w.dtype == cdt and state.ssm.dtype == torch.float32:
            zxbc, residual = linear(hidden, w.in_w, residual=residual, norm_weight=w.norm_w,
                                    eps=w.eps, return_residual=True)  # fmt: skip
            y = mamba3_step_raw(state, zxbc, w, "triton")
            hidden = linear(y.flatten(-2), w.out_w)
            continue
        normed, residual = norm(hidden, w.norm_w, w.eps, residual, cdt)
        y = mamba3_step_raw(state, F.linear(normed, w.in_w), w, backend)
        hidden = F.linear(y.flatten(-2).to(w.out_w.dtype), w.out_w)
    return hidden, residual


def check_mamba3_state(name: str, state, batch: int, H: int, P: int, N: int, S: int, device):
    """A `Mamba3State` of `batch` rows for H heads of P values, N = d_state, S angles."""
    if not isinstance(state, Mamba3State):
        raise TypeError(f"{name} must be a Mamba3State, got {type(state).__name__}")
    for field, shape in Mamba3State.shapes(batch, H, P, N, S).items():
        check_tensor(f"{name}.{field}", getattr(state, field), shape, device=device)


def _kernels(x: torch.Tensor, backend: str, state, compiles: bool = False) -> bool:
    """Whether the Triton body runs: on the Triton backend with an f32 state (the kernels
    keep it in f32); under torch.compile only for the custom ops (`compiles`: the scan),
    not for the decode step's in-place kernels (the model's step traces the reference)."""
    return (
        resolve_backend(backend, x) == "triton"
        and (compiles or not torch.compiler.is_compiling())
        and (state is None or state.ssm.dtype == torch.float32)
    )


def _split(zxbc: torch.Tensor, sizes: tuple[int, ...]):
    """in_proj's rows: (z, x as [..., H, P]; B, C as [..., G, N]; dd_dt, dd_A, trap, theta)."""
    E, N, G, H, P, S = sizes
    z, x, B, C, dd_dt, dd_A, trap, theta = torch.split(
        zxbc, [E, E, G * N, G * N, H, H, H, S], dim=-1
    )
    return (z.unflatten(-1, (H, P)), x.unflatten(-1, (H, P)), B.unflatten(-1, (G, N)),
            C.unflatten(-1, (G, N)), dd_dt, dd_A, trap, theta)  # fmt: skip


def _copy_into(state: Mamba3State, new: Mamba3State) -> None:
    for dst, src in zip(state, new):
        dst.copy_(src)


# The scan's custom ops. A schema holds no dataclass: the launch config goes by its id in
# `_CONFIGS` (the library's first; a sweep's candidates are added as it passes them).
_CONFIGS: list = []


def _config_id(cfg) -> int:
    if not _CONFIGS:
        from .chunk import CONFIG

        _CONFIGS.append(CONFIG)
    if cfg is None or cfg is _CONFIGS[0]:
        return 0
    for i, c in enumerate(_CONFIGS):
        if c == cfg:
            return i
    _CONFIGS.append(cfg)
    return len(_CONFIGS) - 1


_ARGS = (
    "Tensor x, Tensor q, Tensor k, Tensor delta, Tensor A, Tensor trap, Tensor theta, "
    "Tensor q_bias, Tensor k_bias, Tensor angle0, Tensor s0, Tensor k0, Tensor x0, Tensor? D, "
    "Tensor? z, Tensor? seq, int cfg"
)
_T4 = "Tensor, Tensor, Tensor, Tensor"


@torch.library.custom_op("mambakit::mamba3_scan_fwd", mutates_args=(),
                         schema=f"({_ARGS}) -> (Tensor, {_T4})")  # fmt: skip
def _scan_fwd(x, q, k, delta, A, trap, theta, q_bias, k_bias, angle0, s0, k0, x0, D, z, seq,
              cfg):  # fmt: skip
    from .chunk import mamba3_scan_fwd

    state = Mamba3State(angle0, s0, k0, x0)
    y, final = mamba3_scan_fwd(x, q, k, delta, A, trap, theta, q_bias, k_bias, D, z, state, seq,
                               _CONFIGS[cfg])  # fmt: skip
    return (y, *final)


@_scan_fwd.register_fake
def _(x, q, k, delta, A, trap, theta, q_bias, k_bias, angle0, s0, k0, x0, D, z, seq, cfg):
    return (x.new_empty(x.shape), *(t.new_empty(t.shape, dtype=torch.float32)
                                    for t in (angle0, s0, k0, x0)))  # fmt: skip


@torch.library.custom_op("mambakit::mamba3_scan_train", mutates_args=(),
                         schema=f"({_ARGS}) -> ({_T4}, {_T4}, {_T4})")  # fmt: skip
def _scan_train(x, q, k, delta, A, trap, theta, q_bias, k_bias, angle0, s0, k0, x0, D, z, seq,
                cfg):  # fmt: skip
    from .chunk import scan_train_forward

    return scan_train_forward(x, q, k, delta, A, trap, theta, q_bias, k_bias, angle0, s0, k0,
                              x0, D, z, seq, _CONFIGS[cfg])  # fmt: skip


@_scan_train.register_fake
def _(x, q, k, delta, A, trap, theta, q_bias, k_bias, angle0, s0, k0, x0, D, z, seq, cfg):
    from .chunk import _operands_dtype

    c = _CONFIGS[cfg]
    Bsz, T, H, P = x.shape
    N, S = q.shape[-1], theta.shape[-1]
    f32, ops = torch.float32, _operands_dtype(x, c)
    nb = -(-T // c.chunk_bwd)
    return (
        x.new_empty(x.shape), x.new_empty(Bsz, H, S, dtype=f32),
        x.new_empty(Bsz, H, P, N, dtype=f32), x.new_empty(Bsz, H, N, dtype=f32),
        x.new_empty(Bsz, T, H, S, dtype=f32), x.new_empty(Bsz, T, H, N, dtype=ops),
        x.new_empty(Bsz, T, H, N, dtype=ops),
        *(x.new_empty(Bsz, T, H, dtype=f32) for _ in range(3)),
        x.new_empty(x.shape) if z is not None else x.new_empty(0),
        x.new_empty(Bsz, H, nb, P, N, dtype=ops) if c.chunk_bwd % c.chunk == 0
        else x.new_empty(0),
    )  # fmt: skip


@torch.library.custom_op(
    "mambakit::mamba3_scan_bwd", mutates_args=(),
    schema=f"(Tensor? dy, Tensor? dphi_T, Tensor? dsT, Tensor? dkT, {_ARGS[:-9]}, Tensor phi, "
    "Tensor qr, Tensor kr, Tensor adt, Tensor gamma, Tensor late, Tensor pre, Tensor states, "
    f"int cfg) -> ({_T4}, {_T4}, {_T4}, Tensor, Tensor, Tensor)",
)  # fmt: skip
def _scan_bwd(dy, dphi_T, dsT, dkT, x, q, k, delta, A, trap, theta, q_bias, k_bias, angle0, s0,
              k0, x0, D, z, seq, phi, qr, kr, adt, gamma, late, pre, states, cfg):  # fmt: skip
    from .chunk import scan_train_backward

    inputs = (x, q, k, delta, A, trap, theta, q_bias, k_bias, angle0, s0, k0, x0, D, z, seq)
    saved = (phi, qr, kr, adt, gamma, late, pre, states)
    grads = scan_train_backward(dy, dphi_T, dsT, dkT, inputs, saved, _CONFIGS[cfg])
    return tuple(x.new_empty(0) if g is None else g for g in grads)  # no two alike


@_scan_bwd.register_fake
def _(dy, dphi_T, dsT, dkT, x, q, k, delta, A, trap, theta, q_bias, k_bias, angle0, s0, k0, x0,
      D, z, seq, phi, qr, kr, adt, gamma, late, pre, states, cfg):  # fmt: skip
    like = (x, q, k, delta, A, trap, theta, q_bias, k_bias, angle0, s0, k0, x0)
    grads = [t.new_empty(t.shape) for t in like]
    grads[3] = delta.new_empty(delta.shape, dtype=torch.float32)  # delta's and A's in f32
    grads[4] = A.new_empty(A.shape, dtype=torch.float32)
    grads[9] = angle0.new_empty(angle0.shape, dtype=torch.float32)
    grads[10:13] = (t.new_empty(t.shape, dtype=torch.float32) for t in (s0, k0, x0))
    grads.append(D.new_empty(D.shape) if D is not None else x.new_empty(0))
    grads.append(z.new_empty(z.shape) if z is not None else x.new_empty(0))
    return tuple(grads)


def _setup_train(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:16], *output[4:])
    ctx.cfg = inputs[16]
    # what the backward reads (outputs 4 on) takes no gradient, and an output no gradient
    # reached comes as None: autograd would otherwise fill zeros of every such output
    # (some 400 MB at 8 x 2048 for the 130m-mamba3 heads) before each backward
    ctx.mark_non_differentiable(*output[4:])
    ctx.set_materialize_grads(False)


def _train_backward(ctx, dy, dphi_T, dsT, dkT, *_saved_grads):
    saved = ctx.saved_tensors
    D, z = saved[13], saved[14]
    grads = _SCAN_BWD(dy, dphi_T, dsT, dkT, *saved, ctx.cfg)
    dD = grads[13] if D is not None else None
    dz = grads[14] if z is not None else None
    return (*grads[:13], dD, dz, None, None)


_scan_train.register_autograd(_train_backward, setup_context=_setup_train)
_SCAN_FWD = Op(_scan_fwd)
_SCAN_TRAIN = Op(_scan_train, _setup_train, _train_backward)
_SCAN_BWD = Op(_scan_bwd)
