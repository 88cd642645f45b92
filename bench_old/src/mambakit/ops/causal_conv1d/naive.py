"""The depthwise causal conv as a decode loop, one timestep at a time in float64: the oracle.

B batch, T time, D channels, K = d_conv taps. A window of the last K inputs slides
over the row; at every step

    c_t = bias + sum_{k<K} weight[:, k] * x_{t-K+1+k}        out_t = silu(c_t) or c_t

The window starts as `initial_state` [B, K-1, D] (oldest first; zeros without
one) and is emptied (all zeros) before every step t where `seq_idx` changes
between t-1 and t, so no tap reads an earlier document and the initial state
feeds only the row's first document. No shifted copies, no masks, no custom
backward (autograd differentiates the loop): slow, and independent of both the
reference (reference.py) and the kernels, which the tests check against it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv1d_naive(
    x: torch.Tensor,  # [B, T, D]
    weight: torch.Tensor,  # [D, K]
    bias: torch.Tensor | None = None,  # [D]
    initial_state: torch.Tensor | None = None,  # [B, K-1, D]
    seq_idx: torch.Tensor | None = None,  # [B, T] int32
    activation: str | None = "silu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [B, T, D], final_state [B, K-1, D]), both float64.

    The final state is the window after the last step without its oldest input:
    the inputs at times T-(K-1)..T-1, zero at the times before the start of the
    row's last document. Where that document is the row's first, the times before
    0 are `initial_state`'s rows (so with T < K-1 part of it carries over).
    """
    f = torch.float64
    Bsz, T, Dn = x.shape
    K = weight.shape[1]
    x, w = x.to(f), weight.to(f)
    hist = initial_state.to(f) if initial_state is not None else x.new_zeros(Bsz, K - 1, Dn)
    outs = []
    for t in range(T):
        if seq_idx is not None and t > 0:
            same = (seq_idx[:, t] == seq_idx[:, t - 1]).to(f)  # [B]
            hist = hist * same[:, None, None]  # a new document: an empty window
        window = torch.cat([hist, x[:, t, None, :]], dim=1)  # [B, K, D], oldest first
        c = (window * w.t()).sum(1)  # sum_k weight[:, k] * x_{t-K+1+k}
        if bias is not None:
            c = c + bias.to(f)
        outs.append(F.silu(c) if activation == "silu" else c)
        hist = window[:, 1:]
    return torch.stack(outs, 1), hist
