"""Initialisation of a Mamba layer, as mamba_ssm does it.

- A_log: S4D-real, A[d, n] = -(n + 1) for every channel d, stored as log(n + 1).
- D: ones.
- dt_proj.weight: uniform(+-dt_rank**-0.5 * dt_scale) ("random") or that constant.
- dt_proj.bias: softplus^-1(dt) with dt log-uniform in [dt_min, dt_max], floored,
  so softplus(bias) starts inside the chosen range of time steps.
- out_proj.weight: rescaled by 1/sqrt(n_layers) (GPT-2's prenorm residual rule).
- embeddings: normal(0, initializer_range); Linear biases zero.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
from torch import nn


@torch.no_grad()
def init_A_log(A_log: torch.Tensor) -> None:
    d_inner, d_state = A_log.shape
    A = torch.arange(1, d_state + 1, dtype=torch.float32, device=A_log.device)
    A_log.copy_(torch.log(A).expand(d_inner, d_state))


@torch.no_grad()
def init_dt_proj(
    dt_proj: nn.Linear,
    dt_rank: int,
    dt_min: float,
    dt_max: float,
    dt_init: str = "random",
    dt_scale: float = 1.0,
    dt_init_floor: float = 1e-4,
) -> None:
    std = dt_rank**-0.5 * dt_scale
    if dt_init == "constant":
        dt_proj.weight.fill_(std)
    elif dt_init == "random":
        dt_proj.weight.uniform_(-std, std)
    else:
        raise ValueError(f"dt_init must be 'random' or 'constant', got {dt_init!r}")
    d_inner = dt_proj.weight.shape[0]
    u = torch.rand(d_inner, device=dt_proj.weight.device, dtype=torch.float32)
    dt = torch.exp(u * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
    dt = dt.clamp(min=dt_init_floor)
    inv_softplus = dt + torch.log(-torch.expm1(-dt))
    dt_proj.bias.copy_(inv_softplus)


@torch.no_grad()
def init_model_weights(
    module: nn.Module, n_layers: int, initializer_range: float, rescale_prenorm_residual: bool
) -> None:
    """Whole-model pass after every layer has its own init (mamba_ssm `_init_weights`)."""
    for name, m in module.named_modules():
        if isinstance(m, nn.Linear) and m.bias is not None and not name.endswith("dt_proj"):
            m.bias.zero_()
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, std=initializer_range)
    if rescale_prenorm_residual:
        for name, p in module.named_parameters():
            if name.endswith("out_proj.weight"):
                nn.init.kaiming_uniform_(p, a=math.sqrt(5))
                p /= math.sqrt(n_layers)


def no_weight_decay(p: nn.Parameter) -> nn.Parameter:
    """Mark a parameter that AdamW must not decay (A_log, D, dt bias, norms, biases)."""
    p._no_weight_decay = True
    return p


@contextlib.contextmanager
def no_decay_marks_kept(model: nn.Module) -> Iterator[None]:
    """Within it `model`'s parameters may be made anew (`to_empty`, sharding), which drops
    their `no_weight_decay` marks: after it they are put back, by name."""
    keep = {n for n, p in model.named_parameters() if getattr(p, "_no_weight_decay", False)}
    yield
    for n, p in model.named_parameters():
        if n in keep:
            p._no_weight_decay = True
