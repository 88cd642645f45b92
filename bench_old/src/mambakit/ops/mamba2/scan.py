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

from .._triton import cdiv, launch, next_power_of_2, opt
from ..mamba3.chunk import CONFIG, _block, _Core, _Ctx, _launch_fwd, _operands_dtype, _precision
from ..mamba3.chunk_parallel_kernels import _state_scan_kernel
from .reference import mamba2_delta_reference
from .ssd_kernels import _ssd_cb_kernel, _ssd_state_kernel, _ssd_y_kernel

_INF = float("inf")


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


def scan_fwd(x, delta, A, B, C, D, z, s0, seq, cfg=None, dt_bias=None, lo=0.0, hi=_INF):
    """The scan without autograd: (y [B, T, H, P] in x.dtype with D and the gate, the final
    state [B, H, P, N] f32). x and z have unit last stride; s0 is f32 and contiguous. With
    dt_bias, delta is in_proj's dt: the scan's delta is clamp(softplus(dt + dt_bias), lo,
    hi) (made inside the SSD kernels)."""
    cfg = cfg or CONFIG
    if cfg.m2_fwd == "ssd":
        return ssd_fwd(x, delta, A, B, C, D, z, s0, seq, cfg, dt_bias, lo, hi)
    if dt_bias is not None:
        delta = mamba2_delta_reference(delta, dt_bias, (lo, hi))
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


def ssd_fwd(x, delta, A, B, C, D, z, s0, seq, cfg=None, dt_bias=None, lo=0.0, hi=_INF):
    """`scan_fwd` as the SSD chunked form, every chunk in parallel (ssd_kernels.py): the
    chunks' decays and own state parts, the start states in order (`_state_scan_kernel`),
    then y. Buffers: cs [B, H, T] and the chunks' states [B, H, T / ssd_chunk, P, N], f32,
    with the start states in the products' operand dtype."""
    cfg = cfg or CONFIG
    Bsz, T, H, P = x.shape
    G, N = B.shape[2:]
    L = cfg.ssd_chunk
    nc = cdiv(T, L)
    if B.stride(-1) != 1:
        B = B.contiguous()
    if C.stride(-1) != 1:
        C = C.contiguous()
    f32 = dict(device=x.device, dtype=torch.float32)
    cs = torch.empty(Bsz, H, T, **f32)
    u = torch.empty(Bsz, H, nc, P, N, **f32)
    keep = torch.empty(Bsz, H, nc, **f32)
    sT = torch.empty_like(s0)
    seqt = seq if seq is not None else cs
    prec = _precision(x, cfg)
    block_p, block_n = _block(P), _block(N)
    xs = (x.stride(0), x.stride(1), x.stride(2))
    bs = (B.stride(0), B.stride(1), B.stride(2))
    dts = (delta.stride(0), delta.stride(1))
    launch(_ssd_state_kernel, (Bsz, H, nc),
        x, B, delta, opt(dt_bias, cs), A, seqt, cs, u, keep, T, H, P, N, H // G, lo, hi, *xs, *bs,
        *dts, seqt.stride(0),
        HAS_SEQ=seq is not None, DT_RAW=dt_bias is not None, L=L, BLOCK_K=cfg.ssd_block_k,
        BLOCK_P=block_p, BLOCK_N=block_n, PREC=prec, num_warps=cfg.ssd_warps,
    )  # fmt: skip
    # the start states as the products read them (bf16 for bf16 products: half the bytes)
    dt = _operands_dtype(x, cfg)
    st = u if dt == torch.float32 else torch.empty(u.shape, device=x.device, dtype=dt)
    block = cfg.scan_block
    launch(_state_scan_kernel, (Bsz * H, cdiv(P * N, block)),
        keep, s0, s0, s0, keep, u, st, sT, T, H, P * N, N, L, 0,
        BLOCK=block, CHUNKS=min(cfg.ssd_scan_chunks, next_power_of_2(nc)), LATE0=False,
        num_warps=cfg.scan_warps,
    )  # fmt: skip
    # y after u is released (bf16 start states: y can reuse u's memory, 100 MB at 8 x 2048)
    del u
    y = torch.empty(x.shape, device=x.device, dtype=x.dtype)
    zt = z if z is not None else x
    BM = cfg.ssd_block_m
    stages = {} if cfg.ssd_stages is None else {"num_stages": cfg.ssd_stages}
    cb = cs
    if cfg.ssd_cb:
        cb = torch.empty(Bsz, G, nc, L, L, **f32)
        launch(_ssd_cb_kernel, (Bsz * G, nc, (L // BM) ** 2),
            B, C, cb, T, G, N, *bs, C.stride(0), C.stride(1), C.stride(2),
            L=L, BLOCK_M=BM, BLOCK_N=block_n, PREC=prec, num_warps=cfg.ssd_warps,
        )  # fmt: skip
    launch(_ssd_y_kernel, (Bsz, H, nc * (L // BM)),
        x, B, C, delta, opt(dt_bias, cs), cs, seqt, zt, D.float() if D is not None else cs, st, y,
        cb, T, H, P, N, H // G, G, lo, hi, *xs, *bs, C.stride(0), C.stride(1), C.stride(2), *dts,
        seqt.stride(0), zt.stride(0), zt.stride(1), zt.stride(2), y.stride(0), y.stride(1),
        y.stride(2),
        HAS_SEQ=seq is not None, HAS_Z=z is not None, HAS_D=D is not None, HAS_CB=cfg.ssd_cb,
        DT_RAW=dt_bias is not None,
        L=L, BLOCK_M=BM, BLOCK_P=block_p, BLOCK_N=block_n, PREC=prec,
        num_warps=cfg.ssd_warps, **stages,
    )  # fmt: skip
    return y, sT
