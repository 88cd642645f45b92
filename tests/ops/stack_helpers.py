"""What the whole-stack decode tests share (test_stack_bodies.py, test_cpu_jit*.py): a
small backbone with random weights and random per-row states, and the comparison of a
step's tensors with the oracle's. (A module beside the tests, imported by name: pytest
puts this folder on the path.)"""

from __future__ import annotations

import torch

from mambakit import MambaBackbone, MambaConfig

STEPS = 4
TOL = {torch.float64: 1e-12, torch.float32: 1e-5}  # relative error over a whole tensor


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp(min=1e-30)).item()


def random_stack(cfg: dict, dtype: torch.dtype, batch: int, dt_shift: float = 0.0):
    """(backbone, state): 3 layers of d_model 64 on 24 float inputs, the weights moved off
    their init by noise (and dt_bias by `dt_shift`), every row of the state its own
    random one (Mamba-3's angles anywhere in [0, 2 pi))."""
    torch.manual_seed(0)
    bb = MambaBackbone(MambaConfig(d_model=64, n_layers=3, input_dim=24, **cfg)).to(dtype).eval()
    with torch.no_grad():
        for p in bb.parameters():
            p.add_(torch.randn_like(p) * 0.1)
        if dt_shift:
            for block in bb.layers:
                block.mixer.dt_bias.add_(dt_shift)
    state = bb.init_state(batch)
    for t in state._tensors():
        t.copy_(torch.randn_like(t))
    if bb.config.mixer == "mamba3":
        state.angle.uniform_(0, 6.28)
    return bb, state


def assert_close(step: int, dtype: torch.dtype, fields) -> None:
    """Every (name, got, oracle) of `fields` within TOL[dtype] relative error."""
    for field, a, b in fields:
        err = rel(a, b)
        assert err < TOL[dtype], f"step {step}: {field} relative error {err:.1e}"


def stream_and_states(got, out, residual, state, oracle) -> list:
    """(name, got, oracle) of a stack step: the residual stream (the oracle's out +
    residual) and every field of the state against the oracle's."""
    fields = [(f"state.{f}", a, b) for (f, a), (_, b) in zip(state._items(), oracle._items())]
    return [("residual stream", got, out + residual), *fields]
