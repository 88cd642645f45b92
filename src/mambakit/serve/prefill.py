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


GRAPH_MAX_PIECE = 64  # pieces up to this length run from CUDA graphs (longer: eagerly)
GRAPH_MAX_ROWS = 16  # rows of a captured prefill (more: eagerly)


class PrefillGraphs:
    """On CUDA, the forward of a short piece from a state, captured once per (rows bucket,
    piece length) and replayed: an eager forward costs hundreds of kernel launches
    (milliseconds) however few its tokens, which would make the small pieces of the
    power-of-two split, not the arithmetic, the price of a prefill. Rows are padded to a
    power of two (zero state, token 0: garbage nobody reads). The outputs are copied out
    at once: the next replay of a graph of the shared memory pool overwrites them."""

    def __init__(self, model) -> None:
        self.model = model
        self.pool = torch.cuda.graph_pool_handle()
        self.entries: dict[tuple[int, int], tuple] = {}
        self.enabled = True

    def run(self, ids: list[list[int]], state: ModelState | None, device):
        """(logits [g, V], state [L, g, ...]) of the pieces `ids` (g rows of one length) from
        `state` (None: zeros), or None where a graph does not apply."""
        from ..inference.cuda_graph import capture
        from ..inference.plan import refresh

        g, n = len(ids), len(ids[0])
        if not self.enabled or n > GRAPH_MAX_PIECE or g > GRAPH_MAX_ROWS:
            return None
        rows = 1 << (g - 1).bit_length()
        entry = self.entries.get((rows, n))
        if entry is None:
            buf = torch.zeros(rows, n, dtype=torch.int64, device=device)
            state_in = self.model.init_state(rows)

            def fn(buf=buf, state_in=state_in):
                return self.model.last_logits(buf, state_in)

            try:
                graph, out = capture(fn, warmup=2, pool=self.pool)
            except Exception:  # eager from now on
                self.enabled = False
                return None
            entry = self.entries[(rows, n)] = (graph, buf, state_in, out)
        graph, buf, state_in, (logits, state_out) = entry
        buf[:g].copy_(torch.tensor(ids, dtype=torch.int64))
        buf[g:].zero_()
        for dst, src in zip(state_in._tensors(), (state._tensors() if state else ())):
            dst[:, :g].copy_(src)
        if state is None:
            state_in.zero_()
        elif g < rows:
            for t in state_in._tensors():
                t[:, g:].zero_()
        refresh(self.model)
        graph.replay()
        rows_out = (t[:, :g].clone() for t in state_out._tensors())
        return logits[:g].clone(), type(state_out)(*rows_out)
