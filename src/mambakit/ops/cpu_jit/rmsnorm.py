"""RMSNorm with its fused residual add, forward and backward, compiled: the CPU body of
`ops.rms_norm` for float32 and float64 rows (`ops.rms_norm.compiled`).

    r   = x + residual                  (x alone without a residual)
    k   = 1 / sqrt(mean(r^2) + eps)     per row
    out = r k w

and backwards, with g = dL/dout and gr = dL/dr from the residual stream:

    dL/dr = k g w - k^3 r mean(g w r) + gr        dL/dw = sum over rows of g r k

The PyTorch body is six ops forward and six autograd nodes back, each a trip through
PyTorch's dispatch that costs more than its arithmetic on a small model's rows (a
T = 32 window of d_model 128: 4,096 values); here each direction is one call. Rows run
on torch's threads from `PARALLEL_MIN` rows on; the weight's gradient is summed from
fixed chunks of `CHUNK` rows in chunk order, so it does not depend on the threads.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from .common import JIT, one, threads, zero

PARALLEL_MIN = 256  # rows from which they run on threads (below, waking them costs more)
CHUNK = 64  # rows a partial sum of the weight's gradient covers


def forward(x, res, w, eps, out, r):
    """Writes out (and r = x + res where res is not None) of rows x [R, D] and w [D], arrays
    of one float dtype (out, r: the caller's, [R, D]); returns k [R], each row's 1 / rms."""
    R = x.shape[0]
    k = np.empty(R, x.dtype)
    has_res = res is not None
    if not has_res:
        res, r = x, x
    e = x.dtype.type(eps)
    if R < PARALLEL_MIN:
        _forward_rows(x, res, has_res, w, e, out, r, k, 0, R)
    else:
        with threads():
            _forward_par(x, res, has_res, w, e, out, r, k)
    return k


def backward(g, gr, r, k, w, gin):
    """Writes dL/dr into gin [R, D] (the caller's) and returns dL/dw [D], from g = dL/dout
    and gr = dL/dr (either None: zeros), r, k and w as `forward` took and gave them."""
    R, D = r.shape
    has_g, has_gr = g is not None, gr is not None
    g = g if has_g else r
    gr = gr if has_gr else r
    chunks = max(1, -(-R // CHUNK))
    part = np.zeros((chunks, D), r.dtype)
    if R < PARALLEL_MIN:
        for c in range(chunks):
            _backward_rows(g, has_g, gr, has_gr, r, k, w, gin, part, c)
    else:
        with threads():
            _backward_par(g, has_g, gr, has_gr, r, k, w, gin, part)
    return _sum_chunks(part)


@njit(**JIT)
def _forward_rows(x, res, has_res, w, eps, out, r, k, lo, hi):
    D = x.shape[1]
    inv_d = one(eps) / D
    for i in range(lo, hi):
        s = zero(eps)
        if has_res:
            for j in range(D):
                v = x[i, j] + res[i, j]
                r[i, j] = v
                s += v * v
        else:
            for j in range(D):
                s += x[i, j] * x[i, j]
        ki = one(eps) / math.sqrt(s * inv_d + eps)
        k[i] = ki
        for j in range(D):
            out[i, j] = r[i, j] * ki * w[j]


@njit(parallel=True, **JIT)
def _forward_par(x, res, has_res, w, eps, out, r, k):
    R = x.shape[0]
    n = -(-R // CHUNK)
    for c in prange(n):
        _forward_rows(x, res, has_res, w, eps, out, r, k, c * CHUNK, min(R, (c + 1) * CHUNK))


@njit(**JIT)
def _backward_rows(g, has_g, gr, has_gr, r, k, w, gin, part, c):
    """Rows c * CHUNK .. of the backward; chunk c's share of dL/dw into part[c]."""
    R, D = r.shape
    inv_d = one(k[0]) / D
    for i in range(c * CHUNK, min(R, (c + 1) * CHUNK)):
        ki = k[i]
        if has_g:
            dot = zero(ki)
            for j in range(D):
                dot += g[i, j] * w[j] * r[i, j]
            c3 = ki * ki * ki * dot * inv_d
            for j in range(D):
                gin[i, j] = ki * g[i, j] * w[j] - c3 * r[i, j]
            for j in range(D):
                part[c, j] += g[i, j] * r[i, j] * ki
        else:
            for j in range(D):
                gin[i, j] = zero(ki)
        if has_gr:
            for j in range(D):
                gin[i, j] += gr[i, j]


@njit(parallel=True, **JIT)
def _backward_par(g, has_g, gr, has_gr, r, k, w, gin, part):
    for c in prange(part.shape[0]):
        _backward_rows(g, has_g, gr, has_gr, r, k, w, gin, part, c)


@njit(**JIT)
def _sum_chunks(part):
    out = part[0].copy()
    for c in range(1, part.shape[0]):
        for j in range(part.shape[1]):
            out[j] += part[c, j]
    return out
