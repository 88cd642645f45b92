"""The Mamba-3 SISO scan, forward and backward, compiled: the CPU body of
`mamba3.reference.mamba3_scan_reference` where numba is (`ops.cpu_jit`) and there are no
documents (`seq_idx` None).

B batch, T time, H heads of P values, G groups of the normalised B, C rows (k, q [N]),
S rotary angles. Per row and head, step by step (reference.py gives the math):

    phi_t = (phi_{t-1} + pi tanh(theta_t) delta_t) mod 2 pi
    k~_t  = rot(k_t + k_bias, phi_t)     q~_t = rot(q_t + q_bias, phi_t)
    lam_t = sigmoid(trap_t)   alpha_t = exp(A_t delta_t)
    S_t   = alpha_t (S_{t-1} + (1 - lam_t) delta_t x_{t-1} k~_{t-1}^T) + lam_t delta_t x_t k~_t^T
    y_t   = (S_t q~_t + D x_t) silu(z_t)

The PyTorch body runs this as a few dozen whole-tensor ops per chunk of 64 steps, each a
trip through PyTorch's dispatch and memory; at the RL shapes (T = 32, a row or a few)
that overhead is the whole cost. Here each (row, head) walks time once with its state
[P, N] in cache, keeping every step's state for the backward (the caller bounds that
memory: `MAX_STATE_BYTES`), which walks time backwards:

    G_t  = dS_t (from y_t and from S_{t+1} through alpha_{t+1})
    dS_{t-1} = alpha_t G_t,  and the gradients of alpha, lam, delta, k~, x, q~ at t

The rows run on as many threads as torch uses; the heads of a row in order, so the sums
over heads (q, k, theta) and over rows (the biases, D: each row's share, then the rows in
order) are deterministic.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from numba import njit, prange

from .common import JIT, exp, sincos
from .scan import _threads

MAX_STATE_BYTES = 256 << 20  # every step's state kept for the backward, at most
TWO_PI = 2 * math.pi


def state_bytes(x: torch.Tensor, N: int) -> int:
    """The bytes of every step's state of a scan over x [B, T, H, P]."""
    return x.numel() * N * x.element_size()


def forward(x, q, k, delta, A, trap, rate, qb, kb, D, z, angle0, ssm0, k0, x0):
    """(y [B, T, H, P], final angle, ssm, k~, x, and what `backward` reads: every step's
    state [B, H, T, P, N] and turned rows k~, q~ [B, H, T, 2, N] with the angles' cos and
    sin [B, H, T, 2, S]) from contiguous tensors of one float dtype; rate = pi tanh(theta)
    [B, T, S]; D and z may be None."""
    Bsz, T, H, P = x.shape
    N, S = q.shape[-1], rate.shape[-1]
    y = torch.empty_like(x)
    states = x.new_empty(Bsz, H, T, P, N)
    turned, cs = x.new_empty(Bsz, H, T, 2, N), x.new_empty(Bsz, H, T, 2, S)
    angle, ssm = torch.empty_like(angle0), torch.empty_like(ssm0)
    kT, xT = torch.empty_like(k0), torch.empty_like(x0)
    ins = (x, q, k, delta, A, trap, rate, qb, kb, D, z, angle0, ssm0, k0, x0)
    with _threads():
        _forward(*_arrays(*ins), y.numpy(), states.numpy(), turned.numpy(), cs.numpy(),
                 angle.numpy(), ssm.numpy(), kT.numpy(), xT.numpy())  # fmt: skip
    return y, angle, ssm, kT, xT, (states, turned, cs)


def _arrays(x, q, k, delta, A, trap, rate, qb, kb, D, z, angle0, ssm0, k0, x0) -> tuple:
    """The kernels' leading arguments: the inputs as arrays, zeros for an absent D or z and
    whether z is there."""
    Dv = D if D is not None else x.new_zeros(x.shape[2])
    zv = z if z is not None else x.new_zeros(1, 1, 1, 1)
    head = (x, q, k, delta, A, trap, rate, qb, kb, Dv, zv)
    return (*(t.numpy() for t in head), z is not None,
            *(t.numpy() for t in (angle0, ssm0, k0, x0)))  # fmt: skip


