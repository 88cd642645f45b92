"""Mamba-2's sequence scan on the Mamba-3 chunk kernels (ops/mamba3/chunk.py): one body for
both mixers' scans.

Mamba-3's state update S_t = alpha_t S_{t-1} + beta_t x_{t-1} k~_{t-1}^T + gamma_t x_t k~_t^T
is Mamba-2's when its late term beta is 0 and its turned keys and queries are B and C: the
kernels run with k~ = B, q~ = C (a group's rows read by its heads through a stride-0 view
when there is one group, copied per head otherwise), A delta, gamma = delta and late = 0,
and no initial k~ or x. Their backward gives the per-head gradients of B and C (summed here
over each group's heads, in a fixed order) and those of A delta and gamma, from which delta's
and A's follow.
"""

from __future__ import annotations

import torch

from ..mamba3.chunk import CONFIG, _Core, _Ctx, _launch_fwd


def _heads(t: torch.Tensor, H: int) -> torch.Tensor:
    """[B, T, G, N] group rows -> [B, T, H, N] per head: a view when G is 1 or H."""
    G = t.shape[2]
    if G == H:
        return t
    if G == 1:
        return t.expand(-1, -1, H, -1)
    return t.repeat_interleave(H // G, dim=2)


def _terms(x, delta, A, B, C):
    """(q~, k~, A delta, gamma, late, initial k~, initial x) of the Mamba-3 core for Mamba-2's
    inputs; q~ and k~ with one set of strides, as the kernels read them."""
    Bsz, T, H, P = x.shape
    N = B.shape[-1]
    if B.stride() != C.stride() or B.stride(-1) != 1:
        B, C = B.contiguous(), C.contiguous()
    gamma = delta.float().contiguous()
    adt = gamma * A.float()
    late = torch.zeros_like(gamma)
    k0 = x.new_zeros(Bsz, H, N, dtype=torch.float32)
    x0 = x.new_zeros(Bsz, H, P, dtype=torch.float32)
    return _heads(C, H), _heads(B, H), adt, gamma, late, k0, x0


def scan_fwd(x, delta, A, B, C, D, z, s0, seq, cfg=None):
    """The scan without autograd: (y [B, T, H, P] in x.dtype with D and the gate, the final
    state [B, H, P, N] f32). x and z have unit last stride; s0 is f32 and contiguous."""
    cfg = cfg or CONFIG
    qr, kr, adt, gamma, late, k0, x0 = _terms(x, delta, A, B, C)
    y = torch.empty(x.shape, device=x.device, dtype=x.dtype)
    sT, _, _ = _launch_fwd(x, qr, kr, adt, gamma, late, seq, D, z, s0, k0, x0, y, cfg.chunk,
                           cfg)  # fmt: skip
    return y, sT


def scan_train_forward(x, delta, A, B, C, D, z, s0, seq, cfg=None):
    """The forward of the differentiable scan: (y, the final state, y before the gate or an
    empty tensor, the backward's chunk start states or an empty tensor)."""
    cfg = cfg or CONFIG
    qr, kr, adt, gamma, late, k0, x0 = _terms(x, delta, A, B, C)
    core = _Ctx()
    y, sT = _Core.forward(core, x, qr, kr, adt, gamma, late, seq, s0, k0, x0, D, z, cfg)
    pre, states = core.saved_tensors[-2:]
    return (y, sT, x.new_empty(0) if pre is None else pre,
            x.new_empty(0) if states is None else states)  # fmt: skip


def scan_train_backward(dy, dsT, inputs, pre, states, cfg=None):
    """The gradients of (x, delta, A, B, C, D, z, s0), None for an absent D or z, from those
    of y and the final state (None where none reached them)."""
    cfg = cfg or CONFIG
    x, delta, A, B, C, D, z, s0, seq = inputs
    qr, kr, adt, gamma, late, k0, x0 = _terms(x, delta, A, B, C)
    pre = pre if z is not None else None
    states = states if states.numel() else None
    core = _Ctx((x, qr, kr, adt, gamma, late, seq, s0, k0, x0, D, z, pre, states), cfg=cfg,
                groups=B.shape[2])  # fmt: skip
    # dq, dk: q~'s and k~'s gradients summed over each group's heads (`_qk_grads`)
    dx, dq, dk, dadt, dgam, _, _, ds0, _, _, dD, dz = _Core.backward(core, dy, dsT)
    dC, dB = dq.to(C.dtype), dk.to(B.dtype)
    ddelta = (dgam + dadt * A.float()).to(delta.dtype)
    dA = (dadt * gamma).sum((0, 1)).to(A.dtype)
    return dx, ddelta, dA, dB, dC, dD, dz, ds0
