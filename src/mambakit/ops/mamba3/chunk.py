"""The Mamba-3 SISO sequence scan as Triton kernels: the forward and its backward.

B batch, T time, H heads of P values, G groups, N = d_state, S angles, L = the chunk.
The angles, the turned keys and queries (k~, q~) and the per-token weights come from
the terms kernels (terms.py); the scan kernels (chunk_kernels.py) do what costs: for one
(row, head) the forward walks the chunks in order, carrying the state S [P, N] and the
last token's k~ and x (without autograd at few (row, head) pairs, the chunks run in
parallel instead: chunk_parallel_kernels.py, `parallel_below`), and per chunk computes, as
reference.py's chunked form,

    y_t   = sum_{s <= t} (q~_t . k~_s) exp(cs_t - cs_s) w'_{t,s} x_s
            + exp(cs_t) carry_t  q~_t S'_start
    S_end = exp(cs_last) carry_last S'_start + sum_s tail_s x_s k~_s^T

with three matrix products ([L, N] x [N, L], [L, L] x [L, P], [P, L] x [L, N]) and
the start-state product. Products take bf16 operands for bf16 inputs, tf32 for f16
ones and tf32x3 (f32 accuracy) for f32 ones, always accumulating in f32; the state is f32.
"""

from __future__ import annotations

import torch

from ...state import Mamba3State
from .._triton import cdiv, launch, next_power_of_2, opt, sm_count
from .chunk_bwd_kernels import (
    _chunk_grad_kernel,
    _chunk_qk_grad_kernel,
    _dstate_scan_kernel,
    _dy_chunk_kernel,
)
from .chunk_kernels import _chunk_fwd_kernel
from .chunk_parallel_kernels import _chunk_end_kernel, _chunk_y_kernel, _state_scan_kernel
from .scan_config import (
    CONFIG,
    Mamba3ScanConfig,
    _block,
    _operands_dtype,
    _parallel,
    _precision,
)
from .terms import _Terms, same_strides, token_terms_kernel


def _launch_fwd_chunks(x, qr, kr, adt, gamma, late, seq_idx, D, z, s0, k0, x0, y, L, cfg):
    """`_launch_fwd` computing y alone, its chunks in parallel (see `parallel_below`)."""
    Bsz, T, H, P = x.shape
    N = qr.shape[-1]
    nc = cdiv(T, L)
    sT, kT, xT = torch.empty_like(s0), torch.empty_like(k0), torch.empty_like(x0)
    u = torch.empty(Bsz, H, nc, P, N, device=x.device, dtype=torch.float32)
    keep = torch.empty(Bsz, H, nc, device=x.device, dtype=torch.float32)
    seq = seq_idx if seq_idx is not None else adt
    block_p, block_n = min(_block(P), cfg.parallel_block_p), _block(N)
    prec, warps = _precision(x, cfg), cfg.parallel_warps
    strides = (x.stride(0), x.stride(1), x.stride(2), qr.stride(0), qr.stride(1),
               qr.stride(2), adt.stride(0), adt.stride(1), seq.stride(0))  # fmt: skip
    grid = (Bsz, H, nc * cdiv(P, block_p))
    launch(_chunk_end_kernel, grid,
        x, kr, adt, gamma, late, seq, u, keep, T, H, P, N, *strides,
        HAS_SEQ=seq_idx is not None, L=L, BLOCK_P=block_p, BLOCK_N=min(block_n, cfg.end_block_n),
        PREC=prec, num_warps=warps,
    )  # fmt: skip
    launch(_state_scan_kernel, (Bsz * H, cdiv(P * N, cfg.scan_block)),
        keep, s0, k0, x0, late, u, u, sT, T, H, P * N, N, L, late.stride(0),
        BLOCK=cfg.scan_block, CHUNKS=min(cfg.scan_chunks, next_power_of_2(nc)), LATE0=True,
        num_warps=cfg.scan_warps,
    )  # fmt: skip
    launch(_chunk_y_kernel, grid,
        x, qr, kr, adt, gamma, late, seq, z if z is not None else x,
        D.float() if D is not None else adt, u, y, kT, xT, T, H, P, N, *strides,
        *(z.stride()[:3] if z is not None else (0, 0, 0)), y.stride(0), y.stride(1), y.stride(2),
        HAS_SEQ=seq_idx is not None, HAS_Z=z is not None, HAS_D=D is not None, L=L,
        BLOCK_P=block_p, BLOCK_N=block_n, PREC=prec, num_warps=warps,
    )  # fmt: skip
    return sT, kT, xT


