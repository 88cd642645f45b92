"""Chunked, batched prefill: prompts run through the model in pieces whose lengths let
many prompts share one forward.

P = block size. A prompt is prefilled from its start (or from the end of a cached
prefix) in pieces that never cross a multiple of P, so the state at every block
boundary exists and goes into the prefix cache. A piece shorter than P is cut into
powers of two, largest first (a piece of 100 tokens runs as 64, 32 and 4), so that
however the prompts' lengths differ, each round of the prefill is one forward over
every prompt whose next piece has that round's length: at most log2(P) + 1 forwards
plus one per whole block, whatever the number of prompts, each with the prompts'
states stacked as its initial state. A forward over a piece from a state gives the
same state and last logits as the prompt run whole (up to the rounding of f32 sums).
"""

from __future__ import annotations

from collections import deque

import torch

from ..state import ModelState


def piece_lengths(pos: int, end: int, block: int) -> deque[int]:
    """The lengths of the pieces that take a prompt from `pos` to `end`."""
    out: deque[int] = deque()
    while pos < end:
        stop = min(end, (pos // block + 1) * block)
        n = stop - pos
        if n == block:
            out.append(n)
        else:
            for bit in reversed(range(n.bit_length())):
                if n >> bit & 1:
                    out.append(1 << bit)
        pos = stop
    return out


def stack_rows(states: list[ModelState | None], zero: ModelState) -> ModelState | None:
    """One state of len(states) rows (a row of zeros for None); None when every one is."""
    if all(s is None for s in states):
        return None
    fields = zip(*((s if s is not None else zero)._tensors() for s in states))
    return type(zero)(*(torch.cat(ts, dim=1) for ts in fields))


def plan_targets(prefilling: list, budget: int, block: int) -> list[tuple[object, int]]:
    """(request, the position its prefill reaches in this iteration), first come first
    served, within `budget` prompt tokens: a request stops at a block boundary unless it
    finishes its prompt; the first one always advances by at least one piece."""
    plan = []
    for req in prefilling:
        if budget <= 0:
            break
        end = len(req.prompt)
        target = min(end, req.pos + budget)
        if target < end:
            aligned = (target // block) * block
            if aligned <= req.pos:
                if plan:
                    break
                aligned = min(end, (req.pos // block + 1) * block)
            target = aligned
        plan.append((req, target))
        budget -= target - req.pos
    return plan
