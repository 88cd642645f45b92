"""The selective scan's recurrence, forward and backward, compiled: the CPU body of
`selective_scan.reference._Scan` where numba is (`ops.cpu_jit`).

B batch, T time, D channels, N = d_state. With dt [B, T, D] (after softplus), x = dt u
[B, T, D], A [D, N], B and C rows [B, T, N], keep [B, T] (0 where a document starts):

    h_t = a_t h_{t-1} + x_t B_t,   a_t = exp(dt_t A) keep_t,   y_t = sum_n h_t C_t

The PyTorch body runs this as whole-tensor ops over chunks of time, each pass a trip
through memory; here each row keeps its state in cache as [N, D] and walks time once,
the arithmetic of a step in loops the compiler vectorises over the channels (over N, 16
long with a sum across it, they vectorised poorly: 2.5x the time), the rows on as many
threads as torch uses (numba's pool, one caller at a time). The backward walks time
backwards from the final state's gradient. Where every state of a layer takes at most
`KEEP_BYTES` (short windows: an RL policy's), the forward keeps them all
(`forward_states`) and the backward reads them; otherwise it recomputes them chunk by
chunk from states kept every `CHECKPOINT` steps (memory T / CHECKPOINT states, not T).
Both give the same bits:

    g_h_t  = C_t gy_t + a_{t+1} g_h_{t+1}
    g_C_t  = sum_d h_t gy_t     g_B_t = sum_d g_h_t x_t     g_x_t = sum_n g_h_t B_t
    dz_t   = g_h_t a_t h_{t-1}  g_A += dz_t dt_t            g_dt_t = sum_n dz_t A

Reductions run in one fixed order whatever the threads (g_A: each row's share, then the
rows in order; g_B, g_C: each row's own sum over the channels, in the compiled
loop's one order): deterministic.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit, prange

from .common import JIT, exp, one, threads, zero

CHECKPOINT = 64  # steps between the states the backward keeps
KEEP_BYTES = 32 << 20  # every state of a forward kept for its backward up to this size


def keeps(dt: torch.Tensor, A: torch.Tensor) -> bool:
    """Whether a forward on dt [B, T, D] and A [D, N] keeps every state (`KEEP_BYTES`)."""
    Bsz, T, D = dt.shape
    return Bsz * (T + 1) * D * A.shape[1] * dt.element_size() <= KEEP_BYTES


def forward(dt, x, A, Bm, C, keep, h0) -> tuple[torch.Tensor, torch.Tensor]:
    """(y [B, T, D], h_T [B, D, N]) from contiguous tensors of one float dtype (keep may be
    None)."""
    Bsz, T, D = dt.shape
    y = dt.new_empty(Bsz, T, D)
    hT = h0.new_empty(h0.shape)
    k = keep if keep is not None else dt.new_ones(1, 1)
    with threads():
        _forward(dt.numpy(), x.numpy(), _channels_last(A), Bm.numpy(), C.numpy(), k.numpy(),
                 keep is not None, h0.numpy(), y.numpy(), hT.numpy())  # fmt: skip
    return y, hT


def forward_states(dt, x, A, Bm, C, keep, h0) -> tuple[torch.Tensor, ...]:
    """`forward` keeping every state: (y, h_T, states [B, T + 1, N, D], h0 first; channels
    last, as the kernels walk them: only `backward` reads them)."""
    Bsz, T, D = dt.shape
    y = dt.new_empty(Bsz, T, D)
    states = h0.new_empty(Bsz, T + 1, A.shape[1], D)
    k = keep if keep is not None else dt.new_ones(1, 1)
    with threads():
        _forward_states(dt.numpy(), x.numpy(), _channels_last(A), Bm.numpy(), C.numpy(),
                        k.numpy(), keep is not None, h0.numpy(), y.numpy(),
                        states.numpy())  # fmt: skip
    return y, states[:, T].transpose(1, 2).contiguous(), states


def backward(dt, x, A, Bm, C, keep, h, gy, g_hT) -> tuple[torch.Tensor, ...]:
    """(g_dt, g_x, g_A, g_B, g_C, g_h0) of the forward's inputs from the outputs' gradients
    (contiguous tensors of its dtype). h: what the forward kept, h0 [B, D, N] (`forward`:
    the states are recomputed from checkpoints) or every state [B, T + 1, N, D]
    (`forward_states`)."""
    g_dt, g_x = torch.empty_like(dt), torch.empty_like(x)
    g_AT = A.new_zeros(A.shape[1], A.shape[0])  # [N, D], as the kernels walk it
    g_B, g_C = torch.empty_like(Bm), torch.empty_like(C)
    g_h0 = torch.empty_like(g_hT)
    k = keep if keep is not None else dt.new_ones(1, 1)
    arrs = (dt.numpy(), x.numpy(), _channels_last(A), Bm.numpy(), C.numpy(), k.numpy(),
            keep is not None, h.numpy(), gy.numpy(), g_hT.numpy())  # fmt: skip
    grads = (g_dt.numpy(), g_x.numpy(), g_AT.numpy(), g_B.numpy(), g_C.numpy(), g_h0.numpy())
    with threads():
        if h.dim() == 4:
            _backward_states(*arrs, *grads)
        else:
            _backward(*arrs, CHECKPOINT, *grads)
    return g_dt, g_x, g_AT.t().contiguous(), g_B, g_C, g_h0


def _channels_last(A: torch.Tensor) -> np.ndarray:
    """A [D, N] as the kernels read it: [N, D], channels innermost."""
    return A.t().contiguous().numpy()


@njit(inline="never", **JIT)
def _step(h, A, dtv, xv, Bv, Cv, kv, y):
    """One step of every channel of a row, channels innermost (the loop the compiler
    vectorises: no sum across it): h [N, D] in place, A [N, D], y [D] = sum_n h C."""
    N, D = h.shape
    for d in range(D):
        y[d] = zero(y[d])
    for n in range(N):
        hn = h[n]
        an = A[n]
        b = Bv[n]
        c = Cv[n]
        for d in range(D):
            v = exp(dtv[d] * an[d]) * kv * hn[d] + xv[d] * b
            hn[d] = v
            y[d] += v * c


@njit(parallel=True, **JIT)
def _forward(dt, x, A, Bm, C, keep, has_keep, h0, y, hT):
    Bsz, T, D = dt.shape
    for b in prange(Bsz):  # rows in parallel: nothing is shared between them
        h = np.ascontiguousarray(h0[b].T)  # [N, D], stepped in place, in cache
        for t in range(T):
            kv = keep[b, t] if has_keep else one(dt[b, t, 0])
            _step(h, A, dt[b, t], x[b, t], Bm[b, t], C[b, t], kv, y[b, t])
        hT[b] = h.T


@njit(parallel=True, **JIT)
def _forward_states(dt, x, A, Bm, C, keep, has_keep, h0, y, states):
    Bsz, T, D = dt.shape
    for b in prange(Bsz):  # rows in parallel: nothing is shared between them
        s = states[b]
        h = np.ascontiguousarray(h0[b].T)  # [N, D], stepped in place; each step's copy stored
        s[0] = h
        for t in range(T):
            kv = keep[b, t] if has_keep else one(dt[b, t, 0])
            _step(h, A, dt[b, t], x[b, t], Bm[b, t], C[b, t], kv, y[b, t])
            s[t + 1] = h


@njit(parallel=True, **JIT)
def _backward_states(dt, x, A, Bm, C, keep, has_keep, states, gy, g_hT, g_dt, g_x, g_A, g_B,
                     g_C, g_h0):  # fmt: skip
    Bsz, T, D = dt.shape
    N = A.shape[0]
    g_A_rows = np.zeros((Bsz, N, D), dt.dtype)  # each row's share of g_A, summed in order
    for b in prange(Bsz):  # rows in parallel, each writing its own gradients
        s = states[b]
        gh = np.ascontiguousarray(g_hT[b].T)  # dL/dh after the last step, [N, D]
        for t in range(T - 1, -1, -1):
            kv = keep[b, t] if has_keep else one(dt[b, t, 0])
            _step_back(gh, s[t], s[t + 1], A, dt[b, t], x[b, t], Bm[b, t], C[b, t], gy[b, t],
                       kv, g_dt[b, t], g_x[b, t], g_A_rows[b], g_B[b, t], g_C[b, t])  # fmt: skip
        g_h0[b] = gh.T
    for b in range(Bsz):  # one fixed order: deterministic whatever the threads
        g_A += g_A_rows[b]


@njit(parallel=True, **JIT)
def _backward(dt, x, A, Bm, C, keep, has_keep, h0, gy, g_hT, every, g_dt, g_x, g_A, g_B,
              g_C, g_h0):  # fmt: skip
    Bsz, T, D = dt.shape
    N = A.shape[0]
    chunks = (T + every - 1) // every
    g_A_rows = np.zeros((Bsz, N, D), dt.dtype)  # each row's share of g_A, summed in order
    for b in prange(Bsz):  # rows in parallel, each with buffers of its own
        kept = np.empty((chunks, N, D), dt.dtype)  # the state before each chunk
        states = np.empty((every + 1, N, D), dt.dtype)  # a chunk's states, recomputed
        scratch = np.empty(D, dt.dtype)
        h = np.ascontiguousarray(h0[b].T)
        last = (chunks - 1) * every  # the last chunk's own steps are recomputed below
        for t in range(last):
            if t % every == 0:
                kept[t // every] = h
            kv = keep[b, t] if has_keep else one(dt[b, t, 0])
            _step(h, A, dt[b, t], x[b, t], Bm[b, t], C[b, t], kv, scratch)
        if chunks:  # T = 0: nothing kept, nothing to walk back
            kept[chunks - 1] = h
        gh = np.ascontiguousarray(g_hT[b].T)  # dL/dh after the last step, [N, D]
        for c in range(chunks - 1, -1, -1):
            t0 = c * every
            t1 = min(T, t0 + every)
            states[0] = kept[c]
            for t in range(t0, t1):
                i = t - t0
                states[i + 1] = states[i]
                kv = keep[b, t] if has_keep else one(dt[b, t, 0])
                _step(states[i + 1], A, dt[b, t], x[b, t], Bm[b, t], C[b, t], kv, scratch)
            for t in range(t1 - 1, t0 - 1, -1):
                i = t - t0
                kv = keep[b, t] if has_keep else one(dt[b, t, 0])
                _step_back(gh, states[i], states[i + 1], A, dt[b, t], x[b, t], Bm[b, t],
                           C[b, t], gy[b, t], kv, g_dt[b, t], g_x[b, t], g_A_rows[b],
                           g_B[b, t], g_C[b, t])  # fmt: skip
        g_h0[b] = gh.T
    for b in range(Bsz):  # one fixed order: deterministic whatever the threads
        g_A += g_A_rows[b]


@njit(inline="never", **JIT)
def _step_back(gh, h_prev, h_now, A, dtv, xv, Bv, Cv, gyv, kv, g_dt, g_x, g_A, g_B, g_C):
    """One step backwards for a row, channels innermost as in `_step`: gh [N, D] (dL/dh_t
    from the steps after t) becomes dL/dh_{t-1}; the step's gradients are written (g_dt,
    g_x [D], g_B, g_C [N]) or added (g_A [N, D])."""
    N, D = gh.shape
    for d in range(D):
        g_x[d] = zero(g_x[d])
        g_dt[d] = zero(g_dt[d])
    for n in range(N):
        g = gh[n]
        hp = h_prev[n]
        hn = h_now[n]
        an = A[n]
        gA = g_A[n]
        b = Bv[n]
        c = Cv[n]
        sB = zero(b)
        sC = zero(c)
        for d in range(D):
            gyd = gyv[d]
            gt = g[d] + c * gyd  # dL/dh_t in all
            sC += hn[d] * gyd
            sB += gt * xv[d]
            g_x[d] += gt * b
            a = exp(dtv[d] * an[d]) * kv
            dz = gt * a * hp[d]
            gA[d] += dz * dtv[d]
            g_dt[d] += dz * an[d]
            g[d] = a * gt
        g_B[n] = sB
        g_C[n] = sC
