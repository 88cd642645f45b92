"""CUDA graphs behind `MambaBackbone.step` and `MambaLM.step`: the step a user calls.

A small model's decode or RL step is a hundred-odd kernels of a few microseconds each:
launched one by one from the host it costs about a millisecond (the H200, a 3-layer
d_model 128 backbone), replayed from a CUDA graph under 20 us. So a no-grad step on a CUDA
device is captured the third time it runs with the same inputs (`WARM_CALLS`: the first
calls compile the Triton kernels and derive the decode plan eagerly), and replayed from
then on. A graph is kept per key: the input's shape and dtype, the autocast dtype and the
addresses of the state's tensors (the graph advances that state in place, where the
caller's state lives). A loop that carries one state, resetting rows with
`state.reset_(done)`, replays one graph; one that makes a new state every few steps runs
eagerly, since a capture costs as much as dozens of eager steps.

Per replay: the input is copied into the graph's own, the decode plan is refreshed from the
parameters (an optimizer step in between is followed: `inference.plan`) and a graph
replays. An input that comes back where an earlier one was (a loop that refills one
buffer, or whose inputs the allocator hands the same few blocks) is read where it is: the
third time one address, shape and strides come back to a key's copying graph, a graph
reading the input there is captured (`DIRECT` such addresses a key at most), and a
replay of it copies nothing (the copy is a launch of its own, a fifth of a batch-1
step's host time). Such a graph reads the address in stream order, as any kernel
launched on the input would.

A step's output is not copied: a key keeps up to `RING` graphs, each in a memory pool of
its own writing its own output, and a step replays one whose output no alias handed out
before (nor a view, export or saved copy of one) still reaches, and returns a new alias of
it. A loop that rebinds `y, state = model.step(x, state)` alternates between two; a caller
that keeps every output is served by one more graph whose output is cloned, as a replay
overwrites it. A graph is recaptured when the parameters move (`.to()`, a load that
replaces them) or the decode plan had to be derived anew.

The step stays eager, and `step_graph_status(model)["reason"]` says why, where replaying
would not compute what the modules say or cannot work: a module that is not plain (a
hook, an adapter: their Python would not run on a replay), autograd recording the step,
torch.compile tracing it, a CUDA graph being captured around it (generate's and
`CUDAGraphStep`'s own captures), or a capture that failed. `step(..., cuda_graph=False)`
asks for the eager step.
"""

from __future__ import annotations

import contextlib
import operator
import weakref
from collections import OrderedDict
from collections.abc import Callable

import torch
from torch import nn

from ..layers.plain import _GLOBAL_HOOKS, plain
from .cuda_graph import capture, graph_cache, static_mode, use_cuda_graph
from .plan import reads, record, rederive
from .step_slots import _free_counts, _memory, _Slot, _unheld

__all__ = ["WARM_CALLS", "MAX_GRAPHS", "RING", "DIRECT", "step_graph_status", "graphed_step"]

WARM_CALLS = 2  # eager calls with one key before it is captured (the next call captures)
MAX_GRAPHS = 8  # keys kept per model, the least recently used dropped first
RING = 2  # graphs per key whose outputs are handed out as they are
DIRECT = 4  # input addresses a key captures graphs reading the input in place for, at most
_MAX_SEEN = 64  # keys counted while warming up; the table is cleared beyond this


class _Graph:
    """A key's graphs: `slots` (up to RING) hand their outputs out, `spare` (captured when
    every slot's output is held) has its output cloned; `spare` is False where its capture
    failed (the step then runs eagerly while every slot's output is held). All read the
    same input, parameters, plan and state. `x`: the static input a caller's is copied
    into, or None where the graphs read the caller's input where it is (a direct key's);
    `src`: the one-item list the captured body reads its input from (`[x]`, or for a direct
    key the caller's input during a call and None between calls, so the graph's tensors
    never keep it alive). `others`: (weak reference to the module, name, derivation) of
    each plan besides the backbone's step plan that the capture read (the reference
    bodies' whole-stack weights)."""

    __slots__ = ("slots", "spare", "x", "src", "inference", "params", "plan", "extra",
                 "watch", "others")  # fmt: skip

    def __init__(self, slot, x, src, inference, params, plan, extra, watch) -> None:
        # an output that something else held at its capture cannot be watched: spare only
        self.slots, self.spare = ([slot], None) if _unheld(slot, _free_counts()) else ([], slot)
        self.x, self.src, self.inference, self.params = x, src, inference, params
        self.plan, self.extra, self.watch = plan, extra, watch
        self.others: tuple = ()  # filled from the capture's reads (`_with_reads`)


