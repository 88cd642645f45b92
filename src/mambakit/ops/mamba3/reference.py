"""Mamba-3 SISO scan in plain PyTorch: the CPU path and the oracle (Lahoti et al. 2026).

Glossary: B batch, T time, H heads, P headdim (values per head), G groups of
B/C (heads share the group h // (H // G)), N = d_state, S rotary angles
(S <= N / 2). Per row, head h and time t, with q_t, k_t the head's group's
normalised C and B rows:

    phi_t   = (phi_{t-1} + pi tanh(theta_t) delta_t) mod 2 pi      [S], per head
    k~_t    = rot(k_t + k_bias_h, phi_t)    q~_t = rot(q_t + q_bias_h, phi_t)
    lam_t   = sigmoid(trap_t)      alpha_t = exp(A_t delta_t)
    beta_t  = (1 - lam_t) delta_t alpha_t                gamma_t = lam_t delta_t
    S_t     = alpha_t S_{t-1} + beta_t x_{t-1} k~_{t-1}^T + gamma_t x_t k~_t^T    [P, N]
    y_t     = S_t q~_t + D_h x_t,  then  y_t * silu(z_t)

`rot` turns the adjacent pairs (2i, 2i+1), i < S, by phi_t[i]; state dims
2S..N-1 are not turned. The exponential-trapezoidal rule puts each token's
outer product x_s k~_s^T in the state twice: gamma_s at step s and, through
beta_{s+1}, at step s+1. The recurrent state is (angle phi [S], S [P, N],
k~ [N], x [P]) per head: the last token's turned key and value wait for their
beta term.

Unrolled, with cs_t = sum_{r<=t} A_r delta_r and
w_s = gamma_s + (1 - lam_{s+1}) delta_{s+1} (the second term 0 for the last
token of a chunk, whose beta term belongs to the next one):

    S_t = exp(cs_t) S'_start + sum_{s<=t} exp(cs_t - cs_s) w'_{t,s} x_s k~_s^T
    w'_{t,s} = w_s (s < t),  gamma_t (s = t)
    S'_start = S_{-1} + (1 - lam_0) delta_0 x_{-1} k~_{-1}^T

so a chunk of C steps is one [C, C] matrix per head (the SSD form of Mamba-2),
and a short loop over chunks carries (S, k~, x). The angles are one cumsum
over the whole sequence. Decays are exp of non-positive sums only.

With `seq_idx` [B, T] (non-decreasing document ids), a document starts from a
zero state: no decay, late term or angle crosses its start, and the initial
state feeds only the row's first document (times before 0 belong to it).
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from ...state import Mamba3State
from .._checks import state_dtype

CHUNK = 64  # timesteps per quadratic block; the carry loop runs T / CHUNK times
TWO_PI = 2 * math.pi


def rotate_pairs(v: torch.Tensor, phi: torch.Tensor) -> torch.Tensor:
    """Turn the adjacent pairs (2i, 2i+1) of v [..., N] by phi [..., S], i < S."""
    S = phi.shape[-1]
    pairs = v[..., : 2 * S].unflatten(-1, (S, 2))
    v0, v1 = pairs[..., 0], pairs[..., 1]
    cos, sin = torch.cos(phi), torch.sin(phi)
    turned = torch.stack([v0 * cos - v1 * sin, v0 * sin + v1 * cos], dim=-1).flatten(-2)
    return torch.cat([turned, v[..., 2 * S :]], dim=-1)


def _heads(t: torch.Tensor, H: int) -> torch.Tensor:
    """[B, T, G, N] group rows -> [B, T, H, N]: head h reads group h // (H // G)."""
    G = t.shape[2]
    return t if G == H else t.repeat_interleave(H // G, dim=2)


def _angles(theta, delta, angle0, same) -> torch.Tensor:
    """phi [B, T, H, S]: the inclusive cumsum of pi tanh(theta) delta from angle0, mod 2 pi;
    restarted from 0 at every document start (same [B, T] bool: t continues t - 1)."""
    inc = (math.pi * torch.tanh(theta)).unsqueeze(2) * delta.unsqueeze(-1)  # [B, T, H, S]
    total = torch.cumsum(inc, dim=1)
    if same is None:
        phi = total + angle0.unsqueeze(1)
    else:
        T = inc.shape[1]
        t = torch.arange(T, device=inc.device).expand_as(same)
        start = torch.cummax(torch.where(same, 0, t), dim=1).values  # [B, T] its document's start
        before = torch.cat([torch.zeros_like(total[:, :1]), total[:, :-1]], dim=1)
        idx = start[:, :, None, None].expand_as(total)
        first = (start == 0)[:, :, None, None]  # the row's first document: from angle0
        phi = total - before.gather(1, idx) + first * angle0.unsqueeze(1)
    return phi - TWO_PI * torch.floor(phi / TWO_PI)


def token_terms(q, k, delta, A, trap, theta, q_bias, k_bias, angle0, seq_idx, f):
    """The per-token terms of the scan, in dtype f: (phi [B, T, H, S], q~, k~ [B, T, H, N],
    A delta, gamma, late [B, T, H]); late is token s's beta term without alpha, paid at
    step s + 1, and 0 on a document's first token (nothing is paid for its predecessor)."""
    H = delta.shape[-1]
    deltaf = delta.to(f)
    same = None  # [B, T]: token t continues the document of t - 1 (t = 0: the initial state's)
    if seq_idx is not None:
        same = torch.ones_like(seq_idx, dtype=torch.bool)
        same[:, 1:] = seq_idx[:, 1:] == seq_idx[:, :-1]
    phi = _angles(theta.to(f), deltaf, angle0.to(f), same)
    kr = rotate_pairs(_heads(k.to(f), H) + k_bias.to(f), phi)
    qr = rotate_pairs(_heads(q.to(f), H) + q_bias.to(f), phi)
    lam = torch.sigmoid(trap.to(f))
    late = (1 - lam) * deltaf
    if same is not None:
        late = late * same.unsqueeze(-1)
    return phi, qr, kr, A.to(f) * deltaf, lam * deltaf, late


def heavy_tail(u: torch.Tensor) -> torch.Tensor:
    """f(u) = 1 + u for u >= 0, 1 / (1 - u) for u < 0: positive, smooth at 0, f(u) ~ |u|^-1 as
    u -> -inf (a slower approach to 0 than softplus's exp(u)). A = -max(f(dd_A), A_floor)."""
    return u.clamp(min=0) + torch.reciprocal(1 - u.clamp(max=0))


def mamba3_scan_reference(
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
    chunk: int = CHUNK,
) -> tuple[torch.Tensor, Mamba3State]:
    """(y [B, T, H, P] in x.dtype, final state), differentiable in every input."""
    Bsz, T, H, P = x.shape
    N, S = q.shape[-1], theta.shape[-1]
    f = state_dtype(x)
    if initial_state is None:
        initial_state = Mamba3State.zeros(Bsz, H, P, N, S, x.device, f)
    ins = (x, q, k, delta, A, trap, theta, q_bias, k_bias, D, z, *initial_state)
    grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in ins)
    if seq_idx is None and scan_compiles(x, f, N, None, grad):  # compiled: `cpu_jit.scan3`
        rate = math.pi * torch.tanh(theta.to(f))  # the angles' rate, shared by the heads
        ins = (*ins[:6], rate, *ins[7:])
        ins = tuple(None if t is None else t.to(f).contiguous() for t in ins)
        y, *final = _Scan3.apply(grad, *ins)
        return y.to(x.dtype), Mamba3State(*final)
    xf = x.to(f)
    phi, qr, kr, adt, gamma, late = token_terms(
        q, k, delta, A, trap, theta, q_bias, k_bias, initial_state.angle, seq_idx, f
    )

    ssm, k_prev, x_prev = (t.to(f) for t in initial_state[1:])
    ys = []
    for c0 in range(0, T, chunk):
        c1 = min(T, c0 + chunk)
        L = c1 - c0
        # the previous token's outer product, with its beta weight, joins the start state
        start = ssm + (late[:, c0, :, None, None] * x_prev.unsqueeze(-1)) * k_prev.unsqueeze(-2)
        cs = torch.cumsum(adt[:, c0:c1], dim=1)  # [B, L, H]
        w = gamma[:, c0:c1].clone()
        if L > 1:
            w[:, :-1] = w[:, :-1] + late[:, c0 + 1 : c1]
        # decay[t, s] = exp(cs_t - cs_s) for s <= t, weights w_s (s < t), gamma_t (s = t)
        diff = cs.unsqueeze(2) - cs.unsqueeze(1)  # [B, L(t), L(s), H]
        causal = torch.ones(L, L, dtype=torch.bool, device=x.device).tril()[None]
        carry = torch.ones(Bsz, L, 1, dtype=f, device=x.device)  # t still sees the start state
        if seq_idx is not None:
            doc = seq_idx[:, c0:c1]
            causal = causal & (doc.unsqueeze(2) == doc.unsqueeze(1))
            prev = seq_idx[:, c0 - 1 : c0] if c0 > 0 else seq_idx[:, :1]
            carry = (doc == prev).to(f).unsqueeze(-1)
        decay = torch.exp(diff.masked_fill(~causal[..., None], float("-inf")))
        weight = decay * w.unsqueeze(1)
        eye = torch.eye(L, dtype=torch.bool, device=x.device)[None, :, :, None]
        weight = torch.where(eye, gamma[:, c0:c1].unsqueeze(1), weight)
        qc, kc, xc = qr[:, c0:c1], kr[:, c0:c1], xf[:, c0:c1]
        scores = torch.einsum("bthn,bshn->btsh", qc, kc) * weight
        y = torch.einsum("btsh,bshp->bthp", scores, xc)
        y = y + (torch.exp(cs) * carry).unsqueeze(-1) * torch.einsum("bhpn,bthn->bthp", start, qc)
        ys.append(y)
        # the state after the chunk: its last token's late term is left for the next chunk
        tail = torch.exp(cs[:, -1:] - cs) * w  # [B, L, H]
        tail[:, -1] = gamma[:, c1 - 1]
        keep = torch.exp(cs[:, -1]) * carry[:, -1]  # [B, H]
        if seq_idx is not None:  # only the last document's tokens stay in the state
            tail = tail * (doc == doc[:, -1:]).unsqueeze(-1)
        ssm = keep[..., None, None] * start + torch.einsum("bsh,bshp,bshn->bhpn", tail, xc, kc)
        k_prev, x_prev = kc[:, -1], xc[:, -1]
    y = torch.cat(ys, dim=1)
    if D is not None:
        y = y + D.to(f)[:, None] * xf
    if z is not None:
        y = y * F.silu(z.to(f))
    final = Mamba3State(phi[:, -1], ssm, k_prev, x_prev)
    return y.to(x.dtype), final


