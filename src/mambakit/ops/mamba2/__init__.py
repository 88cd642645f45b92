"""Mamba-2 (SSD): the mixer's family of ops, each with its reference body (reference.py, on
the readable oracle naive.py) and its Triton body, chosen here only.

- `mamba2_scan`: the sequence forward (and its backward), state in and out, `seq_idx`;
  Triton: the Mamba-3 chunk kernels with Mamba-2's terms (scan.py), as the custom ops
  `mambakit::mamba2_scan_fwd`, `mamba2_scan_train` and `mamba2_scan_bwd` (so torch.compile
  traces them; `_dispatch.Op` calls their bodies directly in eager mode).
- `mamba2_state_update`: one decode step on made inputs (x, delta, B, C), the state in
  place.
- `mamba2_step_raw`: one decode step from in_proj's output as it comes (the conv, delta,
  the state update, D and the gated norm made inside), the states in place; Triton: two
  kernels (step.py).
- `mamba2_stack_step`: one decode step through a stack of blocks whose weights the caller
  holds (add, norm, in_proj, the step, out_proj per block).

The public ops check their inputs; their private twins (`_mamba2_scan`) serve the layer,
which checked once.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from .._backend import resolve_backend
from .._checks import check_seq_idx, check_tensor
from .._dispatch import Op
from ..mamba3 import _CONFIGS, _config_id
from ..rms_norm.reference import rms_norm_reference
from .reference import (
    CHUNK,
    mamba2_delta_reference,
    mamba2_scan_reference,
    mamba2_step_fused_reference,
    mamba2_step_reference,
)
from .stack import decode_layers

__all__ = [
    "Mamba2StepWeights",
    "check_mamba2_state",
    "mamba2_delta_reference",
    "mamba2_scan",
    "mamba2_scan_reference",
    "mamba2_stack_step",
    "mamba2_state_update",
    "mamba2_step_raw",
    "mamba2_step_reference",
]


class Mamba2StepWeights(NamedTuple):
    """What a decode step of a Mamba-2 block reads (views of its parameters; A made)."""

    norm_w: torch.Tensor | None  # [M] the block's RMSNorm weight
    eps: float
    in_w: torch.Tensor | None  # [2 E + 2 G N + H, M] in the compute dtype (None: the layer
    in_b: torch.Tensor | None  # calls its projections, `Mamba2.decode`)
    out_w: torch.Tensor | None  # [M, E]
    out_b: torch.Tensor | None
    conv_w: torch.Tensor  # [conv_dim, K]
    conv_b: torch.Tensor | None  # [conv_dim]
    dt_bias: torch.Tensor  # [H]
    A: torch.Tensor  # [H] = -exp(A_log), f32 (f64 for a float64 model)
    D: torch.Tensor  # [H] or [H, P]
    gnorm_w: torch.Tensor | None  # [d_ssm] the gated norm's weight; None: y * silu(z)
    gnorm_eps: float
    sizes: tuple[int, int, int, int, int, int]  # (d_mlp, d_ssm, G, N, H, P)
    dt_limit: tuple[float, float]
    norm_before_gate: bool


def mamba2_scan(
    x: torch.Tensor,  # [B, T, H, P]
    delta: torch.Tensor,  # [B, T, H] > 0 (after softplus and the limits)
    A: torch.Tensor,  # [H] < 0
    B: torch.Tensor,  # [B, T, G, N]
    C: torch.Tensor,  # [B, T, G, N]
    D: torch.Tensor | None = None,  # [H] or [H, P]
    z: torch.Tensor | None = None,  # [B, T, H, P] gate: y * silu(z)
    initial_state: torch.Tensor | None = None,  # [B, H, P, N]
    seq_idx: torch.Tensor | None = None,  # [B, T] int32
    chunk: int = CHUNK,
    backend: str = "auto",
    dt_bias: torch.Tensor | None = None,  # [H]: delta is in_proj's dt (see below)
    dt_limit: tuple[float, float] = (0.0, math.inf),
) -> tuple[torch.Tensor, torch.Tensor]:
    """(y [B, T, H, P] in x.dtype, the final state [B, H, P, N] f32, or f64 for float64
    inputs), differentiable in every input and the initial state (reference.py gives the
    math). `chunk`: the reference body's block (the result does not depend on it). With
    `dt_bias`, `delta` is in_proj's raw dt and the scan's delta is clamp(softplus(delta +
    dt_bias), *dt_limit) (`mamba2_delta_reference`; made inside the kernels of a forward
    without autograd)."""
    check_tensor("x", x, (None, None, None, None))
    Bsz, T, H, P = x.shape
    dev = x.device
    check_tensor("B", B, (Bsz, T, None, None), device=dev)
    G, N = B.shape[2:]
    if H % G:
        raise ValueError(f"B: {G} groups do not divide the {H} heads of x")
    check_tensor("C", C, (Bsz, T, G, N), device=dev)
    check_tensor("delta", delta, (Bsz, T, H), device=dev)
    check_tensor("A", A, (H,), device=dev)
    if D is not None:
        check_tensor("D", D, (H,) if D.dim() == 1 else (H, P), device=dev)
    if z is not None:
        check_tensor("z", z, (Bsz, T, H, P), device=dev)
    if initial_state is not None:
        check_mamba2_state("initial_state", initial_state, Bsz, H, P, N, dev)
    if seq_idx is not None:
        check_seq_idx(seq_idx, Bsz, T, dev)
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk <= 0:
        raise ValueError(f"chunk must be a positive int, got {chunk!r}")
    if dt_bias is not None:
        check_tensor("dt_bias", dt_bias, (H,), device=dev)
    lo, hi = _check_limit(dt_limit)
    return _mamba2_scan(x, delta, A, B, C, D, z, initial_state, seq_idx, chunk, backend,
                        dt_bias, (lo, hi))  # fmt: skip


def _check_limit(dt_limit) -> tuple[float, float]:
    try:
        lo, hi = (float(v) for v in dt_limit)
    except (TypeError, ValueError):
        raise ValueError(
            f"dt_limit must be a pair of floats (low, high), got {dt_limit!r}"
        ) from None
    if not 0.0 <= lo < hi:
        raise ValueError(f"dt_limit must satisfy 0 <= low < high, got {dt_limit!r}")
    return lo, hi


def _mamba2_scan(x, delta, A, B, C, D, z, initial_state, seq_idx, chunk, backend, dt_bias=None,
                 dt_limit=(0.0, math.inf)):  # fmt: skip
    """`mamba2_scan` without the checks. Triton: the kernels (also under torch.compile, as
    custom ops), with an f32 state."""
    if resolve_backend(backend, x) == "triton" and (
        initial_state is None or initial_state.dtype == torch.float32
    ):
        return mamba2_scan_kernel(x, delta, A, B, C, D, z, initial_state, seq_idx,
                                  dt_bias=dt_bias, dt_limit=dt_limit)  # fmt: skip
    if dt_bias is not None:
        delta = mamba2_delta_reference(delta, dt_bias, dt_limit)
    return mamba2_scan_reference(x, delta, A, B, C, D, z, initial_state, seq_idx, chunk)


def mamba2_scan_kernel(x, delta, A, B, C, D=None, z=None, initial_state=None, seq_idx=None,
                       cfg=None, dt_bias=None, dt_limit=(0.0, math.inf)):  # fmt: skip
    """The Triton body of `mamba2_scan` (its inputs checked), differentiable in every input
    and the initial state: (y in x.dtype, the final f32 state). Outside autograd one custom
    op, `mambakit::mamba2_scan_fwd`; under autograd `mambakit::mamba2_scan_train`, with
    `mambakit::mamba2_scan_bwd` its backward. A D of one value per head and the gate run
    inside the kernels; a D per channel ([H, P]) is added here. cfg: launch parameters other
    than the library's (`ops.mamba3.scan_config.Mamba3ScanConfig`). With dt_bias, delta is
    in_proj's dt (`mamba2_scan`): made into the scan's inside the forward kernels without
    autograd, before them otherwise."""
    Bsz, T, H, P = x.shape
    N = B.shape[-1]
    if initial_state is None:
        initial_state = x.new_zeros(Bsz, H, P, N, dtype=torch.float32)
    if T == 0:
        return x.new_empty(x.shape), initial_state.float().clone()
    tensors = (x, delta, A, B, C, D, z, initial_state, dt_bias)
    grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
    if dt_bias is not None and grad:
        delta, dt_bias = mamba2_delta_reference(delta, dt_bias, dt_limit), None
    D_h = D if D is not None and D.dim() == 1 else None
    if D_h is None and D is not None and z is not None:  # D x joins y before the gate
        y, final = mamba2_scan_kernel(x, delta, A, B, C, None, None, initial_state, seq_idx, cfg,
                                      dt_bias, dt_limit)  # fmt: skip
        y = (y.float() + D.float() * x.float()) * torch.nn.functional.silu(z.float())
        return y.to(x.dtype), final
    seq = seq_idx.to(torch.int32).contiguous() if seq_idx is not None else None
    xs = x if x.stride(-1) == 1 else x.contiguous()
    zs = z if z is None or z.stride(-1) == 1 else z.contiguous()
    s0 = initial_state.float().contiguous()
    # the kernels index delta's heads, A, D and dt_bias with unit stride
    delta = delta if delta.stride(-1) == 1 else delta.contiguous()
    A, D_h = A.contiguous(), D_h.contiguous() if D_h is not None else None
    dt_bias = dt_bias.contiguous() if dt_bias is not None else None
    args = (xs, delta, A, B, C, D_h, zs, s0, seq)
    if not grad:
        lo, hi = dt_limit
        y, final = _SCAN_FWD(*args, dt_bias, float(lo), float(hi), _config_id(cfg))
    else:
        y, final, *_ = _SCAN_TRAIN(*args, _config_id(cfg))
    if D is not None and D_h is None:  # [H, P], no gate
        y = (y.float() + D.float() * x.float()).to(x.dtype)
    return y, final


def mamba2_state_update(
    ssm: torch.Tensor,  # [B, H, P, N], advanced in place
    x: torch.Tensor,  # [B, H, P]
    delta: torch.Tensor,  # [B, H]
    A: torch.Tensor,  # [H]
    B: torch.Tensor,  # [B, G, N]
    C: torch.Tensor,  # [B, G, N]
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
) -> torch.Tensor:
    """One decode step with `ssm` advanced in place, without autograd: y [B, H, P] in
    x.dtype. The caller checked the inputs (the Mamba-2 layer)."""
    y, new = mamba2_step_reference(x, delta, A, B, C, D, z, ssm)
    ssm.copy_(new)
    return y


def mamba2_step_raw(
    conv_state: torch.Tensor,  # [B, K-1, conv_dim], advanced in place
    ssm_state: torch.Tensor,  # [B, H, P, N], advanced in place
    zxbcdt: torch.Tensor,  # [B, in_proj rows], in_proj's output
    w: Mamba2StepWeights,
    backend: str = "auto",
) -> torch.Tensor:
    """One decode step from in_proj's output, without autograd: what out_proj reads [B,
    d_mlp + d_ssm] (step.py gives the math), the states advanced in place. Triton: two
    kernels, outside torch.compile and with f32 states. The caller checked the states."""
    args = (zxbcdt, conv_state, ssm_state, w.conv_w, w.conv_b, w.dt_bias, w.A, w.D, w.gnorm_w,
            w.gnorm_eps, w.sizes)  # fmt: skip
    d_mlp, d_ssm, G, N, H, _ = w.sizes
    width = 2 * d_mlp + 2 * d_ssm + 2 * G * N + H
    if zxbcdt.shape[-1] != width or zxbcdt.stride(-1) != 1:  # the rest is the layer's own
        raise ValueError(
            f"zxbcdt (in_proj's output) must be [B, {width}] with unit last stride, got shape "
            f"{tuple(zxbcdt.shape)}, strides {zxbcdt.stride()}"
        )
    for name, t in (("conv_state", conv_state), ("ssm_state", ssm_state)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have stride 1 in its last dim, got {t.stride()}")
    # the states were checked at the model's or the layer's entry, the weights are the
    # layer's own: no per-argument checks on each layer of each token
    kw = dict(dt_limit=w.dt_limit, norm_before_gate=w.norm_before_gate, check=False)
    if (
        resolve_backend(backend, zxbcdt) == "triton"
        and not torch.compiler.is_compiling()
        and ssm_state.dtype == conv_state.dtype == torch.float32
    ):
        from .step import mamba2_step_triton

        return mamba2_step_triton(*args, **kw)
    return mamba2_step_fused_reference(*args, **kw)


def mamba2_stack_step(
    hidden: torch.Tensor,  # [B, M], the embedded input
    layers,  # every block's Mamba2StepWeights, in order: a list, or () -> the list (a plan)
    states: list,  # every block's `Mamba2State`, advanced in place
    compute_dtype: torch.dtype,
    backend: str = "auto",
    stack=None,  # () -> the reference body's whole-stack weights (`mamba2/stack.py`) or None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One decode step through a stack of Mamba-2 blocks whose weights the caller holds
    (the model's decode plan), without autograd: (the last block's output [B, M], the
    residual stream [B, M] f32). The caller checked the input and the states.

    Triton, with the projections in the compute dtype and f32 states: per block the add,
    the norm and in_proj (at batch 1, one kernel streaming the weight, which also stores
    the residual; at 2 rows of short rows, or up to 16 of small float32 weights, a norm
    launch then that kernel; `mamba_step.launch.linear` picks), the two step kernels, out_proj.
    Otherwise the add and norm, F.linear, the step and F.linear, each on the backend's
    body. Reference, with the input, the weights and the states in one dtype: the whole
    stack in as few PyTorch calls as it takes (`mamba2/stack.py`, on the weights `stack()`
    derives once per plan)."""
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
        conv, ssm = state
        if triton and w.in_w.dtype == w.out_w.dtype == cdt and ssm.dtype == torch.float32:
            zxbcdt, residual = linear(hidden, w.in_w, w.in_b, residual=residual,
                                      norm_weight=w.norm_w, eps=w.eps,
                                      return_residual=True)  # fmt: skip
            y = mamba2_step_raw(conv, ssm, zxbcdt, w, "triton")
            hidden = linear(y, w.out_w, w.out_b)
            continue
        normed, residual = norm(hidden, w.norm_w, w.eps, residual, cdt)
        y = mamba2_step_raw(conv, ssm, F.linear(normed, w.in_w, w.in_b), w, backend)
        hidden = F.linear(y.to(w.out_w.dtype), w.out_w, w.out_b)
    return hidden, residual


