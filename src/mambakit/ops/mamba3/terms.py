"""The Mamba-3 per-token terms as Triton kernels: reference.token_terms and its backward.

B batch, T time, H heads, G groups (head h reads group h // (H / G)), N = d_state,
S angles. What the scan kernels read:

    phi_t = (phi_{t-1} + pi tanh(theta_t) delta_t) mod 2 pi        (0 at a document start,
                                                                     angle0 before t = 0)
    q~_t, k~_t = rot(q_t + q_bias, phi_t), rot(k_t + k_bias, phi_t)  [N]: pair (2i, 2i+1), i < S
    A delta, gamma = lam delta, late = (1 - lam) delta (0 at a document start),  lam = sigmoid(trap)

Two parts. The angles carry along time: time is cut into chunks of a few blocks of BT
steps, and a program owns one (row, head, chunk), walks its chunk block by block
carrying the angle and writes phi [B, T, H, S], A delta, gamma and late. Within a block the
angle sum is a cumsum, or with documents a [BT, BT] same-document lower-triangular product
in f32 (ieee). The chunks run in parallel, as the scan's segments do: a first launch
(SUMS) gives what each chunk adds to the carry (forward: the angle at its end from 0;
backward: dphi summed back to its first step from 0), and each program of the second
launch composes the sums of the chunks before (forward) or after (backward) its own in
order, restarting where a document starts inside a chunk. The turn carries nothing:
`_turn_kernel` turns each (row, head, block of steps) by phi, pairs read as the even and
odd halves of a row so the rotation is elementwise on [BT, N/2] tiles (angle i >= S: 0).

The backward runs the other way round: `_unturn_kernel` takes q~ and k~'s gradients back
through the turn for one (row, group, block of steps), its heads in order, summing q and
k's gradients over the group's heads in registers, writing dphi [B, T, H, S] and each
head's bias gradient summed over the block; then the angle kernels walk the blocks in
reverse with the reverse sum of dphi. theta's gradient is per head ([H, B, T, S]), summed
over the heads in a fixed order by `sum_blocks_kernel`. cos and sin: `fast_cos_sin`.
"""

from __future__ import annotations

import dataclasses

import torch

from .._triton import launch, next_power_of_2, sum_blocks_kernel
from .terms_kernels import _terms_bwd_kernel, _terms_fwd_kernel, _turn_kernel, _unturn_kernel


@dataclasses.dataclass(frozen=True)
class TermsConfig:
    """Launch parameters of the terms kernels (`CONFIG`; m3_terms_sweep.py and m3_chunk_sweep.py
    time others through `cfg=`). H200, 130m-mamba3 heads, 8 x 2048: chunks of 8 blocks of 16
    steps, 4 warps, 0.777 ms forward, 0.886 backward (the whole row a program: 0.941, 1.065);
    the unturn with 2 warps, the scan's forward + backward 3.92 ms (4 warps: 4.05)."""

    block_t: int = 16  # BT: time steps per block of the angle kernels
    fwd_chunk_blocks: int = 8  # blocks per chunk (programs along time) of the forward
    fwd_warps: int = 4
    bwd_chunk_blocks: int = 8  # the same, backward; more than a row's blocks: one chunk
    bwd_warps: int = 4
    turn_block_t: int = 16  # steps per program of the turn and of its backward (the unturn)
    turn_warps: int = 4
    unturn_warps: int = 2
    sum_block: int = 1024  # elements a program of the sum of theta's per-head gradients


CONFIG = TermsConfig()