def scan_compiles(
    x: torch.Tensor, f: torch.dtype, N: int, values: int | None = None, grad: bool = True
) -> bool:
    """Whether the scan runs compiled (`cpu_jit.scan3`): numba there, plain CPU tensors of
    float32/float64, none empty, outside torch.compile, and, where a backward is to come
    (`grad`), every step's state (which it reads: `values` = B T H P values of N each, x's
    by default, and the start state) within `scan3.MAX_STATE_BYTES`."""
    if type(x) is not torch.Tensor or x.device.type != "cpu" or f not in _JIT_DTYPES:
        return False
    if x.numel() == 0 or torch.compiler.is_compiling():
        return False
    from ..cpu_jit import available

    if not available():  # (numba may not be installed: nothing of scan3's is imported then)
        return False
    if not grad:  # inference keeps no state but the running one
        return True
    from ..cpu_jit.scan3 import MAX_STATE_BYTES

    values = x.numel() if values is None else values
    per_step = values // x.shape[1]  # B H P: one step's state values, N each
    return (values + per_step) * N * (8 if f == torch.float64 else 4) <= MAX_STATE_BYTES


_JIT_DTYPES = (torch.float32, torch.float64)


class _Scan3(torch.autograd.Function):
    """The compiled scan (`cpu_jit.scan3`) with its hand-written backward. Inputs: whether a
    backward is to come (`grad`: else nothing is kept for one), x, q, k, delta, A, trap,
    pi tanh(theta), q_bias, k_bias, D or None, z or None, and the initial state's angle,
    ssm, k, x; outputs: y and the final state's four fields."""

    @staticmethod
    def forward(ctx, grad, *ins):
        from ..cpu_jit import scan3

        ins = tuple(None if t is None else t.detach() for t in ins)
        y, angle, ssm, kT, xT, kept = scan3.forward(*ins, keep=grad)
        ctx.save_for_backward(*(t for t in ins if t is not None))
        ctx.kept = kept  # arrays of the node's own
        ctx.present = tuple(t is not None for t in ins)
        ctx.set_materialize_grads(False)
        return y, angle, ssm, kT, xT

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, gy, g_angle, g_ssm, g_k, g_x):
        from ..cpu_jit import scan3

        it = iter(ctx.saved_tensors)
        ins = tuple(next(it) if here else None for here in ctx.present)
        likes = (ins[0], *ins[11:])  # x and the start state's fields: the outputs' likes
        likes = tuple(t.numpy() for t in likes)
        grads = tuple(map(_array_of, (gy, g_angle, g_ssm, g_k, g_x), likes))
        return None, *scan3.backward(ins, ctx.kept, grads)


