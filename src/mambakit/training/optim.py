"""AdamW with the usual Mamba parameter groups, and the warmup + cosine schedule."""

from __future__ import annotations

import math

import torch
from torch import nn

# the parameters of more than one dimension that are not decayed, by name (A_log of Mamba-1
# is [D, N]; Mamba-3's B and C biases are [H, 1, N]): a parameter made anew (`to_empty`,
# a conversion that swaps tensors) loses the `_no_weight_decay` mark but keeps its name
NO_DECAY_NAMES = ("A_log", "B_bias", "C_bias")


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """No decay on norms, biases, A_log, D and the dt bias (`_no_weight_decay`, 1-d, or named
    in `NO_DECAY_NAMES`)."""
    decay, no_decay, seen = [], [], set()
    for name, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        named = name.rsplit(".", 1)[-1] in NO_DECAY_NAMES
        if getattr(p, "_no_weight_decay", False) or p.dim() < 2 or named:
            no_decay.append(p)
        else:
            decay.append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def make_optimizer(
    model: nn.Module,
    lr: float,
    weight_decay: float,
    betas: tuple[float, float],
    eps: float,
    capturable: bool = False,
) -> torch.optim.AdamW:
    """AdamW over `param_groups`, fused (one kernel a step) where PyTorch has the kernel for
    the parameters' device: CUDA, and the CPU (on 2 cores the clip and step take 0.67 ms at
    d_model 128 x 3 layers against 2.13 with the foreach step, and 106 ms at 130m against
    603, `Trainer` folding the clip into the fused step: scripts/optimizer_timing.py), else
    the foreach one."""
    device = next(model.parameters()).device
    kwargs: dict = {"betas": betas, "eps": eps}
    if device.type == "cuda" and capturable:
        # CUDA-graph replay: lr lives in a tensor the schedule fills in place
        kwargs["capturable"] = True
        lr = torch.tensor(lr, device=device)
    if _fused_kernels(device):
        kwargs["fused"] = True
    return torch.optim.AdamW(param_groups(model, weight_decay), lr=lr, **kwargs)


def _fused_kernels(device: torch.device) -> bool:
    """Whether PyTorch has fused optimizer kernels for this device (it checks only at the
    first step)."""
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices
    except ImportError:  # a PyTorch without the list
        return device.type == "cuda"
    return device.type in _get_fused_kernels_supported_devices()


class WarmupCosine:
    """lr multiplier: linear warmup to 1, then cosine down to `min_ratio` at `total` steps."""

    def __init__(self, warmup: int, total: int, min_ratio: float) -> None:
        self.warmup, self.total, self.min_ratio = warmup, total, min_ratio

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        span = max(1, self.total - self.warmup)
        progress = min(1.0, (step - self.warmup) / span)
        return self.min_ratio + (1 - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def clip_factor(grads: list[torch.Tensor], max_norm: float, out: torch.Tensor) -> torch.Tensor:
    """The gradients' total 2-norm, with max(1, (norm + 1e-6) / max_norm) written into `out`:
    the inverse of `clip_grad_norm_`'s factor, which a fused AdamW applies as its
    `grad_scale` (it divides each gradient by it as it reads it)."""
    norm = nn.utils.get_total_norm(grads, foreach=True)
    torch.clamp((norm + 1e-6) / max_norm, min=1.0, out=out)
    return norm
