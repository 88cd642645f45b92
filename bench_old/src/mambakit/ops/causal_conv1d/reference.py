"""Depthwise causal conv1d in plain PyTorch, channels-last: the CPU path and the oracle.

B batch, T time, D channels, K = d_conv taps. For every row and channel:

    out_t = bias + sum_{k<K} weight[:, k] * x_{t-K+1+k},   then silu (optional)

where x at negative times comes from `initial_state` [B, K-1, D] (oldest
first) or is zero. With `seq_idx`, a tap that reaches into an earlier document
reads zero; `initial_state` feeds only the first document of each row. The
final state is the last K-1 inputs of the row's last document (zero where that
document is shorter than K-1 and did not start the row).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .._checks import state_dtype


def _same_doc(seq_idx: torch.Tensor, shift: int) -> torch.Tensor:
    """[B, T] bool: position t - shift lies in the document of t (positions before 0
    belong to the initial state, which is the document of t = 0)."""
    Bsz, T = seq_idx.shape
    src = torch.cat([seq_idx[:, :1].expand(Bsz, shift), seq_idx], dim=1)[:, :T]
    return src == seq_idx


def causal_conv1d_reference(
    x: torch.Tensor,  # [B, T, D]
    weight: torch.Tensor,  # [D, K]
    bias: torch.Tensor | None = None,  # [D]
    initial_state: torch.Tensor | None = None,  # [B, K-1, D]
    seq_idx: torch.Tensor | None = None,  # [B, T] int32
    activation: str | None = "silu",
    return_final_state: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    Bsz, T, Dn = x.shape
    K = weight.shape[1]
    f = state_dtype(x)
    xf = x.to(f)
    hist = (
        initial_state.to(f)
        if initial_state is not None
        else torch.zeros(Bsz, K - 1, Dn, device=x.device, dtype=f)
    )
    xp = torch.cat([hist, xf], dim=1)  # [B, K-1+T, D]
    w = weight.to(f)
    out = torch.zeros(Bsz, T, Dn, device=x.device, dtype=f)
    for k in range(K):  # tap k reads x_{t-(K-1-k)}
        tap = xp[:, k : k + T] * w[:, k]
        if seq_idx is not None and k < K - 1:
            tap = tap * _same_doc(seq_idx, K - 1 - k).unsqueeze(-1).to(f)
        out = out + tap
    if bias is not None:
        out = out + bias.to(f)
    if activation == "silu":
        out = F.silu(out)
    out = out.to(x.dtype)
    if not return_final_state:
        return out
    final = xp[:, T:]  # the last K-1 inputs, oldest first
    if seq_idx is not None:
        last = seq_idx[:, -1:]
        pos = torch.arange(T - (K - 1), T, device=x.device)
        src = seq_idx.gather(1, pos.clamp(min=0).expand(Bsz, -1))
        src = torch.where(pos >= 0, src, seq_idx[:, :1])
        final = final * (src == last).unsqueeze(-1).to(f)
    return out, final


def causal_conv1d_update_reference(
    conv_state: torch.Tensor,  # [B, K-1, D], updated in place
    x: torch.Tensor,  # [B, D]
    weight: torch.Tensor,  # [D, K]
    bias: torch.Tensor | None = None,
    activation: str | None = "silu",
) -> torch.Tensor:
    """One timestep of the conv (decode): shifts `x` into `conv_state` in place, returns [B, D]."""
    f = conv_state.dtype
    window = torch.cat([conv_state, (x if x.dtype == f else x.to(f)).unsqueeze(1)], dim=1)
    conv_state.copy_(window[:, 1:])  # window: [B, K, D]
    out = (window * (weight if weight.dtype == f else weight.to(f)).t()).sum(1)
    if bias is not None:
        out = out + bias
    if activation == "silu":
        out = F.silu(out)
    return out if out.dtype == x.dtype else out.to(x.dtype)


def conv_states_at(
    x: torch.Tensor,  # [B, T, D], the conv's input
    positions: torch.Tensor,  # [B, k] int64
    K: int,
    initial_state: torch.Tensor | None = None,  # [B, K-1, D]
    seq_idx: torch.Tensor | None = None,  # [B, T] int32
) -> torch.Tensor:
    """The conv state after each step of `positions`: [B, k, K-1, D] f32 (f64 for f64
    inputs), the K-1 inputs up to that step, oldest first, as the conv run to there would
    leave it: zero before the step's document, the initial state's tail before step 0 (in
    the first document only). Gathers only: no sync, so it runs inside a CUDA graph."""
    Bsz, T, D = x.shape
    k = positions.shape[1]
    f = torch.float64 if x.dtype == torch.float64 else torch.float32
    idx = positions[:, :, None] + torch.arange(2 - K, 1, device=x.device)  # [B, k, K-1]
    flat = idx.clamp(min=0).view(Bsz, k * (K - 1))
    out = torch.gather(x, 1, flat[..., None].expand(Bsz, k * (K - 1), D))
    out = out.view(Bsz, k, K - 1, D).to(f)
    inside = idx >= 0
    if seq_idx is not None:
        own = torch.gather(seq_idx, 1, positions)[:, :, None]  # each step's document
        inside &= torch.gather(seq_idx, 1, flat).view(Bsz, k, K - 1) == own
    out = out * inside[..., None]
    if initial_state is not None:  # steps before 0 read the initial state's tail
        before = idx < 0
        if seq_idx is not None:
            before &= seq_idx[:, :1, None] == own
        tail = torch.gather(
            initial_state.to(f), 1, (idx + K - 1).clamp(0, K - 2).view(Bsz, -1, 1).expand(
                Bsz, k * (K - 1), D)
        ).view(Bsz, k, K - 1, D)  # fmt: skip
        out = torch.where(before[..., None], tail, out)
    return out
