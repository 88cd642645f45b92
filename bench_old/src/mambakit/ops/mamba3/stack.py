"""The decode step of a stack of Mamba-3 blocks on the reference backend, in as few PyTorch
calls as it takes: the reference body of `ops.mamba3.mamba3_stack_step`.

B batch, M = d_model, E = d_inner, H heads of P values, G groups of the N-wide B/C rows
(head h reads group h // (H / G)), S rotary angles. Each block advances the residual
stream r one timestep and its state (angle, ssm, k, x) in place, the math of
`mamba3_step_reference` on the layer's inputs (`Mamba3._inputs`):

    zxbc  = rmsnorm(r) W_in^T               -> z, x, B, C, dd_dt, dd_A, trap, theta
    k, q  = rmsnorm_N(B) + B_bias, rmsnorm_N(C) + C_bias     per head, then turned by phi
    delta = softplus(dd_dt + dt_bias)       alpha = exp(-max(f(dd_A), A_floor) delta)
    phi   = (phi + pi tanh(theta) delta) mod 2 pi
    S     = alpha (S + (1 - lam) delta x_prev k_prev^T) + lam delta x k^T,  lam = sigmoid(trap)
    r'    = r + ((S q + D x) * silu(z)) W_out^T

At batch 1 on a CPU this step is bound by the cost of each PyTorch call, so it is
written for few calls, as `ops/mamba_step/stack.py` is (the constant column of r that
folds the norm's eps, contiguous transposed weights, inference mode), and:

- in_proj's rows are reordered once (`_derive`) so that one split and two views give
  every input in the shape its op reads: per group [B_g, c, 0, C_g, c, 0], then per head
  [z_h, x_h, dd_dt_h, 1 - dd_A_h, trap_h] (a [B, H, 2P + 3, 1] block: x and z as columns
  [B, H, P, 1], the per-head scalars as [B, H, 1, 1]), then theta. in_proj's bias row
  holds dt_bias, the 1 of 1 - dd_A and c = sqrt(eps N): with it, |[B_g, c]| is
  sqrt(N (mean(B_g^2) + eps)), so each B/C norm is one `vector_norm` and one `addcdiv`
  (whose addend, the per-head biases, makes the heads' rows at once).
- f(u) = 1 + u (u >= 0), 1 / (1 - u) (u < 0) is 1/g + g - a for a = 1 - u, g = max(a, 1).
- the pairs the angles turn are complex numbers: the turn is one `polar` and one in-place
  complex `mul_` on B and C together.
- the two outer products of the state update share alpha: (1 - lam) delta alpha x_prev
  k_prev^T is alpha ((1 - lam) delta x_prev k_prev^T).

With numba, up to `rows_max` rows of float32 or float64 (`cpu_jit.rows_max`), `cpu_jit.mamba3` runs
this math on the same weights as one compiled call for the whole stack
(`DecodeWeights.compiled`); this body runs the rest.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from ...state import Mamba3State
from ..cpu_jit import compile_stack
from ..mamba_step.stack import DecodeWeights

TWO_PI = 2 * math.pi


class BlockWeights(NamedTuple):
    """One block's tensors as `block_step` reads them."""

    in_wT: torch.Tensor  # [M + 1, W]: reordered rows of (W_in * norm weight * sqrt(M))^T
    in_b: torch.Tensor  # [W]: dt_bias, 1 (of 1 - dd_A), sqrt(eps N) where the layout has them
    kq_w: torch.Tensor  # [2, N/2, 2]: the B and C norms' weights * sqrt(N)
    kq_b: torch.Tensor  # [G, H/G, 2, N/2, 2]: B_bias and C_bias per head
    D: torch.Tensor  # [H, 1, 1]
    ones: torch.Tensor  # [S]: the modulus of the turns
    out_wT: torch.Tensor  # [E, M + 1]: W_out^T, a zero last column
    A_floor: float
    split: tuple[int, int, int]  # (2G (N + 2), H (2P + 3), S): zxbc's regions
    head_split: tuple[int, int, int, int, int]  # (P, P, 1, 1, 1): a head's region
    dims: tuple[int, int, int, int, int]  # (G, H, N, P, S)


def decode_layers(
    h: torch.Tensor,  # [B, M], the embedded input
    weights: DecodeWeights,
    states: list[Mamba3State],  # every block's, advanced in place
) -> torch.Tensor:
    """The residual stream [B, M] after every block (before the final norm), as an
    inference tensor: the caller's next op makes a normal one."""
    if weights.compiled is not None and h.shape[0] <= weights.compiled.rows_max:
        return weights.compiled(h, states)
    Bsz, M = h.shape
    with torch.inference_mode():
        r = F.pad(h, (0, 1), value=weights.pad)
        for w, state in zip(weights.blocks, states):
            block_step(r, w, state)
        return r.narrow(1, 0, M)


