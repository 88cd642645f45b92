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
[P, N] in cache, keeping every step's state for the backward where one is to come (the
caller bounds that memory: `MAX_STATE_BYTES`; inference keeps none), which walks time
backwards:

    G_t  = dS_t (from y_t and from S_{t+1} through alpha_{t+1})
    dS_{t-1} = alpha_t G_t,  and the gradients of alpha, lam, delta, k~, x, q~ at t

The (row, head) pairs run on as many threads as torch uses, each writing its own shares
of what heads and rows share (q, k, theta; the biases, D), which are summed after in one
fixed order: the results are deterministic.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from numba import njit, prange

from . import param_array
from .common import JIT, exp, one, sigmoid, silu, sincos, threads, zero

MAX_STATE_BYTES = 256 << 20  # every step's state kept for the backward, at most
TWO_PI = 2 * math.pi
INV_TWO_PI = 1 / TWO_PI


def forward(x, q, k, delta, A, trap, rate, qb, kb, D, z, angle0, ssm0, k0, x0, keep=True):
    """(y [B, T, H, P], final angle, ssm, k~, x, and what `backward` reads, or None without
    `keep`) from contiguous tensors of one float dtype; rate = pi tanh(theta) [B, T, S]; D
    and z may be None."""
    ins = (x, q, k, delta, A, trap, rate, qb, kb, D, z, angle0, ssm0, k0, x0)
    y, angle, ssm, kT, xT, kept = forward_arrays(arrays(*ins), keep)
    return (*map(torch.from_numpy, (y, angle, ssm, kT, xT)), kept)


def forward_arrays(arrs: tuple, keep: bool = True) -> tuple:
    """`forward` on `arrays(...)`: (y, angle, ssm, k~, x, kept), kept = (the start state and
    every step's [B, H, T + 1, P, N], the turned rows k~, q~ [B, H, T, 2, N], the angles'
    cos and sin [B, H, T, 2, S], y before the gate [B, T, H, P] (where there is one));
    arrays all. Without `keep` (no backward to come: inference) kept is None, and the
    scan holds one state per (row, head), whatever T."""
    with threads():
        y, states, turned, cs, pre, angle, ssm, kT, xT = _forward(*arrs, keep)
    return y, angle, ssm, kT, xT, (states, turned, cs, pre) if keep else None


def arrays(x, q, k, delta, A, trap, rate, qb, kb, D, z, angle0, ssm0, k0, x0) -> tuple:
    """The kernels' leading arguments from tensors: the inputs as arrays, zeros for an
    absent D or z ([H] and [1, 1, 1, 1]) and whether z is there."""
    f = x.numpy().dtype
    Dv = param_array(D) if D is not None else np.zeros(x.shape[2], f)
    zv = z.numpy() if z is not None else np.zeros((1, 1, 1, 1), f)
    head = (x, q, k, delta, A, trap, rate)
    return (*(t.numpy() for t in head), param_array(qb), param_array(kb), Dv, zv,
            z is not None, *(t.numpy() for t in (angle0, ssm0, k0, x0)))  # fmt: skip


