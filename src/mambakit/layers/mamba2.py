"""The Mamba-2 mixer layer (SSD, Dao & Gu 2024), with its recurrent state in and out.

B batch, T time, M = d_model, E = d_inner = expand * M, d_ssm (E unless given) channels
run the SSM as H = d_ssm / headdim heads of P = headdim values, G = ngroups B/C groups,
N = d_state, K = d_conv, d_mlp = E - d_ssm (a gated MLP beside the SSM; 0 in every
released model). One in_proj gives, in this order: z0 [d_mlp], x0 [d_mlp], z [d_ssm],
xBC [d_ssm + 2 G N], dt [H]. Then

    xBC     = silu(causal_conv1d(xBC))             (depthwise, K taps, bias)
    x, B, C = split(xBC)                          ([H, P], [G, N], [G, N])
    delta   = clamp(softplus(dt + dt_bias), dt_limit)      A = -exp(A_log)   [H]
    y       = mamba2_scan(x, delta, A, B, C, D)   (ops/mamba2: h_t = e^(delta A) h + delta x B^T)
    y       = rmsnorm_G(y * silu(z)) * norm.weight        (norm_before_gate=False)
    out     = out_proj([silu(z0) * x0, y])

Parameter names, shapes and initialisation equal mamba_ssm's `Mamba2` (and the mixer of
transformers' `Mamba2ForCausalLM`): `in_proj`, `conv1d`, `dt_bias` [H], `A_log` [H], `D`
[H] (or [d_ssm] with `D_has_hdim`), `norm.weight` [d_ssm], `out_proj`; state dicts map
one to one. The layer's state is `Mamba2State(conv [B, K-1, d_ssm + 2GN], ssm [B, H, P,
N])`, f32.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..ops import _rms_norm_gated
from ..ops._checks import check_seq_idx, check_tensor, state_dtype
from ..ops.causal_conv1d.reference import conv_states_at
from ..ops.mamba2 import (
    Mamba2StepWeights,
    _mamba2_scan,
    check_mamba2_state,
    mamba2_delta_reference,
    mamba2_stack_step,
    mamba2_state_update,
    mamba2_step_raw,
)
from ..ops.mamba2.stack import stack_weights
from ..state import Mamba2State
from .init import no_weight_decay
from .mixer import FREEZE_DT, _p, conv_silu, conv_silu_step
from .plain import plain

_NO_LIMIT = (0.0, float("inf"))


class Mamba2(nn.Module):
    """Mamba-2 mixer: [B, T, M] -> [B, T, M], with its `Mamba2State` in and out. The
    constructor is mamba_ssm's `Mamba2`'s (its tensor-parallel and kernel-path options
    aside)."""

    def __init__(
        self,
        d_model: int,
        d_state: int = 128,
        d_conv: int = 4,
        conv_init: float | None = None,
        expand: int = 2,
        headdim: int = 64,
        d_ssm: int | None = None,
        ngroups: int = 1,
        A_init_range: tuple[float, float] = (1.0, 16.0),
        D_has_hdim: bool = False,
        rmsnorm: bool = True,
        norm_before_gate: bool = False,
        dt_min: float = 0.001,
        dt_max: float = 0.1,
        dt_init_floor: float = 1e-4,
        dt_limit: tuple[float, float] = _NO_LIMIT,
        bias: bool = False,
        conv_bias: bool = True,
        chunk_size: int = 256,
        norm_eps: float = 1e-5,  # the gated norm's (mamba_ssm fixes 1e-5; transformers' is the
        # config's layer_norm_epsilon)
        layer_idx: int | None = None,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        sizes = dict(d_model=d_model, d_state=d_state, expand=expand, headdim=headdim,
                     ngroups=ngroups, chunk_size=chunk_size)  # fmt: skip
        for name, v in sizes.items():
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"Mamba2: {name} must be a positive int, got {v!r}")
        if isinstance(d_conv, bool) or not isinstance(d_conv, int) or d_conv < 2:
            raise ValueError(f"Mamba2: d_conv must be an int >= 2, got {d_conv!r}")
        d_inner = expand * d_model
        d_ssm = d_inner if d_ssm is None else d_ssm
        if isinstance(d_ssm, bool) or not isinstance(d_ssm, int) or not 0 < d_ssm <= d_inner:
            raise ValueError(
                f"Mamba2: d_ssm must be None or an int in (0, expand * d_model = {d_inner}], "
                f"got {d_ssm!r}"
            )
        if d_ssm % headdim:
            raise ValueError(f"Mamba2: headdim {headdim} does not divide d_ssm = {d_ssm}")
        nheads = d_ssm // headdim
        if nheads % ngroups:
            raise ValueError(f"Mamba2: the {nheads} heads do not split into ngroups={ngroups}")
        if not (0 < dt_min <= dt_max < math.inf) or not dt_init_floor > 0:  # (NaN fails too)
            raise ValueError("Mamba2: need 0 < dt_min <= dt_max < inf and dt_init_floor > 0")
        lo, hi = (float(v) for v in dt_limit)
        if not 0 <= lo < hi:
            raise ValueError(f"Mamba2: dt_limit must satisfy 0 <= low < high, got {dt_limit}")
        a0, a1 = A_init_range
        if not 0 < a0 <= a1 < math.inf:
            raise ValueError(
                f"Mamba2: A_init_range must satisfy 0 < low <= high < inf, got {A_init_range}"
            )
        if conv_init is not None and not 0 <= conv_init < math.inf:  # (uniform_ named none)
            raise ValueError(f"Mamba2: conv_init must be None or a finite number >= 0, "
                             f"got {conv_init!r}")  # fmt: skip
        self.d_model, self.d_state, self.d_conv, self.d_inner = d_model, d_state, d_conv, d_inner
        self.d_ssm, self.headdim, self.nheads, self.ngroups = d_ssm, headdim, nheads, ngroups
        self.d_mlp = d_inner - d_ssm
        self.conv_dim = d_ssm + 2 * ngroups * d_state
        self.D_has_hdim, self.rmsnorm, self.norm_before_gate = D_has_hdim, rmsnorm, norm_before_gate
        self.dt_limit, self.chunk_size, self.layer_idx = (lo, hi), chunk_size, layer_idx
        fk = {"device": device, "dtype": dtype}
        H = nheads
        d_in_proj = 2 * d_inner + 2 * ngroups * d_state + H
        self.in_proj = nn.Linear(d_model, d_in_proj, bias=bias, **fk)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, d_conv, groups=self.conv_dim,
                                padding=d_conv - 1, bias=conv_bias, **fk)  # fmt: skip
        if conv_init is not None:
            nn.init.uniform_(self.conv1d.weight, -conv_init, conv_init)
        f32 = {"device": device, "dtype": torch.float32}
        dt = torch.exp(torch.rand(H, **f32) * (math.log(dt_max) - math.log(dt_min))
                       + math.log(dt_min)).clamp(min=dt_init_floor)  # fmt: skip
        self.dt_bias = no_weight_decay(nn.Parameter(dt + torch.log(-torch.expm1(-dt))))
        A = torch.empty(H, **f32).uniform_(a0, a1)
        self.A_log = no_weight_decay(nn.Parameter(torch.log(A)))
        self.D = no_weight_decay(nn.Parameter(torch.ones(d_ssm if D_has_hdim else H, **f32)))
        if rmsnorm:
            self.norm = RMSNormGated(d_ssm, eps=norm_eps, group_size=d_ssm // ngroups,
                                     norm_before_gate=norm_before_gate, **fk)  # fmt: skip
        self.out_proj = nn.Linear(d_inner, d_model, bias=bias, **fk)

    # the decode step of a stack of `fusable()` blocks on the model's decode plan
    stack_step = staticmethod(mamba2_stack_step)
    stack_weights = staticmethod(stack_weights)  # its reference body's weights, from the plan

    def init_state(self, batch_size: int, device=None) -> Mamba2State:
        p = self.A_log  # (a parameter of the layer itself: the projections may be wrapped)
        return Mamba2State.zeros(batch_size, *self._state_sizes(), device=device or p.device,
                                 dtype=state_dtype(p))  # fmt: skip

    def _state_sizes(self) -> tuple[int, int, int, int, int]:
        return self.d_conv, self.conv_dim, self.nheads, self.headdim, self.d_state

    def _split(self, zxbcdt: torch.Tensor):
        """in_proj's rows: (z0, x0, z, xBC, dt) over its leading dims."""
        m, s = self.d_mlp, self.d_ssm
        return torch.split(zxbcdt, [m, m, s, self.conv_dim, self.nheads], dim=-1)

    def _ssm_inputs(self, xBC: torch.Tensor, dt: torch.Tensor, raw_dt: bool = False):
        """The scan's inputs from the conv's output and in_proj's dt rows: (x [..., H, P], B,
        C [..., G, N], delta [..., H] (raw_dt: dt as it comes, for a scan given dt_bias) and
        A [H] in the state dtype, D as the scan takes it)."""
        H, P, G, N = self.nheads, self.headdim, self.ngroups, self.d_state
        x, B, C = torch.split(xBC, [self.d_ssm, G * N, G * N], dim=-1)
        f = state_dtype(xBC)
        delta = dt if raw_dt else mamba2_delta_reference(dt, self.dt_bias, self.dt_limit)
        A = -torch.exp(self.A_log.to(f))
        D = self.D.view(H, P) if self.D_has_hdim else self.D
        return (x.unflatten(-1, (H, P)), B.unflatten(-1, (G, N)), C.unflatten(-1, (G, N)),
                delta, A, D)  # fmt: skip

    def _output(self, y: torch.Tensor, z0, x0, z, backend: str) -> torch.Tensor:
        """out_proj of the gated (normed) y [..., d_ssm], with the gated MLP's part."""
        if self.rmsnorm:
            y = self.norm(y, z, backend)
        if self.d_mlp:
            y = torch.cat([F.silu(z0) * x0, y.to(x0.dtype)], dim=-1)
        return self.out_proj(y)  # y in in_proj's output dtype, as the projections compute

    def forward(
        self,
        u: torch.Tensor,  # [B, T, M]
        state: Mamba2State | None = None,
        seq_idx: torch.Tensor | None = None,  # [B, T] int32 document ids
        return_state: bool = False,
        backend: str = "auto",
    ) -> torch.Tensor | tuple[torch.Tensor, Mamba2State]:
        check_tensor("u", u, (None, None, self.d_model))
        if state is not None:
            self._check_state(state, u.shape[0], u.device)
        if seq_idx is not None:
            check_seq_idx(seq_idx, u.shape[0], u.shape[1], u.device)
        out, final = self._run(u, state, seq_idx, backend)
        return (out, final) if return_state else out

    def _run(self, u, state, seq_idx, backend, stop=None) -> tuple[torch.Tensor, Mamba2State]:
        """The forward's body: (out, the final state). `stop` [B] int64: the steps past
        stop[b] of row b are filler, and the state is the one after step stop[b]: their
        delta is made 0 (`FREEZE_DT`), so the scan's state passes them unchanged (e^0 = 1,
        no input), and the conv state is gathered from the inputs up to the stop."""
        z0, x0, z, xBC, dt = self._split(self.in_proj(u))
        conv_state = None if state is None else state.conv
        if stop is not None:
            after = torch.arange(u.shape[1], device=u.device) > stop[:, None]
            dt = dt.masked_fill(after[..., None], FREEZE_DT)
            conv_at = conv_states_at(xBC, stop[:, None], self.d_conv, conv_state)[:, 0]
        xBC, conv_final = conv_silu(self.conv1d, xBC, conv_state, seq_idx, backend, self.d_conv)
        if stop is not None:
            conv_final = conv_at
        x, B, C, dt, A, D = self._ssm_inputs(xBC, dt, raw_dt=True)
        gate = None if self.rmsnorm else z.unflatten(-1, (self.nheads, self.headdim))
        ssm_state = None if state is None else state.ssm
        y, ssm_final = _mamba2_scan(x, dt, A, B, C, D, gate, ssm_state, seq_idx, self.chunk_size,
                                    backend, self.dt_bias, self.dt_limit)  # fmt: skip
        out = self._output(y.flatten(-2), z0, x0, z, backend)
        return out, Mamba2State(conv_final, ssm_final)

    def step(
        self, u: torch.Tensor, state: Mamba2State, backend: str = "auto"
    ) -> tuple[torch.Tensor, Mamba2State]:
        """One timestep: u [B, M] -> (out [B, M], the next state). As the model's `step`: in
        place when no gradient is recorded (the state returned is the one passed in),
        functionally when one is (the forward over one step; the state passed in is not
        changed)."""
        check_tensor("u", u, (None, self.d_model))
        self._check_state(state, u.shape[0], u.device)
        records = torch.is_grad_enabled() and (
            u.requires_grad
            or any(p.requires_grad for p in self.parameters())
            or any(t.requires_grad for t in state)
        )
        if records:
            out, new = self(u[:, None], state, return_state=True, backend=backend)
            return out[:, 0], new
        return self.decode(u, state, backend), state

    def decode(self, u: torch.Tensor, state: Mamba2State, backend: str) -> torch.Tensor:
        """What a block runs for one decode step (every mixer has it): u [B, M] -> [B, M],
        `state` advanced in place (no gradient is recorded). With a plain conv and norm,
        one op from in_proj's rows to out_proj's input (`ops.mamba2.mamba2_step_raw`: two
        kernels on Triton); otherwise the modules are called."""
        if self._inner_plain():
            w = self.decode_weights(projections=False)
            y = mamba2_step_raw(state.conv, state.ssm, self.in_proj(u), w, backend)
            return self.out_proj(y)  # y in in_proj's output dtype
        z0, x0, z, xBC, dt = self._split(self.in_proj(u))
        xBC = conv_silu_step(self.conv1d, xBC, state.conv, backend)
        x, B, C, delta, A, D = self._ssm_inputs(xBC, dt)
        gate = None if self.rmsnorm else z.unflatten(-1, (self.nheads, self.headdim))
        y = mamba2_state_update(state.ssm, x, delta, A, B, C, D, gate)
        return self._output(y.flatten(-2), z0, x0, z, backend)

    def sequence(self, x, state, seq_idx, backend, derived=None, last=False, stop=None):
        """What a block runs over a sequence (every mixer has it): (out, the final state).
        Nothing is derived ahead for Mamba-2 and every step's output is given. `stop` [B]
        int64 (`stops_rows()`): the state after step stop[b] of each row instead, the steps
        past it filler (their outputs are not the model's)."""
        if stop is None:
            return self(x, state, seq_idx, return_state=True, backend=backend)
        return self._run(x, state, None, backend, stop)

    def stops_rows(self) -> bool:
        """Whether `sequence` can stop each row at a step of its own: a delta of 0 must pass
        the state unchanged, which a lower dt_limit above 0 forbids."""
        return self.dt_limit[0] == 0

    def _inner_plain(self) -> bool:
        """Whether the decode step may read the conv's and the gated norm's weights (each a
        plain module: layers/plain.py); otherwise it calls them."""
        mods = self._modules
        return plain(mods["conv1d"], nn.Conv1d) and (
            not self.rmsnorm or plain(mods["norm"], RMSNormGated)
        )

    def fusable(self) -> bool:
        """Whether a decode step may read every weight of the layer (the model's decode
        plan and the stack op, `ops.mamba2.mamba2_stack_step`); otherwise it calls the
        modules."""
        mods = self._modules
        return plain(mods["in_proj"]) and plain(mods["out_proj"]) and self._inner_plain()

    def plan_constants(self) -> tuple:
        """What `decode_weights` reads besides the parameters and the block's norm: the
        gated norm's eps, dt_limit and norm_before_gate (the decode plans' key,
        `MambaBackbone._plan_key`)."""
        gnorm = self._modules.get("norm")
        return (None if gnorm is None else gnorm.eps, self.dt_limit, self.norm_before_gate)

    def decode_weights(
        self, norm: nn.Module | None = None, projections: bool = True
    ) -> Mamba2StepWeights:
        """The tensors a decode step reads (views of the parameters; A = -exp(A_log) made in
        f32, f64 for a float64 model), with the block's `norm` (its RMSNorm) when given.
        The projections' weights only with `projections` (a `fusable()` layer: the model's
        decode plan); without, they are None and the caller calls the modules."""
        mods = self._modules
        gnorm = mods.get("norm")
        H, P = self.nheads, self.headdim
        D = _p(self, "D")
        proj = dict(in_w=None, in_b=None, out_w=None, out_b=None)
        if projections:
            proj = dict(in_w=_p(mods["in_proj"], "weight"), in_b=_p(mods["in_proj"], "bias"),
                        out_w=_p(mods["out_proj"], "weight"),
                        out_b=_p(mods["out_proj"], "bias"))  # fmt: skip
        return Mamba2StepWeights(
            norm_w=None if norm is None else _p(norm, "weight"),
            eps=0.0 if norm is None else norm.eps,
            **proj,
            conv_w=_p(mods["conv1d"], "weight").squeeze(1),
            conv_b=_p(mods["conv1d"], "bias"),
            dt_bias=_p(self, "dt_bias"),
            A=-torch.exp(_p(self, "A_log").to(state_dtype(self.A_log))),
            D=D.view(H, P) if self.D_has_hdim else D,
            gnorm_w=None if gnorm is None else _p(gnorm, "weight"),
            gnorm_eps=0.0 if gnorm is None else gnorm.eps,
            sizes=(self.d_mlp, self.d_ssm, self.ngroups, self.d_state, H, P),
            dt_limit=self.dt_limit,
            norm_before_gate=self.norm_before_gate,
        )

    def _check_state(self, state: Mamba2State, batch: int, device) -> None:
        if not isinstance(state, Mamba2State):
            raise TypeError(f"state must be a Mamba2State, got {type(state).__name__}")
        K, Cd, H, P, N = self._state_sizes()
        check_tensor("state.conv", state.conv, (batch, K - 1, Cd), device=device)
        if state.conv.dtype not in (torch.float32, torch.float64):
            raise TypeError(f"state.conv must be float32 (or float64), got {state.conv.dtype}")
        check_mamba2_state("state.ssm", state.ssm, batch, H, P, N, device)


class RMSNormGated(nn.Module):
    """Mamba-2's gated RMSNorm over groups of `group_size` channels, as mamba_ssm's
    (`norm_before_gate=False`: rmsnorm(x * silu(z)) * weight; True: rmsnorm(x) * weight *
    silu(z)); statistics in f32 (f64 for a float64 model), out in x's dtype."""

    def __init__(self, d: int, eps: float = 1e-5, group_size: int | None = None,
                 norm_before_gate: bool = False, device=None, dtype=None) -> None:  # fmt: skip
        super().__init__()
        self.eps = eps
        self.group_size = d if group_size is None else group_size
        if d % self.group_size:
            raise ValueError(f"RMSNormGated: group_size {group_size} does not divide {d}")
        self.norm_before_gate = norm_before_gate
        self.weight = no_weight_decay(nn.Parameter(torch.ones(d, device=device, dtype=dtype)))

    def forward(
        self, x: torch.Tensor, z: torch.Tensor | None = None, backend: str = "auto"
    ) -> torch.Tensor:
        """`ops.rms_norm_gated` (one kernel each way on the Triton backend)."""
        return _rms_norm_gated(x, z, self.weight, self.eps, self.group_size,
                               self.norm_before_gate, x.dtype, backend)  # fmt: skip