def _chunks(T: int, block_t: int, blocks: int) -> tuple[int, int]:
    """(steps per chunk, chunks) for T steps in chunks of `blocks` blocks of block_t steps."""
    return block_t * blocks, max(1, -(-T // (block_t * blocks)))


def _h2(N: int) -> int:
    return max(16, next_power_of_2((N + 1) // 2))


def _s(S: int) -> int:
    return max(16, next_power_of_2(S))


class _Terms(torch.autograd.Function):
    """reference.token_terms on the kernels (f32 outputs, contiguous; q~ and k~ in `turned`),
    differentiable in q, k, delta, A, trap, theta, the biases and the initial angle."""

    @staticmethod
    def forward(ctx, q, k, delta, A, trap, theta, q_bias, k_bias, angle0, seq,
                turned=torch.float32, cfg=CONFIG):  # fmt: skip
        Bsz, T, G, N = q.shape
        H, S = delta.shape[-1], theta.shape[-1]
        f = dict(device=q.device, dtype=torch.float32)
        q, k = same_strides(q, k)
        delta, A = (t.float().contiguous() for t in (delta, A))
        trap, theta = (t if t.stride(-1) == 1 else t.contiguous() for t in (trap, theta))
        q_bias, k_bias = q_bias.contiguous(), k_bias.contiguous()
        angle0 = angle0.float().contiguous()
        qr = torch.empty(Bsz, T, H, N, device=q.device, dtype=turned)
        kr = torch.empty_like(qr)
        phi = torch.empty(Bsz, T, H, S, **f)
        adt, gam, late = (torch.empty(Bsz, T, H, **f) for _ in range(3))
        phiT = torch.empty(Bsz, H, S, **f)
        seqt = seq if seq is not None else adt
        ch, C = _chunks(T, cfg.block_t, cfg.fwd_chunk_blocks)
        sums = torch.empty(Bsz, H, C, S, **f)
        args = (delta, A, trap, theta, angle0, seqt, sums,
                phi, adt, gam, late, phiT,
                T, H, S, ch, C,
                delta.stride(0), delta.stride(1), trap.stride(0), trap.stride(1),
                theta.stride(0), theta.stride(1), seqt.stride(0))  # fmt: skip
        flags = dict(HAS_SEQ=seq is not None, BT=cfg.block_t, BLOCK_S=_s(S),
                     num_warps=cfg.fwd_warps)  # fmt: skip
        if C > 1:  # what each chunk but the last adds to the angle
            launch(_terms_fwd_kernel, (Bsz, H, C - 1), *args, SUMS=True, **flags)
        launch(_terms_fwd_kernel, (Bsz, H, C), *args, SUMS=False, **flags)
        if T > 0:
            launch(_turn_kernel, (-(-T // cfg.turn_block_t), Bsz, H),
                q, k, q_bias, k_bias, phi, qr, kr,
                T, H, G, N, S, q.stride(0), q.stride(1), q.stride(2),
                BT=cfg.turn_block_t, BLOCK_H2=_h2(N), num_warps=cfg.turn_warps,
            )  # fmt: skip
        ctx.save_for_backward(q, k, delta, A, trap, theta, q_bias, k_bias, seq, phi)
        ctx.dtypes, ctx.cfg = (q.dtype, k.dtype, trap.dtype, theta.dtype, angle0.dtype), cfg
        return phiT, qr, kr, adt, gam, late

    @staticmethod
    def backward(ctx, dphiT, dqr, dkr, dadt, dgam, dlate):
        q, k, delta, A, trap, theta, q_bias, k_bias, seq, phi = ctx.saved_tensors
        cfg = ctx.cfg
        Bsz, T, G, N = q.shape
        H, S = delta.shape[-1], theta.shape[-1]
        f = dict(device=q.device, dtype=torch.float32)

        def grad(t, shape):
            return torch.zeros(shape, **f) if t is None else t.float().contiguous()

        dqr, dkr = grad(dqr, (Bsz, T, H, N)), grad(dkr, (Bsz, T, H, N))
        dadt, dgam, dlate = (grad(t, (Bsz, T, H)) for t in (dadt, dgam, dlate))
        dphiT = dphiT.float().contiguous() if dphiT is not None else None
        qd, kd, trd, thd, ad = ctx.dtypes
        # through the turn first: q and k per group (summed over its heads in f32, stored in
        # their dtypes), dphi per head, the biases' block sums
        nt = -(-T // cfg.turn_block_t)
        dq = torch.empty(Bsz, T, G, N, device=q.device, dtype=qd)
        dk = torch.empty(Bsz, T, G, N, device=q.device, dtype=kd)
        dphi = torch.empty(Bsz, T, H, S, **f)
        dqb, dkb = torch.empty(nt, Bsz, H, N, **f), torch.empty(nt, Bsz, H, N, **f)
        if T > 0:
            launch(_unturn_kernel, (nt, Bsz, G),
                q, k, q_bias, k_bias, phi, dqr, dkr, dq, dk, dphi, dqb, dkb,
                T, H, G, N, S, q.stride(0), q.stride(1), q.stride(2),
                BT=cfg.turn_block_t, BLOCK_H2=_h2(N), num_warps=cfg.unturn_warps,
            )  # fmt: skip
        ddelta, dA = torch.empty(Bsz, T, H, **f), torch.empty(Bsz, T, H, **f)
        dtrap = torch.empty(Bsz, T, H, device=q.device, dtype=trd)  # stored in trap's dtype
        dth = torch.empty(H, Bsz, T, S, **f)  # per head, summed below
        dangle0 = torch.empty(Bsz, H, S, **f)
        seqt = seq if seq is not None else delta
        ch, C = _chunks(T, cfg.block_t, cfg.bwd_chunk_blocks)
        sums = torch.empty(Bsz, H, C, S, **f)
        args = (delta, A, trap, theta, seqt, dphi, sums,
                dadt, dgam, dlate, dphiT if dphiT is not None else dangle0,
                ddelta, dA, dtrap, dth, dangle0,
                T, H, S, ch, C)  # fmt: skip
        strides = (delta.stride(0), delta.stride(1), trap.stride(0), trap.stride(1),
                   theta.stride(0), theta.stride(1), seqt.stride(0))  # fmt: skip
        flags = dict(HAS_SEQ=seq is not None, HAS_DPHIT=dphiT is not None, BT=cfg.block_t,
                     BLOCK_S=_s(S), num_warps=cfg.bwd_warps)  # fmt: skip
        if C > 1:  # what reaches each chunk's first step from inside it, all but the first
            launch(_terms_bwd_kernel, (Bsz, H, C - 1), *args, 1, *strides, SUMS=True, **flags)
        launch(_terms_bwd_kernel, (Bsz, H, C), *args, 0, *strides, SUMS=False, **flags)
        dq_bias = dqb.sum((0, 1)).to(q_bias.dtype)
        dk_bias = dkb.sum((0, 1)).to(k_bias.dtype)
        # theta's gradient: the heads' in order, in one pass (torch's sum over the middle
        # dimension of [B, T, H, S] took 0.11 ms at 8 x 2048)
        dtheta = torch.empty(Bsz, T, S, device=q.device, dtype=thd)
        M = dtheta.numel()
        if M > 0:
            launch(sum_blocks_kernel, (-(-M // cfg.sum_block), 1), dth, dth, dtheta, dtheta, H,
                   M, BLOCK_E=cfg.sum_block)  # fmt: skip
        return (dq, dk, ddelta, dA, dtrap, dtheta, dq_bias, dk_bias, dangle0.to(ad),
                None, None, None)  # fmt: skip


def same_strides(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k as the turn kernels read them: with unit last stride and one set of strides
    (q's), copied when they differ."""
    if q.stride() != k.stride() or q.stride(-1) != 1:
        return q.contiguous(), k.contiguous()
    return q, k


def token_terms_kernel(q, k, delta, A, trap, theta, q_bias, k_bias, angle0, seq,
                       turned=torch.float32, cfg: TermsConfig | None = None):  # fmt: skip
    """reference.token_terms(..., f=float32) on the kernels, but (phi_T [B, H, S], q~, k~,
    A delta, gamma, late): the final angle instead of every step's, q~ and k~ in `turned`
    (f32, or bf16 where the scan's products round them so). seq: int32 [B, T] contiguous
    document ids, or None. cfg: launch parameters other than the library's `CONFIG`."""
    return _Terms.apply(q, k, delta, A, trap, theta, q_bias, k_bias, angle0, seq, turned,
                        cfg or CONFIG)  # fmt: skip