class _StepGraphs:
    """The graphs of one model's step (in `graph_cache(model)`, which dies with the model)."""

    def __init__(self) -> None:
        self.graphs: OrderedDict[tuple, _Graph] = OrderedDict()
        self.seen: dict[tuple, int] = {}
        # graphs reading the input where it is, by (key, address, strides); how often an
        # address came back to a key's copying graph; how many a key has captured
        self.direct: OrderedDict[tuple, _Graph] = OrderedDict()
        self.direct_seen: dict[tuple, int] = {}
        self.direct_made: dict[tuple, int] = {}
        self.failed: set[tuple] = set()
        self.reason: str | None = None
        self.replays = 0
        self.cloned = 0


def _tables(model: nn.Module) -> _StepGraphs:
    cache = graph_cache(model)
    table = cache.get("step")
    if table is None:
        table = cache["step"] = _StepGraphs()
    return table


def step_graph_status(model: nn.Module) -> dict:
    """What `model.step` does on CUDA: {"graphs": the keys captured (batch, input dtype,
    compute dtype), "direct": how many graphs read the input where it is (`DIRECT`),
    "replays": steps replayed so far, "cloned": how many of those returned a clone (every
    slot's output still held, `RING`), "reason": why the last step that could not replay
    ran eagerly (None when every step could)}."""
    cache = graph_cache(model, create=False)
    table = None if cache is None else cache.get("step")
    if table is None:
        return {"graphs": [], "direct": 0, "replays": 0, "cloned": 0, "reason": None}
    return {
        "graphs": [(k[0][0], k[1], k[2]) for k in table.graphs],  # (batch, dtype, autocast)
        "direct": len(table.direct),
        "replays": table.replays,
        "cloned": table.cloned,
        "reason": table.reason,
    }


def _not_plain(backbone: nn.Module) -> str | None:
    """The first module a replay would skip the Python of, or None when all are plain."""
    if backbone.embeddings is not None and not plain(backbone.embeddings, nn.Embedding):
        return "embeddings"
    if backbone.input_proj is not None and not plain(backbone.input_proj):
        return "input_proj"
    for i, block in enumerate(backbone._modules["layers"]):
        if not block.fusable():
            return f"layers.{i}"
    if not plain(backbone.norm_f, type(backbone.norm_f)):
        return "norm_f"
    return None


_data_ptr = torch.Tensor.data_ptr


def _params(model: nn.Module) -> tuple:
    return tuple(map(_data_ptr, model.parameters()))


