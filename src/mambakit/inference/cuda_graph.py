"""CUDA graphs for decode: capture one timestep once per batch size, replay it per token.

A decode step of a Mamba model is a few hundred small kernels whose launch
cost (~7 us each from the host) dwarfs their run time at small batch. Captured
in a CUDA graph it is one launch. The pattern is mamba_ssm's
(`utils/generation.py`): allocate static buffers once, warm up on a side
stream (Triton compiles its kernels there; capture cannot), capture, then per
step copy inputs into the static buffers and replay. The recurrent state is a
static model state (`state.py`) updated in place by `step()` (which it is when no gradient
is recorded), so nothing leaves the GPU between steps.

`CUDAGraphStep` wraps `MambaBackbone.step` or `MambaLM.step` for a fixed batch
size (an RL actor: static x in, hidden out, state advanced in place).
`generate` captures model step + sampling together (see generate.py).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable
from typing import Any

import torch

from ..cuda_graphs import graph_capture
from ..state import ModelState
from .plan import drop, refresh

__all__ = ["CUDAGraphStep", "capture", "clear_cuda_graphs", "graph_cache", "use_cuda_graph"]


@contextlib.contextmanager
def static_mode():
    """No autograd and ordinary (not inference) tensors, even inside a caller's
    `torch.inference_mode()`: static buffers are written in place later, outside it."""
    with torch.inference_mode(False), torch.no_grad():
        yield


def use_cuda_graph(cuda_graph: bool | str, device: torch.device) -> bool:
    """Resolve the `cuda_graph` argument: "auto" -> on CUDA devices; True needs one."""
    if cuda_graph == "auto":
        return device.type == "cuda"
    if cuda_graph is True:
        if device.type != "cuda":
            raise ValueError(f"cuda_graph=True needs a CUDA device, the model is on {device}")
        return True
    if cuda_graph is False:
        return False
    raise ValueError(f"cuda_graph must be 'auto', True or False, got {cuda_graph!r}")


def capture(
    fn: Callable[[], Any],
    warmup: int = 2,
    pool=None,
    warm: Callable[[], Any] | None = None,
    stream: torch.cuda.Stream | None = None,
) -> tuple[torch.cuda.CUDAGraph, Any]:
    """Warm `fn` up on a side stream, then capture one call: (graph, what the call returned).

    `fn` must read and write only tensors that outlive the graph (static buffers);
    the warm-up runs it for real, so reload those buffers before the first replay, or
    give `warm`, which the warm-up runs instead (the same work on other buffers).
    `stream`: the capture stream (`graph_capture`); graphs replayed beside each other on
    different streams need different ones."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            (warm or fn)()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with graph_capture(graph, pool=pool, stream=stream):
        out = fn()
    return graph, out


# model -> {"pool": mempool handle, key -> entry}; entries die with the model.
_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def graph_cache(model: torch.nn.Module, create: bool = True) -> dict | None:
    """The per-model dict of captured decode graphs (with the memory pool generate's graphs
    share; the step graphs of `inference.step_graph` each have a pool of their own); None
    where there is none and `create` is False."""
    cache = _CACHE.get(model)
    if cache is None and create:
        cache = {"pool": torch.cuda.graph_pool_handle()}
        _CACHE[model] = cache
    return cache


def clear_cuda_graphs(model: torch.nn.Module) -> None:
    """Drop the decode graphs captured for `model` (and their static buffers) and its
    decode plans (`inference.plan`, which hold views of its weights)."""
    _CACHE.pop(model, None)
    drop(model)


def params_signature(model: torch.nn.Module) -> tuple:
    """Addresses and dtypes of the parameters, the modules' classes and their hooks, and
    the numbers the kernels take from the modules (a backbone's `kernel_constants`: norm
    eps, a mixer's A_floor or dt_limit): a graph captured on other ones is stale (after
    `model.to(...)`, an adapter put in a projection's place, a hook registered or removed,
    an eps set)."""
    params = tuple((p.data_ptr(), p.dtype) for p in model.parameters())
    modules = tuple(
        (type(m), tuple(m._forward_hooks), tuple(m._forward_pre_hooks)) for m in model.modules()
    )
    constants = getattr(getattr(model, "backbone", model), "kernel_constants", tuple)()
    return params, modules, constants


class CUDAGraphStep:
    """`module.step(x, state)` for a fixed batch size, replayed from a CUDA graph.

    module: a `MambaBackbone` (x [B, input_dim or d_model] floats, returns hidden
    [B, d_model]) or a `MambaLM` / backbone with embeddings (x [B] token ids,
    returns logits [B, V] / hidden). `self.state` is the static model state (`state.py`),
    advanced in place by each call; reset rows with `self.state.reset_(done)` or
    load one with `self.state.copy_(other)` (both keep its addresses). The
    returned tensor is a static buffer overwritten by the next call: clone it to
    keep it. On a CPU model, or with `enabled=False`, the same API runs without a
    graph; `compile=True` wraps the step in `torch.compile` first (on the CPU it
    cuts the per-op dispatch cost that bounds a small model's step; the first
    call compiles, for tens of seconds). The graph reads the parameters where they
    live, so in-place updates between calls (an optimizer step between rollouts) are
    followed; replacing a parameter, moving the module or setting a number its kernels
    take (a norm's eps, `MambaBackbone.kernel_constants`) needs a new CUDAGraphStep.

        actor = CUDAGraphStep(backbone, batch_size=64)
        for t in range(T):
            hidden = actor(obs_t)          # [64, d_model]
            actor.state.reset_(done_t)
    """

    def __init__(
        self,
        module: torch.nn.Module,
        batch_size: int,
        *,
        input_dtype: torch.dtype | None = None,
        enabled: bool | str = "auto",
        warmup: int = 2,
        pool=None,
        compile: bool = False,
    ) -> None:
        if not hasattr(module, "step") or not hasattr(module, "init_state"):
            raise TypeError(
                f"module must have step() and init_state(), got {type(module).__name__}"
            )
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        param = next(module.parameters())
        self.module = module
        self.device = param.device
        self.batch_size = batch_size
        backbone = getattr(module, "backbone", module)
        cfg = backbone.config
        with static_mode():
            if backbone.embeddings is not None:
                self.x = torch.zeros(batch_size, dtype=torch.int64, device=self.device)
            else:
                width = cfg.input_dim if backbone.input_proj is not None else cfg.d_model
                dtype = input_dtype or param.dtype
                self.x = torch.zeros(batch_size, width, dtype=dtype, device=self.device)
            self.state: ModelState = module.init_state(batch_size)
            self.graph = None
            self.out: torch.Tensor | None = None
            self._run = self._step
            if compile:  # fuses the ~70 small ops per layer; on CPU the step's main cost
                self._run = torch.compile(self._step, dynamic=False)
            if use_cuda_graph(enabled, self.device):
                self.graph, self.out = capture(self._run, warmup=warmup, pool=pool)
                self.state.zero_()

    def _step(self) -> torch.Tensor:
        out, _ = self.module.step(self.x, self.state, cuda_graph=False)
        return out

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor) or x.shape != self.x.shape:
            got = list(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"CUDAGraphStep: x must have shape {list(self.x.shape)}, got {got}")
        with static_mode():
            self.x.copy_(x)
            if self.graph is None:
                self.out = self._run()
            else:
                refresh(self.module)  # the policy may have trained since the capture: the
                # graph reads the decode plan's tensors (`inference.plan`)
                self.graph.replay()
        return self.out

    def reset(self) -> None:
        """Zero the whole state (a new batch of episodes)."""
        self.state.zero_()
