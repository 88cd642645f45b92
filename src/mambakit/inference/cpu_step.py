"""The no-grad CPU step of a backbone compiled end to end: what an RL policy acting one
observation at a time calls (`MambaBackbone.step`), and the rows under a language model's
head at each generated token (`MambaLM.step`).

At batch 1 on a CPU the step's arithmetic (a d_model 128, 3-layer backbone: about 0.3
MFLOP) takes tens of microseconds compiled; the op-by-op path around it (the input
projection, a freshness check of the decode plan, each block's plain-module checks, the
per-layer state views, the final norm) took about as much again twice over. Here, where
numba is there (`ops.cpu_jit`), three compiled calls make the step: input_proj (or the
embedding rows of token ids) into the residual stream, every block (the mixer's `Packed`
body on the model state's stacked tensors), norm_f. The checks that remain are the ones
that decide whether this computes what the modules say: every module plain and unchanged
since last seen (one pass over a watch list, `step_graph._watch`), the decode plan fresh
(`inference.plan`). Anything else (a hook or an adapter, autocast, other dtypes, an
embedding with max_norm, more rows than the compiled stack takes: `cpu_jit.rows_max`,
MAMBAKIT_BACKEND=triton) takes the general path, as do ids outside the vocabulary (it
raises).
"""

from __future__ import annotations

import weakref
from functools import cache

import numpy as np
import torch

from ..layers.block import RMSNorm
from ..layers.plain import plain
from ..ops._backend import forced_backend
from ..ops.cpu_jit import borrowed_array, compiles, param_array
from .step_graph import _not_plain, _unchanged, _watch


class _Entry:
    __slots__ = ("watch", "weights", "eps", "ends")

    def __init__(self, watch) -> None:
        self.watch, self.weights, self.eps, self.ends = watch, None, None, None


_IDS = (torch.int64, torch.int32)
_ENTRIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # backbone -> _Entry


def compiled_rows(backbone, x: torch.Tensor, state, stack) -> torch.Tensor | None:
    """The step's hidden rows [B, M] (norm_f applied), the state advanced in place; or None
    where the compiled step does not apply. `stack()`: the backbone's whole-stack decode
    weights (its "stack" plan), whose `compiled` body runs the blocks."""
    if (
        torch.is_autocast_enabled("cpu")
        or torch.compiler.is_compiling()
        or forced_backend() == "triton"  # the kernels asked for (interpreted)
    ):
        return None
    entry = _ENTRIES.get(backbone)
    if entry is None or not _unchanged(entry.watch, [backbone]):
        # the final norm runs as RMSNorm's math here: exactly that class, no subclass
        if _not_plain(backbone) is not None or not plain(backbone.norm_f, RMSNorm):
            _ENTRIES.pop(backbone, None)
            return None
        entry = _ENTRIES[backbone] = _Entry(_watch([backbone]))
    weights = stack()
    compiled = getattr(weights, "compiled", None)
    if compiled is None or x.shape[0] > compiled.rows_max:
        return None
    eps = backbone._modules["norm_f"].eps  # the module is plain: no hook, no __getattr__
    if weights is not entry.weights or eps != entry.eps:  # a parameter or eps changed
        if _not_plain(backbone) is not None:  # a constant of the plans' key (a norm's eps)
            _ENTRIES.pop(backbone, None)  # may leave a block unfusable
            return None
        entry.ends = _ends(backbone, weights.pad)
        entry.weights, entry.eps = weights, eps
    if entry.ends is None:
        return None
    WT, b, E, w, consts, dtype = entry.ends
    fields = state._tensors()
    if E is not None:  # token ids [B] (`_check_step` saw one dimension)
        if x.dtype not in _IDS or backbone._modules["embeddings"].max_norm is not None:
            return None
    elif x.shape[1] != (WT.shape[0] if WT is not None else w.shape[0]) or x.dtype != dtype:
        return None
    if not all(t.dtype == dtype for t in fields):
        return None
    B, M = x.shape[0], w.shape[0]
    rows = np.empty((B, M + 1), consts.dtype)
    xs = x.detach().numpy()
    input_rows, embed_rows, norm_rows = _kernels()
    if E is not None:
        if not embed_rows(xs, E, consts, rows):
            return None  # an id outside the vocabulary: the general path says so
    elif WT is not None:
        input_rows(xs, WT, b, consts, rows)
    else:
        rows[:, :M] = xs
        rows[:, M] = consts[0]
    compiled.layers(rows, tuple(map(_array, fields)))
    # written through numpy, unseen by autograd: a graph that saved the state must know
    torch.autograd.graph.increment_version(fields)
    out = torch.empty(B, M, dtype=dtype)  # torch's own storage: resizable, as elsewhere
    norm_rows(rows, w, consts, out.numpy())
    return out