def graphed_step(
    model: nn.Module,
    backbone: nn.Module,
    body: Callable[[torch.Tensor, object], torch.Tensor],
    x: torch.Tensor,
    state,
    cuda_graph: bool | str,
    head: nn.Module | None = None,
) -> torch.Tensor | None:
    """`body(x, state)` (no autograd, the state advanced in place) replayed from a CUDA
    graph of `model`'s, or None where the caller should run it eagerly (on a CPU, before a
    key is warm, or where a graph cannot stand in for the modules: the reason is kept for
    `step_graph_status`). `head`: a module after the backbone (an LM's head), plain too,
    whose weights the graph reads where they are."""
    if not use_cuda_graph(cuda_graph, x.device):
        return None
    table = _tables(model)
    if torch.compiler.is_compiling():
        table.reason = "torch.compile is tracing the step"
        return None
    if x.is_cuda and torch.cuda.is_current_stream_capturing():
        table.reason = "a CUDA graph is being captured around the step"
        return None
    autocast = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else None
    key = (x.shape, x.dtype, autocast, tuple(map(_data_ptr, state._tensors())))
    where = (key, x.data_ptr(), x.stride())
    if table.direct:
        entry = table.direct.get(where)
        if entry is not None:
            if _stands(model, backbone, head, entry):
                table.direct.move_to_end(where)
                if key in table.graphs:  # the key is in use: its copying graph too
                    table.graphs.move_to_end(key)
                out = _replay_at(table, entry, body, state, x)
                if out is not None:
                    return out  # (None: every slot held and no spare; the copying graph)
            else:
                del table.direct[where]
    entry = table.graphs.get(key)
    if entry is not None:
        if _stands(model, backbone, head, entry):
            table.graphs.move_to_end(key)
            direct = _direct(table, key, where, model, backbone, body, x, state, head)
            if direct is not None:
                out = _replay_at(table, direct, body, state, x)
                if out is not None:
                    return out
            _load(entry, x)
            return _replay(table, entry, body, state)
        # stale: captured on modules, parameters or plan tensors since replaced; so are
        # the key's direct graphs (the new modules may capture their own)
        del table.graphs[key]
        _drop_direct(table, key)
    name = _not_plain(backbone) or (None if head is None or plain(head) else "lm_head")
    if name is not None:
        table.reason = (
            f"{name} is not a plain module (a hook or an adapter would not run on a replay)"
        )
        return None
    if key in table.failed:
        return None
    seen = table.seen.get(key, 0) + 1
    if seen <= WARM_CALLS and cuda_graph == "auto":
        if len(table.seen) >= _MAX_SEEN:
            table.seen.clear()
        table.seen[key] = seen
        return None
    table.seen.pop(key, None)
    try:
        entry = _capture(model, backbone, body, x, state, head)
    except Exception as exc:  # noqa: BLE001 - the eager step is always there
        table.failed.add(key)
        table.reason = f"capture failed: {type(exc).__name__}: {exc}"
        return None
    table.graphs[key] = entry
    while len(table.graphs) > MAX_GRAPHS:
        _drop_direct(table, table.graphs.popitem(last=False)[0])
    _load(entry, x)
    return _replay(table, entry, body, state)


def _drop_direct(table: _StepGraphs, key: tuple) -> None:
    """Forget `key`'s direct graphs and their count (its copying graph is gone)."""
    for where in [w for w in table.direct if w[0] == key]:
        del table.direct[where]
    table.direct_made.pop(key, None)


def _direct(table, key, where, model, backbone, body, x, state, head) -> _Graph | None:
    """The graph reading the input where it is (address and strides `where`), captured
    the third time they come back to `key`'s copying graph (after that graph's own warm
    calls and capture), `DIRECT` captures a key at most while its copying graph lives
    (those evicted are not made again: addresses that keep changing would capture every
    few steps); None before then, past them, or where the capture fails (the copying
    graph runs)."""
    made = table.direct_made.get(key, 0)
    if made >= DIRECT or where in table.direct:  # (there: its outputs all held, no spare)
        return None
    seen = table.direct_seen.get(where, 0) + 1
    if seen <= WARM_CALLS:
        if len(table.direct_seen) >= _MAX_SEEN:
            table.direct_seen.clear()
        table.direct_seen[where] = seen
        return None
    table.direct_seen.pop(where, None)
    table.direct_made[key] = made + 1
    try:
        entry = _capture(model, backbone, body, x, state, head, direct=True)
    except Exception:  # noqa: BLE001 - the copying graph is there
        table.direct_made[key] = DIRECT
        return None
    table.direct[where] = entry
    while len(table.direct) > MAX_GRAPHS:
        table.direct.popitem(last=False)
    return entry


def _replay_at(table: _StepGraphs, entry: _Graph, body, state, x) -> torch.Tensor | None:
    """`_replay` of a direct key's graphs, the caller's input `x` where they read it (a
    capture of another slot reads it through `entry.src`, which holds it for the call)."""
    entry.src[0] = x
    try:
        return _replay(table, entry, body, state)
    finally:
        entry.src[0] = None


def _load(entry: _Graph, x: torch.Tensor) -> None:
    """x into the graphs' static input (made in inference mode where the state was: then
    written in it, whatever mode the caller steps in)."""
    if entry.inference:
        with torch.inference_mode():
            entry.x.copy_(x)
    else:
        entry.x.copy_(x)


