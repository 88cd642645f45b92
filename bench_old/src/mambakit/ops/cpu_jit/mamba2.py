"""The Mamba-2 stack's decode step as one compiled call: `mamba2/stack.py`'s math on its
folded weights (`BlockWeights`), each layer's packed into arrays [L, ...].

B batch, M = d_model, H heads of P values (E = d_ssm = H P), G groups of the N-wide B/C
rows (head h reads group g = h // (H / G)), K = d_conv, C = conv_dim = E + 2 G N,
F = d_mlp. Per row and block, r [M + 1] being the residual stream and its constant
column:

    zxbcdt = in_b + (r in_wT) / |r|                  -> z0 [F], x0 [F], z [E], xBC [C], dt [H]
    xBC    = silu(conv_b + sum_k conv_wT[k] window[k])  window = [conv state; xBC], shifted
    x, B, C = xBC                                       x [H, P], B and C [G, N]
    delta  = clamp(softplus(dt_h), dt_limit)            (dt_bias is in in_b; none: (0, inf))
    S      = exp(delta A_h) S + delta x_h B_g^T         ssm state in place
    y      = S C_g + D_h x_h                            D per head or per head-dim: [H, P]
    y      = y silu(z)                                  without the gated norm, else per group
             rmsnorm(y) silu(z) (norm before gate) or rmsnorm(y silu(z)),
             rmsnorm(v) = v / sqrt(mean(v^2) + eps)     (its weight is in out_wT)
    r     += y out_wT + (silu(z0) x0) mlp_wT + out_b
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from . import rows_max, stack_layers
from .common import (
    JIT,
    conv_step,
    exp,
    normed_projection,
    one,
    silu,
    softplus,
    vecmat_add,
)
from .packed import PackedStack

# the gated norm: `_layers`' `gate` argument
GATE, NORM_GATED, NORM_THEN_GATE = 0, 1, 2


def packs(blocks: list) -> bool:
    """Whether `Packed` takes these blocks: one layout for every layer (one model's)."""
    return len({(b.split, b.xbc_split, b.dims, b.gnorm and b.gnorm[2]) for b in blocks}) == 1


class Packed(PackedStack):
    """Every block's `BlockWeights` stacked over the layers into numpy arrays [L, ...]
    (viewing tensors this object keeps), and the compiled step on them (`PackedStack`:
    the states `Mamba2State` (conv, ssm))."""

    __slots__ = ("gate",)

    def __init__(self, blocks: list, pad: float) -> None:
        G, H, P, _ = blocks[0].dims
        in_wT = blocks[0].in_wT
        new = in_wT.new_zeros
        M1 = in_wT.shape[0]
        gnorm = blocks[0].gnorm
        mlp_wT = [new(0, M1) if b.mlp_wT is None else b.mlp_wT for b in blocks]
        out_b = [new(M1) if b.out_b is None else b.out_b for b in blocks]
        # dt_limit's (lo, hi), softplus's own (0, inf) where it has none; the gated norm's
        # eps and group size (E / G), in the weights' dtype as clamp and F.rms_norm round them
        limits = [b.dt_limit or (0.0, math.inf) for b in blocks]
        norms = [(b.gnorm[1], b.gnorm[0]) if b.gnorm else (0.0, 1.0) for b in blocks]
        self.tensors = (
            stack_layers([b.in_wT for b in blocks]),  # [L, M + 1, W]
            stack_layers([b.in_b for b in blocks]),  # [L, W]
            stack_layers([b.conv_wT for b in blocks]),  # [L, K, C]
            stack_layers([b.conv_b[-1] for b in blocks]),  # [L, C]
            stack_layers([b.A.view(H) for b in blocks]),  # [L, H]
            stack_layers([b.D.view(H, -1).expand(H, P) for b in blocks]),  # [L, H, P]
            stack_layers([b.out_wT for b in blocks]),  # [L, E, M + 1]
            stack_layers(mlp_wT),  # [L, F, M + 1]
            stack_layers(out_b),  # [L, M + 1]
            in_wT.new_tensor(limits),  # [L, 2]
            in_wT.new_tensor(norms),  # [L, 2]
        )
        self.arrays = tuple(t.numpy() for t in self.tensors)
        self.gate = GATE if gnorm is None else NORM_THEN_GATE if gnorm[2] else NORM_GATED
        self.groups = G
        self.pad = pad
        self.rows_max = rows_max(self.tensors)  # rows a step on these weights takes

    def consts(self) -> tuple:
        return self.gate, self.groups


@njit(parallel=True, **JIT)
def _layers_rows(r, in_wT, in_b, conv_w, conv_b, A, Dv, out_wT, mlp_wT, out_b, dt_limit, gnorm,
                 gate, G, conv, ssm):  # fmt: skip
    """`_layers` with the rows on numba's threads: nothing is shared between rows."""
    for b in prange(r.shape[0]):
        _layers(r, in_wT, in_b, conv_w, conv_b, A, Dv, out_wT, mlp_wT, out_b, dt_limit, gnorm,
              gate, G, conv, ssm, b, b + 1)  # fmt: skip


@njit(inline="never", **JIT)
def _layers(r, in_wT, in_b, conv_w, conv_b, A, Dv, out_wT, mlp_wT, out_b, dt_limit, gnorm, gate,
          G, conv, ssm, lo, hi):  # fmt: skip
    """Every block on the rows lo..hi-1 of r, one row after another."""
    L, _, W = in_wT.shape
    H, P = Dv.shape[1], Dv.shape[2]
    E = H * P
    F = mlp_wT.shape[1]
    C = conv.shape[3]
    N = (C - E) // (2 * G)
    X0 = 2 * F + E  # where xBC starts in zxbcdt
    DT = X0 + C  # where dt starts
    HG = H // G
    GS = E // G  # the gated norm's group
    dtype = r.dtype
    zx = np.empty(W, dtype)
    xc = np.empty(C, dtype)  # x, B, C after the conv
    y = np.empty(E, dtype)
    m = np.empty(F, dtype)
    for b in range(lo, hi):
        rb = r[b]
        for layer in range(L):
            normed_projection(rb, in_wT[layer], in_b[layer], zx)
            conv_step(conv[layer, b], conv_w[layer], conv_b[layer], zx[X0 : X0 + C], xc)
            dt_lo, dt_hi = dt_limit[layer, 0], dt_limit[layer, 1]
            for hd in range(H):
                g = hd // HG
                delta = softplus(zx[DT + hd])
                if delta < dt_lo:  # as clamp: NaN stays NaN
                    delta = dt_lo
                if delta > dt_hi:
                    delta = dt_hi
                dA = exp(delta * A[layer, hd])
                Bg = xc[E + g * N : E + (g + 1) * N]
                Cg = xc[E + (G + g) * N : E + (G + g + 1) * N]
                st = ssm[layer, b, hd]
                d = Dv[layer, hd]
                for p in range(P):
                    xv = xc[hd * P + p]
                    dx = delta * xv
                    sp = st[p]
                    acc = d[p] * xv
                    for n in range(N):
                        v = sp[n] * dA + dx * Bg[n]
                        sp[n] = v
                        acc += v * Cg[n]
                    y[hd * P + p] = acc
            z = zx[2 * F : 2 * F + E]
            if gate != NORM_THEN_GATE:
                for i in range(E):
                    y[i] *= silu(z[i])
            if gate != GATE:
                eps, size = gnorm[layer, 0], gnorm[layer, 1]
                for g in range(G):
                    v = y[g * GS : (g + 1) * GS]
                    ss = v[0] * v[0]
                    for i in range(1, GS):
                        ss += v[i] * v[i]
                    sn = one(ss) / math.sqrt(ss / size + eps)
                    for i in range(GS):
                        v[i] *= sn
                if gate == NORM_THEN_GATE:
                    for i in range(E):
                        y[i] *= silu(z[i])
            vecmat_add(y, out_wT[layer], rb)
            if F:
                for j in range(F):
                    m[j] = silu(zx[j]) * zx[F + j]
                vecmat_add(m, mlp_wT[layer], rb)
            ob = out_b[layer]
            for j in range(rb.shape[0]):
                rb[j] += ob[j]


Packed.kernel = staticmethod(_layers)
Packed.kernel_rows = staticmethod(_layers_rows)
