"""A stack of Mamba-3 blocks on the CPU as one autograd node: the training window of a small
model (an RL policy's d_model 128 x 3 layers over T = 32 steps) in a few large calls.

Per block l, from the previous block's output h and the residual stream r (the embedded
input for both at the first block):

    normed, r = rmsnorm(h + r) w_l          (rmsnorm(h) w_0 and r = h at the first)
    zx        = normed in_proj_l^T
    y, final  = the compiled Mamba-3 layer on zx (`cpu_jit.terms3`, then `cpu_jit.scan3`)
    h         = y out_proj_l^T

and (h, r) after the last block, with every block's final state; with `Ends`, the
backbone's input projection (h = x W^T + b before the first block) and its final norm
(out = rmsnorm(h + r) w after the last, the node's output then) go in too. The kernels are the
ones the blocks' modules run one node each (`ops.rms_norm.compiled`, the layer's node in
`reference.py`, `nn.Linear`'s matmuls): the node computes what they compute, bit for bit,
and its backward is theirs, in reverse block order. What it saves is the rest: at these
sizes the module path spends more time in autograd's engine, PyTorch's dispatch and the
modules' Python (some seventy nodes a window) than in its arithmetic.

Its compiled calls run on torch's thread count (`cpu_jit.common.threads`), however small
the window: on two 16-core hosts a batch-1 window with numba at 4 threads against torch's
16 took 7.4-10.7 ms, with both at 16 3.6-14.6 ms, with numba at 1 75-102 ms
(`scripts/rl_cpu_pools.py`; benchmarks/results/profiles/2026-12-07-rl-pools-h100-h200.txt).

`MambaBackbone` runs it where every block is plain (`MambaBlock.window_weights`): it
reads the weights and calls no module, so a hook, an adapter or a parametrization anywhere
in the stack sends the window through the modules instead.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from ...state import Mamba3ModelState
from .reference import _array_of

WEIGHTS = 9  # per block: norm, in_proj, B and C norms, dt_bias, C_bias, B_bias, D, out_proj


class Ends(NamedTuple):
    """What the node runs around the blocks: the input projection's weight [M, F] and bias
    (or None: the input is the first block's), the final norm's weight and eps (or None:
    the node gives the last block's output and the residual stream)."""

    in_w: torch.Tensor | None = None
    in_b: torch.Tensor | None = None
    norm_w: torch.Tensor | None = None
    norm_eps: float = 0.0


def mamba3_layers_compiled(
    x: torch.Tensor,  # [B, T, F] the input (input_proj's) or [B, T, M] the embedded input
    weights: list[tuple],  # per block, `WEIGHTS` tensors (`MambaBlock.window_weights`)
    consts: list[tuple],  # per block: (norm eps, B norm eps, C norm eps, A_floor, sizes)
    state: Mamba3ModelState | None,  # [L, B, ...] start states (None: zeros)
    ends: Ends | None = None,
) -> tuple:
    """(out [B, T, M], the final state [L, B, ...]) where `ends` has the final norm, else
    (the last block's output h [B, T, M], the residual stream r [B, T, M], the final
    state), as the modules compute them one by one, differentiable in x, every weight and
    the start state."""
    ends = ends or Ends()
    if state is None:
        E, N, G, H, P, S = consts[0][4]
        state = Mamba3ModelState.zeros(len(weights), x.shape[0], H, P, N, S, x.device, x.dtype)
    has_in, has_norm = ends.in_w is not None, ends.norm_w is not None
    flat = [*(ends.in_w, ends.in_b) * has_in, *(t for w in weights for t in w)]
    flat += [ends.norm_w] * has_norm
    meta = (tuple(consts), has_in, ends.norm_eps if has_norm else None)
    out = _Layers3.apply(meta, x.contiguous(), *state._tensors(), *flat)
    if has_norm:
        return out[0], Mamba3ModelState(*out[1:])
    return out[0], out[1], Mamba3ModelState(*out[2:])


SMALL = (0, 2, 3, 4, 5, 6, 7)  # a block's small weights: the norms', dt_bias, C/B_bias, D


def _arrays(tensors: list) -> list[np.ndarray]:
    """Parameters' values as arrays of their own, in one copy (`cpu_jit.param_array`:
    `.numpy()` on a parameter would pin its storage's size), each its tensor's shape."""
    flat = torch.cat([t.detach().reshape(-1) for t in tensors]).numpy()
    out, at = [], 0
    for t in tensors:
        out.append(flat[at : at + t.numel()].reshape(t.shape))
        at += t.numel()
    return out


class _Layers3(torch.autograd.Function):
    """Inputs: (each block's constants, whether the input projection is there, the final
    norm's eps or None), x, the start state's angle, ssm, k, x [L, B, ...], then the input
    projection's weight and bias (where there), each block's weights and the final norm's
    weight (where there); outputs: out (or h and r) and the final state's four fields."""

    @staticmethod
    def forward(ctx, meta, x, angle0, ssm0, k0, x0, *flat):
        return _forward(ctx, meta, x, angle0, ssm0, k0, x0, *flat)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads_out):
        if ctx.kept is None:
            raise RuntimeError(
                "the compiled Mamba-3 stack kept nothing for a backward: its forward ran where "
                "no backward was expected"
            )
        return _backward(ctx, *grads_out)


def _forward(ctx, meta, x, angle0, ssm0, k0, x0, *flat):
    from ..cpu_jit import rmsnorm, scan3, terms3

    consts, has_in, norm_eps = meta
    Bsz, T = x.shape[:2]
    x_rows = x.detach().reshape(Bsz * T, -1)
    rows = x_rows
    if has_in:  # as nn.Linear: addmm with a bias, mm without
        W, b = flat[0].detach(), flat[1]
        rows = x_rows @ W.t() if b is None else torch.addmm(b.detach(), x_rows, W.t())
    blocks = flat[2 * has_in :]
    grad = any(ctx.needs_input_grad)  # (else nothing is kept: no backward will come)
    r = None
    kept, finals = [], []
    # the small weights (and norm_f's) as arrays of their own, kept for the backward
    # (the weights are saved for it too: changed in place between the two, autograd
    # raises)
    smalls = [blocks[l * WEIGHTS + i] for l in range(len(consts)) for i in SMALL]
    smalls = _arrays(smalls + ([flat[-1]] if norm_eps is not None else []))
    for l, (eps, eps_B, eps_C, A_floor, sizes) in enumerate(consts):
        W_in, W_out = blocks[l * WEIGHTS + 1], blocks[l * WEIGHTS + 8]
        E, N, G, H, P, S = sizes
        norm_w, w_B, w_C, dt_bias, C_bias, B_bias, D = smalls[l * 7 : l * 7 + 7]
        small = (norm_w, w_B, w_C, dt_bias)
        normed = torch.empty_like(rows)
        r_new = rows if r is None else torch.empty_like(rows)
        k_norm = rmsnorm.forward(
            rows.numpy(), None if r is None else r.numpy(), small[0], eps, normed.numpy(),
            None if r is None else r_new.numpy(),
        )  # fmt: skip
        r = r_new
        zx = (normed @ W_in.detach().t()).view(Bsz, T, -1)
        xs, z, q, k, delta, A, trap, rate, r_k, r_q = terms3.forward(
            zx.numpy(), small[1], small[2], eps_B, eps_C, small[3], A_floor, sizes
        )
        s0 = tuple(t[l].detach().contiguous().numpy() for t in (angle0, ssm0, k0, x0))
        arrs = (xs, q, k, delta, A, trap, rate, C_bias.reshape(H, N), B_bias.reshape(H, N),
                D, z, True, *s0)  # fmt: skip
        y, *final, scan_kept = scan3.forward_arrays(arrs, grad)
        y_rows = torch.from_numpy(y).view(Bsz * T, E)
        kept.append((k_norm, r, normed, zx, arrs, scan_kept, r_k, r_q, y_rows, small))
        finals.append(final)
        rows = y_rows @ W_out.detach().t()
    state = tuple(torch.from_numpy(np.stack(f)) for f in zip(*finals))
    M = rows.shape[1]
    ends = None
    if norm_eps is not None:  # the final norm: out = rmsnorm(h + r) w
        out, r_end = torch.empty_like(rows), torch.empty_like(rows)
        w_end = smalls[-1]
        k_end = rmsnorm.forward(rows.numpy(), r.numpy(), w_end, norm_eps, out.numpy(),
                                r_end.numpy())  # fmt: skip
        ends = (k_end, r_end, w_end)
        outs = (out.view(Bsz, T, M),)
    else:
        outs = (rows.view(Bsz, T, M), r.view(Bsz, T, M))
    ctx.kept = (kept, ends, x_rows) if grad else None
    ctx.meta, ctx.shape = meta, (Bsz, T, M)
    # (x and the start state too, though the backward reads them through `kept`: so
    # that autograd raises where they are changed in place before it, as it does for
    # the modules, which save them)
    ctx.save_for_backward(x, angle0, ssm0, k0, x0, *flat)
    ctx.set_materialize_grads(False)
    return (*outs, *state)


def _backward(ctx, *grads_out):
    from ..cpu_jit import rmsnorm, scan3, terms3

    flat = ctx.saved_tensors[5:]  # (unpacking them checks that none was changed)
    (consts, has_in, _), (kept, ends, x_rows) = ctx.meta, ctx.kept
    L = len(consts)
    Bsz, T, M = ctx.shape
    blocks = flat[2 * has_in : 2 * has_in + L * WEIGHTS]
    needs = ctx.needs_input_grad[6:]  # flat's
    grads: list = [None] * len(flat)
    # the gradients of a block's output (g_rows) and of the residual stream after it;
    # where the output is not used (a loss on the final state alone) the last block's
    # out_proj and the final norm get None, as they do through the modules
    dtype = kept[-1][1].dtype
    top = grads_out[0]  # out's (the final norm's), or the last block's h's
    g_rows = torch.zeros(Bsz * T, M, dtype=dtype) if top is None else top
    g_rows = g_rows.reshape(Bsz * T, M)
    if ends is not None:
        g_final, g_res = grads_out[1:], None
        if top is not None:
            k_end, r_end, w_end = ends
            g_in = torch.empty(Bsz * T, M, dtype=dtype)
            grads[-1] = torch.from_numpy(rmsnorm.backward(
                np.ascontiguousarray(g_rows.numpy()), None, r_end.numpy(), k_end, w_end,
                g_in.numpy(),
            ))  # fmt: skip
            g_rows, g_res = g_in, g_in
    else:
        g_r, g_final = grads_out[1], grads_out[2:]
        g_res = None if g_r is None else g_r.reshape(Bsz * T, M).contiguous()
    g_state = [None] * 4  # per field, [L, B, ...]: filled from the last block down
    for l in range(L - 1, -1, -1):
        norm_w, W_in, w_B, w_C, dt_bias, C_bias, B_bias, D, W_out = _block(blocks, l)
        A_floor = consts[l][3]
        k_norm, r, normed, zx, arrs, scan_kept, r_k, r_q, y_rows, small = kept[l]
        H, P = arrs[0].shape[2:]
        n = 2 * has_in + l * WEIGHTS
        if needs[n + 8] and (top is not None or l < L - 1):
            grads[n + 8] = g_rows.t() @ y_rows
        g_y = (g_rows @ W_out.detach()).view(Bsz, T, H, P)
        outs = (g_y, *(None if g is None else g[l] for g in g_final))
        likes = (arrs[0], *arrs[12:])
        g_scan = tuple(map(_array_of, outs, likes))
        (g_xin, g_q, g_k_heads, g_delta, g_A, g_trap, g_rate, g_qb, g_kb, g_D, g_z,
         *g_s0) = scan3.backward_arrays(arrs, scan_kept, g_scan)  # fmt: skip
        g_zx, g_wB, g_wC, g_dt = terms3.backward(
            zx.numpy(), small[1], small[2], small[3], A_floor, r_k, r_q, g_xin, g_z, g_q,
            g_k_heads, g_delta, g_A, g_trap, g_rate,
        )  # fmt: skip
        g_zx = torch.from_numpy(g_zx).view(Bsz * T, -1)
        if needs[n + 1]:
            grads[n + 1] = g_zx.t() @ normed
        g_normed = g_zx @ W_in.detach()
        g_in = torch.empty_like(g_normed)
        g_w = rmsnorm.backward(
            g_normed.numpy(), None if g_res is None else g_res.numpy(), r.numpy(), k_norm,
            small[0], g_in.numpy(),
        )  # fmt: skip
        t = torch.from_numpy
        grads[n] = t(g_w)
        grads[n + 2 : n + 8] = (t(g_wB), t(g_wC), t(g_dt), t(g_qb).view_as(C_bias),
                                t(g_kb).view_as(B_bias), t(g_D))  # fmt: skip
        for i, g in enumerate(g_s0):
            if g_state[i] is None:
                g_state[i] = np.empty((L, *g.shape), g.dtype)
            g_state[i][l] = g
        g_rows, g_res = g_in, g_in  # the block's input and the residual before it
    g_x = g_rows
    if has_in:  # rows = x W^T + b
        W, b = flat[0], flat[1]
        if needs[0]:
            grads[0] = g_rows.t() @ x_rows
        if b is not None and needs[1]:
            grads[1] = g_rows.sum(0)
        g_x = g_rows @ W.detach()
    g_state = [torch.from_numpy(g) for g in g_state]
    return (None, g_x.view(Bsz, T, -1), *g_state, *grads)


def _block(flat: tuple, l: int) -> tuple:
    """Block l's `WEIGHTS` tensors from the blocks' flat list."""
    return flat[l * WEIGHTS : (l + 1) * WEIGHTS]