def _replay(table: _StepGraphs, entry: _Graph, body, state) -> torch.Tensor | None:
    """Replay one of the key's graphs (its input in `entry.x`, or read where it is) and
    return its output: an alias of a slot's tensor (a new tensor object on the same memory:
    what the caller does to it in place, to its shape or flags, stays with it) where
    nothing else holds it, capturing another slot while there are fewer than RING; else a
    clone of the spare graph's, captured the first time every slot's output is held. None
    (the caller runs the eager step) where that capture fails.

    Readers of the output on another stream must be done before the next step on the
    caller's: a slot's memory is not the allocator's, so `record_stream` does not keep it."""
    free = _free_counts()  # once for every slot
    for slot in entry.slots:
        if _unheld(slot, free):
            if _memory(slot.out) != slot.memory:  # resized through an alias: never again
                entry.slots.remove(slot)
                return _replay(table, entry, body, state)
            slot.graph.replay()
            table.replays += 1
            return slot.out.detach()
    if entry.spare is None:
        try:
            with reads() as read:
                slot = _capture_slot(body, entry.src, state)
            entry.others = _with_reads(entry, read)
        except Exception as exc:  # noqa: BLE001 - the eager step is always there
            entry.spare = False
            table.reason = f"capture failed: {type(exc).__name__}: {exc}"
            return None
        if len(entry.slots) < RING and _unheld(slot, free):
            entry.slots.append(slot)
            slot.graph.replay()
            table.replays += 1
            return slot.out.detach()
        entry.spare = slot
    if entry.spare is False:
        return None
    entry.spare.graph.replay()
    table.replays += 1
    table.cloned += 1
    return entry.spare.out.clone()


def _extra(backbone: nn.Module, head: nn.Module | None) -> tuple:
    """What a graph reads outside the decode plans and that their freshness does not
    cover: norm_f's eps (passed to its kernel) and where the head's weights are."""
    eps = backbone._modules["norm_f"].eps
    if head is None:
        return (eps,)
    return (eps, *(p.data_ptr() for p in head._parameters.values() if p is not None))


def _watch(roots: list[nn.Module]) -> tuple:
    """What a replay assumes of `roots` and everything under them, in a form checked in a
    few microseconds (`_unchanged`): their classes, their hooks (none), and which module is
    each one's child (an adapter put in a projection's place changes one). The roots
    themselves are not held (the caller passes them again), so a table that keeps this
    beside a model does not keep the model alive."""
    mods = [m for root in roots for m in root.modules()]
    hooks = tuple(
        d
        for m in mods
        for d in (m._forward_hooks, m._forward_pre_hooks, m._backward_hooks,
                  m._backward_pre_hooks)
    )  # fmt: skip
    edges = [(m._modules, name, child) for m in mods for name, child in m._modules.items()]
    inner = [m for m in mods if not any(m is r for r in roots)]
    return (
        tuple(inner),
        tuple(map(type, inner)),
        tuple(map(type, roots)),
        hooks,
        tuple(e[0] for e in edges),
        tuple(e[1] for e in edges),
        tuple(e[2] for e in edges),
    )


def _unchanged(watch: tuple, roots: list[nn.Module]) -> bool:
    mods, types, root_types, hooks, parents, names, children = watch
    return (
        not any(_GLOBAL_HOOKS)
        and not any(hooks)
        and tuple(map(type, roots)) == root_types  # classes compare by identity
        and tuple(map(type, mods)) == types
        and all(map(operator.is_, map(dict.get, parents, names), children))
    )


