"""CUDA-graph capture that keeps the stream and the random generator usable when it fails,
and the version counters of tensors a replay (or a fused kernel) writes unseen: what the
Trainer's captured step and the graph decode share."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def graph_capture(graph: torch.cuda.CUDAGraph, pool=None, stream=None) -> Iterator[None]:
    """`torch.cuda.graph(graph, pool=pool, stream=stream)`, except that a capture that fails
    does not leave the caller's stream or the CUDA random generator unusable.

    `stream`: the capture stream (None: torch's one default capture stream). cuBLAS keeps
    its workspace per stream, and a graph keeps the address of the workspace of the stream
    it was captured on: graphs that are replayed at the same time on different streams
    must be captured on different streams, or their GEMMs share one workspace.

    When the captured code raises (a host sync, say), torch.cuda.graph's exit can fail in
    `capture_end` before two things it would have done: putting back the caller's stream
    (its capture stream stays current) and ending the default CUDA generator's capture
    (torch 2.11: the generator stays marked as capturing, so every later random op on the
    device raises "Offset increment outside graph capture encountered unexpectedly").
    Then the stream is restored and the generator gets a fresh state at its seed and
    offset. Graphs captured before keep the generator's old state object, so their random
    numbers no longer advance the default generator's offset. (That the exit failed is
    what tells: the capture stream may be the caller's own, so the current stream cannot.)"""
    caller = torch.cuda.current_stream()
    context = torch.cuda.graph(graph, pool=pool, stream=stream)
    try:
        context.__enter__()
    except BaseException:
        if torch.cuda.current_stream() != caller:  # capture_begin failed on its stream
            torch.cuda.set_stream(caller)
        raise
    try:
        yield
    except BaseException as e:
        _exit(context, caller, (type(e), e, e.__traceback__))
        raise
    _exit(context, caller, (None, None, None))


def _exit(context, caller, exc_info) -> None:
    """The capture context's exit; where it raises, the caller's stream is put back and the
    default generator reset before the exit's error goes on."""
    try:
        context.__exit__(*exc_info)
    except BaseException:
        torch.cuda.set_stream(caller)
        _reset_generator(caller.device)
        raise


def _reset_generator(device: torch.device) -> None:
    """The default generator of `device`, no longer capturing, at the seed and offset it had."""
    gen = torch.cuda.default_generators[device.index]
    fresh = torch.Generator(device=device)
    fresh.set_state(gen.get_state())
    gen.graphsafe_set_state(fresh)


def increment_versions(tensors: list[torch.Tensor]) -> None:
    """Move the autograd version counters of tensors written in place where autograd does
    not see it (a graph replay, a fused optimizer's kernels), so what is keyed on them (the
    decode plans of `inference.plan`) is derived again. One call from torch 2.5, one per
    tensor before."""
    if _VERSIONS_OF_A_LIST:
        torch.autograd.graph.increment_version(tensors)
    else:
        for t in tensors:
            torch.autograd.graph.increment_version(t)


_VERSIONS_OF_A_LIST = tuple(map(int, torch.__version__.split(".")[:2])) >= (2, 5)
