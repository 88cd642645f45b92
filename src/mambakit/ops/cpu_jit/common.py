"""What the compiled steps share: exp in both float widths, the activations, and the
vector-matrix products the compiler vectorises (imported only when numba is).

A product x W (x [K], W [K, N] row-major) runs as rows: out += x[k] W[k, :], eight k at a
time, the inner loop contiguous in W and out. It sits in a function of its own, never inlined: there
LLVM checks once that out does not overlap W and vectorises the row loop; inlined into
a larger body it often cannot prove that and stays scalar (twice the time or more).
"""

from __future__ import annotations

import math
import os
import threading
from contextlib import contextmanager

import numba
import numpy as np
import torch
from numba import njit, prange, types
from numba.extending import overload

# reassociation lets sums vectorise; contraction makes a * b + c one fused multiply-add.
# No flag that assumes finite values: the steps pass infinities and NaNs through as the
# PyTorch bodies do. numpy's error model: a float division is IEEE's (x / 0 is inf or
# NaN, as in torch), not Python's, whose zero check before every division keeps a loop
# that divides from vectorising (a SiLU over 768 floats: 3.6 us against 0.4).
FAST = {"reassoc", "contract"}
JIT = dict(fastmath=FAST, cache=True, nogil=True, error_model="numpy")
_OVERLOAD = {"fastmath": FAST, "error_model": "numpy"}
LOG2E = 1.4426950408889634
LN2_HI = 0.693145751953125  # ln 2 in two parts: k ln 2 subtracted without rounding error
LN2_LO = 1.428606765330187e-06


# one caller at a time in numba's thread pool (its workqueue layer, where OpenMP is not
# there, must not be entered by two threads at once)
_LOCK = threading.Lock()


def _new_lock() -> None:
    global _LOCK
    _LOCK = threading.Lock()


# a fork while another thread held the lock: the child gets a free one (numba's workqueue
# and TBB layers; its OpenMP layer does not run in a forked child at all)
os.register_at_fork(after_in_child=_new_lock)


@contextmanager
def threads():
    """numba's threads as many as torch's (the library's choice: `mambakit.threads`), and
    torch's count as it was after: numba's OpenMP layer may set OpenMP's count when it
    starts. Never fewer than torch's, however small the work: a smaller numba team was not
    faster on 16-core hosts (`mambakit.ops.mamba3.layers_compiled`), and where numba's
    OpenMP layer and torch use one libgomp, a team smaller than the last makes libgomp end
    the threads it leaves out and start them again. Where they use two (torch's wheel
    bundles one; numba's layer may load the system's), each pool spins a while after its
    parallel regions; numba's workqueue layer, which does not spin, was up to twice as slow
    on a 2-core machine."""
    n = torch.get_num_threads()
    with _LOCK:
        if numba.get_num_threads() != n:
            numba.set_num_threads(min(n, numba.config.NUMBA_NUM_THREADS))
        try:
            yield
        finally:
            if torch.get_num_threads() != n:
                torch.set_num_threads(n)


PARALLEL_ROWS = 2  # rows from which a compiled step runs them on numba's threads


def run_rows(rows, parallel, r, *args) -> None:
    """`rows(r, *args, 0, B)`, a compiled step over the rows 0..B-1 of r; or
    `parallel(r, *args)`, which runs `rows` on each row, on numba's threads (as many as
    torch's), from `PARALLEL_ROWS` rows where torch has more than one thread. A row's
    arithmetic is the same either way."""
    if r.shape[0] >= PARALLEL_ROWS and torch.get_num_threads() > 1:
        with threads():
            parallel(r, *args)
    else:
        rows(r, *args, 0, r.shape[0])


def exp(x):
    """e^x, in numba code: float32 as a polynomial the loops vectorise (within 3e-7
    relative of the exact value), float64 as libm's exp."""
    raise NotImplementedError("exp runs in numba code only")


def _exp32(x):
    # e^x = 2^k e^f, k = round(x log2 e), |f| <= ln2 / 2: a degree-6 polynomial in f.
    # Below -87 the result would leave float32's normal range: e^-87 (within 2e-38 of 0)
    y = max(x, np.float32(-87.0))
    y = min(y, np.float32(88.0))
    k = np.floor(y * np.float32(LOG2E) + np.float32(0.5))
    f = y - k * np.float32(LN2_HI) - k * np.float32(LN2_LO)
    p = np.float32(1.0 / 720)
    p = p * f + np.float32(1.0 / 120)
    p = p * f + np.float32(1.0 / 24)
    p = p * f + np.float32(1.0 / 6)
    p = p * f + np.float32(0.5)
    p = p * f + np.float32(1.0)
    p = p * f + np.float32(1.0)
    scale = np.int32((np.int32(k) + np.int32(127)) << np.int32(23)).view(np.float32)
    out = p * scale
    if x > np.float32(88.0):
        out = np.float32(np.inf)
    if x != x:  # NaN in, NaN out
        out = x
    return out


def _exp64(x):
    return math.exp(x)


