"""Pre-norm residual block: r_{l+1} = r_l + mixer(rmsnorm(r_l)), the residual kept in f32.

The add and the norm are fused (`rms_norm(x, w, residual=r)` returns the new
residual and the normed input of the mixer), as in mamba_ssm's fused add-norm.
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import MambaConfig
from ..ops import _rms_norm, rms_norm
from .init import no_weight_decay
from .mamba2 import Mamba2
from .mamba3 import Mamba3, _RMSNormN
from .mixer import Mamba
from .plain import hooked, own_tensor, plain


class RMSNorm(nn.Module):
    """x * rsqrt(mean(x^2) + eps) * weight, statistics in f32."""

    def __init__(self, d: int, eps: float = 1e-5, device=None, dtype=None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = no_weight_decay(nn.Parameter(torch.ones(d, device=device, dtype=dtype)))

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None = None,
        out_dtype: torch.dtype | None = None,
        validate: bool = True,
        backend: str = "auto",
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(normed in out_dtype, residual_out = x + residual in f32). `validate=False`: the
        caller checked x and the residual (a block)."""
        norm = rms_norm if validate else _rms_norm
        return norm(x, self.weight, self.eps, residual, out_dtype, backend)

    def rows(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        out_dtype: torch.dtype,
        backend: str,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward` for a decode step's rows, inputs checked by the caller: the op on the
        weight when this norm is plain (a module call costs a few us, as much as two small
        ops), else the module itself, so its hooks run (layers/plain.py)."""
        if plain(self, RMSNorm):
            return _rms_norm(x, self._parameters["weight"], self.eps, residual, out_dtype, backend)
        return self(x, residual, out_dtype, validate=False, backend=backend)


class MambaBlock(nn.Module):
    """rmsnorm, then the mixer `cfg.mixer` picks: `Mamba` (Mamba-1), `Mamba2` or `Mamba3`
    (SISO)."""

    def __init__(self, cfg: MambaConfig, layer_idx: int, device=None, dtype=None) -> None:
        super().__init__()
        self.norm = RMSNorm(cfg.d_model, cfg.rms_norm_eps, device=device, dtype=dtype)
        if cfg.mixer == "mamba3":
            self.mixer = Mamba3(
                cfg.d_model,
                d_state=cfg.d_state,
                expand=cfg.expand,
                headdim=cfg.headdim,
                ngroups=cfg.ngroups,
                rope_fraction=cfg.rope_fraction,
                dt_min=cfg.dt_min,
                dt_max=cfg.dt_max,
                dt_init_floor=cfg.dt_init_floor,
                A_floor=cfg.A_floor,
                chunk_size=cfg.chunk_size,
                layer_idx=layer_idx,
                device=device,
                dtype=dtype,
            )
            return
        if cfg.mixer == "mamba2":
            self.mixer = Mamba2(
                cfg.d_model,
                d_state=cfg.d_state,
                d_conv=cfg.d_conv,
                conv_init=cfg.conv_init,
                expand=cfg.expand,
                headdim=cfg.headdim,
                d_ssm=cfg.d_ssm,
                ngroups=cfg.ngroups,
                A_init_range=cfg.A_init_range,
                D_has_hdim=cfg.D_has_hdim,
                rmsnorm=cfg.rmsnorm,
                norm_before_gate=cfg.norm_before_gate,
                dt_min=cfg.dt_min,
                dt_max=cfg.dt_max,
                dt_init_floor=cfg.dt_init_floor,
                dt_limit=cfg.dt_limit,
                bias=cfg.bias,
                conv_bias=cfg.conv_bias,
                chunk_size=cfg.chunk_size,
                norm_eps=cfg.rms_norm_eps,  # one eps for every norm, as transformers' Mamba2
                layer_idx=layer_idx,
                device=device,
                dtype=dtype,
            )
            return
        self.mixer = Mamba(
            cfg.d_model,
            d_state=cfg.d_state,
            d_conv=cfg.d_conv,
            expand=cfg.expand,
            dt_rank=cfg.dt_rank,
            dt_min=cfg.dt_min,
            dt_max=cfg.dt_max,
            dt_init=cfg.dt_init,
            dt_scale=cfg.dt_scale,
            dt_init_floor=cfg.dt_init_floor,
            conv_bias=cfg.conv_bias,
            bias=cfg.bias,
            layer_idx=layer_idx,
            device=device,
            dtype=dtype,
        )

    def forward(
        self,
        hidden: torch.Tensor,  # [B, T, M], the previous mixer's output (or the input)
        residual: torch.Tensor | None,  # [B, T, M] f32, None before the first block
        compute_dtype: torch.dtype,
        state=None,  # this layer's state (`state.py`: MambaLayerState, Mamba2State, Mamba3State)
        seq_idx: torch.Tensor | None = None,
        backend: str = "auto",  # the model resolves it once per call
        derived: tuple | None = None,  # what the model's plan holds for the mixer, if any
        last: bool = False,  # only the output at the last step is read (a prefill's last layer)
        at: torch.Tensor | None = None,  # [B, k] int64: also the states after these steps
        stop: torch.Tensor | None = None,  # [B] int64: each row's state after its own step
    ) -> tuple:
        """(the mixer's output, the residual [B, T, M] f32, the layer's final state). With
        `last`, a mixer may give its output at the last step alone ([B, 1, M]). With `at`
        (a Mamba-1 mixer), the layer's states after those steps come fourth. With `stop`
        (a Mamba-2 or Mamba-3 mixer, `stops_rows()`), the state is the one after step
        stop[b] of each row b, the steps past it filler."""
        normed, residual = self.norm(hidden, residual, compute_dtype, backend=backend)
        if at is not None:
            out, new, states = self.mixer.sequence(normed, state, seq_idx, backend, derived, at=at)
            return out, residual, new, states
        if stop is not None:
            out, new = self.mixer.sequence(normed, state, None, backend, derived, stop=stop)
            return out, residual, new
        out, new = self.mixer.sequence(normed, state, seq_idx, backend, derived, last)
        return out, residual, new

    def step(
        self,
        hidden: torch.Tensor,  # [B, M]
        residual: torch.Tensor | None,
        compute_dtype: torch.dtype,
        state,  # this layer's state, views advanced in place
        backend: str = "auto",
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode step through the modules: (the mixer's output [B, M], the residual
        [B, M] f32). The model runs a stack of `fusable()` blocks through its mixer's stack
        op instead (`ops.mamba_stack_step`, `ops.mamba3.mamba3_stack_step`)."""
        normed, residual = self._modules["norm"].rows(hidden, residual, compute_dtype, backend)
        return self._modules["mixer"].decode(normed, state, backend), residual

    def fusable(self) -> bool:
        """Whether a decode step may read the norm's and the mixer's weights (fused kernels,
        the model's decode plans); otherwise it calls the modules (layers/plain.py). Never
        where the block or its mixer is `hooked`."""
        mixer = self._modules["mixer"]
        return (
            plain(self._modules["norm"], RMSNorm)
            and mixer.fusable()
            and not hooked(self)
            and not hooked(mixer)
        )

    def window_weights(self, h: torch.Tensor) -> tuple | None:
        """What the compiled stack of Mamba-3 blocks (`ops.mamba3.layers_compiled`) reads
        of this block: (its norm's, in_proj's, the B and C norms', dt_bias, C_bias, B_bias,
        D and out_proj's weights; (the norm's eps, the B and C norms' eps, A_floor, the
        mixer's sizes)), where the block is a plain Mamba-3 one (every module of its exact
        class, no hook: `layers/plain.py`), its projections without bias, and its weights
        its own plain tensors in h's dtype on h's device; else None (the block is called).
        (Checked on every forward, in a few us: a hook may come at any time.)"""
        mixer, norm = self._modules["mixer"], self._modules["norm"]
        if type(mixer) is not Mamba3 or type(norm) is not RMSNorm:
            return None
        mods, own = mixer._modules, mixer._parameters
        in_proj, out_proj, bn, cn = (mods["in_proj"], mods["out_proj"], mods["B_norm"],
                                     mods["C_norm"])  # fmt: skip
        if type(in_proj) is not nn.Linear or type(out_proj) is not nn.Linear:
            return None
        if type(bn) is not _RMSNormN or type(cn) is not _RMSNormN:
            return None
        if any(map(hooked, (self, mixer, norm, in_proj, out_proj, bn, cn))):
            return None
        if in_proj.bias is not None or out_proj.bias is not None:
            return None
        weights = (
            norm._parameters.get("weight"), in_proj._parameters.get("weight"),
            bn._parameters.get("weight"), cn._parameters.get("weight"), own.get("dt_bias"),
            own.get("C_bias"), own.get("B_bias"), own.get("D"), out_proj._parameters.get("weight"),
        )  # fmt: skip
        if not all(own_tensor(w, h) for w in weights):
            return None
        return weights, (norm.eps, bn.eps, cn.eps, mixer.A_floor, mixer._sizes())

    def hooked(self) -> bool:
        """Whether a hook watches the block or its mixer: a step then runs as the forward
        over one token (`MambaBackbone.step`), which calls both; `step` here does not."""
        return hooked(self) or hooked(self._modules["mixer"])

    def decode_weights(self):
        """The tensors of the fused decode step of this block (its mixer's, with the norm)."""
        return self._modules["mixer"].decode_weights(self._modules["norm"])
