"""The device a run asks for: "auto" (CUDA when present), "cpu", "cuda" or "cuda:N"."""

from __future__ import annotations

import torch


def resolve_device(spec: str) -> torch.device:
    """TrainConfig.device's value as a device, refusing CUDA where there is none."""
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(spec)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"TrainConfig.device is {spec!r} but no CUDA device is available")
    return dev
