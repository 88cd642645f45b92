"""The Mamba-3 stack's decode step as one compiled call: `mamba3/stack.py`'s math on its
folded weights (`BlockWeights`), each layer's packed into arrays [L, ...].

B batch, M = d_model, E = d_inner, H heads of P values, G groups of the N-wide B/C rows
(head h reads group g = h // (H / G)), S rotary angles, W = in_proj's rows in the lean
body's order (`_derive`: per group [B_g, c, 0, C_g, c, 0], per head [z_h, x_h, dt_h,
1 - dd_A_h, trap_h], then theta). Per row and block, r [M + 1] being the residual stream
and its constant column:

    zxbc  = in_b + (r in_wT) / |r|
    k_h   = kq_b[h, 0] + kq_w[0] B_g / |[B_g, c]|     q_h likewise from C_g and kq_*[1]
    delta = softplus(dt_h)                            (dt_bias is in in_b)
    phi   = (phi + pi tanh(theta) delta) mod 2 pi     angle state in place, in [0, 2 pi)
    k_h, q_h: the pairs (2s, 2s + 1), s < S, turned by phi[s]
    alpha = exp(-max(f + 1/g, A_floor) delta),        g = max(a, 1), f = g - a, a = 1 - dd_A
    S     = alpha (S + (1 - lam) delta x_prev k_prev^T) + lam delta x_h k_h^T,
            lam = sigmoid(trap_h); then x_prev, k_prev = x_h, k_h     state in place
    r    += ((S q_h + D_h x_h) silu(z_h)) out_wT
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from . import rows_max, stack_layers
from .common import (
    JIT,
    exp,
    norm,
    normed_projection,
    one,
    sigmoid,
    silu,
    sincos,
    softplus,
    vecmat_add,
)
from .packed import PackedStack


class Packed(PackedStack):
    """Every block's `BlockWeights` stacked over the layers into numpy arrays [L, ...]
    (viewing tensors this object keeps), and the compiled step on them (`PackedStack`:
    the states `Mamba3State` (angle, ssm, k, x))."""

    __slots__ = ("turn",)

    def __init__(self, blocks: list, pad: float) -> None:
        G, H, N, P, S = blocks[0].dims
        in_wT = blocks[0].in_wT
        self.tensors = (
            stack_layers([b.in_wT for b in blocks]),  # [L, M + 1, W]
            stack_layers([b.in_b for b in blocks]),  # [L, W]
            stack_layers([b.kq_w.view(2, N) for b in blocks]),  # [L, 2, N]: B's, C's norm weights
            stack_layers([b.kq_b.view(H, 2, N) for b in blocks]),  # [L, H, 2, N]: B_bias, C_bias
            stack_layers([b.D.view(H) for b in blocks]),  # [L, H]
            stack_layers([b.out_wT for b in blocks]),  # [L, E, M + 1]
            in_wT.new_tensor([b.A_floor for b in blocks]),  # [L]
        )
        # pi and 2 pi in the weights' dtype, as PyTorch rounds the scalars of addcmul_ and
        # remainder_ to the tensor's
        self.turn = in_wT.new_tensor([math.pi, 2 * math.pi]).numpy()
        self.arrays = tuple(t.numpy() for t in self.tensors)
        self.groups = G
        self.pad = pad
        self.rows_max = rows_max(self.tensors)  # rows a step on these weights takes

    def consts(self) -> tuple:
        return self.turn, self.groups


@njit(parallel=True, **JIT)
def _layers_rows(r, in_wT, in_b, kq_w, kq_b, Dh, out_wT, A_floor, turn, G, angle, ssm, k_prev,
                 x_prev):  # fmt: skip
    """`_layers` with the rows on numba's threads: nothing is shared between rows."""
    for b in prange(r.shape[0]):
        _layers(r, in_wT, in_b, kq_w, kq_b, Dh, out_wT, A_floor, turn, G, angle, ssm, k_prev,
              x_prev, b, b + 1)  # fmt: skip


