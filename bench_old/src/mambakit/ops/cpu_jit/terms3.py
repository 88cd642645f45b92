"""The Mamba-3 layer's per-token terms, compiled: what `layers.Mamba3` derives from in_proj's
rows before the scan, forward and backward, so that on the CPU a layer is in_proj, one
compiled call (these terms and `cpu_jit.scan3`) and out_proj, instead of some forty
PyTorch ops and their backward nodes (at the RL shapes each costs more than its arithmetic).

B batch, T time, H heads of P values, G groups of N, S angles; in_proj's row of width
W = 2 H P + 2 G N + 3 H + S splits (`ops.mamba3._split`) into z, x [H, P], B, C [G, N],
dd_dt, dd_A, trap [H] and theta [S]. Per token:

    k = rmsnorm_N(B) w_B       q = rmsnorm_N(C) w_C        (per group; eps of each norm)
    delta = softplus(dd_dt + dt_bias)
    A     = -max(f(dd_A), A_floor)    f(u) = max(u, 0) + 1 / (1 - min(u, 0))
    rate  = pi tanh(theta)

and z, x and trap pass through. The backward takes the scan's gradients, with q's, k's and
rate's still per head (`scan3.backward_arrays`), sums them over each group's heads in order,
and writes the gradient of the whole row; the norms' weights and dt_bias get each token's
share, summed over the tokens in order afterwards (deterministic). The clamps' gradients
follow PyTorch's (a clamp passes the gradient where its input is at the bound), so this
agrees with the op chain it replaces to rounding.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from .common import JIT, exp, one, threads, zero

PARALLEL_MIN = 512  # tokens from which they run on threads (below, waking them costs more)


def forward(zx, w_B, w_C, eps_B, eps_C, dt_bias, A_floor, sizes):
    """(x, z [B, T, H, P], q, k [B, T, G, N], delta, A, trap [B, T, H], rate [B, T, S], and
    the norms' 1 / rms of k and q [B, T, G] for the backward), arrays, from in_proj's rows
    zx [B, T, W] and the parameters, arrays of one float dtype (zx contiguous)."""
    E, N, G, H, P, S = sizes
    c = np.array([eps_B, eps_C, A_floor, math.pi, 1 / sizes[1]], zx.dtype)
    if zx.shape[0] * zx.shape[1] < PARALLEL_MIN:
        return _forward_one(zx, w_B, w_C, dt_bias, c, H, G, P, S)
    with threads():
        return _forward_par(zx, w_B, w_C, dt_bias, c, H, G, P, S)


def backward(zx, w_B, w_C, dt_bias, A_floor, r_k, r_q, g_x, g_z, g_q_heads, g_k_heads,
             g_delta, g_A, g_trap, g_rate_heads):  # fmt: skip
    """(the gradients of zx [B, T, W], w_B, w_C [N] and dt_bias [H]), arrays, from the
    scan's input gradients (arrays): g_x, g_z [B, T, H, P] (g_z None or [1, 1, 1, 1]:
    zeros), g_delta, g_A, g_trap [B, T, H], and each head's share of q's, k's and rate's:
    [B, H, T, N], [B, H, T, S]."""
    has_z = g_z is not None and g_z.shape == g_x.shape
    gz = g_z if has_z else np.zeros((1, 1, 1, 1), g_x.dtype)
    c = np.array([A_floor, math.pi, 1 / w_B.shape[0]], zx.dtype)
    args = (zx, w_B, w_C, dt_bias, c, r_k.shape[2], r_k, r_q, g_x, gz, has_z, g_q_heads,
            g_k_heads, g_delta, g_A, g_trap, g_rate_heads)  # fmt: skip
    if zx.shape[0] * zx.shape[1] < PARALLEL_MIN:
        return _backward_one(*args)
    with threads():
        return _backward_par(*args)


def _forward(zx, w_B, w_C, dt_bias, c, H, G, P, S):
    Bsz, T = zx.shape[0], zx.shape[1]
    N, f = w_B.shape[0], zx.dtype
    x, z = np.empty((Bsz, T, H, P), f), np.empty((Bsz, T, H, P), f)
    q, k = np.empty((Bsz, T, G, N), f), np.empty((Bsz, T, G, N), f)
    delta, A, trap = np.empty((Bsz, T, H), f), np.empty((Bsz, T, H), f), np.empty((Bsz, T, H), f)
    rate = np.empty((Bsz, T, S), f)
    r_k, r_q = np.empty((Bsz, T, G), f), np.empty((Bsz, T, G), f)
    E = H * P
    o_B = 2 * E
    o_C = o_B + G * N
    o_dt = o_C + G * N
    o_A, o_trap, o_theta = o_dt + H, o_dt + 2 * H, o_dt + 3 * H
    eps_B, eps_C, A_floor, pi, inv_N = c[0], c[1], c[2], c[3], c[4]  # in zx's dtype
    for bt in prange(Bsz * T):  # tokens in parallel: nothing shared between them
        b, t = bt // T, bt % T
        row = zx[b, t]
        for h in range(H):
            for p in range(P):
                z[b, t, h, p] = row[h * P + p]
                x[b, t, h, p] = row[E + h * P + p]
        for g in range(G):
            r_k[b, t, g] = _norm_into(row, o_B + g * N, w_B, eps_B, inv_N, k[b, t, g])
            r_q[b, t, g] = _norm_into(row, o_C + g * N, w_C, eps_C, inv_N, q[b, t, g])
        for h in range(H):
            v = row[o_dt + h] + dt_bias[h]  # softplus (threshold 20) with libm's exp, as torch's
            delta[b, t, h] = v if v > 20 else math.log1p(math.exp(v))
            u = row[o_A + h]
            f = max(u, zero(u)) + one(u) / (one(u) - min(u, zero(u)))
            A[b, t, h] = -max(f, A_floor)
            trap[b, t, h] = row[o_trap + h]
        for i in range(S):
            rate[b, t, i] = pi * math.tanh(row[o_theta + i])
    return x, z, q, k, delta, A, trap, rate, r_k, r_q


@njit(inline="always", **JIT)
def _norm_into(row, start, w, eps, inv_N, out):
    """out = v / rms(v) w over v = row[start : start + N]; returns 1 / rms(v)."""
    N = out.shape[0]
    s = zero(row[start])
    for n in range(N):
        v = row[start + n]
        s += v * v
    r = one(s) / math.sqrt(s * inv_N + eps)
    for n in range(N):
        out[n] = row[start + n] * r * w[n]
    return r


def _backward(zx, w_B, w_C, dt_bias, c, G, r_k, r_q, g_x, g_z, has_z, g_q_heads, g_k_heads,
              g_delta, g_A, g_trap, g_rate_heads):  # fmt: skip
    Bsz, T, H, P = g_x.shape
    N, S = w_B.shape[0], g_rate_heads.shape[3]
    g_zx = np.empty_like(zx)
    # each token's share of the weights' gradients, summed over the tokens in order after
    share_B, share_C = np.empty((Bsz, T, N), zx.dtype), np.empty((Bsz, T, N), zx.dtype)
    share_dt = np.empty((Bsz, T, H), zx.dtype)
    per = H // G
    E = H * P
    o_B = 2 * E
    o_C = o_B + G * N
    o_dt = o_C + G * N
    o_A, o_trap, o_theta = o_dt + H, o_dt + 2 * H, o_dt + 3 * H
    A_floor, pi, inv_N = c[0], c[1], c[2]  # in zx's dtype
    for bt in prange(Bsz * T):
        b, t = bt // T, bt % T
        row = zx[b, t]
        out = g_zx[b, t]
        for h in range(H):
            for p in range(P):
                out[h * P + p] = g_z[b, t, h, p] if has_z else zero(row[0])
                out[E + h * P + p] = g_x[b, t, h, p]
        gsum = np.empty(N, zx.dtype)
        for n in range(N):
            share_B[b, t, n] = 0
            share_C[b, t, n] = 0
        for g in range(G):
            for which in range(2):  # k (from B), then q (from C)
                heads = g_k_heads if which == 0 else g_q_heads
                for n in range(N):
                    gsum[n] = heads[b, g * per, t, n]
                for j in range(1, per):
                    for n in range(N):
                        gsum[n] += heads[b, g * per + j, t, n]
                if which == 0:
                    _norm_back(row, o_B + g * N, w_B, r_k[b, t, g], inv_N, gsum, out, share_B[b, t])
                else:
                    _norm_back(row, o_C + g * N, w_C, r_q[b, t, g], inv_N, gsum, out, share_C[b, t])
        for h in range(H):
            v = row[o_dt + h] + dt_bias[h]
            gd = g_delta[b, t, h]
            if v <= 20:  # softplus' slope, as PyTorch's backward: 1 above its threshold
                e = exp(v)
                gd = gd * e / (e + one(e))
            out[o_dt + h] = gd
            share_dt[b, t, h] = gd
            u = row[o_A + h]
            f = max(u, zero(u)) + one(u) / (one(u) - min(u, zero(u)))
            slope = zero(u)
            if u >= 0:
                slope += one(u)
            if u <= 0:
                m = one(u) - u
                slope += one(u) / (m * m)
            out[o_A + h] = -g_A[b, t, h] * slope if f >= A_floor else zero(u)
            out[o_trap + h] = g_trap[b, t, h]
        for i in range(S):
            gr = g_rate_heads[b, 0, t, i]
            for h in range(1, H):
                gr += g_rate_heads[b, h, t, i]
            th = math.tanh(row[o_theta + i])
            out[o_theta + i] = gr * pi * (one(th) - th * th)
    for b in range(Bsz):
        for t in range(T):
            if b + t > 0:
                for n in range(N):
                    share_B[0, 0, n] += share_B[b, t, n]
                    share_C[0, 0, n] += share_C[b, t, n]
                for h in range(H):
                    share_dt[0, 0, h] += share_dt[b, t, h]
    return g_zx, share_B[0, 0], share_C[0, 0], share_dt[0, 0]


@njit(inline="always", **JIT)
def _norm_back(row, start, w, r, inv_N, gy, out, share_w):
    """The RMSNorm's backward for v = row[start : start + N], y = v r w, r = 1 / rms(v):
    out[start + n] = r (w gy)_n - v_n r^3 mean(v w gy); share_w += v r gy."""
    N = w.shape[0]
    dot = zero(r)
    for n in range(N):
        dot += row[start + n] * w[n] * gy[n]
    c = r * r * r * dot * inv_N
    for n in range(N):
        v = row[start + n]
        out[start + n] = r * w[n] * gy[n] - v * c
        share_w[n] += v * r * gy[n]


# each body twice: on threads (prange) and in one (prange as range)
_forward_par, _backward_par = (njit(parallel=True, **JIT)(f) for f in (_forward, _backward))
_forward_one, _backward_one = (njit(**JIT)(f) for f in (_forward, _backward))