def _warps(block_p: int, N: int, states: bool, cfg: Mamba3ScanConfig) -> int:
    """Warps for a program holding a [block_p, N] state (at most 4 below 8192 values)."""
    w = cfg.states_warps if states else cfg.fwd_warps
    return w if block_p * N >= 8192 else min(w, 4)


def _launch_fwd(
    x, qr, kr, adt, gamma, late, seq_idx, D, z, s0, k0, x0, y, L, cfg, states=None, pre=None,
    LS=None,
):  # fmt: skip
    """The forward kernel over (row, head): y and the final state into y, and the returned
    (sT, kT, xT); the start state of each chunk of LS steps (default L) into `states` when
    given (the backward's, with y or as a pass of its own when y is None). `pre` (y's shape
    and strides): y before the gate, stored too."""
    Bsz, T, H, P = x.shape
    if y is not None and states is None and pre is None and _parallel(x, qr.shape[-1], L, cfg):
        return _launch_fwd_chunks(x, qr, kr, adt, gamma, late, seq_idx, D, z, s0, k0, x0, y, L,
                                  cfg)  # fmt: skip
    N = qr.shape[-1]
    sT, kT, xT = torch.empty_like(s0), torch.empty_like(k0), torch.empty_like(x0)
    seq = seq_idx if seq_idx is not None else adt
    ys = y if y is not None else x
    block_p = min(_block(P), cfg.fwd_block_p if y is not None else cfg.states_block_p)
    # each program walks every chunk: while (row, head) pairs leave SMs idle (a prefill at
    # batch 1), more programs over smaller blocks of P
    while x.is_cuda and block_p > 16 and Bsz * H * cdiv(P, block_p) < sm_count(x.device.index):
        block_p //= 2
    states_only = y is None
    launch(_chunk_fwd_kernel, (Bsz, H, cdiv(P, block_p)),
        x, qr, kr, adt, gamma, late, seq, z if z is not None else x,
        D.float() if D is not None else adt, s0, k0, x0, ys, pre if pre is not None else ys,
        sT, kT, xT, states if states is not None else s0,
        T, H, P, N,
        x.stride(0), x.stride(1), x.stride(2), qr.stride(0), qr.stride(1), qr.stride(2),
        adt.stride(0), adt.stride(1), seq.stride(0),
        *(z.stride()[:3] if z is not None else (0, 0, 0)),
        ys.stride(0), ys.stride(1), ys.stride(2),
        HAS_SEQ=seq_idx is not None, HAS_Z=z is not None, HAS_D=D is not None,
        L=L, BLOCK_P=block_p, BLOCK_N=_block(N), PREC=_precision(x, cfg),
        COMPUTE_Y=y is not None, STORE_STATES=states is not None, STORE_PRE=pre is not None,
        LS=LS or L,
        num_warps=_warps(block_p, N, states_only, cfg),
    )  # fmt: skip
    return sT, kT, xT


def _prepare(x, q, theta, initial_state, seq_idx):
    """What both scans launch with: (the initial state, f32 zeros if None; int32 document
    ids or None; x with unit last stride; the initial S, k~, x in f32, contiguous)."""
    Bsz, T, H, P = x.shape
    N, S = q.shape[-1], theta.shape[-1]
    if initial_state is None:
        initial_state = Mamba3State.zeros(Bsz, H, P, N, S, x.device, torch.float32)
    seq = seq_idx.to(torch.int32).contiguous() if seq_idx is not None else None
    xs = x if x.stride(-1) == 1 else x.contiguous()
    s0, k0, x0 = (t.float().contiguous() for t in initial_state[1:])
    return initial_state, seq, xs, s0, k0, x0