@njit(inline="never", **JIT)
def _layers(r, in_wT, in_b, kq_w, kq_b, Dh, out_wT, A_floor, turn, G, angle, ssm, k_prev, x_prev,
          lo, hi):  # fmt: skip
    """Every block on the rows lo..hi-1 of r, one row after another."""
    L, _, W = in_wT.shape
    H = kq_b.shape[1]
    N = kq_w.shape[2]
    E = out_wT.shape[1]
    P = E // H
    S = angle.shape[3]
    KQ = 2 * G * (N + 2)  # where the heads' region starts
    HW = 2 * P + 3  # a head's region
    TH = KQ + H * HW  # where theta starts
    dtype = r.dtype
    pi, two_pi = turn[0], turn[1]
    zxbc = np.empty(W, dtype)
    kq = np.empty((G, 2, N), dtype)  # the normed B and C rows of each group
    spin = np.empty(S, dtype)  # pi tanh(theta)
    k = np.empty(N, dtype)
    q = np.empty(N, dtype)
    y = np.empty(E, dtype)
    delta = np.empty(H, dtype)
    gamma = np.empty(H, dtype)
    alpha = np.empty(H, dtype)
    cos_t = np.empty(S, dtype)  # the turns' cos and sin
    sin_t = np.empty(S, dtype)
    for b in range(lo, hi):
        rb = r[b]
        for layer in range(L):
            normed_projection(rb, in_wT[layer], in_b[layer], zxbc)
            # B and C: RMSNorm as |[row, c]|, c = sqrt(eps N) from in_b, the weights' sqrt(N)
            for g in range(G):
                for j in range(2):
                    row = zxbc[(2 * g + j) * (N + 2) : (2 * g + j + 1) * (N + 2)]
                    sn = one(row[0]) / norm(row)
                    wj = kq_w[layer, j]
                    for n in range(N):
                        kq[g, j, n] = row[n] * wj[n] * sn
            for i in range(S):
                spin[i] = pi * math.tanh(zxbc[TH + i])
            for hd in range(H):  # the heads' scalars, then their gates: loops that vectorise
                o = KQ + hd * HW
                dl = softplus(zxbc[o + 2 * P])
                a = zxbc[o + 2 * P + 1]
                ga = max(a, one(a))
                gam = sigmoid(zxbc[o + 2 * P + 2]) * dl  # lam delta
                delta[hd], gamma[hd] = dl, gam
                alpha[hd] = exp(-(max(ga - a + one(a) / ga, A_floor[layer]) * dl))
            for hd in range(H):
                o = KQ + hd * HW
                for p in range(P):
                    y[hd * P + p] = silu(zxbc[o + p])
            for hd in range(H):
                g = hd // (H // G)
                o = KQ + hd * HW
                dl, gam = delta[hd], gamma[hd]
                late = dl - gam  # (1 - lam) delta
                bk = kq_b[layer, hd, 0]
                bq = kq_b[layer, hd, 1]
                for n in range(N):
                    k[n] = bk[n] + kq[g, 0, n]
                    q[n] = bq[n] + kq[g, 1, n]
                phi = angle[layer, b, hd]
                for i in range(S):
                    t = phi[i] + spin[i] * dl
                    if not (t >= 0 and t < two_pi):  # PyTorch's remainder: the divisor's sign
                        t = np.fmod(t, two_pi)
                        if t < 0:
                            t += two_pi
                    phi[i] = t
                for i in range(S):
                    sin_t[i], cos_t[i] = sincos(phi[i])
                for i in range(S):
                    c, si = cos_t[i], sin_t[i]
                    k0, k1 = k[2 * i], k[2 * i + 1]
                    k[2 * i] = k0 * c - k1 * si
                    k[2 * i + 1] = k0 * si + k1 * c
                    q0, q1 = q[2 * i], q[2 * i + 1]
                    q[2 * i] = q0 * c - q1 * si
                    q[2 * i + 1] = q0 * si + q1 * c
                st = ssm[layer, b, hd]
                kp = k_prev[layer, b, hd]
                xp = x_prev[layer, b, hd]
                d = Dh[layer, hd]
                al = alpha[hd]
                for p in range(P):
                    xv = zxbc[o + P + p]
                    xl = xp[p] * late
                    xg = xv * gam
                    sp = st[p]
                    acc = d * xv
                    for n in range(N):
                        v = (sp[n] + xl * kp[n]) * al + xg * k[n]
                        sp[n] = v
                        acc += v * q[n]
                    xp[p] = xv
                    y[hd * P + p] *= acc
                for n in range(N):
                    kp[n] = k[n]
            vecmat_add(y, out_wT[layer], rb)


Packed.kernel = staticmethod(_layers)
Packed.kernel_rows = staticmethod(_layers_rows)