def check_mamba2_state(name: str, ssm, batch: int, H: int, P: int, N: int, device) -> None:
    """An SSM state [batch, H, P, N] (f32, or f64 for a float64 model) on `device`."""
    check_tensor(name, ssm, (batch, H, P, N), device=device)
    if ssm.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"{name} must be float32 (or float64), got {ssm.dtype}")


# The scan's custom ops; the launch config goes by its id in `ops.mamba3._CONFIGS` (the
# chunk kernels are Mamba-3's).
_ARGS = (
    "Tensor x, Tensor delta, Tensor A, Tensor B, Tensor C, Tensor? D, Tensor? z, Tensor s0, "
    "Tensor? seq, int cfg"
)


@torch.library.custom_op(
    "mambakit::mamba2_scan_fwd", mutates_args=(),
    schema=f"({_ARGS[:-9]}, Tensor? dt_bias, float lo, float hi, int cfg) -> (Tensor, Tensor)",
)  # fmt: skip
def _scan_fwd(x, delta, A, B, C, D, z, s0, seq, dt_bias, lo, hi, cfg):
    from .scan import scan_fwd

    return scan_fwd(x, delta, A, B, C, D, z, s0, seq, _CONFIGS[cfg], dt_bias, lo, hi)


@_scan_fwd.register_fake
def _(x, delta, A, B, C, D, z, s0, seq, dt_bias, lo, hi, cfg):
    return x.new_empty(x.shape), s0.new_empty(s0.shape, dtype=torch.float32)


