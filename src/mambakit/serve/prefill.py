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
from .slots import to_device


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


GRAPH_STATE_BYTES = 2 << 30  # the static state buffers of the prefill graphs, at most
GRAPH_MAX_ROWS = 16  # rows of a captured prefill at most (a larger group runs in parts)


class PrefillGraphs:
    """On CUDA, the forward of a piece from a state, captured once per (rows bucket, piece
    length) and replayed: an eager forward costs hundreds of kernel launches (about a
    millisecond or more) however few its tokens, which would make the number of pieces,
    not the arithmetic, the price of a prefill. Rows are padded to a power of two (zero
    state, token 0: garbage nobody reads). The graphs of one rows bucket share their
    static state and logits buffers (each graph copies its results into them), so the
    memory they hold is two states of the bucket's rows, whatever the number of piece
    lengths; the buckets stop where those buffers would pass `GRAPH_STATE_BYTES`."""

    def __init__(self, model, block_size: int) -> None:
        self.model = model
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[tuple[int, int], tuple] = {}  # (rows, n) -> (graph, ids buffer)
        self.buffers: dict[int, tuple] = {}  # rows -> (state in, state out, logits)
        self.enabled = True
        row = model.init_state(1)
        row_bytes = sum(t.numel() * t.element_size() for t in row._tensors())
        rows = 1  # buckets 1, 2, ... R hold 2 states of 2R - 1 rows in all
        while rows < GRAPH_MAX_ROWS and 2 * (4 * rows - 1) * row_bytes <= GRAPH_STATE_BYTES:
            rows *= 2
        self.max_rows = rows
        self.lengths = [1 << i for i in range(block_size.bit_length()) if 1 << i < block_size]
        self.lengths.append(block_size)

    def _entry(self, rows: int, n: int, device):
        from ..inference.cuda_graph import capture

        key = (rows, n)
        if key in self.graphs:
            return self.graphs[key]
        if rows not in self.buffers:
            param = next(self.model.parameters())
            vocab = self.model.config.vocab_size
            self.buffers[rows] = (
                self.model.init_state(rows),
                self.model.init_state(rows),
                torch.zeros(rows, vocab, dtype=param.dtype, device=device),
            )
        state_in, state_out, logits_out = self.buffers[rows]
        ids = torch.zeros(rows, n, dtype=torch.int64, device=device)

        def fn():
            logits, state = self.model.last_logits(ids, state_in)
            state_out.copy_(state)
            logits_out.copy_(logits)

        graph, _ = capture(fn, warmup=2, pool=self.pool)
        self.graphs[key] = (graph, ids)
        return self.graphs[key]

    def warmup(self, device) -> None:
        """Capture every graph now (a capture mid-service would stall an iteration)."""
        for rows in (1 << i for i in range(self.max_rows.bit_length())):
            for n in self.lengths:
                if self.enabled:
                    self._run([[0] * n] * rows, None, device)

    def run(self, ids: list[list[int]], state: ModelState | None, device):
        """(logits [g, V], state [L, g, ...]) of the pieces `ids` (g rows of one length) from
        `state` (None: zeros), or None when the graphs are off."""
        if not self.enabled:
            return None
        parts = []
        for i in range(0, len(ids), self.max_rows):
            part = None
            if state is not None:
                part = type(state)(*(t[:, i : i + self.max_rows] for t in state._tensors()))
            out = self._run(ids[i : i + self.max_rows], part, device)
            if out is None:
                return None
            parts.append(out)
        if len(parts) == 1:
            return parts[0]
        logits = torch.cat([p[0] for p in parts])
        fields = zip(*(p[1]._tensors() for p in parts))
        return logits, type(parts[0][1])(*(torch.cat(ts, dim=1) for ts in fields))

    def _run(self, ids, state, device):
        from ..inference.plan import refresh

        g, n = len(ids), len(ids[0])
        rows = 1 << (g - 1).bit_length()
        try:
            graph, buf = self._entry(rows, n, device)
        except Exception:  # a capture that fails: eager from now on
            self.enabled = False
            return None
        state_in, state_out, logits_out = self.buffers[rows]
        buf[:g].copy_(to_device(ids, device))
        buf[g:].zero_()
        if state is None:
            state_in.zero_()
        else:
            for dst, src in zip(state_in._tensors(), state._tensors()):
                dst[:, :g].copy_(src)
                dst[:, g:].zero_()
        refresh(self.model)
        graph.replay()
        rows_out = (t[:, :g].clone() for t in state_out._tensors())
        return logits_out[:g].clone(), type(state_out)(*rows_out)
