"""The Mamba-3 SISO recurrence, one timestep at a time in float64: the oracle.

B batch, T time, H heads, P headdim (values per head), G groups of the
normalised B/C rows (head h reads group h // (H / G)), N = d_state, S rotary
angles (S <= N / 2). Per row, head h and time t, with q_t, k_t the head's
group's C and B rows:

    phi_t   = (phi_{t-1} + pi tanh(theta_t) delta_t) mod 2 pi      [S]
    k~_t    = rot(k_t + k_bias_h, phi_t)    q~_t = rot(q_t + q_bias_h, phi_t)    [N]
    lam_t   = sigmoid(trap_t)      alpha_t = exp(A_t delta_t)
    beta_t  = (1 - lam_t) delta_t alpha_t                gamma_t = lam_t delta_t
    S_t     = alpha_t S_{t-1} + beta_t x_{t-1} k~_{t-1}^T + gamma_t x_t k~_t^T    [P, N]
    y_t     = S_t q~_t + D_h x_t,  then  y_t * silu(z_t)

`rot` turns each pair (v_2i, v_2i+1), i < S, by phi_t[i]:
(v_2i cos - v_2i+1 sin, v_2i sin + v_2i+1 cos); dims 2S..N-1 stay. The state
carried from step to step is (phi, S, k~_{t-1}, x_{t-1}), the `Mamba3State`.

Where `seq_idx` changes between t-1 and t a document starts: phi_{t-1},
S_{t-1}, k~_{t-1} and x_{t-1} are all zero before step t (no angle, decay or
late beta term crosses it), and the initial state feeds only the row's first
document. No chunks, no unrolled weights, no custom backward (autograd
differentiates the loop): slow, and independent of the chunked reference
(reference.py) and of the kernels, which the tests check against it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ...state import Mamba3State


def mamba3_scan_naive(
    x: torch.Tensor,  # [B, T, H, P] values
    q: torch.Tensor,  # [B, T, G, N] normalised C rows (before the bias)
    k: torch.Tensor,  # [B, T, G, N] normalised B rows (before the bias)
    delta: torch.Tensor,  # [B, T, H] > 0 (after softplus)
    A: torch.Tensor,  # [B, T, H] < 0
    trap: torch.Tensor,  # [B, T, H] logits of lam
    theta: torch.Tensor,  # [B, T, S] rotation logits, shared by the heads
    q_bias: torch.Tensor,  # [H, N]
    k_bias: torch.Tensor,  # [H, N]
    D: torch.Tensor | None = None,  # [H]
    z: torch.Tensor | None = None,  # [B, T, H, P] gate
    initial_state: Mamba3State | None = None,
    seq_idx: torch.Tensor | None = None,  # [B, T] int32 document ids
) -> tuple[torch.Tensor, Mamba3State]:
    """(y [B, T, H, P], final state (phi_T, S_T, k~_T, x_T)), all float64."""
    f = torch.float64
    Bsz, T, H, P = x.shape
    G, N, S = q.shape[2], q.shape[3], theta.shape[-1]
    group = torch.arange(H, device=x.device) // (H // G)  # [H]: head h reads group[h]
    if initial_state is None:
        initial_state = Mamba3State.zeros(Bsz, H, P, N, S, x.device, f)
    phi, ssm, k_prev, x_prev = (t.to(f) for t in initial_state)
    ys = []
    for t in range(T):
        if seq_idx is not None and t > 0:  # a new document: nothing carries over
            same = (seq_idx[:, t] == seq_idx[:, t - 1]).to(f)  # [B]
            phi = phi * same[:, None, None]
            ssm = ssm * same[:, None, None, None]
            k_prev = k_prev * same[:, None, None]
            x_prev = x_prev * same[:, None, None]
        x_t = x[:, t].to(f)  # [B, H, P]
        dt = delta[:, t].to(f)  # [B, H]
        # the angles advance, then turn the biased key and query of every head
        phi = phi + math.pi * torch.tanh(theta[:, t].to(f))[:, None, :] * dt[:, :, None]
        phi = phi - 2 * math.pi * torch.floor(phi / (2 * math.pi))  # [B, H, S]
        k_t = k[:, t].to(f)[:, group] + k_bias.to(f)  # [B, H, N]
        q_t = q[:, t].to(f)[:, group] + q_bias.to(f)
        cos, sin = torch.cos(phi), torch.sin(phi)
        k_rot, q_rot = k_t.clone(), q_t.clone()
        for i in range(S):
            for v, out in ((k_t, k_rot), (q_t, q_rot)):
                a, b = v[..., 2 * i], v[..., 2 * i + 1]
                out[..., 2 * i] = a * cos[..., i] - b * sin[..., i]
                out[..., 2 * i + 1] = a * sin[..., i] + b * cos[..., i]
        # the exponential-trapezoidal update: decay, the previous token's late half, this token
        lam = torch.sigmoid(trap[:, t].to(f))
        alpha = torch.exp(A[:, t].to(f) * dt)
        beta = (1 - lam) * dt * alpha
        gamma = lam * dt
        ssm = (
            alpha[:, :, None, None] * ssm
            + beta[:, :, None, None] * x_prev[:, :, :, None] * k_prev[:, :, None, :]
            + gamma[:, :, None, None] * x_t[:, :, :, None] * k_rot[:, :, None, :]
        )  # [B, H, P, N]
        y = (ssm * q_rot[:, :, None, :]).sum(-1)  # S_t q~_t: [B, H, P]
        if D is not None:
            y = y + D.to(f)[:, None] * x_t
        if z is not None:
            y = y * F.silu(z[:, t].to(f))
        ys.append(y)
        k_prev, x_prev = k_rot, x_t
    return torch.stack(ys, 1), Mamba3State(phi, ssm, k_prev, x_prev)
