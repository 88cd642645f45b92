"""Shape, dtype, device and stride checks shared by the ops; they run before any kernel."""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def check_tensor(
    name: str,
    t: torch.Tensor,
    shape: tuple[int | None, ...] | None = None,
    dtypes: tuple[torch.dtype, ...] | None = FLOAT_DTYPES,
    device: torch.device | None = None,
    last_dim_contiguous: bool = False,
) -> None:
    """Raise a ValueError/TypeError naming `name` when `t` breaks a rule.

    `shape` entries of None match any size.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if shape is not None:
        bad = t.dim() != len(shape)
        if not bad:
            got = t.shape
            for i, s in enumerate(shape):  # a plain loop: this runs on every decode step
                if s is not None and s != got[i]:
                    bad = True
                    break
        if bad:
            want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
            raise ValueError(f"{name} must have shape {want}, got {list(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} must have dtype in ({names}), got {t.dtype}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device} but the other inputs are on {device}")
    if last_dim_contiguous and t.dim() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must have stride 1 in its last dim, got strides {t.stride()}")


def check_seq_idx(seq_idx: torch.Tensor, batch: int, seqlen: int, device: torch.device) -> None:
    check_tensor("seq_idx", seq_idx, (batch, seqlen), (torch.int32,), device)


def check_positions(positions: torch.Tensor, batch: int, seqlen: int, device) -> None:
    """Steps [batch, k] int64, each in [0, seqlen) (checked on the host: a sync)."""
    check_tensor("states_at", positions, (batch, None), (torch.int64,), device)
    if positions.numel():
        lo, hi = int(positions.min()), int(positions.max())
        if lo < 0 or hi >= seqlen:
            raise ValueError(f"states_at: steps must lie in [0, {seqlen}), got {lo} .. {hi}")
        k = positions.shape[1]
        if k > 1 and bool((positions.sort(dim=1).values.diff(dim=1) == 0).any()):
            raise ValueError("states_at: a step is named twice in one row")


def check_states_at_no_grad(*tensors: torch.Tensor | None) -> None:
    """The Triton scan stores the states asked for outside autograd: refuse them where a
    gradient would be needed (the reference backend differentiates through them)."""
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        raise ValueError("states_at: the Triton scan gives them without autograd only")


def check_same_dtype(names_tensors: dict[str, torch.Tensor]) -> None:
    dtypes = {n: t.dtype for n, t in names_tensors.items()}
    if len(set(dtypes.values())) > 1:
        desc = ", ".join(f"{n}={str(d).replace('torch.', '')}" for n, d in dtypes.items())
        raise TypeError(f"these inputs must share one dtype: {desc}")


def state_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    """f64 when any input is f64 (the oracle path), else f32: the dtype of state and reductions."""
    return (
        torch.float64
        if any(t is not None and t.dtype == torch.float64 for t in tensors)
        else torch.float32
    )
