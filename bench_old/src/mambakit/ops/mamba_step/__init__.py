"""One decode step of a Mamba block, fused: the weights it reads and the Triton launchers.

`StepWeights` gathers a block's tensors as the step reads them (views of the
parameters, A, D and the dt bias in f32); `ops.mamba_layer_step` and
`ops.norm_linear` dispatch between `launch.py` and `reference.py`. The fused
step runs eagerly or inside a CUDA graph; under torch.compile the model runs
the op chain instead.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class StepWeights(NamedTuple):
    norm_w: torch.Tensor  # [M] the block's RMSNorm weight
    eps: float
    in_w: torch.Tensor  # [2D, M]; its dtype is the compute dtype
    in_b: torch.Tensor | None  # [2D]
    conv_w: torch.Tensor  # [D, K]
    conv_b: torch.Tensor | None  # [D]
    x_w: torch.Tensor  # [R + 2N, D]
    dt_w: torch.Tensor  # [D, R]
    dt_bias: torch.Tensor  # [D] f32
    A: torch.Tensor  # [D, N] f32, -exp(A_log)
    D: torch.Tensor  # [D] f32
    out_w: torch.Tensor  # [M, D]
    out_b: torch.Tensor | None  # [M]


def mamba_layer_step_triton(hidden, residual, w, conv_state, ssm_state):
    from .launch import layer_step

    return layer_step(hidden, residual, w, conv_state, ssm_state)


def norm_linear_triton(x, weight, bias=None, residual=None, norm_weight=None, eps=1e-5):
    from .launch import linear

    return linear(x, weight, bias, residual=residual, norm_weight=norm_weight, eps=eps)