def head_rows(head: torch.nn.Module, rows: torch.Tensor) -> torch.Tensor:
    """An LM head on `compiled_rows`' rows [B, M]: a plain nn.Linear of their dtype and
    width row by row, compiled (each row's logits the same whatever the batch up to the
    compiled stack's `rows_max`, as the GPU's head kernel gives them: a BLAS product's
    sums depend on the batch, which would let a request's tokens depend on the others
    served beside it); any other head, or one whose gradient autograd records, called."""
    W, bias = head.weight, head.bias
    if (
        not plain(head)
        or W.dtype != rows.dtype
        or W.device.type != "cpu"
        or W.dim() != 2
        or W.shape[1] != rows.shape[1]
        or W.is_neg()
        or (
            bias is not None
            and (
                bias.shape != W.shape[:1]
                or bias.dtype != W.dtype
                or bias.device != W.device
                or bias.is_neg()
            )
        )
        or (
            torch.is_grad_enabled() and (W.requires_grad or bias is not None and bias.requires_grad)
        )
    ):  # the module says what is wrong, or records the head's gradient
        return head(rows)
    b = borrowed_array(bias) if bias is not None else np.empty(0, rows.numpy().dtype)
    out = torch.empty(rows.shape[0], W.shape[0], dtype=rows.dtype)
    run_rows, linear_rows, parallel = _linear()
    # the weights borrowed for the call (`.numpy()` would leave FSDP unable to resize them)
    run_rows(linear_rows, parallel, rows.numpy(), borrowed_array(W), b, out.numpy())
    return out


def _array(t: torch.Tensor) -> np.ndarray:
    """t's numpy view (detached first only where it needs it: a microsecond a field)."""
    return t.detach().numpy() if t.requires_grad else t.numpy()


def _ends(backbone, pad: float):
    """(input_proj's W^T [F, M] and bias [M] (None, None without one), the embedding table
    [V, M] (None without one), norm_f's weight [M], [pad, eps, 1 / M]) as numpy arrays, and
    their torch dtype; or None where the weights do not compile."""
    w = backbone.norm_f.weight.detach()
    if not compiles(w):
        return None
    M = w.shape[0]
    wa = param_array(w)
    consts = np.array([pad, backbone.norm_f.eps, 1.0 / M], dtype=wa.dtype)
    # copies (`param_array`), made again whenever a parameter changes (a new stack plan):
    # `.numpy()` on a parameter would mark its storage as never to be resized (FSDP's)
    emb, proj = backbone.embeddings, backbone.input_proj
    if emb is not None:
        E = emb.weight.detach()
        if E.dtype != w.dtype:
            return None
        return None, None, param_array(E), wa, consts, w.dtype
    if proj is None:
        return None, None, None, wa, consts, w.dtype
    if proj.weight.dtype != w.dtype:
        return None
    WT = proj.weight.detach().t().contiguous().numpy()
    b = param_array(proj.bias) if proj.bias is not None else np.zeros(M, WT.dtype)
    return WT, b, None, wa, consts, w.dtype


@cache
def _linear():
    """The compiled head (imported on first use, as `_kernels`)."""
    from ..ops.cpu_jit.common import linear_rows, linear_rows_parallel, run_rows

    return run_rows, linear_rows, linear_rows_parallel


@cache
def _kernels():
    """The compiled ends (imported on first use: numba loads in about a second)."""
    from ..ops.cpu_jit.common import embed_rows, input_rows, norm_rows

    return input_rows, embed_rows, norm_rows