def mamba3_layer_compiled(
    zx: torch.Tensor,  # [B, T, W] in_proj's rows
    sizes: tuple[int, ...],  # (E, N, G, H, P, S): how they split (`ops.mamba3._split`)
    norms: tuple,  # (w_B, eps_B, w_C, eps_C): the B and C norms' weights [N] and eps
    dt_bias: torch.Tensor,  # [H]
    A_floor: float,
    q_bias: torch.Tensor,  # [H, 1, N] (the layer's C_bias)
    k_bias: torch.Tensor,  # [H, 1, N] (B_bias)
    D: torch.Tensor,  # [H]
    initial_state: Mamba3State | None,
) -> tuple[torch.Tensor, Mamba3State]:
    """A Mamba-3 layer from in_proj's rows to the scan's output, compiled on the CPU (where
    `layer_compiles`): the per-token terms (`cpu_jit.terms3`) and the scan (`cpu_jit.scan3`)
    as one autograd node. (y [B, T, H, P], the final state), as `layers.Mamba3` computes
    them with its modules' ops and `mamba3_scan_reference`, differentiable in zx, the norms'
    weights, the biases, D and the initial state."""
    E, N, G, H, P, S = sizes
    if initial_state is None:
        initial_state = Mamba3State.zeros(zx.shape[0], H, P, N, S, zx.device, zx.dtype)
    w_B, eps_B, w_C, eps_C = norms
    grad = _needs_grad(zx, w_B, w_C, dt_bias, q_bias, k_bias, D, *initial_state)
    consts = (sizes, eps_B, eps_C, A_floor, grad)
    y, *final = _Layer3.apply(consts, zx.contiguous(), w_B, w_C, dt_bias, q_bias, k_bias, D,
                              *initial_state)  # fmt: skip
    return y, Mamba3State(*final)


