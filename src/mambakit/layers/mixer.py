"""The Mamba mixer layer (selective SSM block of the paper, Figure 3).

B batch, T time, M = d_model, D = d_inner = expand * M, N = d_state, K = d_conv,
R = dt_rank. Parameter names and shapes equal Hugging Face `MambaMixer` and
mamba_ssm `Mamba`, so state dicts map one to one.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..config import auto_dt_rank
from ..ops import (
    StepWeights,
    _mamba_inner,
    causal_conv1d,
    causal_conv1d_update,
    mamba_last,
    selective_scan,
    selective_state_update,
)
from ..ops._checks import check_tensor, state_dtype
from ..ops.causal_conv1d.reference import conv_states_at
from ..ops.decode import _mamba_mixer_step
from . import mamba_ssm_cache
from .init import init_A_log, init_dt_proj, no_weight_decay
from .plain import hooked, plain

# in_proj's dt rows past a row's stop (Mamba-2's and Mamba-3's `sequence(..., stop=)`):
# softplus(dt + dt_bias) is exactly 0 there in f32, bf16 and f16, so a step with it passes
# the state unchanged (a decay of e^0 = 1, no input)
FREEZE_DT = -1e4


class Mamba(nn.Module):
    """Selective SSM mixer: [B, T, M] -> [B, T, M], with its recurrent state in and out.

    With `return_state=True` it also takes the state of this layer, conv [B, K-1, D]
    and ssm [B, D, N] (both f32), and returns the final one, differentiable. Between
    in_proj and out_proj it runs `mamba_inner` (ops/mamba_inner), which on the Triton
    backend is one autograd node that recomputes the conv output and delta in the
    backward.

    A drop-in for `mamba_ssm.Mamba` too: the same constructor (`use_fast_path` is
    accepted; the fused path is always on), parameters and initialisation, and its
    inference cache protocol in its layouts: `forward(hidden_states, inference_params)`
    (`key_value_memory_dict[layer_idx]`, `seqlen_offset`), `allocate_inference_cache`
    and `step(hidden_states [B, 1, M], conv_state [B, D, K], ssm_state [B, D, N])`,
    whose conv cache holds the last K inputs where mambakit's holds K-1 (`mamba_ssm_cache`).
    """

    def __init__(
        self,
        d_model: int,
        d_state: int = 16,
        d_conv: int = 4,
        expand: int = 2,
        dt_rank: int | str = "auto",
        dt_min: float = 0.001,
        dt_max: float = 0.1,
        dt_init: str = "random",
        dt_scale: float = 1.0,
        dt_init_floor: float = 1e-4,
        conv_bias: bool = True,
        bias: bool = False,
        use_fast_path: bool = True,  # mamba_ssm's flag: accepted, the fused path is always on
        layer_idx: int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.use_fast_path = use_fast_path
        for name, v in (("d_model", d_model), ("d_state", d_state), ("expand", expand)):
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"Mamba: {name} must be a positive int, got {v!r}")
        if not isinstance(d_conv, int) or d_conv < 2:
            raise ValueError(f"Mamba: d_conv must be an int >= 2, got {d_conv!r}")
        if not (0 < dt_min <= dt_max < math.inf):  # (an infinite dt_max: every dt bias inf)
            raise ValueError(f"Mamba: need 0 < dt_min <= dt_max < inf, got {dt_min}, {dt_max}")
        if isinstance(dt_scale, bool) or not 0 <= dt_scale < math.inf:  # (uniform_ named none)
            raise ValueError(f"Mamba: dt_scale must be a finite number >= 0, got {dt_scale!r}")
        if not dt_init_floor > 0:  # (NaN too: it would make every dt bias NaN)
            raise ValueError(f"Mamba: dt_init_floor must be > 0, got {dt_init_floor}")
        self.d_model = d_model
        self.d_state = d_state
        self.d_conv = d_conv
        self.d_inner = expand * d_model
        self.dt_rank = auto_dt_rank(d_model) if dt_rank == "auto" else dt_rank
        if isinstance(self.dt_rank, bool) or not isinstance(self.dt_rank, int) or self.dt_rank <= 0:
            raise ValueError(f"Mamba: dt_rank must be 'auto' or a positive int, got {dt_rank!r}")
        self.layer_idx = layer_idx
        fk = {"device": device, "dtype": dtype}
        D, N, R = self.d_inner, d_state, self.dt_rank

        self.in_proj = nn.Linear(d_model, 2 * D, bias=bias, **fk)
        self.conv1d = nn.Conv1d(D, D, d_conv, groups=D, padding=d_conv - 1, bias=conv_bias, **fk)
        self.x_proj = nn.Linear(D, R + 2 * N, bias=False, **fk)
        self.dt_proj = nn.Linear(R, D, bias=True, **fk)
        self.A_log = no_weight_decay(nn.Parameter(torch.empty(D, N, **fk)))
        self.D = no_weight_decay(nn.Parameter(torch.ones(D, **fk)))
        self.out_proj = nn.Linear(D, d_model, bias=bias, **fk)
        no_weight_decay(self.dt_proj.bias)
        init_A_log(self.A_log)
        init_dt_proj(self.dt_proj, R, dt_min, dt_max, dt_init, dt_scale, dt_init_floor)

    def _ssm_params(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """A = -exp(A_log), D and the dt bias, in f32 (f64 for a float64 model). Only the
        fused paths read the bias (`inner_plain`); a dt_proj called as a module adds its own,
        and may have none to read (None then)."""
        return ssm_params(self.A_log, self.D, getattr(self.dt_proj, "bias", None))

    def inner_plain(self) -> bool:
        """Whether the fused inner part may read conv1d's, x_proj's and dt_proj's weights
        (each a plain module: layers/plain.py); otherwise it calls them."""
        mods = self._modules
        return plain(mods["x_proj"]) and plain(mods["dt_proj"]) and plain(mods["conv1d"], nn.Conv1d)

    def fusable(self) -> bool:
        """Whether the decode step may read every projection's and the conv's weights (the
        model's decode plans and fused kernels); otherwise it calls the modules."""
        mods = self._modules
        return plain(mods["in_proj"]) and plain(mods["out_proj"]) and self.inner_plain()

    def forward(
        self,
        x: torch.Tensor,  # [B, T, M]
        conv_state: torch.Tensor | None = None,  # [B, K-1, D]
        ssm_state: torch.Tensor | None = None,  # [B, D, N]
        seq_idx: torch.Tensor | None = None,  # [B, T] int32
        return_state: bool = False,
        inference_params=None,  # mamba_ssm's cache object (also accepted second, positionally)
        backend: str = "auto",
        derived: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """`derived`: (A, D, dt bias) as `ssm_params` gives them, when the caller holds them
        already (the model's decode plan, `inference.plan`, without autograd)."""
        if inference_params is None and hasattr(conv_state, "key_value_memory_dict"):
            inference_params, conv_state = conv_state, None  # mixer(hidden, inference_params)
        if inference_params is not None:
            return mamba_ssm_cache.cached_forward(self, x, inference_params)
        check_tensor("x", x, (None, None, self.d_model))
        Bsz = x.shape[0]
        if conv_state is not None:
            check_tensor(
                "conv_state", conv_state, (Bsz, self.d_conv - 1, self.d_inner), device=x.device
            )
        if ssm_state is not None:
            check_tensor("ssm_state", ssm_state, (Bsz, self.d_inner, self.d_state), device=x.device)
        xz = self.in_proj(x)  # [B, T, 2D]
        y, conv_out, ssm_out = self._inner(xz, conv_state, ssm_state, seq_idx, backend, derived)
        out = self.out_proj(y)
        return (out, (conv_out, ssm_out)) if return_state else out

    def _inner(self, xz, conv_state, ssm_state, seq_idx, backend, derived, at=None) -> tuple:
        """Between in_proj and out_proj: (y [B, T, D], final conv and ssm states, and with
        `at` the states after those steps). The fused op on the weights when the modules
        are plain (`derived`: A, D, dt bias held by the caller), else the modules' chain
        (their adapters and hooks take part). x and the states are checked by the caller."""
        if not self.inner_plain():
            return self._inner_modules(xz, conv_state, ssm_state, seq_idx, backend, at)
        A, D, dt_bias = self._ssm_params() if derived is None else derived
        w = (self.conv1d.weight.squeeze(1), self.conv1d.bias, self.x_proj.weight,
             self.dt_proj.weight, A, D, dt_bias)  # fmt: skip
        return _mamba_inner(xz, *w, conv_state, ssm_state, seq_idx, backend, states_at=at)

    def _inner_modules(
        self,
        xz: torch.Tensor,  # [B, T, 2D]
        conv_state: torch.Tensor | None,
        ssm_state: torch.Tensor | None,
        seq_idx: torch.Tensor | None,
        backend: str,
        at: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, ...]:
        """`mamba_inner` calling conv1d (unless plain), x_proj and dt_proj as modules, so
        their adapters and hooks take part: (y [B, T, D], final conv and ssm states), and
        with `at` the conv and ssm states after those steps."""
        Dn, N, R = self.d_inner, self.d_state, self.dt_rank
        x_in, z = xz.split(Dn, dim=-1)  # (the backward of two slices: two zero-filled [B, T, 2D])
        u, conv_out = conv_silu(self.conv1d, x_in, conv_state, seq_idx, backend, self.d_conv)
        dt_r, B, C = self.x_proj(u).split([R, N, N], dim=-1)
        delta = self.dt_proj(dt_r)  # with dt_proj's own bias
        A, D, _ = self._ssm_params()
        out = selective_scan(
            u, delta, A, B, C, D=D, z=z, delta_softplus=True, initial_state=ssm_state,
            seq_idx=seq_idx, return_final_state=True, backend=backend, states_at=at,
        )  # fmt: skip
        if at is None:
            return out[0], conv_out, out[1]
        conv_at = conv_states_at(x_in, at, self.d_conv, conv_state, seq_idx)
        return out[0], conv_out, out[1], conv_at, out[2]

    def sequence(
        self,
        x: torch.Tensor,  # [B, T, M], the normed input
        state: tuple | None,  # (conv [B, K-1, D], ssm [B, D, N]) or None
        seq_idx: torch.Tensor | None,
        backend: str,
        derived: tuple | None = None,
        last: bool = False,
        at: torch.Tensor | None = None,
    ) -> tuple:
        """What a block runs over a sequence (every mixer has it): (out, the final state).
        `derived`: (A, D, dt bias) as `ssm_params` gives them, when the caller holds them
        (the model's plan, without autograd). `last`: only the last step's output is read
        (a prefill's last layer); without autograd and with plain modules the output is
        that step's alone ([B, 1, M]), from `ops.mamba_last`. `at` [B, k] int64 (distinct
        steps, checked by the caller): also the states after those steps, (out, final
        state, (conv [B, k, K-1, D], ssm [B, k, D, N])) (`MambaLM.states_at`)."""
        conv, ssm = (None, None) if state is None else state
        if at is not None:
            return self._sequence_at(x, conv, ssm, seq_idx, backend, derived, at)
        if (
            last
            and self.fusable()
            and not hooked(self)  # its hooks run where it is called, below
            and not torch.is_grad_enabled()
            and not torch.compiler.is_compiling()
        ):
            check_tensor("x", x, (None, None, self.d_model))
            w = self.decode_weights()
            if derived is not None:
                w = w._replace(A=derived[0], D=derived[1], dt_bias=derived[2])
            out, conv_out, ssm_out = mamba_last(x, w, conv, ssm, seq_idx, backend)
            return out, (conv_out, ssm_out)
        return self(x, conv, ssm, seq_idx, return_state=True, backend=backend, derived=derived)

    def _sequence_at(self, x, conv, ssm, seq_idx, backend, derived, at) -> tuple:
        """`sequence` with the states after the steps `at`."""
        check_tensor("x", x, (None, None, self.d_model))
        y, conv_out, ssm_out, conv_at, ssm_at = self._inner(
            self.in_proj(x), conv, ssm, seq_idx, backend, derived, at
        )
        return self.out_proj(y), (conv_out, ssm_out), (conv_at, ssm_at)

    def decode(self, x: torch.Tensor, state: tuple, backend: str) -> torch.Tensor:
        """What a block runs for one decode step (every mixer has it): x [B, M] -> [B, M],
        `state` (conv, ssm) advanced in place."""
        return self.step(x, state[0], state[1], backend)

    def step(
        self,
        x: torch.Tensor,  # [B, M]
        conv_state: torch.Tensor,  # [B, K-1, D], updated in place
        ssm_state: torch.Tensor,  # [B, D, N], updated in place
        backend: str = "auto",
    ):
        """One timestep of decode: the states advance in place; returns [B, M]. Where a
        gradient is recorded it is the forward over one step, its final states copied into
        the ones passed in (a leaf state that requires grad cannot be: pass a clone).

        Given mamba_ssm's form, x [B, 1, M] with its conv cache [B, D, K], it is mamba_ssm's
        step: returns (out [B, 1, M], conv_state, ssm_state) (`mamba_ssm_cache.step`).

        At batch 1 on a CPU the step is bound by per-call overhead, not arithmetic: it skips
        the per-op checks (the backbone checked the state) and runs the op chain on the
        parameters (`ops.mamba_step.chain`) when every module is plain, else calls them."""
        if x.dim() == 3:
            return mamba_ssm_cache.step(self, x, conv_state, ssm_state)
        if torch.is_grad_enabled() and (
            x.requires_grad
            or conv_state.requires_grad
            or ssm_state.requires_grad
            or any(p.requires_grad for p in self.parameters())
        ):  # recorded: the forward over one step on copies (which autograd may keep), then
            # the states written back (the in-place step would overwrite what it saved)
            out, (conv, ssm) = self(x[:, None], conv_state.clone(), ssm_state.clone(),
                                    return_state=True, backend=backend)  # fmt: skip
            conv_state.copy_(conv)
            ssm_state.copy_(ssm)
            return out[:, 0]
        if not self.fusable():
            return self._step_modules(x, conv_state, ssm_state, backend)
        return _mamba_mixer_step(x, self.decode_weights(), conv_state, ssm_state, backend)

    def _step_modules(
        self, x: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor, backend: str
    ) -> torch.Tensor:
        """`step` calling the projections (and conv1d unless plain) as modules."""
        Dn, N, R = self.d_inner, self.d_state, self.dt_rank
        xz = self.in_proj(x)  # [B, 2D]
        u = conv_silu_step(self.conv1d, xz[:, :Dn], conv_state, backend)
        dt_r, B, C = self.x_proj(u).split([R, N, N], dim=-1)
        delta = self.dt_proj(dt_r)
        A, D, _ = self._ssm_params()
        y = selective_state_update(
            ssm_state, u, delta, A, B, C, D, xz[:, Dn:], None, True, backend=backend
        )
        return self.out_proj(y)

    def plan_constants(self) -> tuple:
        """What `decode_weights` reads besides the parameters and the block's norm: nothing
        (the decode plans' key, `MambaBackbone._plan_key`)."""
        return ()

    def decode_weights(self, norm: nn.Module | None = None) -> StepWeights:
        """The tensors a decode step reads (views of the parameters; A, D and the dt bias in
        f32), with the block's `norm` (its RMSNorm) when given; only for a `fusable()` layer.
        Read from the parameter dicts: an nn.Module attribute lookup costs about 1 us, as
        much as one of a batch-1 CPU step's ops."""
        mods = self._modules
        A, D, dt_bias = ssm_params(_p(self, "A_log"), _p(self, "D"), _p(mods["dt_proj"], "bias"))
        return StepWeights(
            None if norm is None else _p(norm, "weight"), 0.0 if norm is None else norm.eps,
            _p(mods["in_proj"], "weight"), _p(mods["in_proj"], "bias"),
            _p(mods["conv1d"], "weight").squeeze(1), _p(mods["conv1d"], "bias"),
            _p(mods["x_proj"], "weight"), _p(mods["dt_proj"], "weight"), dt_bias, A, D,
            _p(mods["out_proj"], "weight"), _p(mods["out_proj"], "bias"),
        )  # fmt: skip

    def allocate_inference_cache(self, batch_size: int, max_seqlen: int, dtype=None, **kwargs):
        """mamba_ssm's cache of this layer: (conv [B, D, K], ssm [B, D, N]) zeros."""
        return mamba_ssm_cache.allocate(self, batch_size, dtype)

    def _get_states_from_cache(self, inference_params, batch_size: int, initialize_states=False):
        """mamba_ssm's: this layer's (conv, ssm) cache in `inference_params`, made on first use."""
        return mamba_ssm_cache.states_from_cache(
            self, inference_params, batch_size, initialize_states
        )


def ssm_params(A_log: torch.Tensor, D: torch.Tensor, dt_bias: torch.Tensor | None) -> tuple:
    """(A = -exp(A_log), D, dt bias) in the state dtype (f32; f64 for a float64 model): the one
    place the layer's SSM parameters are derived, for the forward, the decode steps and the
    decode plan (`inference.plan`)."""
    f = state_dtype(A_log)
    return -torch.exp(A_log.to(f)), D.to(f), None if dt_bias is None else dt_bias.to(f)


def conv_silu(
    conv: nn.Module,
    x_in: torch.Tensor,  # [B, T, D]
    conv_state: torch.Tensor | None,  # [B, K-1, D]
    seq_idx: torch.Tensor | None,
    backend: str,
    d_conv: int,  # K: the layer's (a wrapper, peft's LoRA conv, may not say its kernel_size)
) -> tuple[torch.Tensor, torch.Tensor]:
    """silu(causal conv of x_in) and the final conv state [B, K-1, D]: `ops.causal_conv1d` on
    the weights of a plain conv1d, else the module itself (its adapters and hooks run)."""
    if plain(conv, nn.Conv1d):
        return causal_conv1d(
            x_in, conv.weight.squeeze(1), conv.bias, initial_state=conv_state, seq_idx=seq_idx,
            activation="silu", return_final_state=True, backend=backend,
        )  # fmt: skip
    return _conv_module(conv, x_in, conv_state, seq_idx, d_conv)


def conv_silu_step(
    conv: nn.Module,
    x_in: torch.Tensor,  # [B, D], one timestep
    conv_state: torch.Tensor,  # [B, K-1, D], advanced in place
    backend: str,
) -> torch.Tensor:
    """`conv_silu` for one decode step, the state in place: silu(conv) [B, D]."""
    if plain(conv, nn.Conv1d):
        return causal_conv1d_update(conv_state, x_in, conv.weight.squeeze(1), conv.bias, "silu",
                                    backend=backend)  # fmt: skip
    out, new = _conv_module(conv, x_in[:, None], conv_state, None, conv_state.shape[1] + 1)
    conv_state.copy_(new)
    return out[:, 0]


def _conv_module(
    conv: nn.Module,
    x_in: torch.Tensor,  # [B, T, D]
    conv_state: torch.Tensor | None,  # [B, K-1, D]
    seq_idx: torch.Tensor | None,
    K: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The causal conv and its SiLU through the conv1d module itself (wrapped or hooked):
    (silu(conv) [B, T, D], final state [B, K-1, D]). The module pads K-1 on both sides,
    so its output at position j of [state; x_in] covers that position and the K-1 before."""
    if seq_idx is not None:
        raise NotImplementedError(
            "seq_idx with a conv1d that is not a plain nn.Conv1d (an adapter or a hook on "
            "it): the module cannot reset its window at document starts"
        )
    Bsz, T, Dn = x_in.shape
    if conv_state is None:
        conv_state = x_in.new_zeros(Bsz, K - 1, Dn)
    window = torch.cat([conv_state.to(x_in.dtype), x_in], 1)  # [B, K-1+T, D]
    out = conv(window.mT)[..., K - 1 : K - 1 + T].mT.contiguous()  # [B, T, D]
    return F.silu(out), window[:, T:].to(state_dtype(x_in))


def _p(module: nn.Module, name: str) -> torch.Tensor | None:
    """module.<name> from its parameter dict, without nn.Module.__getattr__'s cost; a
    parametrized weight (not in the dict: computed on access) goes through getattr."""
    params = module._parameters
    return params[name] if name in params else getattr(module, name)
