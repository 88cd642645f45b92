"""The Mamba-1 stack's decode step as one compiled call: `mamba_step/stack.py`'s math on
its folded weights (`BlockWeights`), each layer's packed into arrays [L, ...].

B batch, M = d_model, D = d_inner, N = d_state, K = d_conv, R = dt_rank. Per row and
block, r [M + 1] being the residual stream and its constant column:

    xz    = in_b + (r in_wT) / |r|                   -> x_in, z
    u     = silu(conv_b + sum_k conv_wT[k] window[k])  window = [conv state; x_in]
    dt_r, B, C = u x_wT
    delta = softplus(dt_r dt_wT + dt_bias)
    h     = exp(delta A) h + delta u B                  ssm state in place
    r    += ((h C + D u) silu(z)) out_wT + out_b
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit, prange

from . import rows_max, stack_layers
from .common import (
    JIT,
    conv_step,
    exp,
    normed_projection,
    run_rows,
    silu,
    softplus,
    vecmat,
    vecmat_add,
)


class Packed:
    """Every block's `BlockWeights` stacked over the layers into numpy arrays [L, ...]
    (viewing tensors this object keeps), and the compiled step on them."""

    __slots__ = ("arrays", "pad", "rows_max", "tensors")

    def __init__(self, blocks: list, pad: float) -> None:
        out_b = [b.out_b if b.out_b is not None else b.in_b.new_zeros(b.out_wT.shape[1])
                 for b in blocks]  # fmt: skip
        self.tensors = (
            stack_layers([b.in_wT for b in blocks]),  # [L, M + 1, 2D]
            stack_layers([b.in_b for b in blocks]),  # [L, 2D]
            stack_layers([b.conv_wT for b in blocks]),  # [L, K, D]
            stack_layers([b.conv_b[-1] for b in blocks]),  # [L, D]
            stack_layers([b.x_wT for b in blocks]),  # [L, D, R + 2N]
            stack_layers([b.dt_w.t() for b in blocks]),  # [L, R, D]
            stack_layers([b.dt_bias for b in blocks]),  # [L, D]
            stack_layers([b.A for b in blocks]),  # [L, D, N]
            stack_layers([b.D for b in blocks]),  # [L, D]
            stack_layers([b.out_wT for b in blocks]),  # [L, D, M + 1]
            stack_layers(out_b),  # [L, M + 1]
        )
        self.arrays = tuple(t.numpy() for t in self.tensors)
        self.pad = pad
        self.rows_max = rows_max(self.tensors)  # rows a step on these weights takes

    def __call__(self, h: torch.Tensor, conv: torch.Tensor, ssm: torch.Tensor) -> torch.Tensor:
        """`mamba_step.stack.decode_layers` compiled: the residual stream [B, M] after every
        block (an inference tensor); conv [L, B, K-1, D] and ssm [L, B, D, N] advance in
        place."""
        M = h.shape[1]
        with torch.inference_mode():
            r = torch.nn.functional.pad(h, (0, 1), value=self.pad)
            fields = (conv.detach().numpy(), ssm.detach().numpy())
            run_rows(_layers, _layers_rows, r.numpy(), *self.arrays, *fields)
        torch.autograd.graph.increment_version((conv, ssm))  # written unseen by autograd
        return r.narrow(1, 0, M)

    def layers(self, r: np.ndarray, fields: tuple) -> None:
        """Every block on the rows r [B, M + 1] (the residual stream and its constant
        column) in place; a `MambaState`'s fields (conv, ssm) as numpy arrays advance in
        place."""
        run_rows(_layers, _layers_rows, r, *self.arrays, *fields)


@njit(parallel=True, **JIT)
def _layers_rows(r, in_wT, in_b, conv_w, conv_b, x_wT, dt_wT, dt_b, A, Dv, out_wT, out_b, conv,
                 ssm):  # fmt: skip
    """`_layers` with the rows on numba's threads: nothing is shared between rows."""
    for b in prange(r.shape[0]):
        _layers(r, in_wT, in_b, conv_w, conv_b, x_wT, dt_wT, dt_b, A, Dv, out_wT, out_b, conv,
              ssm, b, b + 1)  # fmt: skip


@njit(inline="never", **JIT)
def _layers(r, in_wT, in_b, conv_w, conv_b, x_wT, dt_wT, dt_b, A, Dv, out_wT, out_b, conv, ssm, lo,
          hi):  # fmt: skip
    """Every block on the rows lo..hi-1 of r, one row after another."""
    L, _, D2 = in_wT.shape
    D = D2 // 2
    N = A.shape[2]
    R = dt_wT.shape[1]
    dtype = r.dtype
    xz = np.empty(D2, dtype)
    u = np.empty(D, dtype)
    delta = np.empty(D, dtype)
    xp = np.empty(R + 2 * N, dtype)
    y = np.empty(D, dtype)
    for b in range(lo, hi):
        rb = r[b]
        for layer in range(L):
            normed_projection(rb, in_wT[layer], in_b[layer], xz)
            conv_step(conv[layer, b], conv_w[layer], conv_b[layer], xz[:D], u)
            vecmat(u, x_wT[layer], xp)
            db = dt_b[layer]
            for d in range(D):
                delta[d] = db[d]
            vecmat_add(xp[:R], dt_wT[layer], delta)
            for d in range(D):
                delta[d] = softplus(delta[d])
            for d in range(D):  # the gate first: a loop the compiler vectorises
                y[d] = silu(xz[D + d])
            hs = ssm[layer, b]
            Al = A[layer]
            Dl = Dv[layer]
            Bt = xp[R : R + N]
            Ct = xp[R + N :]
            for d in range(D):
                h = hs[d]
                a = Al[d]
                dl = delta[d]
                du = dl * u[d]
                acc = Dl[d] * u[d]
                for n in range(N):
                    hn = exp(dl * a[n]) * h[n] + du * Bt[n]
                    h[n] = hn
                    acc += hn * Ct[n]
                y[d] *= acc
            vecmat_add(y, out_wT[layer], rb)
            ob = out_b[layer]
            for j in range(rb.shape[0]):
                rb[j] += ob[j]