def backward(saved, kept, gy, g_angle, g_ssm, g_k, g_x):
    """The gradients of `forward`'s inputs (x, q, k, delta, A, trap, rate, qb, kb, D, z,
    angle0, ssm0, k0, x0; None for an absent D or z) from the outputs' gradients (`kept`:
    what `forward` returned for this)."""
    g = backward_heads(saved, kept, gy, g_angle, g_ssm, g_k, g_x)
    g_q_heads, g_k_heads, g_rate_heads = g[1], g[2], g[6]
    Bsz, H, T, N = g_q_heads.shape
    G = saved[1].shape[2]
    # heads h of group h // (H / G): [B, H, T, N] -> [B, T, G, N]
    g_q = g_q_heads.view(Bsz, G, H // G, T, N).sum(2).transpose(1, 2).contiguous()
    g_k = g_k_heads.view(Bsz, G, H // G, T, N).sum(2).transpose(1, 2).contiguous()
    return (g[0], g_q, g_k, *g[3:6], g_rate_heads.sum(1), *g[7:])


def backward_heads(saved, kept, gy, g_angle, g_ssm, g_k, g_x):
    """As `backward`, but q's, k's and rate's gradients each head's share, [B, H, T, N] and
    [B, H, T, S] (what heads share is summed by the caller). The heads run in parallel;
    the rows' shares of the biases' and D's gradients are summed in row order."""
    x, q, k, delta, A, trap, rate, qb, kb, D, z, angle0, ssm0, k0, x0 = saved
    Bsz, T, H, P = x.shape
    N, S = q.shape[-1], rate.shape[-1]
    g_x_in = torch.empty_like(x)
    g_q_heads, g_k_heads = x.new_empty(Bsz, H, T, N), x.new_empty(Bsz, H, T, N)
    g_rate_heads = x.new_empty(Bsz, H, T, S)
    g_delta, g_A, g_trap = torch.empty_like(delta), torch.empty_like(A), torch.empty_like(trap)
    g_z = torch.empty_like(x) if z is not None else x.new_zeros(1, 1, 1, 1)
    g_qb_rows, g_kb_rows = x.new_zeros(Bsz, H, N), x.new_zeros(Bsz, H, N)
    g_D_rows = x.new_zeros(Bsz, H)
    g_angle0, g_ssm0 = torch.empty_like(angle0), torch.empty_like(ssm0)
    g_k0, g_x0 = torch.empty_like(k0), torch.empty_like(x0)
    with _threads():
        grads_in = (*kept, gy, g_angle, g_ssm, g_k, g_x)
        grads_out = (g_x_in, g_q_heads, g_k_heads, g_delta, g_A, g_trap, g_rate_heads,
                     g_qb_rows, g_kb_rows, g_D_rows, g_z, g_angle0, g_ssm0, g_k0, g_x0)  # fmt: skip
        _backward(*_arrays(*saved), *(t.numpy() for t in (*grads_in, *grads_out)))
    g_qb, g_kb, g_D = _row_sums(g_qb_rows), _row_sums(g_kb_rows), _row_sums(g_D_rows)
    return (g_x_in, g_q_heads, g_k_heads, g_delta, g_A, g_trap, g_rate_heads, g_qb, g_kb,
            g_D if D is not None else None, g_z if z is not None else None, g_angle0,
            g_ssm0, g_k0, g_x0)  # fmt: skip


def _row_sums(t: torch.Tensor) -> torch.Tensor:
    """The rows' shares summed in row order (deterministic)."""
    out = t[0].clone()
    for b in range(1, t.shape[0]):
        out += t[b]
    return out


@njit(parallel=True, **JIT)
def _forward(x, q, k, delta, A, trap, rate, qb, kb, Dv, z, has_z, angle0, ssm0, k0, x0, y,
             states, turned, cs, angle, ssm, kT, xT):  # fmt: skip
    Bsz, T, H, P = x.shape
    G, N, S = q.shape[2], q.shape[3], rate.shape[2]
    per = H // G
    # (no views in the loops: in numba each one costs reference counting)
    for bh in prange(Bsz * H):  # (row, head) pairs in parallel: nothing shared between them
        b, h = bh // H, bh % H
        g = h // per
        phi = angle0[b, h].copy()
        kp = k0[b, h].copy()
        xp = x0[b, h].copy()
        cur = ssm0[b, h].copy()  # the state [P, N], updated in place step by step
        Dh = Dv[h]
        for t in range(T):
            dl = delta[b, t, h]
            for i in range(S):
                v = phi[i] + rate[b, t, i] * dl
                phi[i] = v - TWO_PI * math.floor(v / TWO_PI)
                sn, c = sincos(phi[i])
                cs[b, h, t, 0, i] = c
                cs[b, h, t, 1, i] = sn
            for n in range(N):  # k~ = rot(k + kb, phi), q~ likewise: pairs (2i, 2i+1), i < S
                turned[b, h, t, 0, n] = k[b, t, g, n] + kb[h, n]
                turned[b, h, t, 1, n] = q[b, t, g, n] + qb[h, n]
            for j in range(2):
                for i in range(S):
                    c, sn = cs[b, h, t, 0, i], cs[b, h, t, 1, i]
                    a0, a1 = turned[b, h, t, j, 2 * i], turned[b, h, t, j, 2 * i + 1]
                    turned[b, h, t, j, 2 * i] = a0 * c - a1 * sn
                    turned[b, h, t, j, 2 * i + 1] = a0 * sn + a1 * c
            lam = 1 / (1 + exp(-trap[b, t, h]))
            alpha = exp(A[b, t, h] * dl)
            late = (1 - lam) * dl
            gamma = lam * dl
            for p in range(P):
                lx = late * xp[p]
                xv = x[b, t, h, p]
                gx = gamma * xv
                acc = alpha * 0
                for n in range(N):
                    v = alpha * (cur[p, n] + lx * kp[n]) + gx * turned[b, h, t, 0, n]
                    cur[p, n] = v
                    acc += v * turned[b, h, t, 1, n]
                acc += Dh * xv
                if has_z:
                    zz = z[b, t, h, p]
                    acc *= zz / (1 + exp(-zz))
                y[b, t, h, p] = acc
                xp[p] = xv
            for p in range(P):  # kept for the backward
                for n in range(N):
                    states[b, h, t, p, n] = cur[p, n]
            for n in range(N):
                kp[n] = turned[b, h, t, 0, n]
        for i in range(S):
            angle[b, h, i] = phi[i]
        for p in range(P):
            for n in range(N):
                ssm[b, h, p, n] = cur[p, n]
        for n in range(N):
            kT[b, h, n] = kp[n]
        for p in range(P):
            xT[b, h, p] = xp[p]


@njit(parallel=True, **JIT)
def _backward(x, q, k, delta, A, trap, rate, qb, kb, Dv, z, has_z, angle0, ssm0, k0, x0,
              states, turned, cs, gy, g_angle, g_ssm, g_k, g_x, dx, dq, dk, ddelta, dA,
              dtrap, drate, dqb, dkb, dD, dz, dangle0, dssm0, dk0, dx0):  # fmt: skip
    """dq, dk [B, H, T, N] and drate [B, H, T, S]: each head's share (written whole)."""
    Bsz, T, H, P = x.shape
    N, S = q.shape[3], rate.shape[2]
    for bh in prange(Bsz * H):  # (row, head) pairs in parallel, each writing its own shares
        b, h = bh // H, bh % H
        dkr = np.zeros((T, N), x.dtype)  # k~_t's gradient: from y's step t and from t + 1
        dxa = np.zeros((T, P), x.dtype)
        dyr = np.empty(P, x.dtype)
        dqr = np.empty(N, x.dtype)
        dkp = np.empty(N, x.dtype)
        kp = np.empty(N, x.dtype)
        xp = np.empty(P, x.dtype)
        for n in range(N):
            dkr[T - 1, n] = g_k[b, h, n]
        for p in range(P):
            dxa[T - 1, p] = g_x[b, h, p]
        Gs = g_ssm[b, h].copy()  # the state's gradient [P, N], carried back in time
        gphi = g_angle[b, h].copy()
        Dh = Dv[h]
        gD = Dh * 0
        for t in range(T - 1, -1, -1):
            dl = delta[b, t, h]
            lam = 1 / (1 + exp(-trap[b, t, h]))
            alpha = exp(A[b, t, h] * dl)
            late = (1 - lam) * dl
            gamma = lam * dl
            for n in range(N):  # the previous step's k~ and x (the start state's at t = 0)
                kp[n] = turned[b, h, t - 1, 0, n] if t > 0 else k0[b, h, n]
            for p in range(P):
                xp[p] = x[b, t - 1, h, p] if t > 0 else x0[b, h, p]
            # y_t: the gate, D, and S_t q~_t
            for p in range(P):
                gyp = gy[b, t, h, p]
                xv = x[b, t, h, p]
                if has_z:
                    zz = z[b, t, h, p]
                    sg = 1 / (1 + exp(-zz))
                    raw = Dh * xv
                    for n in range(N):
                        raw += states[b, h, t, p, n] * turned[b, h, t, 1, n]
                    dz[b, t, h, p] = gyp * raw * sg * (1 + zz * (1 - sg))
                    gyp = gyp * zz * sg
                dyr[p] = gyp
                gD += gyp * xv
                dxa[t, p] += Dh * gyp
            for n in range(N):
                dqr[n] = 0
            for p in range(P):
                gp = dyr[p]
                for n in range(N):
                    dqr[n] += states[b, h, t, p, n] * gp
                    Gs[p, n] += gp * turned[b, h, t, 1, n]
            # S_t = alpha (S_{t-1} + late xp kp^T) + gamma x_t k~_t^T
            dgamma = dl * 0
            dalpha = dl * 0
            dlate = dl * 0
            for n in range(N):
                dkp[n] = 0
            for p in range(P):
                xv = x[b, t, h, p]
                gx = dl * 0
                gxp = dl * 0
                for n in range(N):
                    gpn = Gs[p, n]
                    kr = turned[b, h, t, 0, n]
                    sp = states[b, h, t - 1, p, n] if t > 0 else ssm0[b, h, p, n]
                    dgamma += gpn * xv * kr
                    gx += gpn * kr
                    dkr[t, n] += gamma * gpn * xv
                    dalpha += gpn * (sp + late * xp[p] * kp[n])
                    gi = alpha * gpn  # the gradient carried to S_{t-1}
                    Gs[p, n] = gi
                    dlate += gi * xp[p] * kp[n]
                    gxp += gi * kp[n]
                    dkp[n] += late * gi * xp[p]
                dxa[t, p] += gamma * gx
                if t > 0:
                    dxa[t - 1, p] += late * gxp
                else:
                    dx0[b, h, p] = late * gxp
            for n in range(N):
                if t > 0:
                    dkr[t - 1, n] += dkp[n]
                else:
                    dk0[b, h, n] = dkp[n]
            # the step's scalars: alpha = exp(A delta), late, gamma, lam = sigmoid(trap)
            A_t = A[b, t, h]
            dA[b, t, h] = dalpha * alpha * dl
            ddl = dalpha * alpha * A_t + dlate * (1 - lam) + dgamma * lam
            dtrap[b, t, h] = (dgamma - dlate) * dl * lam * (1 - lam)
            # the turns: k~ = rot(k + kb, phi), q~ likewise
            for i in range(S):
                c, s = cs[b, h, t, 0, i], cs[b, h, t, 1, i]
                a0, a1 = dkr[t, 2 * i], dkr[t, 2 * i + 1]
                b0, b1 = dqr[2 * i], dqr[2 * i + 1]
                k0r, k1r = turned[b, h, t, 0, 2 * i], turned[b, h, t, 0, 2 * i + 1]
                q0r, q1r = turned[b, h, t, 1, 2 * i], turned[b, h, t, 1, 2 * i + 1]
                gphi[i] += -a0 * k1r + a1 * k0r - b0 * q1r + b1 * q0r
                dkr[t, 2 * i] = a0 * c + a1 * s
                dkr[t, 2 * i + 1] = -a0 * s + a1 * c
                dqr[2 * i] = b0 * c + b1 * s
                dqr[2 * i + 1] = -b0 * s + b1 * c
            for n in range(N):
                dk[b, h, t, n] = dkr[t, n]
                dkb[b, h, n] += dkr[t, n]
                dq[b, h, t, n] = dqr[n]
                dqb[b, h, n] += dqr[n]
            # phi_t = phi_{t-1} + rate_t delta_t (mod 2 pi: a shift)
            for i in range(S):
                drate[b, h, t, i] = gphi[i] * dl
                ddl += gphi[i] * rate[b, t, i]
            ddelta[b, t, h] = ddl
        dD[b, h] = gD
        for t in range(T):
            for p in range(P):
                dx[b, t, h, p] = dxa[t, p]
        for p in range(P):
            for n in range(N):
                dssm0[b, h, p, n] = Gs[p, n]
        for i in range(S):
            dangle0[b, h, i] = gphi[i]