def mamba3_scan_fwd(
    x: torch.Tensor,  # [B, T, H, P]
    q: torch.Tensor,  # [B, T, G, N]
    k: torch.Tensor,  # [B, T, G, N]
    delta: torch.Tensor,  # [B, T, H]
    A: torch.Tensor,  # [B, T, H]
    trap: torch.Tensor,  # [B, T, H]
    theta: torch.Tensor,  # [B, T, S]
    q_bias: torch.Tensor,  # [H, N]
    k_bias: torch.Tensor,  # [H, N]
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    initial_state: Mamba3State | None = None,
    seq_idx: torch.Tensor | None = None,
    cfg: Mamba3ScanConfig | None = None,
) -> tuple[torch.Tensor, Mamba3State]:
    """`mamba3_scan_reference`'s values without its autograd: (y [B, T, H, P] in x.dtype,
    the final f32 state). The chunk is `cfg.chunk` whatever the layer's chunk_size (the
    result does not depend on it). D and the gate are applied inside the kernel. cfg:
    launch parameters other than the library's `CONFIG`."""
    cfg = cfg or CONFIG
    initial_state, seq, xs, s0, k0, x0 = _prepare(x, q, theta, initial_state, seq_idx)
    phi_T, qr, kr, adt, gamma, late = token_terms_kernel(
        q, k, delta, A, trap, theta, q_bias, k_bias, initial_state.angle, seq,
        _operands_dtype(x, cfg), cfg.terms,
    )  # fmt: skip
    zs = z if z is None or z.stride(-1) == 1 else z.contiguous()
    y = torch.empty(x.shape, device=x.device, dtype=x.dtype)
    sT, kT, xT = _launch_fwd(xs, qr, kr, adt, gamma, late, seq, D, zs, s0, k0, x0, y, cfg.chunk,
                             cfg)  # fmt: skip
    return y, Mamba3State(phi_T, sT, kT, xT)