def _stands(model, backbone, head, entry: _Graph) -> bool:
    """Whether the graph still computes the step: the modules as they were (`_watch`), the
    decode plan brought up to date with the parameters (a new derivation writes its values
    into the plan's own tensors, which the graph reads) and every tensor the graph reads
    where it was at the capture. While the plan is the same derivation, the backbone's
    parameters are the ones it was derived from (`inference.plan`)."""
    roots = [backbone] if head is None else [backbone, head]
    if not _unchanged(entry.watch, roots) or _extra(backbone, head) != entry.extra:
        return False
    if (record(backbone, "step") is entry.plan and entry.plan.fresh(backbone)
            and (not entry.others or all(map(_fresh, entry.others)))):  # fmt: skip
        return True  # the derivations captured on, current and fresh: the common case
    backbone._decode_plan()
    now = record(backbone, "step")
    if now is not entry.plan:
        if not _same_layout(now, entry.plan) or _params(model) != entry.params:
            return False
        if _not_plain(backbone) is not None:  # a constant the plan's key reads (an eps)
            return False  # may leave a block unfusable
        entry.plan = now  # derived again (an optimizer step) into the same tensors
    return _others_current(entry)


def _same_layout(now, old) -> bool:
    """Whether a graph captured on derivation `old` of a plan runs `now`: the same tensors
    (new values written into them) and the same constants passed to its kernels."""
    return now is not None and now.addresses == old.addresses and now.constants == old.constants


def _fresh(other: tuple) -> bool:
    ref, name, plan = other
    module = ref()
    return module is not None and record(module, name) is plan and plan.fresh(module)


def _others_current(entry: _Graph) -> bool:
    """The other plans the graph reads brought up to date (derived again into the tensors
    the graph reads); False where one is gone or was derived into other tensors."""
    others = []
    for ref, name, old in entry.others:
        module = ref()
        now = None if module is None else rederive(module, name)
        if not _same_layout(now, old):
            return False
        others.append((ref, name, now))
    entry.others = tuple(others)
    return True


def _capture_slot(body, src: list, state) -> _Slot:
    """Capture `body` on the input `src[0]` and the caller's state. The warm-up runs on a
    copy of the state, so the caller's advances by replays alone.

    Into a memory pool of the graph's own: a graph sharing one would lay its output or its
    temporaries over another's, and a replay of one would then write over an output that
    the other handed out and its holder still reads.

    Outside inference mode unless the state was made in it (as generate's graphs: the
    graph's tensors are ordinary ones), and with autocast's cache of casts off (PyTorch's
    rule for graphs: a cached cast is freed when the caller's autocast region ends, and
    would not follow the weights; the graph casts them itself)."""
    inference = any(t.is_inference() for t in state._tensors())
    mode = torch.inference_mode() if inference else static_mode()
    cast = torch.is_autocast_enabled("cuda")
    uncached = (
        torch.autocast("cuda", dtype=torch.get_autocast_dtype("cuda"), cache_enabled=False)
        if cast
        else contextlib.nullcontext()
    )
    with mode, uncached:
        scratch = state.clone()
        graph, out = capture(
            lambda: body(src[0], state), warmup=1, pool=None,
            warm=lambda: body(src[0], scratch),
        )  # fmt: skip
    return _Slot(graph, out)


def _capture(model, backbone, body, x, state, head, direct: bool = False) -> _Graph:
    """A key's first graph: on a static copy of x, or (`direct`) on x where it is."""
    inference = any(t.is_inference() for t in state._tensors())
    if direct:
        static_x, src = None, [x]
    else:
        with torch.inference_mode() if inference else static_mode():
            static_x = torch.empty_like(x, memory_format=torch.contiguous_format)
            static_x.copy_(x)
        src = [static_x]
    try:
        with reads() as read:
            slot = _capture_slot(body, src, state)
    finally:
        if direct:
            src[0] = None
    backbone._decode_plan()
    watch = _watch([backbone] if head is None else [backbone, head])
    entry = _Graph(slot, static_x, src, inference, _params(model), record(backbone, "step"),
                   _extra(backbone, head), watch)  # fmt: skip
    entry.others = _with_reads(entry, read)
    return entry


def _with_reads(entry: _Graph, read: list) -> tuple:
    """`entry.others` and the plans in `read` (what a capture asked for) it lacks, the
    step plan aside."""
    others = list(entry.others)
    seen = {(id(ref()), name) for ref, name, _ in others}
    for module, name in read:
        plan = record(module, name)
        if plan is not None and plan is not entry.plan and (id(module), name) not in seen:
            seen.add((id(module), name))
            others.append((weakref.ref(module), name, plan))
    return tuple(others)