@torch.library.custom_op("mambakit::mamba2_scan_train", mutates_args=(),
                         schema=f"({_ARGS}) -> (Tensor, Tensor, Tensor, Tensor)")  # fmt: skip
def _scan_train(x, delta, A, B, C, D, z, s0, seq, cfg):
    from .scan import scan_train_forward

    return scan_train_forward(x, delta, A, B, C, D, z, s0, seq, _CONFIGS[cfg])


@_scan_train.register_fake
def _(x, delta, A, B, C, D, z, s0, seq, cfg):
    from ..mamba3.chunk import _operands_dtype

    c = _CONFIGS[cfg]
    Bsz, T, H, P = x.shape
    N = B.shape[-1]
    nb = -(-T // c.chunk_bwd)
    return (
        x.new_empty(x.shape), s0.new_empty(s0.shape, dtype=torch.float32),
        x.new_empty(x.shape) if z is not None else x.new_empty(0),
        x.new_empty(Bsz, H, nb, P, N, dtype=_operands_dtype(x, c)) if c.chunk_bwd % c.chunk == 0
        else x.new_empty(0),
    )  # fmt: skip


@torch.library.custom_op(
    "mambakit::mamba2_scan_bwd", mutates_args=(),
    schema=f"(Tensor? dy, Tensor? dsT, {_ARGS[:-9]}, Tensor pre, Tensor states, int cfg) -> "
    "(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
)  # fmt: skip
def _scan_bwd(dy, dsT, x, delta, A, B, C, D, z, s0, seq, pre, states, cfg):
    from .scan import scan_train_backward

    inputs = (x, delta, A, B, C, D, z, s0, seq)
    grads = scan_train_backward(dy, dsT, inputs, pre, states, _CONFIGS[cfg])
    return tuple(x.new_empty(0) if g is None else g for g in grads)  # no two alike


@_scan_bwd.register_fake
def _(dy, dsT, x, delta, A, B, C, D, z, s0, seq, pre, states, cfg):
    return (
        x.new_empty(x.shape), delta.new_empty(delta.shape), A.new_empty(A.shape),
        B.new_empty(B.shape), C.new_empty(C.shape),
        D.new_empty(D.shape) if D is not None else x.new_empty(0),
        z.new_empty(z.shape) if z is not None else x.new_empty(0),
        s0.new_empty(s0.shape, dtype=torch.float32),
    )  # fmt: skip


def _setup_train(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:9], *output[2:])
    ctx.cfg = inputs[9]
    # what the backward reads (outputs 2 on) takes no gradient; an output no gradient
    # reached comes as None (no zeros materialized for it)
    ctx.mark_non_differentiable(*output[2:])
    ctx.set_materialize_grads(False)


def _train_backward(ctx, dy, dsT, *_saved_grads):
    saved = ctx.saved_tensors
    D, z = saved[5], saved[6]
    dx, ddelta, dA, dB, dC, dD, dz, ds0 = _SCAN_BWD(dy, dsT, *saved, ctx.cfg)
    return (dx, ddelta, dA, dB, dC, dD if D is not None else None,
            dz if z is not None else None, ds0, None, None)  # fmt: skip


_scan_train.register_autograd(_train_backward, setup_context=_setup_train)
_SCAN_FWD = Op(_scan_fwd)
_SCAN_TRAIN = Op(_scan_train, _setup_train, _train_backward)
_SCAN_BWD = Op(_scan_bwd)
