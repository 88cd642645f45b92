"""The Mamba-3 SISO mixer layer (Lahoti et al. 2026), with its recurrent state in and out.

B batch, T time, M = d_model, E = d_inner = expand * M, H = E / headdim heads of
P = headdim values, G = ngroups B/C groups, N = d_state, S = rotary angles
(rope_fraction * N / 2, even-rounded). One in_proj (no bias) gives, in this
order: z [E], x [E], B [G N], C [G N], dd_dt [H], dd_A [H], trap [H],
theta [S]. Then

    k, q  = rmsnorm_N(B), rmsnorm_N(C)            (learned weights [N], eps 1e-5)
    A     = min(-f(dd_A), -A_floor)   f(u) = 1 + u (u >= 0), 1 / (1 - u) (u < 0)
    delta = softplus(dd_dt + dt_bias)
    y     = mamba3_scan(x, q, k, delta, A, trap, theta, C_bias, B_bias, D, z)
    out   = y W_out^T

There is no conv and no A_log: A is data-dependent. Parameter names and shapes
equal mamba_ssm's `Mamba3` module (SISO, `is_outproj_norm=False`), so its state
dicts load as they are: `in_proj.weight`, `dt_bias` [H], `B_bias` and `C_bias`
[H, 1, N] (initialised to ones), `B_norm.weight` and `C_norm.weight` [N], `D`
[H], `out_proj.weight`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..ops._checks import check_seq_idx, check_tensor
from ..ops.mamba3.reference import Mamba3State, mamba3_scan_reference, mamba3_step_reference
from .init import no_weight_decay


def heavy_tail(u: torch.Tensor) -> torch.Tensor:
    """f(u) = 1 + u for u >= 0, 1 / (1 - u) for u < 0: positive, smooth at 0, f(u) ~ |u|^-1 as
    u -> -inf (a slower approach to 0 than softplus's exp(u))."""
    return u.clamp(min=0) + torch.reciprocal(1 - u.clamp(max=0))


class Mamba3(nn.Module):
    """Mamba-3 SISO mixer: [B, T, M] -> [B, T, M], with its `Mamba3State` in and out."""

    def __init__(
        self,
        d_model: int,
        d_state: int = 128,
        expand: int = 2,
        headdim: int = 64,
        ngroups: int = 1,
        rope_fraction: float = 0.5,
        dt_min: float = 0.001,
        dt_max: float = 0.1,
        dt_init_floor: float = 1e-4,
        A_floor: float = 1e-4,
        chunk_size: int = 64,
        layer_idx: int | None = None,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        sizes = dict(d_model=d_model, d_state=d_state, expand=expand, headdim=headdim,
                     ngroups=ngroups, chunk_size=chunk_size)  # fmt: skip
        for name, v in sizes.items():
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"Mamba3: {name} must be a positive int, got {v!r}")
        d_inner = expand * d_model
        if d_inner % headdim:
            raise ValueError(
                f"Mamba3: expand * d_model = {d_inner} is not a multiple of headdim {headdim}"
            )
        nheads = d_inner // headdim
        if nheads % ngroups:
            raise ValueError(f"Mamba3: the {nheads} heads do not split into ngroups={ngroups}")
        if rope_fraction not in (0.5, 1.0):
            raise ValueError(f"Mamba3: rope_fraction must be 0.5 or 1.0, got {rope_fraction!r}")
        pairs = int(d_state * rope_fraction)
        n_angles = (pairs - pairs % 2) // 2
        if n_angles <= 0:
            raise ValueError(f"Mamba3: d_state={d_state} leaves no rotary pair")
        if not (0 < dt_min <= dt_max) or dt_init_floor <= 0 or A_floor <= 0:
            raise ValueError("Mamba3: need 0 < dt_min <= dt_max, dt_init_floor > 0, A_floor > 0")
        self.d_model, self.d_state, self.d_inner = d_model, d_state, d_inner
        self.headdim, self.nheads, self.ngroups = headdim, nheads, ngroups
        self.n_angles, self.A_floor, self.chunk_size = n_angles, A_floor, chunk_size
        self.layer_idx = layer_idx
        fk = {"device": device, "dtype": dtype}
        H, N, G = nheads, d_state, ngroups
        d_in_proj = 2 * d_inner + 2 * G * N + 3 * H + n_angles
        self.in_proj = nn.Linear(d_model, d_in_proj, bias=False, **fk)
        f32 = {"device": device, "dtype": torch.float32}
        u = torch.rand(H, **f32)
        dt = torch.exp(u * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
        dt = dt.clamp(min=dt_init_floor)
        self.dt_bias = no_weight_decay(nn.Parameter(dt + torch.log(-torch.expm1(-dt))))
        self.B_bias = no_weight_decay(nn.Parameter(torch.ones(H, 1, N, **f32)))
        self.C_bias = no_weight_decay(nn.Parameter(torch.ones(H, 1, N, **f32)))
        self.B_norm = _RMSNormN(N, **fk)
        self.C_norm = _RMSNormN(N, **fk)
        self.D = no_weight_decay(nn.Parameter(torch.ones(H, **f32)))
        self.out_proj = nn.Linear(d_inner, d_model, bias=False, **fk)

    def init_state(self, batch_size: int, device=None) -> Mamba3State:
        p = self.in_proj.weight
        f = torch.float64 if p.dtype == torch.float64 else torch.float32
        return Mamba3State.zeros(batch_size, self.nheads, self.headdim, self.d_state,
                                 self.n_angles, device or p.device, f)  # fmt: skip

    def _inputs(self, u: torch.Tensor):
        """in_proj, split and activated: the scan's inputs over u's leading dims."""
        E, N, G, H, S = self.d_inner, self.d_state, self.ngroups, self.nheads, self.n_angles
        z, x, B, C, dd_dt, dd_A, trap, theta = torch.split(
            self.in_proj(u), [E, E, G * N, G * N, H, H, H, S], dim=-1
        )
        lead = u.shape[:-1]
        k = self.B_norm(B.unflatten(-1, (G, N)))
        q = self.C_norm(C.unflatten(-1, (G, N)))
        f = torch.float64 if u.dtype == torch.float64 else torch.float32
        A = -heavy_tail(dd_A.to(f)).clamp(min=self.A_floor)  # min(-f(dd_A), -A_floor)
        delta = F.softplus(dd_dt.to(f) + self.dt_bias.to(f))
        P = self.headdim
        return (x.view(*lead, H, P), q, k, delta, A, trap, theta, z.view(*lead, H, P))

    def forward(
        self,
        u: torch.Tensor,  # [B, T, M]
        state: Mamba3State | None = None,
        seq_idx: torch.Tensor | None = None,  # [B, T] int32 document ids
        return_state: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, Mamba3State]:
        check_tensor("u", u, (None, None, self.d_model))
        if state is not None:
            self._check_state(state, u.shape[0], u.device)
        if seq_idx is not None:
            check_seq_idx(seq_idx, u.shape[0], u.shape[1], u.device)
        x, q, k, delta, A, trap, theta, z = self._inputs(u)
        y, final = mamba3_scan_reference(
            x, q, k, delta, A, trap, theta, self.C_bias[:, 0], self.B_bias[:, 0], self.D, z,
            initial_state=state, seq_idx=seq_idx, chunk=self.chunk_size,
        )  # fmt: skip
        out = self.out_proj(y.flatten(-2).to(self.out_proj.weight.dtype))
        return (out, final) if return_state else out

    def step(self, u: torch.Tensor, state: Mamba3State) -> tuple[torch.Tensor, Mamba3State]:
        """One timestep: u [B, M] -> (out [B, M], the next state). Functional: the state
        passed in is not changed."""
        check_tensor("u", u, (None, self.d_model))
        self._check_state(state, u.shape[0], u.device)
        x, q, k, delta, A, trap, theta, z = self._inputs(u)
        y, nxt = mamba3_step_reference(
            x, q, k, delta, A, trap, theta, self.C_bias[:, 0], self.B_bias[:, 0], self.D, z, state
        )
        return self.out_proj(y.flatten(-2).to(self.out_proj.weight.dtype)), nxt

    def _check_state(self, state: Mamba3State, batch: int, device) -> None:
        if not isinstance(state, Mamba3State):
            raise TypeError(f"state must be a Mamba3State, got {type(state).__name__}")
        H, P, N, S = self.nheads, self.headdim, self.d_state, self.n_angles
        want = dict(angle=(batch, H, S), ssm=(batch, H, P, N), k=(batch, H, N), x=(batch, H, P))
        for name, shape in want.items():
            check_tensor(f"state.{name}", getattr(state, name), shape, device=device)


class _RMSNormN(nn.Module):
    """RMSNorm over the last dim (d_state) with a learned weight, statistics in f32."""

    def __init__(self, n: int, eps: float = 1e-5, device=None, dtype=None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = no_weight_decay(nn.Parameter(torch.ones(n, device=device, dtype=dtype)))

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        f = torch.float64 if t.dtype == torch.float64 else torch.float32
        tf = t.to(f)
        out = tf * torch.rsqrt(tf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.to(f)
        return out.to(t.dtype)
