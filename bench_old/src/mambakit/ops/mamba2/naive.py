"""The Mamba-2 scan as a loop over time: the readable oracle the chunked reference and the
kernels are checked against (in float64), one `mamba2_step_reference` per step."""

from __future__ import annotations

import torch

from .reference import mamba2_step_reference


def mamba2_scan_naive(x, delta, A, B, C, D=None, z=None, initial_state=None, seq_idx=None):
    """`mamba2_scan_reference`'s (y, final state) by stepping: the state is zeroed where a
    new document starts (seq_idx changes between t - 1 and t)."""
    Bsz, T, H, P = x.shape
    N = B.shape[-1]
    f = torch.float64 if x.dtype == torch.float64 else torch.float32
    h = torch.zeros(Bsz, H, P, N, dtype=f) if initial_state is None else initial_state.to(f)
    ys = []
    for t in range(T):
        if seq_idx is not None and t > 0:
            same = (seq_idx[:, t] == seq_idx[:, t - 1]).to(f)
            h = h * same[:, None, None, None]
        zt = None if z is None else z[:, t]
        y, h = mamba2_step_reference(x[:, t], delta[:, t], A, B[:, t], C[:, t], D, zt, h)
        ys.append(y)
    return torch.stack(ys, dim=1), h
