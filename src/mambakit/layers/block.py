"""Pre-norm residual block: r_{l+1} = r_l + mixer(rmsnorm(r_l)), the residual kept in f32.

The add and the norm are fused (`rms_norm(x, w, residual=r)` returns the new
residual and the normed input of the mixer), as in mamba_ssm's fused add-norm.
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import MambaConfig
from ..ops import StepWeights, mamba_layer_step, rms_norm
from .init import no_weight_decay
from .mamba3 import Mamba3
from .mixer import Mamba, MixerWeights, _p, mixer_weights
from .plain import plain


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
        """(normed in out_dtype, residual_out = x + residual in f32)."""
        return rms_norm(
            x, self.weight, self.eps, residual=residual, out_dtype=out_dtype, backend=backend,
            validate=validate,
        )  # fmt: skip

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
            return rms_norm(x, self._parameters["weight"], self.eps, residual, out_dtype,
                            backend, False)  # fmt: skip
        return self(x, residual, out_dtype, validate=False, backend=backend)


class MambaBlock(nn.Module):
    """rmsnorm, then the mixer `cfg.mixer` picks: `Mamba` (Mamba-1) or `Mamba3` (SISO)."""

    def __init__(self, cfg: MambaConfig, layer_idx: int, device=None, dtype=None) -> None:
        super().__init__()
        self.norm = RMSNorm(cfg.d_model, cfg.rms_norm_eps, device=device, dtype=dtype)
        self.mamba3 = cfg.mixer == "mamba3"
        if self.mamba3:
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
        state=None,  # this layer's state: (conv, ssm) for Mamba-1, a Mamba3State for Mamba-3
        seq_idx: torch.Tensor | None = None,
        backend: str = "auto",  # the model resolves it once per call
        derived: tuple | None = None,  # Mamba-1: (A, D, dt bias) from the decode plan
        last: bool = False,  # only the output at the last step is read (a prefill's last layer)
    ) -> tuple[torch.Tensor, torch.Tensor, tuple]:
        """(the mixer's output, the residual [B, T, M] f32, the layer's final state). With
        `last`, a Mamba-1 mixer on the Triton backend without autograd gives its output at
        the last step alone ([B, 1, M]); otherwise every step's."""
        normed, residual = self.norm(hidden, residual, compute_dtype, backend=backend)
        last = last and not self.mamba3 and backend == "triton" and self.mixer.fusable()
        if last and not torch.is_grad_enabled() and not torch.compiler.is_compiling():
            conv, ssm = (None, None) if state is None else state
            out, new = self.mixer._last_forward(normed, conv, ssm, seq_idx, derived)
            return out, residual, new
        if self.mamba3:
            out, new = self.mixer(normed, state, seq_idx, return_state=True, backend=backend)
        else:
            conv, ssm = (None, None) if state is None else state
            out, new = self.mixer(
                normed, conv, ssm, seq_idx, return_state=True, backend=backend, derived=derived
            )
        return out, residual, new

    def step(
        self,
        hidden: torch.Tensor,  # [B, M]
        residual: torch.Tensor | None,
        compute_dtype: torch.dtype,
        conv_state: torch.Tensor,
        ssm_state: torch.Tensor,
        backend: str = "auto",
        fused: bool = False,
        weights: MixerWeights | None = None,
        fused_weights: StepWeights | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode step: (the mixer's output [B, M], the residual [B, M] f32).

        `fused` (the Triton backend, outside torch.compile): add, norm and mixer as
        one `mamba_layer_step` when the weights are in the compute dtype. `weights` and
        `fused_weights`: the mixer's tensors when the caller holds them (the model's
        decode plan); None derives them from the parameters. Both only for a block that
        is `fusable()` (the model checks): otherwise the modules are called."""
        mixer = self._modules["mixer"]
        if fused:
            w = fused_weights if fused_weights is not None else self.fused_weights(weights)
            if w.in_w.dtype == compute_dtype:
                return mamba_layer_step(hidden, residual, w, conv_state, ssm_state, backend, False)
        normed, residual = self._modules["norm"].rows(hidden, residual, compute_dtype, backend)
        return mixer.step(normed, conv_state, ssm_state, backend, weights), residual

    def fusable(self) -> bool:
        """Whether a decode step may read the norm's and the mixer's weights (fused kernels,
        the model's decode plans); otherwise it calls the modules (layers/plain.py)."""
        return plain(self._modules["norm"], RMSNorm) and self._modules["mixer"].fusable()

    def step_mamba3(
        self,
        hidden: torch.Tensor,  # [B, M]
        residual: torch.Tensor | None,
        compute_dtype: torch.dtype,
        state,  # this layer's Mamba3State, views advanced in place
        backend: str = "auto",
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode step of a Mamba-3 block: (the mixer's output, the residual).

        On the Triton backend with the weights in the compute dtype, outside autograd: at
        batch 1 three kernels chained by programmatic dependent launch, the add, the norm
        and in_proj streaming its weight (`ops.mamba_step.kernels.linear`, which also
        stores the residual), the step kernel, out_proj streamed; above, a norm launch,
        cuBLAS, the step kernel, cuBLAS."""
        norm = self._modules["norm"]
        mixer = self._modules["mixer"]
        if self.fusable():
            in_w, out_w = _p(mixer.in_proj, "weight"), _p(mixer.out_proj, "weight")
            norm_w = _p(norm, "weight")
            records = torch.is_grad_enabled() and (
                norm_w.requires_grad or (residual is not None and residual.requires_grad)
            )
            if (
                not records
                and mixer._kernels(hidden, state, backend)
                and in_w.dtype == out_w.dtype == compute_dtype
                and mixer.in_proj.bias is None
                and mixer.out_proj.bias is None
            ):
                from ..ops.mamba_step.kernels import linear

                zxbc, residual = linear(
                    hidden, in_w, residual=residual, norm_weight=norm_w, eps=norm.eps,
                    return_residual=True,
                )  # fmt: skip
                y = mixer.state_update_(zxbc, state)
                return linear(y.flatten(-2), out_w), residual
        normed, residual = self._modules["norm"].rows(hidden, residual, compute_dtype, backend)
        return mixer.step_(normed, state, backend), residual

    def fused_weights(self, weights: MixerWeights | None = None) -> StepWeights:
        """The tensors of the fused decode step, from the mixer's `MixerWeights` (derived
        from its parameters when None)."""
        mixer = self._modules["mixer"]
        mods = mixer._modules
        (in_w, x_w, dt_w, out_w), conv_w, (A, D, dt_bias) = (
            weights if weights is not None else mixer_weights(mixer)
        )
        norm = self._modules["norm"]
        return StepWeights(
            _p(norm, "weight"), norm.eps, in_w[0], _p(mods["in_proj"], "bias"), conv_w,
            _p(mods["conv1d"], "bias"), x_w[0], dt_w[0], dt_bias, A, D, out_w[0],
            _p(mods["out_proj"], "bias"),
        )  # fmt: skip
