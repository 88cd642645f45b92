"""The host side the compiled Mamba-2 and Mamba-3 stack steps share: the call over the
layers' states (one compiled call when they are slices of stacked tensors, one per layer
otherwise) and the call on a model state; the rows on numba's threads from a few rows
(`common.run_rows`). No compiled code here."""

from __future__ import annotations

import numpy as np
import torch

from .common import run_rows


def stacked(ts: list[torch.Tensor]) -> torch.Tensor | None:
    """The tensor [L, ...] (detached) whose slices [i] ts are, one per layer, as
    `ModelState.layer(i)` makes them; None where they are not."""
    root = ts[0]._base
    if root is None or root.shape[0] != len(ts) or not root.is_contiguous():
        return None
    start, step, shape = root.storage_offset(), root.stride(0), root.shape[1:]
    for i, t in enumerate(ts):  # contiguous, of root[i]'s shape and offset: root[i] itself
        if (t._base is not root or t.storage_offset() != start + i * step
                or t.shape != shape or not t.is_contiguous()):  # fmt: skip
            return None
    return root.detach()


class PackedStack:
    """Every layer's weights as numpy arrays [L, ...] (`arrays`, viewing `tensors`), and
    the mixer's compiled `kernel(r, *arrays, *consts(), *state fields, lo, hi)`, which runs
    every block on the rows lo..hi-1 of r [B, M + 1] (the residual stream and its constant
    column `pad`) and advances the state fields [L, B, ...] in place (`kernel_rows`: the
    same on every row, the rows on numba's threads; `common.run_rows` picks)."""

    __slots__ = ("arrays", "groups", "pad", "rows_max", "tensors")
    kernel = None  # a subclass's compiled `_layers` (rows lo..hi-1), as a staticmethod
    kernel_rows = None  # and its `_layers_rows` (each row on numba's threads)

    def consts(self) -> tuple:
        raise NotImplementedError

    def __call__(self, h: torch.Tensor, states: list) -> torch.Tensor:
        """The stack's `decode_layers` compiled: the residual stream [B, M] after every
        block (an inference tensor); every layer's state advances in place. Where the
        layers' states are the slices of stacked tensors [L, B, ...] (a model state's
        `layer(i)` views) one call runs every layer, else one call runs each."""
        M = h.shape[1]
        roots = [stacked(ts) for ts in zip(*states)]  # one per state field
        consts = self.consts()
        with torch.inference_mode():
            r = torch.nn.functional.pad(h, (0, 1), value=self.pad)
            rn = r.numpy()
            if all(t is not None for t in roots):
                fields = tuple(t.numpy() for t in roots)
                run_rows(self.kernel, self.kernel_rows, rn, *self.arrays, *consts, *fields)
            else:
                for i, state in enumerate(states):
                    layer = tuple(a[i : i + 1] for a in self.arrays)
                    fields = (t.detach().unsqueeze(0).numpy() for t in state)
                    run_rows(self.kernel, self.kernel_rows, rn, *layer, *consts, *fields)
        # written unseen by autograd: a graph that saved a state must know
        torch.autograd.graph.increment_version([t for state in states for t in state])
        return r.narrow(1, 0, M)

    def layers(self, r: np.ndarray, fields: tuple) -> None:
        """Every block on the rows r [B, M + 1] in place; a model state's fields (stacked
        over the layers), as numpy arrays, advance in place."""
        run_rows(self.kernel, self.kernel_rows, r, *self.arrays, *self.consts(), *fields)
