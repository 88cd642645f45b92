"""Decode plans: what decode steps and no-grad forwards read, derived from a module's
parameters once and kept until one of those parameters changes.

A decode step at batch 1 is bound by per-call overhead, so it should not recompute
A = -exp(A_log), cast D and the dt bias to f32, or look up and transpose its weights on
every token. `derived(module, name, build)` runs `build(module)` once (without autograd)
and returns its result again while every parameter of `module` keeps its identity,
storage and version, every empty parameter slot stays empty (a bias given to a Linear
built without one is seen), and `key(module)` (non-parameter inputs of the build, such as
the norms' eps) is unchanged. An optimizer step, a load or a `.to()` moves one of those, and
the next call derives the plan again. A plan whose build takes some parameters only as
they are (`in_place`: views such as the GEMM weights) sees their new values through those
views, so only the other parameters' versions are watched: fewer reads per step.

The plan is also what CUDA graphs captured on the module read: a graph replays the
addresses it saw at capture. So a new derivation writes its values into the tensors of the
old plan where the plan owns them (a tensor sharing no storage with a parameter, such as
A or an f32 copy of a bf16 D) and their shapes, dtypes and devices still match; tensors
that are parameters or views of them (the GEMM weights) are read by the graph directly.
Code that replays a graph calls `refresh(model)` first (`inference.cuda_graph`), since no
Python runs inside a replay. Code that updates parameters where PyTorch does not see it
must move their version counters (`torch.autograd.graph.increment_version`), or the plan
would not notice: a replayed CUDA graph of an optimizer step (the Trainer and the window
trainer move them after every replay), an in-place op on `p.data`. Assigning
`p.data = other` is seen (the storage moves). A fused optimizer (`fused=True`), or one
that writes through `p.data`, does not move them: a hook after every optimizer step, eager
or compiled, moves those of its parameters that a plan watches (`_after_optimizer_step`).
An adapter merged into the weights writes them through `p.data` too (peft's
`merge_and_unload`), between putting its module in a projection's place and the base
module back: every plan is derived again after a module takes another's place in its
parent anywhere (`_after_replacement`), so a plan derived before the adapter came is not
read after its merge.

Plans live in a table beside the module (keyed on its id, the entry dropped when the
module dies), so they are never pickled, saved or deep-copied with it.
"""

from __future__ import annotations

import contextlib
import operator
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import register_module_module_registration_hook
from torch.optim.optimizer import register_optimizer_step_post_hook

from ..cuda_graphs import increment_versions

__all__ = ["derived", "drop", "reads", "record", "refresh", "rederive"]

# id(module) -> {name: _Plan}, removed when the module dies (a plain dict: a weak-keyed
# one makes a weak reference on every lookup, which a decode step would pay per token)
_PLANS: dict[int, dict[str, _Plan]] = {}
# id(root) -> (the _generation it was found at, weak references to the modules under the
# root that have plans): `refresh` walks a model's modules once, not per replay
_ROOTS: dict[int, tuple[int, list]] = {}
_generation = 0  # moves whenever a module gains its first plan or one with plans dies
_replacements = 0  # moves whenever a module takes another's place (`_after_replacement`)
# the parameters some plan watches the versions of, by id (`_after_optimizer_step`)
_WATCHED: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()


class _Local(threading.local):
    read: list | None = None  # inside `reads`: (module, name) of every plan asked for


_local = _Local()

_version = operator.attrgetter("_version")
_data_ptr = torch.Tensor.data_ptr


class _Plan:
    """One derived value and what it was derived from."""

    __slots__ = (
        "build", "key", "in_place", "slots", "held", "params", "watched", "versions", "ptrs",
        "extra", "replacements",
        "value", "owned", "addresses", "constants",
    )  # fmt: skip

    def fresh(self, module: nn.Module) -> bool:
        # maps of C functions, no Python frame per parameter: a batch-1 step pays this
        return (
            all(map(operator.is_, map(dict.get, *self.slots), self.held))
            and tuple(map(_version, self.watched)) == self.versions
            and tuple(map(_data_ptr, self.params)) == self.ptrs
            and (self.key is None or self.key(module) == self.extra)
            and self.replacements == _replacements
        )