# The backward runs in chunks of `chunk_bwd` steps, every kernel but one a program per (row,
# head, chunk). `_dy_chunk_kernel`: from dy alone, the gate's and D's gradients and the
# chunk's own part u_c = (dy_c e_cs_c)^T q~_c of its start state's gradient (`dy_block_p` of
# the P values by `dy_block_n` states a product); `_dstate_scan_kernel` sums those over the
# chunks in reverse, dS'_c = keep_c dS'_{c+1} + u_c, elementwise over blocks of `scan_block` of
# the P N values. Then, with no loop over chunks, from the chunk's start state (the
# forward's) and its end state's gradient: `_chunk_grad_kernel` the gradients of x and the
# per-token weights, `_chunk_qk_grad_kernel` those of q~ and k~. The start states are
# [B, H, T / chunk_bwd, P, N] (`_operands_dtype`: bf16 for bf16 inputs, 100 MB at 8 x 2048 for
# the 130m-mamba3 heads), kept from the forward, which stores every (chunk_bwd / chunk)-th
# of its chunks' when `chunk` divides `chunk_bwd` (else the backward recomputes them in a pass
# of its own); their gradients are as many, transient (u_c, then dS' in its place).
# H200, 8 x 2048, the scan's forward + backward (scripts/m3_chunk_sweep.py): 2.50 ms with 4
# warps for both per-chunk kernels and blocks of 32 states (f32 states), 2.72 with 8 warps,
# 2.84 in blocks of 64, 3.05 in chunks of 32, 2.98 with 16 warps for the first. One program
# per (row, head, block of 32 states) walking chunks of 16 in reverse and doing all of it
# takes 3.66 ms (its kernel 2.35 against upstream's dqkv 0.83; ncu: 255 registers, 19%
# issue, latency-bound). The start states' gradients as a program per (row, head, 16 of the
# P values) walking the chunks in reverse with the product inside the loop take 0.22 ms at
# 8 x 2048, after a kernel of its own for the gate's gradient (0.12 ms).
class _Core:
    """The forward and backward of an autograd context (`_Scan` runs them): the scan with
    its kernels: (x, q~, k~, A delta, gamma, late, initial S, k~, x, D, z)
    -> (y with D and the gate, in x.dtype; the final S). The forward keeps y before the gate
    (in x.dtype) when there is one and, when its chunks divide the backward's, each of the
    backward's chunks' start state S'_start (f32, stored by the forward kernel beside y; else
    the backward recomputes them in a pass of their own). The backward: the gate's and D's
    gradients with the start states' gradients (`_dstates`), then the rest per chunk."""

    @staticmethod
    def forward(ctx, x, qr, kr, adt, gamma, late, seq, s0, k0, x0, D, z, cfg):
        Bsz, T, H, P = x.shape
        L, LB = cfg.chunk, cfg.chunk_bwd
        y = torch.empty(x.shape, device=x.device, dtype=x.dtype)
        pre = torch.empty_like(y) if z is not None else None
        states = None
        if LB % L == 0:
            states = torch.empty(Bsz, H, cdiv(T, LB), P, qr.shape[-1],
                                 device=x.device, dtype=_operands_dtype(x, cfg))  # fmt: skip
        sT, _, _ = _launch_fwd(x, qr, kr, adt, gamma, late, seq, D, z, s0, k0, x0, y, L, cfg,
                               states, pre, LB)  # fmt: skip
        ctx.save_for_backward(x, qr, kr, adt, gamma, late, seq, s0, k0, x0, D, z, pre, states)
        ctx.cfg = cfg
        return y, sT

    @staticmethod
    def backward(ctx, dy, dsT):
        x, qr, kr, adt, gamma, late, seq, s0, k0, x0, D, z, pre, states = ctx.saved_tensors
        Bsz, T, H, P = x.shape
        N = qr.shape[-1]
        cfg = ctx.cfg
        L = cfg.chunk_bwd
        nc = cdiv(T, L)
        f32 = dict(device=x.device, dtype=torch.float32)
        if states is None:  # the forward ran other chunks: a pass for the backward's
            dt = _operands_dtype(x, cfg)
            states = torch.empty(Bsz, H, nc, P, N, device=x.device, dtype=dt)
            _launch_fwd(x, qr, kr, adt, gamma, late, seq, None, None, s0, k0, x0, None, L, cfg,
                        states)  # fmt: skip
        dy = dy.contiguous() if dy is not None else torch.zeros_like(x)
        dsT = dsT.contiguous() if dsT is not None else None
        dy, dz, dD, dst, ds0 = _dstates(dy, z, pre, x, D, qr, adt, seq, dsT, states, s0, L, cfg)
        seqt = seq if seq is not None else adt
        dx = torch.empty(dy.shape, device=x.device, dtype=x.dtype)
        dadt, dgam, dlate = (torch.empty(adt.shape, **f32) for _ in range(3))
        dk0, dx0 = torch.empty_like(k0), torch.empty_like(x0)
        strided = (
            T, H, P, N,
            x.stride(0), x.stride(1), x.stride(2), qr.stride(0), qr.stride(1), qr.stride(2),
            adt.stride(0), adt.stride(1), seqt.stride(0), dy.stride(0), dy.stride(1),
            dy.stride(2),
        )  # fmt: skip
        consts = dict(HAS_SEQ=seq is not None, L=L, BLOCK_P=_block(P), PREC=_precision(x, cfg))
        launch(_chunk_grad_kernel, (Bsz, H, nc),
            x, qr, kr, adt, gamma, late, seqt, states, dst, x0, k0, opt(D, adt),
            dy, dx, dadt, dgam, dlate, dx0, *strided,
            HAS_D=D is not None, BLOCK_N=min(_block(N), cfg.grad_block_n),
            num_warps=cfg.grad_warps,
            **consts,
        )  # fmt: skip
        qk = (x, qr, kr, adt, gamma, late, seqt, states, dst, x0, dy)
        dq, dk = _qk_grads(qk, dk0, strided, consts, getattr(ctx, "groups", None), cfg)
        dD = dD.sum((0, 1)).to(D.dtype) if D is not None else None
        return dx, dq, dk, dadt, dgam, dlate, None, ds0, dk0, dx0, dD, dz


