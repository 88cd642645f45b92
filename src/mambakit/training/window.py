"""A training window of a recurrent model as one call, captured whole in a CUDA graph.

RL and time-series training steps a small model over short windows (T = 16 to 64) with the
state carried from one window to the next (truncated BPTT). At that size a window's
forward, backward and optimizer step are a few hundred kernels of a few microseconds each,
so launched one by one from the host it costs ten times what the GPU needs. `WindowStep`
runs the window (forward from the carried state, the caller's loss, backward, clipping,
the optimizer step, the final state kept, cut from the graph, for the next window) as one
call; on a CUDA device it replays the whole of it from one CUDA graph.

    step = WindowStep(policy, optimizer, loss_fn, batch_size=16)
    for window in windows:                  # dicts of [B, T, ...] tensors
        loss = step(window)                 # the state carries over
        step.state.reset_(episode_ended)    # rows whose episode ended start from zeros

`loss_fn(model, inputs, state) -> (loss, final state)` is the caller's: it runs the model
on `inputs` from `state` and returns a scalar to minimise. The first `WARM_CALLS` calls
run eagerly (real steps; kernels compile, workspaces are allocated), the next is captured
on static copies of the inputs and replayed; inputs of other shapes or dtypes run eagerly.
The optimizer must step without host syncs under capture (`capturable=True`, or
`fused=True`); otherwise, or where the capture fails, steps stay eager and `graph_reason`
says why. A replay updates the parameters behind PyTorch's back, so their version
counters are moved afterwards: the model's decode plans (`inference.plan`), and so the
acting step's own CUDA graphs, follow the new weights.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import nn

from ..cuda_graphs import graph_capture, increment_versions
from ..inference.cuda_graph import use_cuda_graph

__all__ = ["WindowStep"]

WARM_CALLS = 2

Inputs = dict[str, torch.Tensor]


class WindowStep:
    """One TBPTT window per call (module docstring): `step(inputs)` -> the loss (a tensor),
    `step.state` the carried state (reset rows with `step.state.reset_(mask)`, zero it with
    `step.state.zero_()`), `step.graph_reason` None while windows replay a graph."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: Callable,
        batch_size: int,
        *,
        grad_clip: float | None = None,
        autocast: torch.dtype | None = None,
        cuda_graph: bool | str = "auto",
    ) -> None:
        if not hasattr(model, "init_state"):
            raise TypeError(f"model must have init_state(), got {type(model).__name__}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {optimizer!r}")
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable, got {loss_fn!r}")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        if grad_clip is not None and not grad_clip > 0:
            raise ValueError(f"grad_clip must be positive or None, got {grad_clip!r}")
        if autocast not in (None, torch.bfloat16, torch.float16):
            raise ValueError(
                f"autocast must be None, torch.bfloat16 or torch.float16, got {autocast}"
            )
        self.model, self.optimizer, self.loss_fn = model, optimizer, loss_fn
        self.grad_clip, self.autocast = grad_clip, autocast
        self.device = next(model.parameters()).device
        self.graphed = use_cuda_graph(cuda_graph, self.device)
        self.cuda_graph = cuda_graph
        self.params = [p for g in optimizer.param_groups for p in g["params"]]
        with torch.no_grad():
            self.state = model.init_state(batch_size)
        self.graph_reason: str | None = None if self.graphed else "not on a CUDA device"
        if self.graphed and not all(g.get("capturable") or g.get("fused") for g in
                                    optimizer.param_groups):  # fmt: skip
            self.graph_reason = "the optimizer is neither capturable=True nor fused=True"
            if cuda_graph is True:
                raise ValueError(f"cuda_graph=True cannot be honoured: {self.graph_reason}")
            self.graphed = False
        self.calls = 0
        self._graph: torch.cuda.CUDAGraph | None = None
        self._static: Inputs = {}
        self._loss: torch.Tensor | None = None

    def __call__(self, inputs: Inputs) -> torch.Tensor:
        if not isinstance(inputs, dict) or not all(
            isinstance(v, torch.Tensor) for v in inputs.values()
        ):
            raise TypeError("inputs must be a dict of tensors")
        for k, v in inputs.items():
            if v.device != self.device:
                raise ValueError(f"inputs[{k!r}] is on {v.device}, the model on {self.device}")
        self.calls += 1
        if self.graphed:
            if self._graph is None and self.calls > WARM_CALLS:
                self._capture(inputs)
            if self._graph is not None and self._fits(inputs):
                for k, v in inputs.items():
                    self._static[k].copy_(v)
                self._graph.replay()
                increment_versions(self.params)  # updated in place behind autograd's back
                return self._loss.clone()
        return self._eager(inputs)

    def _fits(self, inputs: Inputs) -> bool:
        s = self._static
        return inputs.keys() == s.keys() and all(
            v.shape == s[k].shape and v.dtype == s[k].dtype for k, v in inputs.items()
        )

    def _context(self):
        if self.autocast is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast)

    def _body(self, inputs: Inputs) -> torch.Tensor:
        """The window: forward from the carried state, loss, backward, clip, step; the
        final state copied into the carried one. Returns the loss, detached."""
        with self._context():
            loss, final = self.loss_fn(self.model, inputs, self.state)
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            raise ValueError("loss_fn must return (a scalar loss tensor, the final state)")
        loss.backward()
        if self.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(self.params, self.grad_clip, foreach=True)
        # a fused optimizer updates in place behind autograd's back: its post-step hook
        # (`inference.plan`) moves the versions the decode plans watch; a replay runs no
        # hook, and `__call__` moves them after it
        self.optimizer.step()
        with torch.no_grad():
            self.state.copy_(final.detach())
        return loss.detach()

    def _eager(self, inputs: Inputs) -> torch.Tensor:
        self.optimizer.zero_grad(set_to_none=True)
        if self.graphed and self._graph is None:  # warm calls: on a side stream, as a
            side = torch.cuda.Stream()  # capture's warm-up must run
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                loss = self._body(inputs)
            torch.cuda.current_stream().wait_stream(side)
            return loss
        return self._body(inputs)

    def _capture(self, inputs: Inputs) -> None:
        """Capture the window on static copies of `inputs` (the gradients allocated inside
        the graph: `zero_grad(set_to_none=True)` first, PyTorch's whole-network recipe).
        A failed capture leaves the steps eager, with the reason."""
        static = {k: v.clone() for k, v in inputs.items()}
        saved = self.state.clone()
        self.optimizer.zero_grad(set_to_none=True)
        graph = torch.cuda.CUDAGraph()
        try:
            with graph_capture(graph):
                loss = self._body(static)
        except Exception as exc:
            if self.cuda_graph is True:
                raise
            self.optimizer.zero_grad(set_to_none=True)
            why = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            self.graph_reason = f"the window could not be captured: {type(exc).__name__}: {why}"
            self.graphed = False
            with torch.no_grad():
                self.state.copy_(saved)
            return
        with torch.no_grad():
            self.state.copy_(saved)  # nothing ran during the capture, but be exact
        self._graph, self._static, self._loss = graph, static, loss