def derived(
    module: nn.Module,
    name: str,
    build: Callable[[nn.Module], Any],
    key: Callable[[nn.Module], Any] | None = None,
    in_place: bool = False,
) -> Any:
    """`build(module)`, derived without autograd and kept until a parameter of `module`
    (or `key(module)`) changes; the module's plans are told apart by `name`. `build` and
    `key` must be plain functions of the module (the table holds them, not the module).

    `in_place`: a parameter whose bytes a tensor of the value reads (a view of it) is
    all the build takes from it: no other tensor of the value, and nothing the value holds
    outside its tensors, tuples and lists, is computed from that parameter. A change of
    its values is then seen through the view, and only the versions of the parameters the
    value holds no view of are watched (its identity and storage always are). One name is
    always derived with the same `in_place`."""
    read = _local.read
    if read is not None:  # a capture on this thread collects what it reads
        read.append((module, name))
    plans = _PLANS.get(id(module))
    if plans is None:
        plans = _PLANS[id(module)] = {}
        weakref.finalize(module, _forget, id(module))
        _moved()
    plan = plans.get(name)
    if plan is not None and plan.fresh(module):
        return plan.value
    slots = _slots(module)
    held = tuple(d[n] for d, n in slots)  # (None in a slot that holds none: a bias given later)
    params = [p for p in held if p is not None]
    slots = (tuple(d for d, _ in slots), tuple(n for _, n in slots))  # for `map(dict.get, ...)`
    with torch.no_grad():
        value = build(module)
    storages = {p.untyped_storage().data_ptr() for p in params}
    if plan is not None:
        value = _refresh_into(plan.value, value, plan.owned)
    new = _Plan()
    new.build, new.key, new.in_place, new.slots = build, key, in_place, slots
    new.held, new.params = held, params
    tensors = _tensors(value)
    spans = [s for s in map(_span, tensors) if s is not None] if in_place else []
    new.watched = tuple(p for p in params if not _viewed(p, spans))
    new.versions = tuple(map(_version, new.watched))
    _WATCHED.update((id(p), p) for p in new.watched)
    new.ptrs = tuple(map(_data_ptr, params))
    new.extra = None if key is None else key(module)
    new.replacements = _replacements
    # the plan's own tensors: those sharing no storage with a parameter when derived
    new.owned = {id(t) for t in tensors if t.untyped_storage().data_ptr() not in storages}
    new.value = value
    new.addresses = tuple(t.data_ptr() for t in tensors)
    new.constants = _constants(value)
    plans[name] = new
    return value


@contextlib.contextmanager
def reads():
    """Collects (module, name) of every plan `derived` is asked for inside, on this thread
    (what a CUDA graph captured there reads: `inference.step_graph` keeps each of them
    current); an enclosing `reads` collects them too."""
    outer = _local.read
    inner = _local.read = []
    try:
        yield inner
    finally:
        _local.read = outer
        if outer is not None:
            outer.extend(inner)


def record(module: nn.Module, name: str) -> _Plan | None:
    """The current derivation of `module`'s plan `name` (a new object whenever the plan is
    derived again), or None. Its `addresses` are those of the plan's tensors and its
    `constants` the numbers, flags and strings beside them (norm eps, sizes): a CUDA graph
    captured on the plan reads those tensors and passes those constants to its kernels,
    so it stands while both are unchanged."""
    plans = _PLANS.get(id(module))
    return None if plans is None else plans.get(name)


def rederive(module: nn.Module, name: str) -> _Plan | None:
    """`module`'s plan `name` brought up to date from its own build (derived again where a
    parameter moved): its current derivation, or None where it has none."""
    plan = record(module, name)
    if plan is None:
        return None
    derived(module, name, plan.build, plan.key, plan.in_place)
    return record(module, name)


def refresh(model: nn.Module) -> None:
    """Bring every plan of `model` and its submodules up to date with their parameters
    (before a graph replay: the graph reads the plans' tensors). About 10 us for a
    3-layer model when nothing changed."""
    found = _ROOTS.get(id(model))
    if found is None or found[0] != _generation:
        if found is None:
            weakref.finalize(model, _ROOTS.pop, id(model), None)
        found = (_generation, [weakref.ref(m) for m in model.modules() if id(m) in _PLANS])
        _ROOTS[id(model)] = found
    for ref in found[1]:
        m = ref()
        if m is not None:
            for name in list(_PLANS[id(m)]):
                rederive(m, name)


def drop(model: nn.Module) -> None:
    """Forget the plans of `model` and its submodules (they hold views of the weights,
    which keep a storage alive after `model.to(...)` until the next call derives anew)."""
    for m in model.modules():
        if _PLANS.pop(id(m), None) is not None:
            _moved()


