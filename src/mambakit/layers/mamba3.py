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
equal mamba_ssm's `Mamba3` module (SISO, `is_outproj_norm=False`), so the key map
from its state dicts is the identity (ops/mamba3/README.md has the table):
`in_proj.weight` [2E + 2GN + 3H + S, M], `dt_bias` [H], `B_bias` and `C_bias`
[H, 1, N] (initialised to ones), `B_norm.weight` and `C_norm.weight` [N], `D`
[H], `out_proj.weight` [M, E]. `Mamba3.from_upstream_state_dict` reads the sizes
off such a state dict and loads it with strict checks;
`Mamba3.load_upstream_state_dict` loads one into an existing layer.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from ..ops import _rms_norm
from ..ops._backend import resolve_backend
from ..ops._checks import check_seq_idx, check_tensor, state_dtype
from ..ops.mamba3 import (
    Mamba3StepWeights,
    _mamba3_scan,
    _split,
    check_mamba3_state,
    heavy_tail,
    mamba3_stack_step,
    mamba3_state_update,
    mamba3_step_raw,
    mamba3_step_reference,
)
from ..ops.mamba3.reference import layer_compiles, mamba3_layer_compiled, rotate_pairs
from ..ops.mamba3.stack import stack_weights
from ..state import Mamba3State
from .init import no_weight_decay
from .mixer import FREEZE_DT, _p
from .plain import plain


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
        n_angles = _n_angles(d_state, rope_fraction)
        if n_angles <= 0:
            raise ValueError(f"Mamba3: d_state={d_state} leaves no rotary pair")
        if not (0 < dt_min <= dt_max < math.inf and dt_init_floor > 0 and A_floor > 0):  # (NaN too)
            raise ValueError(
                "Mamba3: need 0 < dt_min <= dt_max < inf, dt_init_floor > 0, A_floor > 0"
            )
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

    @classmethod
    def from_upstream_state_dict(
        cls,
        state_dict: Mapping[str, torch.Tensor],
        prefix: str = "",
        A_floor: float = 1e-4,
        chunk_size: int = 64,
        layer_idx: int | None = None,
        device=None,
        dtype=None,
    ) -> Mamba3:
        """A layer built and loaded from the state dict of mamba_ssm's `Mamba3` (SISO,
        `is_outproj_norm=False`). The sizes are read off the tensors: d_model and d_inner
        from the projections, heads from `D`, d_state from `B_norm.weight`, ngroups and the
        rotary angles from the rest of in_proj's rows. A_floor and chunk_size are not in a
        state dict: pass upstream's values if they were not its defaults. `prefix` selects
        one layer of a model's state dict (e.g. "backbone.layers.0.mixer."). dtype is that
        of in_proj, out_proj and the B/C norms (None: torch's default, f32); dt_bias,
        B_bias, C_bias and D stay f32."""
        sd = _strip_prefix(state_dict, prefix)
        need = ("in_proj.weight", "out_proj.weight", "D", "B_norm.weight")
        for key, dims in zip(need, (2, 2, 1, 1)):
            t = sd.get(key)
            if not isinstance(t, torch.Tensor) or t.dim() != dims:
                got = "missing" if t is None else f"not a {dims}-D tensor: {getattr(t, 'shape', t)}"
                raise ValueError(f"upstream Mamba3 state dict: {prefix + key!r} is {got}")
        (rows, d_model), (_, d_inner) = sd["in_proj.weight"].shape, sd["out_proj.weight"].shape
        H, N = sd["D"].shape[0], sd["B_norm.weight"].shape[0]
        if d_inner % d_model or d_inner % H:
            raise ValueError(
                f"upstream Mamba3 state dict: out_proj.weight {tuple(sd['out_proj.weight'].shape)}"
                f" gives d_inner {d_inner}, which is not an integer expand of d_model {d_model}"
                f" times the {H} heads of D"
            )
        rest = rows - 2 * d_inner - 3 * H  # 2 G N + S, with S <= N / 2
        ngroups, n_angles = divmod(rest, 2 * N)
        fractions = [f for f in (0.5, 1.0) if _n_angles(N, f) == n_angles]
        if ngroups <= 0 or not fractions:
            raise ValueError(
                f"upstream Mamba3 state dict: in_proj.weight has {rows} rows; with d_inner "
                f"{d_inner}, {H} heads and d_state {N}, the {rest} left over are not 2 * ngroups"
                f" * {N} + the angles of rope_fraction 0.5 ({_n_angles(N, 0.5)}) or 1.0"
                f" ({_n_angles(N, 1.0)})"
            )
        sizes = dict(d_state=N, expand=d_inner // d_model, headdim=d_inner // H, ngroups=ngroups)
        layer = cls(d_model, **sizes, rope_fraction=fractions[0], A_floor=A_floor,
                    chunk_size=chunk_size, layer_idx=layer_idx,
                    device=device, dtype=dtype)  # fmt: skip
        layer.load_upstream_state_dict(sd)
        return layer

    def load_upstream_state_dict(
        self, state_dict: Mapping[str, torch.Tensor], prefix: str = ""
    ) -> None:
        """Copy a state dict of mamba_ssm's `Mamba3` (SISO, `is_outproj_norm=False`) into
        this layer. The key map is the identity; every key must be present, none extra,
        every shape equal, every value a floating tensor (cast to this layer's dtypes).
        On any mismatch a ValueError lists every offending key with both shapes, and
        nothing is written."""
        sd = _strip_prefix(state_dict, prefix)
        ours = dict(self.named_parameters())
        problems = [f"missing {prefix + k!r} (mambakit shape {tuple(p.shape)})"
                    for k, p in ours.items() if k not in sd]  # fmt: skip
        for k, t in sd.items():
            if k not in ours:
                why = _UPSTREAM_ONLY.get(k.rsplit(".", 1)[0] if "." in k else k, "")
                problems.append(f"unexpected {prefix + k!r}" + (f": {why}" if why else ""))
            elif not isinstance(t, torch.Tensor) or not t.is_floating_point():
                what = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
                problems.append(f"{prefix + k!r} is {what}, not a floating tensor")
            elif t.shape != ours[k].shape:
                problems.append(
                    f"{prefix + k!r} has shape {tuple(t.shape)}, mambakit's Mamba3 expects "
                    f"{tuple(ours[k].shape)}{self._shape_hint(k, t)}"
                )
        if problems:
            raise ValueError(
                "upstream Mamba3 state dict does not fit this layer (d_model="
                f"{self.d_model}, d_state={self.d_state}, d_inner={self.d_inner}, headdim="
                f"{self.headdim}, ngroups={self.ngroups}, rotary angles={self.n_angles}):\n  "
                + "\n  ".join(problems)
            )
        with torch.no_grad():
            for k, p in ours.items():
                p.copy_(sd[k])

    def _shape_hint(self, key: str, t: torch.Tensor) -> str:
        """Why an upstream tensor's shape may differ: the constructor argument to check."""
        if key in ("B_bias", "C_bias") and t.dim() == 3 and t.shape[1] != 1:
            return f" (mimo_rank {t.shape[1]}: upstream is_mimo=True; mambakit is SISO)"
        if key == "in_proj.weight":
            E, N, G, H, S = self.d_inner, self.d_state, self.ngroups, self.nheads, self.n_angles
            return (f" (rows z,x,B,C,dd_dt,dd_A,trap,angles = {E},{E},{G * N},{G * N},{H},{H},"
                    f"{H},{S}: check d_state, ngroups, rope_fraction)")  # fmt: skip
        return ""

    # the decode step of a stack of `fusable()` blocks on the model's decode plan
    stack_step = staticmethod(mamba3_stack_step)
    stack_weights = staticmethod(stack_weights)  # its reference body's weights, from the plan

    def init_state(self, batch_size: int, device=None) -> Mamba3State:
        p = self.in_proj.weight
        f = state_dtype(p)
        return Mamba3State.zeros(batch_size, self.nheads, self.headdim, self.d_state,
                                 self.n_angles, device or p.device, f)  # fmt: skip

    def _sizes(self) -> tuple[int, int, int, int, int, int]:
        """(E, N, G, H, P, S): how in_proj's rows split (`ops.mamba3._split`)."""
        return (self.d_inner, self.d_state, self.ngroups, self.nheads, self.headdim,
                self.n_angles)  # fmt: skip

    def _inputs(self, u: torch.Tensor):
        """in_proj, split and activated: the scan's inputs over u's leading dims."""
        return self._terms(self.in_proj(u))

    def _terms(self, zx: torch.Tensor, backend: str = "reference"):
        """in_proj's rows split and activated: the scan's inputs. With the Triton backend,
        delta and A come from one kernel (`ops.mamba3.activations`) instead of the chain."""
        z, x, B, C, dd_dt, dd_A, trap, theta = _split(zx, self._sizes())
        k = self.B_norm(B)
        q = self.C_norm(C)
        f = state_dtype(zx)
        if backend == "triton" and f == torch.float32:
            from ..ops.mamba3.activations import dt_and_A, fusable

            if fusable(dd_dt, dd_A):
                delta, A = dt_and_A(dd_dt, dd_A, self.dt_bias, self.A_floor)
                return x, q, k, delta, A, trap, theta, z
        A = -heavy_tail(dd_A.to(f)).clamp(min=self.A_floor)  # min(-f(dd_A), -A_floor)
        delta = F.softplus(dd_dt.to(f) + self.dt_bias.to(f))
        return x, q, k, delta, A, trap, theta, z

    def forward(
        self,
        u: torch.Tensor,  # [B, T, M]
        state: Mamba3State | None = None,
        seq_idx: torch.Tensor | None = None,  # [B, T] int32 document ids
        return_state: bool = False,
        backend: str = "auto",
    ) -> torch.Tensor | tuple[torch.Tensor, Mamba3State]:
        check_tensor("u", u, (None, None, self.d_model))
        if state is not None:
            self._check_state(state, u.shape[0], u.device)
        if seq_idx is not None:
            check_seq_idx(seq_idx, u.shape[0], u.shape[1], u.device)
        out, final = self._run(u, state, seq_idx, backend)
        return (out, final) if return_state else out

    def _run(self, u, state, seq_idx, backend, stop=None) -> tuple[torch.Tensor, Mamba3State]:
        """The forward's body: (out, the final state). `stop` [B] int64: the steps past
        stop[b] of row b are filler, and the state is the one after step stop[b]: their
        delta is made 0 (in_proj's dd_dt rows at `FREEZE_DT`), so the scan's state and the
        angles pass them unchanged (e^0 = 1, the trapezoid's weights 0), and the last key
        and value are taken at the stop (`_state_at`)."""
        zx = self.in_proj(u)
        if stop is not None:
            E, N, G, H = self.d_inner, self.d_state, self.ngroups, self.nheads
            cols = torch.zeros(zx.shape[-1], dtype=torch.bool, device=zx.device)
            cols[2 * E + 2 * G * N : 2 * E + 2 * G * N + H] = True  # dd_dt
            after = torch.arange(u.shape[1], device=u.device) > stop[:, None]
            zx = zx.masked_fill(after[..., None] & cols, FREEZE_DT)
        compiled = self._compiled(zx, state, backend) if seq_idx is None else None
        if compiled:
            w_B, w_C, dt_bias, C_bias, B_bias, D = compiled
            norms = (w_B, self._modules["B_norm"].eps, w_C, self._modules["C_norm"].eps)
            y, final = mamba3_layer_compiled(
                zx, self._sizes(), norms, dt_bias, self.A_floor, C_bias, B_bias, D, state
            )
        else:
            x, q, k, delta, A, trap, theta, z = self._terms(zx, resolve_backend(backend, zx))
            args = (x, q, k, delta, A, trap, theta, self.C_bias.squeeze(1), self.B_bias.squeeze(1),
                    self.D, z)  # fmt: skip
            y, final = _mamba3_scan(*args, state, seq_idx, self.chunk_size, backend)
        if stop is not None:
            final = self._state_at(zx, final, stop)
        return self.out_proj(y.flatten(-2).to(self.out_proj.weight.dtype)), final

    def _state_at(self, zx: torch.Tensor, final: Mamba3State, stop: torch.Tensor) -> Mamba3State:
        """`final` with the last key and value of step stop[b] of each row instead of the
        filler's: that step's normed B row plus its bias, turned by the angles (which the
        filler left as they were at the stop), and its x, as the scan keeps them."""
        _, x, B, *_ = _split(zx, self._sizes())
        rows = torch.arange(zx.shape[0], device=zx.device)
        f = final.ssm.dtype
        k = self.B_norm(B[rows, stop]).to(f)  # [B, G, N]
        k = k.repeat_interleave(self.nheads // self.ngroups, dim=1) + self.B_bias.squeeze(1).to(f)
        return Mamba3State(final.angle, final.ssm, rotate_pairs(k, final.angle),
                           x[rows, stop].to(f))  # fmt: skip

    def _compiled(self, zx: torch.Tensor, state: Mamba3State | None, backend: str):
        """The tensors the forward's compiled CPU core reads (B and C norms' weights, dt_bias,
        C_bias, B_bias, D) where it runs (`ops.mamba3.reference.mamba3_layer_compiled`: the
        reference backend on the CPU, plain B and C norms, whose weights are read rather
        than the modules called, and `layer_compiles`), else None. (A small model's step
        pays this per layer: module attribute lookups are avoided.)"""
        if zx.device.type != "cpu" or resolve_backend(backend, zx) != "reference":
            return None
        mods, own = self._modules, self._parameters
        bn, cn = mods.get("B_norm"), mods.get("C_norm")
        if not (plain(bn, _RMSNormN) and plain(cn, _RMSNormN)):
            return None
        # (a parametrized tensor is no longer in _parameters: then the modules' chain runs)
        params = (bn._parameters.get("weight"), cn._parameters.get("weight"), own.get("dt_bias"),
                  own.get("C_bias"), own.get("B_bias"), own.get("D"))  # fmt: skip
        return params if layer_compiles(zx, self._sizes(), params, state) else None

    def step(
        self, u: torch.Tensor, state: Mamba3State, backend: str = "auto"
    ) -> tuple[torch.Tensor, Mamba3State]:
        """One timestep: u [B, M] -> (out [B, M], the next state). As the model's `step`: in
        place when no gradient is recorded (the state returned is the one passed in; on the
        Triton backend one kernel from in_proj's rows to y, `ops.mamba3_step_raw`, when the
        B and C norms are plain), functionally when one is (the state passed in is not
        changed; the reference step, which has a backward)."""
        check_tensor("u", u, (None, self.d_model))
        self._check_state(state, u.shape[0], u.device)
        records = torch.is_grad_enabled() and (
            u.requires_grad
            or any(p.requires_grad for p in self.parameters())
            or any(t.requires_grad for t in state)
        )
        if records:
            x, q, k, delta, A, trap, theta, z = self._inputs(u)
            y, state = mamba3_step_reference(
                x, q, k, delta, A, trap, theta, self.C_bias.squeeze(1),
                self.B_bias.squeeze(1), self.D, z, state,
            )  # fmt: skip
        elif self._inner_plain():  # the projections called, whatever they are
            w = self.decode_weights(projections=False)
            y = mamba3_step_raw(state, self.in_proj(u), w, backend)
        else:
            x, q, k, delta, A, trap, theta, z = self._inputs(u)
            y = mamba3_state_update(
                state, x, q, k, delta, A, trap, theta, self.C_bias.squeeze(1),
                self.B_bias.squeeze(1), self.D, z, backend,
            )  # fmt: skip
        return self.out_proj(y.flatten(-2).to(self.out_proj.weight.dtype)), state

    def sequence(self, x, state, seq_idx, backend, derived=None, last=False, stop=None):
        """What a block runs over a sequence (every mixer has it): (out, the final state).
        Nothing is derived ahead for Mamba-3 and every step's output is given. `stop` [B]
        int64: the state after step stop[b] of each row instead, the steps past it filler
        (their outputs are not the model's)."""
        if stop is None:
            return self(x, state, seq_idx, return_state=True, backend=backend)
        return self._run(x, state, None, backend, stop)

    def stops_rows(self) -> bool:
        """Whether `sequence` can stop each row at a step of its own: always (a delta of 0
        passes the state and the angles unchanged)."""
        return True

    def decode(self, x: torch.Tensor, state: Mamba3State, backend: str) -> torch.Tensor:
        """What a block runs for one decode step (every mixer has it): x [B, M] -> [B, M],
        `state` advanced in place (no gradient is recorded)."""
        return self.step(x, state, backend)[0]

    def plan_constants(self) -> tuple:
        """What `decode_weights` reads besides the parameters and the block's norm: A_floor
        and the B and C norms' eps (the decode plans' key, `MambaBackbone._plan_key`)."""
        mods = self._modules
        return (self.A_floor, mods["B_norm"].eps, mods["C_norm"].eps)

    def decode_weights(
        self, norm: nn.Module | None = None, projections: bool = True
    ) -> Mamba3StepWeights:
        """The tensors a decode step reads (views of the parameters), with the block's
        `norm` (its RMSNorm) when given. The projections' weights only with `projections`
        (a `fusable()` layer: the model's decode plan); without, they are None and the
        caller calls the modules (`_inner_plain()` is all the step then needs)."""
        norm_w = None if norm is None else _p(norm, "weight")
        eps = 0.0 if norm is None else norm.eps
        mods = self._modules
        bn, cn = mods["B_norm"], mods["C_norm"]
        in_w = _p(mods["in_proj"], "weight") if projections else None
        out_w = _p(mods["out_proj"], "weight") if projections else None
        return Mamba3StepWeights(
            norm_w, eps, in_w, out_w, _p(self, "C_bias").squeeze(1),
            _p(self, "B_bias").squeeze(1), _p(self, "D"), _p(self, "dt_bias"), self.A_floor,
            _p(cn, "weight"), _p(bn, "weight"), bn.eps, self._sizes(),
        )  # fmt: skip

    def _inner_plain(self) -> bool:
        """Whether the decode step may read the B and C norms' weights (each a plain module:
        layers/plain.py, with one eps, which the step kernels take for both); otherwise it
        calls them."""
        mods = self._modules
        return (
            plain(mods["B_norm"], _RMSNormN)
            and plain(mods["C_norm"], _RMSNormN)
            and mods["B_norm"].eps == mods["C_norm"].eps
        )

    def fusable(self) -> bool:
        """Whether a decode step may read every weight of the layer (`decode_weights`: the
        model's decode plan and the stack step, which take no projection bias); otherwise
        it calls the modules."""
        mods = self._modules
        return (
            plain(mods["in_proj"])
            and plain(mods["out_proj"])
            and mods["in_proj"].bias is None
            and mods["out_proj"].bias is None
            and self._inner_plain()
        )

    def _check_state(self, state: Mamba3State, batch: int, device) -> None:
        H, P, N, S = self.nheads, self.headdim, self.d_state, self.n_angles
        check_mamba3_state("state", state, batch, H, P, N, S, device)


# Keys (or their module) that upstream's Mamba3 has only in a mode mambakit does not build.
_UPSTREAM_ONLY = {
    "norm": "upstream is_outproj_norm=True (a gated RMSNorm before out_proj); mambakit's Mamba3 "
    "gates with silu(z) only, as upstream's is_outproj_norm=False",
    "mimo_x": "upstream is_mimo=True; mambakit's Mamba3 is SISO",
    "mimo_z": "upstream is_mimo=True; mambakit's Mamba3 is SISO",
    "mimo_o": "upstream is_mimo=True; mambakit's Mamba3 is SISO",
}


def _n_angles(d_state: int, rope_fraction: float) -> int:
    """Rotary angles per token, as mamba_ssm counts them (an even number of turned dims)."""
    pairs = int(d_state * rope_fraction)
    return (pairs - pairs % 2) // 2


def _strip_prefix(state_dict: Mapping[str, torch.Tensor], prefix: str) -> dict:
    """The entries under `prefix`, with it removed; an error if there are none."""
    if not prefix:
        return dict(state_dict)
    sd = {k[len(prefix) :]: v for k, v in state_dict.items() if k.startswith(prefix)}
    if not sd:
        raise ValueError(f"upstream Mamba3 state dict: no key starts with prefix {prefix!r}")
    return sd


class _RMSNormN(nn.Module):
    """RMSNorm over the last dim (d_state) with a learned weight, statistics in f32 (f64 for
    a float64 model), out in the input's dtype: `ops.rms_norm` (one kernel each way on the
    Triton backend, where this was some seven PyTorch ops forward and more backward)."""

    def __init__(self, n: int, eps: float = 1e-5, device=None, dtype=None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = no_weight_decay(nn.Parameter(torch.ones(n, device=device, dtype=dtype)))

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return _rms_norm(t, self.weight, self.eps, None, t.dtype, "auto")[0]