def backward(saved, kept, grads):
    """The gradients of `forward`'s inputs (x, q, k, delta, A, trap, rate, qb, kb, D, z,
    angle0, ssm0, k0, x0; None for an absent D or z) from the outputs' gradients (`grads`:
    y's, angle's, ssm's, k~'s and x's, contiguous arrays of the inputs' dtype; `kept`: what
    `forward` returned for this)."""
    g = [torch.from_numpy(a) for a in backward_arrays(arrays(*saved), kept, grads)]
    g_q_heads, g_k_heads, g_rate_heads = g[1], g[2], g[6]
    Bsz, H, T, N = g_q_heads.shape
    G = saved[1].shape[2]
    # heads h of group h // (H / G): [B, H, T, N] -> [B, T, G, N]
    g_q = g_q_heads.view(Bsz, G, H // G, T, N).sum(2).transpose(1, 2).contiguous()
    g_k = g_k_heads.view(Bsz, G, H // G, T, N).sum(2).transpose(1, 2).contiguous()
    g_D = g[9] if saved[9] is not None else None
    g_z = g[10] if saved[10] is not None else None
    return (g[0], g_q, g_k, *g[3:6], g_rate_heads.sum(1), g[7], g[8], g_D, g_z, *g[11:])


def backward_arrays(arrs: tuple, kept: tuple, grads: tuple) -> tuple:
    """The gradients of the inputs in `arrays`' order (D's and z's whether there or not;
    has_z left out), q's, k's and rate's each head's share, [B, H, T, N] and [B, H, T, S]
    (what heads share is summed by the caller), from those of the outputs (`grads`: y,
    angle, ssm, k~, x) and `kept`; arrays all. The heads run in parallel; the rows' shares
    of the biases' and D's gradients are summed in row order."""
    if kept is None:
        raise RuntimeError(
            "the compiled Mamba-3 scan kept nothing for a backward: its forward ran where no "
            "backward was expected (grad mode off, or no input requiring grad)"
        )
    with threads():
        return _backward(*arrs, *kept, *grads)


@njit(parallel=True, **JIT)
def _forward(x, q, k, delta, A, trap, rate, qb, kb, Dv, z, has_z, angle0, ssm0, k0, x0, keep):
    Bsz, T, H, P = x.shape
    G, N, S = q.shape[2], q.shape[3], rate.shape[2]
    per = H // G
    y = np.empty_like(x)
    # what the backward reads, kept only where there is one: the start state and every
    # step's, the turned rows, the angles' cos and sin, y before the gate
    Tk, Bk = (T, Bsz) if keep else (0, 0)
    pre = np.empty_like(x) if has_z and keep else np.empty((1, 1, 1, 1), x.dtype)
    states = np.empty((Bk, H, Tk + 1, P, N), x.dtype)
    turned, cs = np.empty((Bk, H, Tk, 2, N), x.dtype), np.empty((Bk, H, Tk, 2, S), x.dtype)
    angle, ssm = np.empty_like(angle0), np.empty_like(ssm0)
    kT, xT = np.empty_like(k0), np.empty_like(x0)
    # No array views in the loops (in numba each costs reference counting), and each inner
    # loop a plain sum or update over a row, which LLVM vectorises.
    for bh in prange(Bsz * H):  # (row, head) pairs in parallel: nothing shared between them
        b, h = bh // H, bh % H
        g = h // per
        phi = angle0[b, h].copy()
        kp = k0[b, h].copy()
        xp = x0[b, h].copy()
        # the state [P, N]: kept, every step's in `states`; else one, updated in place
        St = ssm0[b, h].copy()
        kr, qr = np.empty(N, x.dtype), np.empty(N, x.dtype)
        cst, yt = np.empty((2, S), x.dtype), np.empty(P, x.dtype)
        if keep:
            for p in range(P):
                for n in range(N):
                    states[b, h, 0, p, n] = St[p, n]
        Dh = Dv[h]
        for t in range(T):
            dl = delta[b, t, h]
            for i in range(S):
                v = phi[i] + rate[b, t, i] * dl
                phi[i] = v - TWO_PI * math.floor(v * INV_TWO_PI)
                sn, c = sincos(phi[i])
                cst[0, i] = c
                cst[1, i] = sn
            for n in range(N):  # k~ = rot(k + kb, phi), q~ likewise: pairs (2i, 2i+1), i < S
                kr[n] = k[b, t, g, n] + kb[h, n]
                qr[n] = q[b, t, g, n] + qb[h, n]
            for i in range(S):
                c, sn = cst[0, i], cst[1, i]
                a0, a1 = kr[2 * i], kr[2 * i + 1]
                kr[2 * i], kr[2 * i + 1] = a0 * c - a1 * sn, a0 * sn + a1 * c
                a0, a1 = qr[2 * i], qr[2 * i + 1]
                qr[2 * i], qr[2 * i + 1] = a0 * c - a1 * sn, a0 * sn + a1 * c
            lam = sigmoid(trap[b, t, h])
            alpha = exp(A[b, t, h] * dl)
            late = (one(lam) - lam) * dl
            gamma = lam * dl
            for p in range(P):  # S_t from S_{t-1}: into `states` (kept) or in place
                xv = x[b, t, h, p]
                lx = alpha * late * xp[p]
                gx = gamma * xv
                acc = Dh * xv
                # (the update and y's sum fused in one loop run 7-14% faster, but the two
                # ways then sum y in orders of their own: a forward under no_grad must give
                # the training forward's values bit for bit)
                if keep:
                    for n in range(N):
                        states[b, h, t + 1, p, n] = (
                            alpha * states[b, h, t, p, n] + lx * kp[n] + gx * kr[n]
                        )
                    for n in range(N):
                        acc += states[b, h, t + 1, p, n] * qr[n]
                else:
                    for n in range(N):
                        St[p, n] = alpha * St[p, n] + lx * kp[n] + gx * kr[n]
                    for n in range(N):
                        acc += St[p, n] * qr[n]
                yt[p] = acc
                xp[p] = xv
            if keep:
                for i in range(S):
                    cs[b, h, t, 0, i] = cst[0, i]
                    cs[b, h, t, 1, i] = cst[1, i]
                for n in range(N):
                    turned[b, h, t, 0, n] = kr[n]
                    turned[b, h, t, 1, n] = qr[n]
                if has_z:
                    for p in range(P):
                        pre[b, t, h, p] = yt[p]
            if has_z:  # the gate, in a loop of its own (it vectorises there)
                for p in range(P):
                    y[b, t, h, p] = yt[p] * silu(z[b, t, h, p])
            else:
                for p in range(P):
                    y[b, t, h, p] = yt[p]
            for n in range(N):
                kp[n] = kr[n]
        for i in range(S):
            angle[b, h, i] = phi[i]
        for p in range(P):
            for n in range(N):
                ssm[b, h, p, n] = states[b, h, T, p, n] if keep else St[p, n]
        for n in range(N):
            kT[b, h, n] = kp[n]
        for p in range(P):
            xT[b, h, p] = xp[p]
    return y, states, turned, cs, pre, angle, ssm, kT, xT


@njit(parallel=True, **JIT)
def _backward(x, q, k, delta, A, trap, rate, qb, kb, Dv, z, has_z, angle0, ssm0, k0, x0,
              states, turned, cs, pre, gy, g_angle, g_ssm, g_k, g_x):  # fmt: skip
    """dq, dk [B, H, T, N] and drate [B, H, T, S]: each head's share (written whole)."""
    Bsz, T, H, P = x.shape
    N, S = q.shape[3], rate.shape[2]
    dx, dz = np.empty_like(x), np.empty_like(z)  # (dz: z's shape, [1, 1, 1, 1] without z)
    dq, dk = np.empty((Bsz, H, T, N), x.dtype), np.empty((Bsz, H, T, N), x.dtype)
    # each head's d delta, dA and d trap in rows of its own, [B, H, 3, T], laid out as
    # [B, T, H] after the heads' loop: written there at every step, the heads of a step
    # share a cache line that the threads take from each other (at 1 x 32 x 16 heads on 2
    # threads, the backward's median 210 us against 185 this way)
    per_head = np.empty((Bsz, H, 3, T), x.dtype)
    drate = np.empty((Bsz, H, T, S), x.dtype)
    dqb, dkb = np.zeros((Bsz, H, N), x.dtype), np.zeros((Bsz, H, N), x.dtype)
    dD = np.empty((Bsz, H), x.dtype)
    dangle0, dssm0 = np.empty_like(angle0), np.empty_like(ssm0)
    dk0, dx0 = np.empty_like(k0), np.empty_like(x0)
    for bh in prange(Bsz * H):  # (row, head) pairs in parallel, each writing its own shares
        b, h = bh // H, bh % H
        dkr = np.zeros((T, N), x.dtype)  # k~_t's gradient: from y's step t and from t + 1
        dxa = np.zeros((T, P), x.dtype)
        dyr = np.empty(P, x.dtype)
        dqr, dkp = np.empty(N, x.dtype), np.empty(N, x.dtype)
        kr, qr, kp = np.empty(N, x.dtype), np.empty(N, x.dtype), np.empty(N, x.dtype)
        xp = np.empty(P, x.dtype)
        for n in range(N):
            dkr[T - 1, n] = g_k[b, h, n]
        for p in range(P):
            dxa[T - 1, p] = g_x[b, h, p]
        Gs = g_ssm[b, h].copy()  # the state's gradient [P, N], carried back in time
        gphi = g_angle[b, h].copy()
        Dh = Dv[h]
        gD = zero(Dh)
        for t in range(T - 1, -1, -1):
            dl = delta[b, t, h]
            lam = sigmoid(trap[b, t, h])
            alpha = exp(A[b, t, h] * dl)
            late = (one(lam) - lam) * dl
            gamma = lam * dl
            for n in range(N):  # this step's k~, q~; the previous one's k~ and x (t = 0: k0, x0)
                kr[n] = turned[b, h, t, 0, n]
                qr[n] = turned[b, h, t, 1, n]
            if t > 0:
                for n in range(N):
                    kp[n] = turned[b, h, t - 1, 0, n]
                for p in range(P):
                    xp[p] = x[b, t - 1, h, p]
            else:
                for n in range(N):
                    kp[n] = k0[b, h, n]
                for p in range(P):
                    xp[p] = x0[b, h, p]
            # y_t = (S_t q~_t + D x_t) silu(z_t)
            if has_z:  # through the gate, in a loop of its own (it vectorises there)
                for p in range(P):
                    zz = z[b, t, h, p]
                    sg = sigmoid(zz)
                    gyp = gy[b, t, h, p]
                    dz[b, t, h, p] = gyp * pre[b, t, h, p] * sg * (one(zz) + zz * (one(sg) - sg))
                    dyr[p] = gyp * zz * sg
            else:
                for p in range(P):
                    dyr[p] = gy[b, t, h, p]
            for p in range(P):
                gD += dyr[p] * x[b, t, h, p]
                dxa[t, p] += Dh * dyr[p]
            # S_t = alpha S_{t-1} + alpha late x_{t-1} k~_{t-1}^T + gamma x_t k~_t^T, by rows p:
            # G_p = (the carried gradient + y_t's, dy_p q~_t), three sums of it against k~_t,
            # k~_{t-1} and S_{t-1} (with q~'s gradient, S_t's rows times dy_p), then updates
            dgamma = zero(dl)
            dalpha = zero(dl)
            dlate = zero(dl)
            for n in range(N):
                dkp[n] = 0
                dqr[n] = 0
            for p in range(P):
                xv = x[b, t, h, p]
                gp = dyr[p]
                s_kr = zero(dl)
                s_kp = zero(dl)
                s_sp = zero(dl)
                for n in range(N):
                    gpn = Gs[p, n] + gp * qr[n]
                    s_kr += gpn * kr[n]
                    s_kp += gpn * kp[n]
                    s_sp += gpn * states[b, h, t, p, n]
                    dqr[n] += states[b, h, t + 1, p, n] * gp
                dgamma += xv * s_kr
                dxa[t, p] += gamma * s_kr
                dalpha += s_sp + late * xp[p] * s_kp
                dlate += alpha * xp[p] * s_kp
                if t > 0:
                    dxa[t - 1, p] += late * alpha * s_kp
                else:
                    dx0[b, h, p] = late * alpha * s_kp
                c1 = gamma * xv
                c2 = late * alpha * xp[p]
                for n in range(N):
                    gpn = Gs[p, n] + gp * qr[n]
                    dkr[t, n] += c1 * gpn
                    dkp[n] += c2 * gpn
                    Gs[p, n] = alpha * gpn  # the gradient carried to S_{t-1}
            for n in range(N):
                if t > 0:
                    dkr[t - 1, n] += dkp[n]
                else:
                    dk0[b, h, n] = dkp[n]
            # the step's scalars: alpha = exp(A delta), late, gamma, lam = sigmoid(trap)
            per_head[b, h, 1, t] = dalpha * alpha * dl
            ddl = dalpha * alpha * A[b, t, h] + dlate * (one(lam) - lam) + dgamma * lam
            per_head[b, h, 2, t] = (dgamma - dlate) * dl * lam * (one(lam) - lam)
            # the turns: k~ = rot(k + kb, phi), q~ likewise
            for i in range(S):
                c, s = cs[b, h, t, 0, i], cs[b, h, t, 1, i]
                a0, a1 = dkr[t, 2 * i], dkr[t, 2 * i + 1]
                b0, b1 = dqr[2 * i], dqr[2 * i + 1]
                gphi[i] += a1 * kr[2 * i] - a0 * kr[2 * i + 1]
                gphi[i] += b1 * qr[2 * i] - b0 * qr[2 * i + 1]
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
            per_head[b, h, 0, t] = ddl
        dD[b, h] = gD
        for t in range(T):
            for p in range(P):
                dx[b, t, h, p] = dxa[t, p]
        for p in range(P):
            for n in range(N):
                dssm0[b, h, p, n] = Gs[p, n]
        for i in range(S):
            dangle0[b, h, i] = gphi[i]
    ddelta, dA, dtrap = np.empty_like(delta), np.empty_like(A), np.empty_like(trap)
    for b in range(Bsz):
        for t in range(T):
            for h in range(H):
                ddelta[b, t, h] = per_head[b, h, 0, t]
                dA[b, t, h] = per_head[b, h, 1, t]
                dtrap[b, t, h] = per_head[b, h, 2, t]
    for b in range(1, Bsz):  # the rows' shares, summed in row order (deterministic)
        for h in range(H):
            dD[0, h] += dD[b, h]
            for n in range(N):
                dqb[0, h, n] += dqb[b, h, n]
                dkb[0, h, n] += dkb[b, h, n]
    return (dx, dq, dk, ddelta, dA, dtrap, drate, dqb[0], dkb[0], dD[0], dz, dangle0, dssm0,
            dk0, dx0)  # fmt: skip