def _qk_grads(qk, dk0, strided, consts, groups, cfg):
    """`_chunk_qk_grad_kernel`: the gradients of q~ and k~ [B, T, H, N] f32 (dk0 filled), or,
    given `groups` G (Mamba-2's B and C read by H / G heads each), their sums over each
    group's heads [B, T, G, N] f32: a launch per slice of at most `qk_head_slice` heads of a
    group, each slice's per-head gradients summed into the group's in a fixed order, so the
    per-head buffers are a slice's, not every head's (400 MB at 8 x 2048 for 24 heads of
    N 128)."""
    x, qr = qk[0], qk[1]
    Bsz, T, H, _ = x.shape
    N = qr.shape[-1]
    L = consts["L"]
    nc = cdiv(T, L)
    f32 = dict(device=x.device, dtype=torch.float32)
    kw = dict(BLOCK_N=min(_block(N), cfg.qk_block_n), num_warps=cfg.qk_warps, **consts)
    R = H // groups if groups else 1
    if R == 1:  # a head per group (or Mamba-3): every head's at once
        dq, dk = torch.empty(Bsz, T, H, N, **f32), torch.empty(Bsz, T, H, N, **f32)
        launch(_chunk_qk_grad_kernel, (Bsz, H, nc), *qk, dq, dk, dk0, *strided,
               dq.stride(0), dq.stride(1), dq.stride(2), 0, **kw)  # fmt: skip
        return dq, dk
    hs = max(d for d in range(1, min(R, cfg.qk_head_slice) + 1) if R % d == 0)
    dq, dk = torch.empty(Bsz, T, groups, N, **f32), torch.empty(Bsz, T, groups, N, **f32)
    sq, sk = torch.empty(Bsz, T, hs, N, **f32), torch.empty(Bsz, T, hs, N, **f32)
    for h0 in range(0, H, hs):
        launch(_chunk_qk_grad_kernel, (Bsz, hs, nc), *qk, sq, sk, dk0, *strided,
               sq.stride(0), sq.stride(1), sq.stride(2), h0, **kw)  # fmt: skip
        g, first = divmod(h0, R)
        if first == 0:
            dq[:, :, g].copy_(sq.sum(2))
            dk[:, :, g].copy_(sk.sum(2))
        else:
            dq[:, :, g] += sq.sum(2)
            dk[:, :, g] += sk.sum(2)
    return dq, dk


class _Ctx:
    """An autograd context's part that `_Scan` hands to `_Terms` or `_Core`."""

    def __init__(self, saved=(), **attrs):
        self.saved_tensors = tuple(saved)
        self.__dict__.update(attrs)

    def save_for_backward(self, *tensors):
        self.saved_tensors = tensors


def scan_train_forward(x, q, k, delta, A, trap, theta, q_bias, k_bias, angle0, s0, k0, x0, D,
                       z, seq, cfg: Mamba3ScanConfig):  # fmt: skip
    """The forward of the differentiable scan (`ops.mamba3`'s custom op runs it): the terms
    (`_Terms`) then the scan with D and the gate (`_Core`) as one node, so q~ and k~ can be
    bf16 (`_operands_dtype`) while their gradients stay f32. Returns (y, phi_T, the final S
    and k~) and what the backward reads beside the inputs: (phi, q~, k~, A delta, gamma, late,
    y before the gate or an empty tensor, the backward's chunk start states or an empty
    tensor)."""
    terms, core = _Ctx(), _Ctx()
    phi_T, qr, kr, adt, gamma, late = _Terms.forward(
        terms, q, k, delta, A, trap, theta, q_bias, k_bias, angle0, seq,
        _operands_dtype(x, cfg), cfg.terms,
    )  # fmt: skip
    y, sT = _Core.forward(core, x, qr, kr, adt, gamma, late, seq, s0, k0, x0, D, z, cfg)
    phi = terms.saved_tensors[-1]
    pre, states = core.saved_tensors[-2:]
    # fresh tensors each (a custom op's outputs may not alias one another)
    kT = kr[:, -1].to(torch.float32, copy=True)
    return (y, phi_T, sT, kT, phi, qr, kr, adt, gamma, late,
            x.new_empty(0) if pre is None else pre,
            x.new_empty(0) if states is None else states)  # fmt: skip