def layer_compiles(zx: torch.Tensor, sizes: tuple, params: tuple, state: Mamba3State | None
                   ) -> bool:  # fmt: skip
    """Whether `mamba3_layer_compiled` runs: the scan compiles (`_compiled`, its memory
    bound where a backward is to come) and zx, the parameters it reads and the state are
    all zx's dtype (float32 or float64)."""
    f, E, N = zx.dtype, sizes[0], sizes[1]
    tensors = (*params, *(state if state is not None else ()))
    if not all(isinstance(t, torch.Tensor) and t.dtype == f for t in tensors):
        return False
    values = zx.shape[0] * zx.shape[1] * E if zx.dim() == 3 else 0
    return f in _JIT_DTYPES and scan_compiles(zx, f, N, values, _needs_grad(zx, *tensors))


def _needs_grad(*tensors: torch.Tensor) -> bool:
    """Whether autograd will want a backward of a node on `tensors`."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _array_of(g: torch.Tensor | None, like: np.ndarray) -> np.ndarray:
    """An output's gradient as a contiguous array of `like`'s dtype (zeros for None)."""
    if g is None:
        return np.zeros(like.shape, like.dtype)
    a = g.detach().numpy()
    if a.flags.c_contiguous and a.dtype == like.dtype:
        return a
    return np.ascontiguousarray(a, like.dtype)


class _Layer3(torch.autograd.Function):
    """`mamba3_layer_compiled`'s node: terms3 then scan3 forward; scan3 then terms3 back.
    What the kernels derive stays in arrays on the node (no tensor per intermediate)."""

    @staticmethod
    def forward(ctx, consts, zx, w_B, w_C, dt_bias, q_bias, k_bias, D, *state0):
        from ..cpu_jit import param_array, scan3, terms3

        sizes, eps_B, eps_C, A_floor, grad = consts
        H, N = sizes[3], sizes[1]
        # what the backward reads (the start state's angle and ssm are copied into `kept`)
        ctx.save_for_backward(zx, w_B, w_C, dt_bias, q_bias, k_bias, D, *state0[2:])
        zx_ = zx.detach().numpy()
        w_B_, w_C_, dt_, D_, qb, kb = map(param_array, (w_B, w_C, dt_bias, D, q_bias, k_bias))
        qb, kb = qb.reshape(H, N), kb.reshape(H, N)
        x, z, q, k, delta, A, trap, rate, r_k, r_q = terms3.forward(
            zx_, w_B_, w_C_, eps_B, eps_C, dt_, A_floor, sizes
        )
        s0 = tuple(t.detach().numpy() for t in state0)
        arrs = (x, q, k, delta, A, trap, rate, qb, kb, D_, z, True, *s0)
        y, angle, ssm, kT, xT, kept = scan3.forward_arrays(arrs, grad)
        ctx.arrays = (arrs, kept, r_k, r_q) if grad else None
        ctx.A_floor = A_floor
        ctx.set_materialize_grads(False)
        return tuple(map(torch.from_numpy, (y, angle, ssm, kT, xT)))

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, gy, g_angle, g_ssm, g_k, g_x):
        from ..cpu_jit import param_array, scan3, terms3

        if ctx.arrays is None:
            raise RuntimeError(
                "the compiled Mamba-3 layer kept nothing for a backward: its forward ran where "
                "no backward was expected (grad mode off, or no input requiring grad)"
            )
        zx, w_B, w_C, dt_bias, q_bias, k_bias, D, *_ = ctx.saved_tensors
        arrs, kept, r_k, r_q = ctx.arrays
        x = arrs[0]
        likes = (x, *arrs[12:])
        grads = tuple(map(_array_of, (gy, g_angle, g_ssm, g_k, g_x), likes))
        (g_xin, g_q, g_k_heads, g_delta, g_A, g_trap, g_rate, g_qb, g_kb, g_D, g_z,
         *g_state0) = scan3.backward_arrays(arrs, kept, grads)  # fmt: skip
        g_zx, g_wB, g_wC, g_dt = terms3.backward(
            zx.detach().numpy(), param_array(w_B), param_array(w_C), param_array(dt_bias),
            ctx.A_floor, r_k, r_q, g_xin, g_z, g_q, g_k_heads, g_delta, g_A, g_trap, g_rate,
        )  # fmt: skip
        t = torch.from_numpy
        return (None, t(g_zx), t(g_wB), t(g_wC), t(g_dt), t(g_qb).view_as(q_bias),
                t(g_kb).view_as(k_bias), t(g_D), *map(t, g_state0))  # fmt: skip


def mamba3_step_reference(
    x: torch.Tensor,  # [B, H, P]
    q: torch.Tensor,  # [B, G, N]
    k: torch.Tensor,  # [B, G, N]
    delta: torch.Tensor,  # [B, H]
    A: torch.Tensor,  # [B, H]
    trap: torch.Tensor,  # [B, H]
    theta: torch.Tensor,  # [B, S]
    q_bias: torch.Tensor,
    k_bias: torch.Tensor,
    D: torch.Tensor | None,
    z: torch.Tensor | None,  # [B, H, P]
    state: Mamba3State,
) -> tuple[torch.Tensor, Mamba3State]:
    """One timestep, functionally: (y [B, H, P] in x.dtype, the next state)."""
    H = x.shape[1]
    f = state.ssm.dtype
    xf, deltaf = x.to(f), delta.to(f)
    phi = state.angle + (math.pi * torch.tanh(theta.to(f))).unsqueeze(1) * deltaf.unsqueeze(-1)
    phi = phi - TWO_PI * torch.floor(phi / TWO_PI)
    kr = rotate_pairs(_heads(k.to(f).unsqueeze(1), H)[:, 0] + k_bias.to(f), phi)
    qr = rotate_pairs(_heads(q.to(f).unsqueeze(1), H)[:, 0] + q_bias.to(f), phi)
    lam = torch.sigmoid(trap.to(f))
    alpha = torch.exp(A.to(f) * deltaf)
    beta = (1 - lam) * deltaf * alpha
    gamma = lam * deltaf
    ssm = (
        alpha[..., None, None] * state.ssm
        + beta[..., None, None] * state.x.unsqueeze(-1) * state.k.unsqueeze(-2)
        + gamma[..., None, None] * xf.unsqueeze(-1) * kr.unsqueeze(-2)
    )
    y = torch.einsum("bhpn,bhn->bhp", ssm, qr)
    if D is not None:
        y = y + D.to(f)[:, None] * xf
    if z is not None:
        y = y * F.silu(z.to(f))
    return y.to(x.dtype), Mamba3State(phi, ssm, kr, xf)
