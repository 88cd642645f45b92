"""MambaState: the recurrent state of a whole model, in two stacked f32 buffers.

Layout (DESIGN.md section 2), L layers, B rows, K = d_conv, D = d_inner, N = d_state:
    conv: [L, B, K-1, D]  the last K-1 conv inputs x_in, oldest first
    ssm:  [L, B, D, N]    the SSM state h

The buffers keep their addresses under `reset_`, `copy_` and `step()`, so a
CUDA graph captured on a state stays valid.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class _LayerStack:
    """Sizes of a state whose `ssm` buffer is [L, B, ...]: shared by both model states."""

    ssm: torch.Tensor

    @property
    def n_layers(self) -> int:
        return self.ssm.shape[0]

    @property
    def batch_size(self) -> int:
        return self.ssm.shape[1]

    @property
    def device(self) -> torch.device:
        return self.ssm.device

    @property
    def dtype(self) -> torch.dtype:
        return self.ssm.dtype


@dataclass
class MambaState(_LayerStack):
    conv: torch.Tensor  # [L, B, K-1, D]
    ssm: torch.Tensor  # [L, B, D, N]

    def __post_init__(self) -> None:
        if self.conv.dim() != 4 or self.ssm.dim() != 4:
            raise ValueError(
                f"MambaState.conv and .ssm must be 4-d, got shapes "
                f"{tuple(self.conv.shape)} and {tuple(self.ssm.shape)}"
            )
        if self.conv.shape[:2] != self.ssm.shape[:2] or self.conv.shape[3] != self.ssm.shape[2]:
            raise ValueError(
                f"MambaState.conv {tuple(self.conv.shape)} and .ssm {tuple(self.ssm.shape)} "
                "disagree on n_layers, batch or d_inner"
            )
        if self.conv.device != self.ssm.device:
            raise ValueError(
                f"MambaState.conv is on {self.conv.device} but .ssm on {self.ssm.device}"
            )

    @classmethod
    def zeros(
        cls,
        n_layers: int,
        batch_size: int,
        d_inner: int,
        d_state: int,
        d_conv: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> MambaState:
        conv = torch.zeros(n_layers, batch_size, d_conv - 1, d_inner, device=device, dtype=dtype)
        ssm = torch.zeros(n_layers, batch_size, d_inner, d_state, device=device, dtype=dtype)
        return cls(conv, ssm)

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(conv [B, K-1, D], ssm [B, D, N]) of layer i, as views."""
        return self.conv[i], self.ssm[i]

    def detach(self) -> MambaState:
        """The same values cut from the autograd graph (the TBPTT boundary)."""
        return MambaState(self.conv.detach(), self.ssm.detach())

    def clone(self) -> MambaState:
        return MambaState(self.conv.clone(), self.ssm.clone())

    def to(self, *args, **kwargs) -> MambaState:
        return MambaState(self.conv.to(*args, **kwargs), self.ssm.to(*args, **kwargs))

    def copy_(self, other: MambaState) -> MambaState:
        """Overwrite in place (keeps addresses for CUDA graphs)."""
        self.conv.copy_(other.conv)
        self.ssm.copy_(other.ssm)
        return self

    def zero_(self) -> MambaState:
        self.conv.zero_()
        self.ssm.zero_()
        return self

    def reset_(self, mask: torch.Tensor) -> MambaState:
        """Zero the rows where `mask` [B] is True (episode ends), without a host sync.

        In place when the state carries no gradient (buffers keep their addresses);
        when it does, the buffers are replaced by masked copies so autograd stays exact.
        """
        if mask.dim() != 1 or mask.shape[0] != self.batch_size:
            raise ValueError(
                f"reset_ mask must have shape [{self.batch_size}], got {tuple(mask.shape)}"
            )
        m = mask.to(device=self.device, dtype=torch.bool).view(1, -1, 1, 1)
        if self.conv.requires_grad or self.ssm.requires_grad:
            self.conv = self.conv.masked_fill(m, 0.0)
            self.ssm = self.ssm.masked_fill(m, 0.0)
        else:
            self.conv.masked_fill_(m, 0.0)
            self.ssm.masked_fill_(m, 0.0)
        return self