def scan_train_backward(dy, dphi_T, dsT, dkT, inputs, saved, cfg: Mamba3ScanConfig):
    """The gradients of `scan_train_forward`'s inputs (x, q, k, delta, A, trap, theta, the
    biases, the initial angle, S, k~ and x, D, z; D's and z's None when absent) from those of
    its four outputs (None where none reached them), its inputs and what it kept."""
    x, q, k, delta, A, trap, theta, q_bias, k_bias, angle0, s0, k0, x0, D, z, seq = inputs
    phi, qr, kr, adt, gamma, late, pre, states = saved
    q, k = same_strides(q, k)
    trap, theta = (t if t.stride(-1) == 1 else t.contiguous() for t in (trap, theta))
    delta, A = delta.float().contiguous(), A.float().contiguous()
    q_bias, k_bias = q_bias.contiguous(), k_bias.contiguous()
    terms = _Ctx((q, k, delta, A, trap, theta, q_bias, k_bias, seq, phi), cfg=cfg.terms,
                 dtypes=(q.dtype, k.dtype, trap.dtype, theta.dtype, angle0.dtype))  # fmt: skip
    pre = pre if z is not None else None
    states = states if states.numel() else None
    core = _Ctx((x, qr, kr, adt, gamma, late, seq, s0, k0, x0, D, z, pre, states), cfg=cfg)
    dx, dqr, dkr, dadt, dgam, dlate, _, ds0, dk0, dx0, dD, dz = _Core.backward(core, dy, dsT)
    if dkT is not None:
        dkr[:, -1] += dkT
    dq, dk, ddelta, dA, dtrap, dtheta, dq_bias, dk_bias, dangle0, *_ = _Terms.backward(
        terms, dphi_T, dqr, dkr, dadt, dgam, dlate
    )
    return (dx, dq, dk, ddelta, dA, dtrap, dtheta, dq_bias, dk_bias, dangle0, ds0, dk0, dx0,
            dD, dz)  # fmt: skip


def _dstates(dy, z, pre, x, D, qr, adt, seq, dsT, states, s0, L, cfg):
    """The backward's first two kernels, `_dy_chunk_kernel` and `_dstate_scan_kernel`: (the
    core's gradient (dy itself without a gate, else f32), dz in z's dtype or None, dD's
    shares [B, chunks, H] f32 or None, the start states' gradients dS'_{c+1} like `states`,
    dS'_0 f32 like s0); dy contiguous [B, T, H, P]."""
    Bsz, T, H, P = dy.shape
    N = qr.shape[-1]
    nc = cdiv(T, L)
    f32 = dict(device=dy.device, dtype=torch.float32)
    dyc = torch.empty(dy.shape, **f32) if z is not None else dy
    dz = torch.empty(z.shape, device=z.device, dtype=z.dtype) if z is not None else None
    dD = torch.empty(Bsz, nc, H, **f32) if D is not None else None
    dst, keep = torch.empty_like(states), torch.empty(Bsz, H, nc, **f32)
    seqt = seq if seq is not None else adt
    zs = z.stride()[:3] if z is not None else (0, 0, 0)
    launch(_dy_chunk_kernel, (Bsz, H, nc),
        dy, opt(z, dy), opt(pre, dy), x, qr, adt, seqt, dyc, opt(dz, dyc), opt(dD, dyc),
        dst, keep,
        T, H, P, N, *zs, x.stride(0), x.stride(1), x.stride(2),
        qr.stride(0), qr.stride(1), qr.stride(2), adt.stride(0), adt.stride(1),
        seqt.stride(0),
        HAS_SEQ=seq is not None, HAS_Z=z is not None, HAS_D=D is not None, L=L,
        BLOCK_P=min(_block(P), cfg.dy_block_p), BLOCK_N=min(_block(N), cfg.dy_block_n),
        PREC=_precision(x, cfg), num_warps=cfg.dy_warps, num_stages=cfg.dy_stages,
    )  # fmt: skip
    ds0 = torch.empty_like(s0)
    launch(_dstate_scan_kernel, (Bsz * H, cdiv(P * N, cfg.scan_block)),
        keep, dsT if dsT is not None else s0, dst, ds0, T, P * N, L,
        HAS_DST=dsT is not None, BLOCK=cfg.scan_block,
        CHUNKS=min(cfg.scan_chunks, next_power_of_2(nc)), num_warps=cfg.scan_warps,
    )  # fmt: skip
    return dyc, dz, dD, dst, ds0