def _forget(key: int) -> None:
    _PLANS.pop(key, None)
    _moved()


def _moved() -> None:
    global _generation
    _generation += 1


def _slots(module: nn.Module) -> list[tuple[dict, str]]:
    """(parameter dict, name) of every parameter slot under `module`: a parametrized weight's
    `original` included (the weight is computed from it), and a slot that holds None (a
    Linear's absent bias: one given later changes what the module computes)."""
    return [(m._parameters, name) for m in module.modules() for name in m._parameters]


def _span(t: torch.Tensor) -> tuple[int, int] | None:
    """The bytes a tensor reads, [first, end), or None when it has no elements."""
    if t.numel() == 0:
        return None
    first = t.data_ptr()
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return first, first + (last + 1) * t.element_size()


def _viewed(p: torch.Tensor, spans: list[tuple[int, int]]) -> bool:
    """Whether a tensor of the value reads only bytes of `p` itself (a view of it; parameters
    that share one storage, as after `vector_to_parameters` on a flat buffer, are told apart
    by their bytes)."""
    own = _span(p)
    return own is not None and any(own[0] <= a and b <= own[1] for a, b in spans)


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    return []


_SCALARS = (int, float, bool, str, type(None))


def _constants(value: Any) -> tuple:
    """The scalars of a plan's value (inside its tuples and lists), in order: what a
    kernel launched on it takes as arguments besides the tensors (other objects are
    left out)."""
    if isinstance(value, _SCALARS):
        return (value,)
    if isinstance(value, (tuple, list)):
        return tuple(c for v in value for c in _constants(v))
    return ()


def _refresh_into(old: Any, new: Any, owned: set[int]) -> Any:
    """`new`, keeping each tensor of `old` that the plan owns (`owned`: their ids) with
    `new`'s values copied in, where the two have the same structure and those tensors the
    same layouts; where they do not, `new` whole. A tensor the plan does not own (a
    parameter or a view of one, even of a storage the parameter has since left) is never
    written: `new`'s takes its place."""
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []

    def merge(o, n):
        if isinstance(n, torch.Tensor):
            if not isinstance(o, torch.Tensor):
                raise _Mismatch
            if id(o) not in owned:
                return n
            if o.shape != n.shape or o.dtype != n.dtype or o.device != n.device:
                raise _Mismatch
            pairs.append((o, n))
            return o
        if isinstance(n, (tuple, list)):
            if type(o) is not type(n) or len(o) != len(n):
                raise _Mismatch
            items = [merge(a, b) for a, b in zip(o, n)]
            if isinstance(n, list):
                return items
            return type(n)(*items) if hasattr(n, "_fields") else tuple(items)
        return n

    try:
        merged = merge(old, new)
    except _Mismatch:
        return new
    # inference mode: the old tensors may have been made under it
    with torch.inference_mode():
        for o, n in pairs:
            o.copy_(n)
    return merged


class _Mismatch(Exception):
    pass


@torch.compiler.disable  # run after a compiled step too (traced, it would move nothing)
def _after_optimizer_step(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    """Move the version counters of the parameters an optimizer step wrote that some plan
    watches: the plan is then derived again, rather than read stale by every later no-grad
    forward and decode step. A fused optimizer's kernels (`AdamW(fused=True)`, as the
    Trainer's) and an optimizer writing through `p.data` (third-party ones) write in place
    unseen by autograd; for one whose writes are seen, the plan was to be derived again
    anyway. Other parameters are left alone: a model without plans in the same process
    keeps its versions as it had them."""
    params = [
        p for group in optimizer.param_groups for p in group["params"] if _WATCHED.get(id(p)) is p
    ]
    if params:
        increment_versions(params)


# the hooks' handles (`.remove()` takes one away)
_optimizer_hook = register_optimizer_step_post_hook(_after_optimizer_step)


def _after_replacement(module: nn.Module, name: str, submodule: nn.Module | None) -> None:
    """Where `submodule` takes the place of another child of `module` (not a first
    registration, as a constructor's), every plan is derived again on its next use: peft
    puts its adapter in a projection's place, merges it into the base weights through
    `p.data` (which moves no version counter) and puts the base module back, the same
    parameters with new values, which a plan's copies (the reference bodies' transposed
    weights) would not see."""
    global _replacements
    old = module._modules.get(name)
    if old is not None and old is not submodule:
        _replacements += 1


_module_hook = register_module_module_registration_hook(_after_replacement)
