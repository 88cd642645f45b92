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

from .common import JIT, exp
from .scan import _threads

MAX_STATE_BYTES = 256 << 20  # every step's state kept for the backward, at most
TWO_PI = 2 * math.pi


def state_bytes(x: torch.Tensor, N: int) -> int:
    """The bytes of every step's state of a scan over x [B, T, H, P]."""
    return x.numel() * N * x.element_size()


def forward(x, q, k, delta, A, trap, rate, qb, kb, D, z, angle0, ssm0, k0, x0):
    """(y [B, T, H, P], final angle, ssm, k~, x, and the states kept for `backward`) from
    contiguous tensors of one float dtype; rate = pi tanh(theta) [B, T, S]; D and z may be
    None."""
    Bsz, T, H, P = x.shape
    N = q.shape[-1]
    y = torch.empty_like(x)
    states = x.new_empty(Bsz, H, T, P, N)
    angle, ssm = torch.empty_like(angle0), torch.empty_like(ssm0)
    kT, xT = torch.empty_like(k0), torch.empty_like(x0)
    ins = (x, q, k, delta, A, trap, rate, qb, kb, D, z, angle0, ssm0, k0, x0)
    with _threads():
        _forward(*_arrays(*ins), y.numpy(), states.numpy(), angle.numpy(), ssm.numpy(),
                 kT.numpy(), xT.numpy())  # fmt: skip
    return y, angle, ssm, kT, xT, states


def _arrays(x, q, k, delta, A, trap, rate, qb, kb, D, z, angle0, ssm0, k0, x0) -> tuple:
    """The kernels' leading arguments: the inputs as arrays, zeros for an absent D or z and
    whether z is there."""
    Dv = D if D is not None else x.new_zeros(x.shape[2])
    zv = z if z is not None else x.new_zeros(1, 1, 1, 1)
    head = (x, q, k, delta, A, trap, rate, qb, kb, Dv, zv)
    return (*(t.numpy() for t in head), z is not None,
            *(t.numpy() for t in (angle0, ssm0, k0, x0)))  # fmt: skip