@dataclass
class Mamba3ModelState(_LayerStack):
    """The recurrent state of a Mamba-3 model: each `Mamba3State` field stacked over layers.

    Layout, L layers, B rows, H heads of P values, N = d_state, S rotary angles:
        angle: [L, B, H, S]     cumulative rotation angles
        ssm:   [L, B, H, P, N]  the SSM state S
        k:     [L, B, H, N]     the last token's turned key
        x:     [L, B, H, P]     the last token's value
    Same methods as MambaState; the buffers keep their addresses under `reset_`, `copy_`
    and `step()`.
    """

    angle: torch.Tensor
    ssm: torch.Tensor
    k: torch.Tensor
    x: torch.Tensor

    _FIELDS = ("angle", "ssm", "k", "x")

    def __post_init__(self) -> None:
        dims = {"angle": 4, "ssm": 5, "k": 4, "x": 4}
        for name, d in dims.items():
            if getattr(self, name).dim() != d:
                raise ValueError(
                    f"Mamba3ModelState.{name} must be {d}-d, got {tuple(getattr(self, name).shape)}"
                )
        L, B, H = self.ssm.shape[:3]
        for name in ("angle", "k", "x"):
            if tuple(getattr(self, name).shape[:3]) != (L, B, H):
                raise ValueError(
                    f"Mamba3ModelState.{name} {tuple(getattr(self, name).shape)} and .ssm "
                    f"{tuple(self.ssm.shape)} disagree on n_layers, batch or heads"
                )

    @classmethod
    def zeros(cls, n_layers, batch_size, nheads, headdim, d_state, n_angles, device=None,
              dtype=torch.float32) -> Mamba3ModelState:  # fmt: skip
        z = dict(device=device, dtype=dtype)
        L, B, H = n_layers, batch_size, nheads
        return cls(
            torch.zeros(L, B, H, n_angles, **z),
            torch.zeros(L, B, H, headdim, d_state, **z),
            torch.zeros(L, B, H, d_state, **z),
            torch.zeros(L, B, H, headdim, **z),
        )

    @classmethod
    def stack(cls, layers: list) -> Mamba3ModelState:
        """From one `Mamba3State` per layer."""
        return cls(*(torch.stack([getattr(s, f) for s in layers]) for f in cls._FIELDS))

    def _tensors(self) -> tuple[torch.Tensor, ...]:
        return tuple(getattr(self, f) for f in self._FIELDS)

    def layer(self, i: int):
        """Layer i's `Mamba3State`, as views."""
        from .ops.mamba3 import Mamba3State

        return Mamba3State(*(t[i] for t in self._tensors()))

    def detach(self) -> Mamba3ModelState:
        return Mamba3ModelState(*(t.detach() for t in self._tensors()))

    def clone(self) -> Mamba3ModelState:
        return Mamba3ModelState(*(t.clone() for t in self._tensors()))

    def to(self, *args, **kwargs) -> Mamba3ModelState:
        return Mamba3ModelState(*(t.to(*args, **kwargs) for t in self._tensors()))

    def copy_(self, other: Mamba3ModelState) -> Mamba3ModelState:
        for a, b in zip(self._tensors(), other._tensors()):
            a.copy_(b)
        return self

    def zero_(self) -> Mamba3ModelState:
        for t in self._tensors():
            t.zero_()
        return self

    @property
    def requires_grad(self) -> bool:
        return any(t.requires_grad for t in self._tensors())

    def reset_(self, mask: torch.Tensor) -> Mamba3ModelState:
        """Zero the rows where `mask` [B] is True, without a host sync (see MambaState)."""
        if mask.dim() != 1 or mask.shape[0] != self.batch_size:
            raise ValueError(
                f"reset_ mask must have shape [{self.batch_size}], got {tuple(mask.shape)}"
            )
        m = mask.to(device=self.device, dtype=torch.bool)
        grad = self.requires_grad
        for f in self._FIELDS:
            t = getattr(self, f)
            mf = m.view(1, -1, *([1] * (t.dim() - 2)))
            if grad:
                setattr(self, f, t.masked_fill(mf, 0.0))
            else:
                t.masked_fill_(mf, 0.0)
        return self