def block_step(
    r: torch.Tensor,  # [B, M + 1], the residual stream and the constant column, in place
    w: BlockWeights,
    state: Mamba3State,  # advanced in place
) -> None:
    """r += mixer(rmsnorm(r)) for one timestep; the state advances in place."""
    G, H, N, P, S = w.dims
    Bsz = r.shape[0]
    norm = torch.linalg.vector_norm(r, dim=-1, keepdim=True)  # [B, 1]
    zxbc = torch.addcdiv(w.in_b, torch.matmul(r, w.in_wT), norm)  # [B, W]
    kq, heads, theta = zxbc.split_with_sizes(w.split, 1)
    kq = kq.view(Bsz, G, 1, 2, N // 2 + 1, 2)  # the last pair: (c, 0)
    z, x, dt, a, trap = heads.view(Bsz, H, 2 * P + 3, 1).split_with_sizes(w.head_split, 2)
    # k and q: the B and C norms, their biases (one row per head), then the turn
    n = torch.linalg.vector_norm(kq, dim=(-2, -1), keepdim=True)  # [B, G, 1, 2, 1, 1]
    kq = torch.addcdiv(w.kq_b, kq.narrow(4, 0, N // 2).mul_(w.kq_w), n)  # [B, G, H/G, 2, N/2, 2]
    delta = F.softplus(dt)  # [B, H, 1, 1]
    angle = state.angle.unsqueeze(2)  # [B, H, 1, S]
    angle.addcmul_(torch.tanh(theta).view(Bsz, 1, 1, S), delta, value=math.pi)
    angle.remainder_(TWO_PI)
    turn = torch.polar(w.ones, angle).view(Bsz, G, H // G, 1, S)
    torch.view_as_complex(kq).narrow(4, 0, S).mul_(turn)
    k, q = kq.view(Bsz, H, 2, N).split(1, 2)  # [B, H, 1, N] each
    # the per-head scalars [B, H, 1, 1]
    gamma = torch.sigmoid(trap).mul_(delta)  # lam delta
    late = torch.sub(delta, gamma)  # (1 - lam) delta
    g = a.clamp(min=1)  # 1 - min(dd_A, 0)
    f = torch.sub(g, a)  # max(dd_A, 0)
    alpha = f.add_(g.reciprocal_()).clamp_(min=w.A_floor).mul_(delta).neg_().exp_()
    # the state: the previous token's late term, the decay, this token's term
    ssm, x_prev, k_prev = state.ssm, state.x.unsqueeze(-1), state.k.unsqueeze(-2)
    ssm.addcmul_(x_prev.mul_(late), k_prev).mul_(alpha)
    ssm.addcmul_(x * gamma, k)
    x_prev.copy_(x)
    k_prev.copy_(k)
    y = torch.matmul(ssm, q.mT).addcmul_(x, w.D).mul_(F.silu(z))  # [B, H, P, 1]
    r.addmm_(y.view(Bsz, H * P), w.out_wT)


def _derive(w) -> BlockWeights | None:
    """A block's `BlockWeights` from its `Mamba3StepWeights` (without autograd), or None
    where N is odd (the turned pairs are read as complex numbers)."""
    E, N, G, H, P, S = w.sizes
    if N % 2:
        return None
    M = w.in_w.shape[1]
    z, x, B, C, dd_dt, dd_A, trap, theta = torch.split(w.in_w, [E, E, G * N, G * N, H, H, H, S])
    new = w.in_w.new_zeros
    pair = new(G, 1, 2, M)  # the rows of (c, 0)
    kq_rows = torch.cat([B.view(G, 1, N, M), pair, C.view(G, 1, N, M), pair], 2)
    head_rows = torch.cat(
        [z.view(H, P, M), x.view(H, P, M), dd_dt.view(H, 1, M), -dd_A.view(H, 1, M),
         trap.view(H, 1, M)], 1,
    )  # fmt: skip
    rows = torch.cat([kq_rows.reshape(-1, M), head_rows.reshape(-1, M), theta])
    in_wT = new(M + 1, rows.shape[0])
    in_wT[:M] = (rows * (w.norm_w * math.sqrt(M))).t()
    kq_b = new(G, 2, N + 2)
    kq_b[..., N] = math.sqrt(w.qk_eps * N)
    head_b = new(H, 2 * P + 3)
    head_b[:, 2 * P] = w.dt_bias
    head_b[:, 2 * P + 1] = 1.0
    in_b = torch.cat([kq_b.flatten(), head_b.flatten(), new(S)])
    kq_w = torch.stack([w.k_norm_w, w.q_norm_w]) * math.sqrt(N)
    kq_bias = torch.stack([w.k_bias, w.q_bias], 1)  # [H, 2, N]
    return BlockWeights(
        in_wT=in_wT,
        in_b=in_b,
        kq_w=kq_w.view(2, N // 2, 2).contiguous(),
        kq_b=kq_bias.view(G, H // G, 2, N // 2, 2).contiguous(),
        D=w.D.view(H, 1, 1).clone(),
        ones=new(S).fill_(1.0),
        out_wT=torch.cat([w.out_w.t(), new(E, 1)], 1),
        A_floor=float(w.A_floor),
        split=(2 * G * (N + 2), H * (2 * P + 3), S),
        head_split=(P, P, 1, 1, 1),
        dims=(G, H, N, P, S),
    )


def stack_weights(layers: list) -> DecodeWeights | None:
    """Every block's `BlockWeights` from the blocks' `Mamba3StepWeights`, or None when the
    blocks' norms differ in eps (the constant column of r holds one) or a layout does not
    apply (odd d_state)."""
    eps = {w.eps for w in layers}
    if len(eps) != 1:
        return None
    with torch.no_grad():
        blocks = [_derive(w) for w in layers]
    if any(b is None for b in blocks):
        return None
    pad = math.sqrt(eps.pop() * layers[0].norm_w.shape[0])
    return DecodeWeights(blocks, pad, compile_stack("mamba3", blocks, pad))