def backward(saved, states, gy, g_angle, g_ssm, g_k, g_x):
    """The gradients of `forward`'s inputs (x, q, k, delta, A, trap, rate, qb, kb, D, z,
    angle0, ssm0, k0, x0; None for an absent D or z) from the outputs' gradients. The heads
    run in parallel, each with its own share of the gradients of what heads share (q, k
    per group, rate), summed over the heads after in one fixed order."""
    x, q, k, delta, A, trap, rate, qb, kb, D, z, angle0, ssm0, k0, x0 = saved
    Bsz, T, H, P = x.shape
    G, N, S = q.shape[2], q.shape[-1], rate.shape[-1]
    g = {"x": torch.empty_like(x)}
    g_q_heads, g_k_heads = x.new_empty(Bsz, H, T, N), x.new_empty(Bsz, H, T, N)
    g_rate_heads = x.new_empty(Bsz, H, T, S)
    g_delta, g_A, g_trap = torch.empty_like(delta), torch.empty_like(A), torch.empty_like(trap)
    g_z = torch.empty_like(x) if z is not None else x.new_zeros(1, 1, 1, 1)
    g_qb_rows, g_kb_rows = x.new_zeros(Bsz, H, N), x.new_zeros(Bsz, H, N)
    g_D_rows = x.new_zeros(Bsz, H)
    g_angle0, g_ssm0 = torch.empty_like(angle0), torch.empty_like(ssm0)
    g_k0, g_x0 = torch.empty_like(k0), torch.empty_like(x0)
    with _threads():
        grads_in = (states, gy, g_angle, g_ssm, g_k, g_x)
        grads_out = (g["x"], g_q_heads, g_k_heads, g_delta, g_A, g_trap, g_rate_heads,
                     g_qb_rows, g_kb_rows, g_D_rows, g_z, g_angle0, g_ssm0, g_k0, g_x0)  # fmt: skip
        _backward(*_arrays(*saved), *(t.numpy() for t in (*grads_in, *grads_out)))
    g_qb, g_kb, g_D = _row_sums(g_qb_rows), _row_sums(g_kb_rows), _row_sums(g_D_rows)
    # heads h of group h // (H // G): [B, H, T, N] -> [B, T, G, N]
    g["q"] = g_q_heads.view(Bsz, G, H // G, T, N).sum(2).transpose(1, 2).contiguous()
    g["k"] = g_k_heads.view(Bsz, G, H // G, T, N).sum(2).transpose(1, 2).contiguous()
    g["rate"] = g_rate_heads.sum(1)
    return (g["x"], g["q"], g["k"], g_delta, g_A, g_trap, g["rate"], g_qb, g_kb,
            g_D if D is not None else None, g_z if z is not None else None, g_angle0,
            g_ssm0, g_k0, g_x0)  # fmt: skip


def _row_sums(t: torch.Tensor) -> torch.Tensor:
    """The rows' shares summed in row order (deterministic)."""
    out = t[0].clone()
    for b in range(1, t.shape[0]):
        out += t[b]
    return out


@njit(inline="never", **JIT)
def _turned(v, bias, cos, sin, out):
    """out = rot(v + bias, phi) (cos, sin of phi [S]): the pairs (2i, 2i+1), i < S, turned."""
    N = v.shape[0]
    for n in range(N):
        out[n] = v[n] + bias[n]
    for i in range(cos.shape[0]):
        c, s = cos[i], sin[i]
        a, b = out[2 * i], out[2 * i + 1]
        out[2 * i] = a * c - b * s
        out[2 * i + 1] = a * s + b * c


@njit(inline="never", **JIT)
def _angles_step(phi, rate_t, dl, cos, sin):
    """phi += rate_t delta, mod 2 pi, in place; cos and sin of the new angles."""
    for i in range(phi.shape[0]):
        v = phi[i] + rate_t[i] * dl
        v = v - TWO_PI * math.floor(v / TWO_PI)
        phi[i] = v
        cos[i] = math.cos(v)
        sin[i] = math.sin(v)


@njit(parallel=True, **JIT)
def _forward(x, q, k, delta, A, trap, rate, qb, kb, Dv, z, has_z, angle0, ssm0, k0, x0, y,
             states, angle, ssm, kT, xT):  # fmt: skip
    Bsz, T, H, P = x.shape
    G, N = q.shape[2], q.shape[3]
    per = H // G
    for bh in prange(Bsz * H):  # (row, head) pairs in parallel: nothing shared between them
        b, h = bh // H, bh % H
        kr = np.empty(N, x.dtype)
        qr = np.empty(N, x.dtype)
        cos = np.empty(rate.shape[2], x.dtype)
        sin = np.empty(rate.shape[2], x.dtype)
        g = h // per
        phi = angle0[b, h].copy()
        kp = k0[b, h].copy()
        xp = x0[b, h].copy()
        for t in range(T):
            Sp = states[b, h, t - 1] if t > 0 else ssm0[b, h]
            S = states[b, h, t]  # written in place: the state kept for the backward
            dl = delta[b, t, h]
            _angles_step(phi, rate[b, t], dl, cos, sin)
            _turned(k[b, t, g], kb[h], cos, sin, kr)
            _turned(q[b, t, g], qb[h], cos, sin, qr)
            lam = 1 / (1 + exp(-trap[b, t, h]))
            alpha = exp(A[b, t, h] * dl)
            late = (1 - lam) * dl
            gamma = lam * dl
            xt = x[b, t, h]
            for p in range(P):
                lx = late * xp[p]
                gx = gamma * xt[p]
                acc = alpha * 0  # (S is not written yet: its old bytes may be NaN)
                for n in range(N):
                    v = alpha * (Sp[p, n] + lx * kp[n]) + gx * kr[n]
                    S[p, n] = v
                    acc += v * qr[n]
                acc += Dv[h] * xt[p]
                if has_z:
                    zz = z[b, t, h, p]
                    acc *= zz / (1 + exp(-zz))
                y[b, t, h, p] = acc
            for n in range(N):
                kp[n] = kr[n]
            for p in range(P):
                xp[p] = xt[p]
        angle[b, h] = phi
        ssm[b, h] = states[b, h, T - 1]
        kT[b, h] = kp
        xT[b, h] = xp


@njit(parallel=True, **JIT)
def _backward(x, q, k, delta, A, trap, rate, qb, kb, Dv, z, has_z, angle0, ssm0, k0, x0,
              states, gy, g_angle, g_ssm, g_k, g_x, dx, dq, dk, ddelta, dA, dtrap, drate,
              dqb, dkb, dD, dz, dangle0, dssm0, dk0, dx0):  # fmt: skip
    """dq, dk [B, H, T, N] and drate [B, H, T, S]: each head's share (written whole)."""
    Bsz, T, H, P = x.shape
    G, N = q.shape[2], q.shape[3]
    S_ = rate.shape[2]
    per = H // G
    for bh in prange(Bsz * H):  # (row, head) pairs in parallel, each writing its own shares
        b, h = bh // H, bh % H
        coss = np.empty((T, S_), x.dtype)
        sins = np.empty((T, S_), x.dtype)
        krs = np.empty((T, N), x.dtype)
        qrs = np.empty((T, N), x.dtype)
        dkr = np.empty((T, N), x.dtype)
        dxa = np.empty((T, P), x.dtype)
        dyr = np.empty(P, x.dtype)
        dqr = np.empty(N, x.dtype)
        dkp = np.empty(N, x.dtype)
        Gs = np.empty((P, N), x.dtype)
        g = h // per
        phi = angle0[b, h].copy()
        for t in range(T):  # the angles and turned rows again (cheap), for every step
            _angles_step(phi, rate[b, t], delta[b, t, h], coss[t], sins[t])
            _turned(k[b, t, g], kb[h], coss[t], sins[t], krs[t])
            _turned(q[b, t, g], qb[h], coss[t], sins[t], qrs[t])
        dkr[:] = 0
        dxa[:] = 0
        dkr[T - 1] += g_k[b, h]
        dxa[T - 1] += g_x[b, h]
        Gs[:] = g_ssm[b, h]
        gphi = g_angle[b, h].copy()
        for t in range(T - 1, -1, -1):
            dl = delta[b, t, h]
            lam = 1 / (1 + exp(-trap[b, t, h]))
            alpha = exp(A[b, t, h] * dl)
            late = (1 - lam) * dl
            gamma = lam * dl
            xt = x[b, t, h]
            St = states[b, h, t]
            Sp = states[b, h, t - 1] if t > 0 else ssm0[b, h]
            kp = krs[t - 1] if t > 0 else k0[b, h]
            xp = x[b, t - 1, h] if t > 0 else x0[b, h]
            kr, qr = krs[t], qrs[t]
            # y_t: the gate, D, and S_t q~_t
            for p in range(P):
                gyp = gy[b, t, h, p]
                if has_z:
                    zz = z[b, t, h, p]
                    sg = 1 / (1 + exp(-zz))
                    raw = Dv[h] * xt[p]
                    for n in range(N):
                        raw += St[p, n] * qr[n]
                    dz[b, t, h, p] = gyp * raw * sg * (1 + zz * (1 - sg))
                    gyp = gyp * zz * sg
                dyr[p] = gyp
                dD[b, h] += gyp * xt[p]
                dxa[t, p] += Dv[h] * gyp
            dqr[:] = 0
            dgamma = dl * 0
            dalpha = dl * 0
            for p in range(P):
                gp = dyr[p]
                for n in range(N):
                    dqr[n] += St[p, n] * gp
                    Gs[p, n] += gp * qr[n]
            # S_t = alpha (S_{t-1} + late xp kp^T) + gamma x_t k~_t^T
            for p in range(P):
                gx = dl * 0
                for n in range(N):
                    gpn = Gs[p, n]
                    dgamma += gpn * xt[p] * kr[n]
                    gx += gpn * kr[n]
                    dkr[t, n] += gamma * gpn * xt[p]
                    dalpha += gpn * (Sp[p, n] + late * xp[p] * kp[n])
                dxa[t, p] += gamma * gx
            dlate = dl * 0
            dkp[:] = 0
            for p in range(P):
                gx = dl * 0
                for n in range(N):
                    gi = alpha * Gs[p, n]
                    Gs[p, n] = gi
                    dlate += gi * xp[p] * kp[n]
                    gx += gi * kp[n]
                    dkp[n] += late * gi * xp[p]
                if t > 0:
                    dxa[t - 1, p] += late * gx
                else:
                    dx0[b, h, p] = late * gx
            if t > 0:
                for n in range(N):
                    dkr[t - 1, n] += dkp[n]
            else:
                for n in range(N):
                    dk0[b, h, n] = dkp[n]
            # the step's scalars: alpha = exp(A delta), late, gamma, lam = sigmoid(trap)
            A_t = A[b, t, h]
            dA[b, t, h] = dalpha * alpha * dl
            ddl = dalpha * alpha * A_t + dlate * (1 - lam) + dgamma * lam
            dtrap[b, t, h] = (dgamma - dlate) * dl * lam * (1 - lam)
            # the turns: k~ = rot(k + kb, phi), q~ likewise
            for i in range(S_):
                c, s = coss[t, i], sins[t, i]
                a0, a1 = dkr[t, 2 * i], dkr[t, 2 * i + 1]
                b0, b1 = dqr[2 * i], dqr[2 * i + 1]
                gphi[i] += -a0 * kr[2 * i + 1] + a1 * kr[2 * i]
                gphi[i] += -b0 * qr[2 * i + 1] + b1 * qr[2 * i]
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
            for i in range(S_):
                drate[b, h, t, i] = gphi[i] * dl
                ddl += gphi[i] * rate[b, t, i]
            ddelta[b, t, h] = ddl
        for t in range(T):
            for p in range(P):
                dx[b, t, h, p] = dxa[t, p]
        dssm0[b, h] = Gs
        dangle0[b, h] = gphi