def _by_width(impl32, impl64):
    """The overload of a float function: `impl32` for float32, `impl64` for float64."""

    def pick(x):
        if isinstance(x, types.Float):
            return impl32 if x.bitwidth == 32 else impl64
        return None

    return pick


overload(exp, jit_options=_OVERLOAD)(_by_width(_exp32, _exp64))


def sincos(x):
    """(sin x, cos x), in numba code: float32 through float64 polynomials the loops vectorise
    (rounded once: within an ulp), float64 as libm's."""
    raise NotImplementedError("sincos runs in numba code only")


def _sincos32(x):
    # in float64, rounded once at the end: x - 2 pi round(x / 2 pi) in [-pi, pi], folded into
    # [-pi/2, pi/2] (sin(pi - r) = sin r, cos(pi - r) = -cos r), Taylor polynomials to r^13
    # and r^14 (error < 1e-9 there)
    v = np.float64(x)
    r = v - TWO_PI * np.floor(v * (0.5 / math.pi) + 0.5)
    flip = r > 0.5 * math.pi or r < -0.5 * math.pi
    if r > 0.5 * math.pi:
        r = math.pi - r
    elif r < -0.5 * math.pi:
        r = -math.pi - r
    r2 = r * r
    s = 1.0 / 6227020800
    s = s * r2 - 1.0 / 39916800
    s = s * r2 + 1.0 / 362880
    s = s * r2 - 1.0 / 5040
    s = s * r2 + 1.0 / 120
    s = s * r2 - 1.0 / 6
    s = (s * r2 + 1.0) * r
    c = -1.0 / 87178291200
    c = c * r2 + 1.0 / 479001600
    c = c * r2 - 1.0 / 3628800
    c = c * r2 + 1.0 / 40320
    c = c * r2 - 1.0 / 720
    c = c * r2 + 1.0 / 24
    c = c * r2 - 0.5
    c = c * r2 + 1.0
    return np.float32(s), np.float32(-c if flip else c)


TWO_PI = 2 * math.pi


def _sincos64(x):
    return math.sin(x), math.cos(x)


overload(sincos, jit_options=_OVERLOAD)(_by_width(_sincos32, _sincos64))


def one(x):
    """1 in x's float type, in numba code (an int literal would make float32 math float64)."""
    raise NotImplementedError("one runs in numba code only")


def zero(x):
    """0 in x's float type, in numba code (`x * 0` would be float64 for a float32 x)."""
    raise NotImplementedError("zero runs in numba code only")


def _constant(value: float):
    """The overload of a function returning `value` in its argument's float type."""

    def typed(x):
        if isinstance(x, types.Float):
            c = np.float32(value) if x.bitwidth == 32 else np.float64(value)
            return lambda x: c
        return None

    return typed


overload(one)(_constant(1.0))
overload(zero)(_constant(0.0))


@njit(inline="always", **JIT)
def sigmoid(x):
    return one(x) / (one(x) + exp(-x))


@njit(inline="always", **JIT)
def silu(x):
    return x / (one(x) + exp(-x))


def softplus(x):
    """log(1 + e^x), as PyTorch's softplus (beta 1, threshold 20: x itself above it), in
    numba code: float32 as max(x, 0) + log1p(e^-|x|) through a polynomial the loops
    vectorise (within 4e-7 relative, as exp; libm's log1p is a call per element, 24 ns), float64 as
    libm's log1p(e^x)."""
    raise NotImplementedError("softplus runs in numba code only")


def _softplus32(x):
    # log1p(t) for t = e^-|x| in (0, 1]: 2 atanh(s), s = t / (2 + t) <= 1/3, as
    # 2 s (1 + s^2/3 + s^4/5 + ... + s^12/13) (the rest below 2e-8 relative), good in
    # relative terms however small t is (below x = -87, where `exp` stops at e^-87, the
    # result stays 1.6e-38, as libm's log1p of that exp gave: torch gives 0 at -inf)
    if x > np.float32(20.0):
        return x
    t = exp(-abs(x))
    s = t / (np.float32(2.0) + t)
    q = s * s
    p = np.float32(1.0 / 13)
    p = p * q + np.float32(1.0 / 11)
    p = p * q + np.float32(1.0 / 9)
    p = p * q + np.float32(1.0 / 7)
    p = p * q + np.float32(1.0 / 5)
    p = p * q + np.float32(1.0 / 3)
    p = p * q + np.float32(1.0)
    return max(x, np.float32(0.0)) + np.float32(2.0) * s * p


def _softplus64(x):
    if x > 20:
        return x
    return math.log1p(math.exp(x))


overload(softplus, jit_options=_OVERLOAD)(_by_width(_softplus32, _softplus64))


@njit(inline="never", **JIT)
def vecmat(x, W, out):
    """out = x W: x [K], W [K, N], out [N] (not overlapping W)."""
    for j in range(out.shape[0]):
        out[j] = zero(out[j])
    vecmat_add(x, W, out)


