"""The conv states after given steps of a sequence (`MambaLM.states_at`), gathered by one
kernel: for each row b, kept step j and tap i < K-1, the conv's input at step
t = positions[b, j] - (K-2) + i, or zero where t lies in an earlier document
(seq_idx), or the initial state's row t + K-1 where t < 0 and the step is in the row's
first document. The reference (`reference.conv_states_at`) does the same in torch ops,
about fifteen of them a layer; inside a packed prefill forward that is a few hundred
small launches, which this kernel makes twenty-four."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._triton import cdiv, launch, opt

BLOCK_D = 128  # channels per program


@triton.jit
def _conv_states_at_kernel(
    p_x, p_pos, p_seq, p_h0, p_out,
    T, Dn, k, s_x_b, s_x_t, s_seq_b, s_h0_b, s_h0_t,
    HAS_SEQ: tl.constexpr, HAS_H0: tl.constexpr, KM1: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Program (channel block, kept step j, row b): out[b, j, :, block] [K-1, BLOCK] f32."""
    d = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    j = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    md = d < Dn
    p = tl.load(p_pos + b * k + j)
    own = 0
    first = 0
    if HAS_SEQ:
        own = tl.load(p_seq + b * s_seq_b + p)
        first = tl.load(p_seq + b * s_seq_b)
    zero = tl.zeros([BLOCK], tl.int64)  # (the step as a vector: masks of one shape)
    for i in tl.static_range(KM1):
        t = zero + (p - (KM1 - 1) + i)
        tc = tl.maximum(t, 0)
        inside = md & (t >= 0)
        if HAS_SEQ:
            inside = inside & (tl.load(p_seq + b * s_seq_b + tc) == own)
        v = tl.load(p_x + b * s_x_b + tc * s_x_t + d, mask=inside, other=0.0).to(tl.float32)
        if HAS_H0:
            before = md & (t < 0)
            if HAS_SEQ:
                before = before & ((zero + first) == own)
            th = tl.minimum(tl.maximum(t + KM1, 0), KM1 - 1)
            v += tl.load(p_h0 + b * s_h0_b + th * s_h0_t + d, mask=before,
                         other=0.0).to(tl.float32)  # fmt: skip
        tl.store(p_out + ((b * k + j) * KM1 + i) * Dn + d, v, mask=md)


def conv_states_at_triton(
    x: torch.Tensor,  # [B, T, D], the conv's input, unit stride along D
    positions: torch.Tensor,  # [B, k] int64, steps in [0, T)
    K: int,
    initial_state: torch.Tensor | None = None,  # [B, K-1, D], unit stride along D
    seq_idx: torch.Tensor | None = None,  # [B, T] int32, unit stride along T
) -> torch.Tensor:
    """`reference.conv_states_at` in one launch: [B, k, K-1, D] f32. Nothing is checked
    here (the callers' forward did) and nothing syncs: it runs inside a CUDA graph."""
    Bsz, T, Dn = x.shape
    k = positions.shape[1]
    out = torch.empty(Bsz, k, K - 1, Dn, dtype=torch.float32, device=x.device)
    if out.numel() == 0:
        return out
    if x.stride(2) != 1:
        x = x.contiguous()
    pos = positions.contiguous()
    seq = seq_idx.contiguous() if seq_idx is not None else None
    h0 = initial_state
    if h0 is not None and h0.stride(2) != 1:
        h0 = h0.contiguous()
    launch(
        _conv_states_at_kernel, (cdiv(Dn, BLOCK_D), k, Bsz),
        x, pos, opt(seq, pos), opt(h0, x), out,
        T, Dn, k, x.stride(0), x.stride(1), seq.stride(0) if seq is not None else 0,
        h0.stride(0) if h0 is not None else 0, h0.stride(1) if h0 is not None else 0,
        HAS_SEQ=seq is not None, HAS_H0=h0 is not None, KM1=K - 1, BLOCK=BLOCK_D,
    )  # fmt: skip
    return out
