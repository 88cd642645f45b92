"""The output slots of the step graphs (`inference.step_graph`): a captured graph, the
output tensor its replay writes, and whether anything outside still reaches that output,
so that a replay may write over it.

A step hands out a new alias of a slot's output rather than a copy; the caller may keep
it (a list of outputs, a view, a DLPack export, autograd's saved tensor). A slot is free
when its output's reference counts equal those of a probe that nothing else references,
counted the same way in the same call: the Python references to the tensor, its C++
owners, the owners of its storage and the references to the storage's Python object.
"""

from __future__ import annotations

import sys

import torch


class _Slot:
    """One captured graph, the output tensor its replay writes and where that memory is
    (a caller may resize the storage through an alias: the graph would write where it was)."""

    __slots__ = ("graph", "out", "memory")

    def __init__(self, graph, out) -> None:
        self.graph, self.out = graph, out
        self.memory = _memory(out)


def _memory(t: torch.Tensor) -> tuple[int, int]:
    storage = t.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


def _counts(slot: _Slot) -> tuple[int, int, int, int]:
    """References to the slot's output: Python ones to the tensor (as this interpreter
    counts them), its C++ owners, owners of its storage (every alias a step handed out,
    views, DLPack exports, autograd's saved tensors) and references to the storage's
    Python object (`untyped_storage()` kept)."""
    storage = slot.out.untyped_storage()  # while held, the same Python object every time
    return (
        sys.getrefcount(slot.out),
        slot.out._use_count(),
        torch._C._storage_Use_Count(storage._cdata),
        sys.getrefcount(storage),
    )


# a slot that nothing else references, counted the same way in the same call: what a free
# output counts (None where this torch lacks the counters: every output is then cloned)
_PROBE = (
    _Slot(None, torch.empty(1))
    if hasattr(torch.Tensor, "_use_count") and hasattr(torch._C, "_storage_Use_Count")
    else None
)


def _free_counts() -> tuple | None:
    """What a free output counts now (None without the counters)."""
    return None if _PROBE is None else _counts(_PROBE)


def _unheld(slot: _Slot, free: tuple | None) -> bool:
    """Whether nothing but `slot` references its output (`free`: `_free_counts()`, taken
    in the same call): no alias a step handed out is alive (nor a view, export or saved
    copy of one), nothing holds its storage. A replay may then overwrite it. Counts that
    differ from the probe's in any way read as held."""
    return free is not None and _counts(slot) == free