@njit(inline="never", **JIT)
def vecmat_add(x, W, out):
    """out += x W: x [K], W [K, N], out [N] (not overlapping W). Eight rows of W per pass
    over out: one load and store of out per eight multiply-adds, not per one (at 129 x 512,
    3.1 us against 5.1 row by row)."""
    K, N = W.shape
    k = 0
    while k + 8 <= K:
        v0, v1, v2, v3 = x[k], x[k + 1], x[k + 2], x[k + 3]
        v4, v5, v6, v7 = x[k + 4], x[k + 5], x[k + 6], x[k + 7]
        w0, w1, w2, w3 = W[k], W[k + 1], W[k + 2], W[k + 3]
        w4, w5, w6, w7 = W[k + 4], W[k + 5], W[k + 6], W[k + 7]
        for j in range(N):
            out[j] += (v0 * w0[j] + v1 * w1[j] + v2 * w2[j] + v3 * w3[j]) + (
                v4 * w4[j] + v5 * w5[j] + v6 * w6[j] + v7 * w7[j]
            )
        k += 8
    while k < K:
        v = x[k]
        w = W[k]
        for j in range(N):
            out[j] += v * w[j]
        k += 1


@njit(inline="always", **JIT)
def norm(r):
    """|r| (r [K])."""
    s = r[0] * r[0]
    for i in range(1, r.shape[0]):
        s += r[i] * r[i]
    return math.sqrt(s)


@njit(**JIT)
def input_rows(x, WT, b, c, r):
    """The residual stream's first rows: r[i, :M] = x[i] WT + b, r[i, M] = c[0] (x [B, F],
    WT [F, M], b [M], r [B, M + 1]: the stream and its constant column)."""
    M = WT.shape[1]
    for i in range(x.shape[0]):
        ri = r[i]
        vecmat(x[i], WT, ri[:M])
        for j in range(M):
            ri[j] += b[j]
        ri[M] = c[0]


@njit(**JIT)
def linear_rows(x, W, b, out, lo, hi):
    """out[i] = W x[i] (+ b) for the rows lo..hi-1: x [B, K], W [N, K], b [N] or [0] (no
    bias), out [B, N]. A row's sums run in the same order whatever the batch (a BLAS
    product's do not): a row's logits do not depend on the rows beside it."""
    N, K = W.shape
    for i in range(lo, hi):
        xi, oi = x[i], out[i]
        for n in range(N):
            wn = W[n]
            s = zero(oi[0])
            for k in range(K):
                s += wn[k] * xi[k]
            oi[n] = s + b[n] if b.shape[0] else s


@njit(parallel=True, **JIT)
def linear_rows_parallel(x, W, b, out):
    """`linear_rows` with the rows on numba's threads."""
    for i in prange(x.shape[0]):
        linear_rows(x, W, b, out, i, i + 1)


@njit(**JIT)
def embed_rows(ids, E, c, r) -> bool:
    """The residual stream's first rows from token ids: r[i, :M] = E[ids[i]], r[i, M] = c[0]
    (ids [B] integers, E [V, M]); False, writing nothing, where an id lies outside [0, V)."""
    V, M = E.shape
    for i in range(ids.shape[0]):
        if ids[i] < 0 or ids[i] >= V:
            return False
    for i in range(ids.shape[0]):
        r[i, :M] = E[ids[i]]
        r[i, M] = c[0]
    return True


@njit(**JIT)
def norm_rows(r, w, c, out):
    """The final norm: out[i] = r[i, :M] / sqrt(mean(r[i, :M]^2) + c[1]) w (r [B, M + 1],
    w [M], out [B, M]; c[1] = eps and c[2] = 1 / M in the arrays' dtype)."""
    M = out.shape[1]
    for i in range(out.shape[0]):
        ri = r[i]
        s = ri[0] * ri[0]
        for j in range(1, M):
            s += ri[j] * ri[j]
        k = one(s) / math.sqrt(s * c[2] + c[1])
        oi = out[i]
        for j in range(M):
            oi[j] = ri[j] * k * w[j]


@njit(inline="never", **JIT)
def normed_projection(r, WT, bias, out):
    """A block's input projection on the normed residual stream, the norm folded into WT
    (the lean bodies' layout): out = (r WT) / |r| + bias, r [M + 1] with its constant
    column, WT [M + 1, W]."""
    vecmat(r, WT, out)
    s = one(r[0]) / norm(r)
    for j in range(out.shape[0]):
        out[j] = out[j] * s + bias[j]


@njit(inline="never", **JIT)
def conv_step(state, w, bias, x, out):
    """The causal depthwise conv's step and its SiLU: out = silu(bias + sum_k w[k] window[k])
    over window = [state; x] (state [K-1, C], w [K, C], x [C]); the state shifts by one,
    x its newest row."""
    K1, C = state.shape
    for c in range(C):
        out[c] = bias[c] + w[K1, c] * x[c]
    for k in range(K1):
        for c in range(C):
            out[c] += w[k, c] * state[k, c]
    for k in range(K1 - 1):
        for c in range(C):
            state[k, c] = state[k + 1, c]
    for c in range(C):
        state[K1 - 1, c] = x[c]
        out[c] = silu(out[c])
