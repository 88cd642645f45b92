"""The pool of state slots and the batched decode step over it.

B = max_batch rows, V vocabulary. The pool is one model state of B rows allocated once
(`state.py`: [L, B, ...] per field); a running choice owns one row. The rows in use are
always rows 0 .. n-1: a choice that ends frees its row by moving the last row into it
(one row copy), so a decode step runs on the leading rows only. On CUDA the step of
each bucket of batch sizes (`decode_buckets`: 1, 2, 4, ... 32, then every multiple of
32, and B; coarser for B past 256) is captured once in a CUDA graph reading the pool's
leading rows, whose addresses never change; n rows run the smallest bucket that holds
them (the rows past n compute garbage nobody reads). On the CPU the step runs eagerly on
exactly n rows.

Sampling runs after the step, outside the graph, with `inference.sampling.sample` on
the rows of each distinct setting: per-row seeds and per-row token numbers feed its
counter-based noise, so a row draws exactly what `generate` draws for that request
alone.
"""

from __future__ import annotations

from functools import partial

import torch

from ..inference.cuda_graph import capture
from ..inference.plan import refresh
from ..inference.sampling import SamplingConfig, sample
from ..state import ModelState


def rows_view(state: ModelState, start: int, stop: int) -> ModelState:
    """Rows start .. stop-1 of every field, as views (their addresses are the pool's)."""
    return type(state)(*(t[:, start:stop] for t in state._tensors()))


def rows_at(state: ModelState, index: torch.Tensor) -> ModelState:
    """The rows `index` (int64 [k], on the state's device) of every field, copied out."""
    return type(state)(*(t.index_select(1, index) for t in state._tensors()))


def to_device(values: list, device: torch.device) -> torch.Tensor:
    """An int64 tensor of `values` (ints, or lists of ints of one length) on `device`
    without waiting for the device: on CUDA through pinned memory and an asynchronous
    copy (the caching host allocator keeps the pinned block until the copy has run); an
    ordinary `torch.tensor(..., device=cuda)` waits for the stream to drain first."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=torch.int64, device=device)
    host = torch.tensor(values, dtype=torch.int64, pin_memory=True)
    return host.to(device, non_blocking=True)


def sample_rows(
    logits: torch.Tensor,  # [R, V]
    cfgs: list[SamplingConfig],  # one per row
    seeds: torch.Tensor,  # [R] int64
    steps: torch.Tensor,  # [R] int64: the number of the token each row draws
    seen: torch.Tensor | None,  # [R, V] bool, where a row's setting has a repetition penalty
) -> torch.Tensor:
    """Next tokens [R]: `sample` on the rows of each distinct setting. Equal settings are
    expected to be one object (the engine interns them): rows are grouped by identity."""
    groups: dict[int, list[int]] = {}
    for i, c in enumerate(cfgs):
        groups.setdefault(id(c), []).append(i)
    if len(groups) == 1:
        cfg = cfgs[0]
        return sample(logits, cfg, seeds, steps, seen if cfg.repetition_penalty != 1 else None)
    out = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    for rows in groups.values():
        cfg = cfgs[rows[0]]
        idx = to_device(rows, logits.device)
        rep = seen[idx] if cfg.repetition_penalty != 1 else None
        out[idx] = sample(logits[idx], cfg, seeds[idx], steps[idx], rep)
    return out


BUCKET_STEP = 32  # past this many rows, buckets grow by a multiple of it, not doubling


def decode_buckets(max_batch: int) -> list[int]:
    """The batch sizes a decode graph is captured for: 1, 2, 4, ... up to the step, then
    every multiple of it, and `max_batch`; the step is `BUCKET_STEP`, or an eighth of
    `max_batch` (in multiples of it) for a large pool, so that there are at most about 8
    coarse buckets, each graph holding its own logits. A step's time grows with its rows
    (at 130m on an H200, 0.69 ms at 64 rows, 0.83 at 128, 1.08 at 256), so 130 running
    rows in a bucket of 160 rather than 256 save a fifth of the step."""
    step = max(1, -(-max_batch // (8 * BUCKET_STEP))) * BUCKET_STEP
    out = [1 << i for i in range(max_batch.bit_length()) if 1 << i <= min(step, max_batch)]
    out += range(2 * step, max_batch, step)
    if out[-1] != max_batch:
        out.append(max_batch)
    return out


class SlotPool:
    """B state rows and the per-row decode inputs, and the batched step over rows 0 .. n-1."""

    def __init__(self, model, max_batch: int, graphs: bool, capture_stream=None) -> None:
        """`capture_stream`: the stream the decode graphs are captured on (None: one of
        their own on CUDA), not that of graphs replayed beside them (`graph_capture`)."""
        self.model = model
        self.max_batch = max_batch
        device = next(model.parameters()).device
        self.device = device
        self.state = model.init_state(max_batch)
        i64 = dict(dtype=torch.int64, device=device)
        self.tok = torch.zeros(max_batch, **i64)  # [B] each row's last token
        self.seeds = torch.zeros(max_batch, **i64)  # [B]
        self.steps = torch.zeros(max_batch, **i64)  # [B] the number of the next token drawn
        self.seen: torch.Tensor | None = None  # [B, V] bool, once a request needs it
        self.vocab = model.config.vocab_size
        self.buckets = decode_buckets(max_batch)
        # brings the plans the graphs read up to date before a replay (the engine's: once
        # an iteration, `Engine._refresh_plans`)
        self.refresh_plans = partial(refresh, model)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.capture_stream = None
        if graphs:
            self.capture_stream = capture_stream
            if capture_stream is None and device.type == "cuda":
                self.capture_stream = torch.cuda.Stream(device)
        if graphs:
            pool = torch.cuda.graph_pool_handle()
            for b in self.buckets:
                view = rows_view(self.state, 0, b)
                tok = self.tok[:b]

                def step(view=view, tok=tok):
                    return self.model.step(tok, view, cuda_graph=False)[0]

                self.graphs[b] = capture(step, warmup=2, pool=pool, stream=self.capture_stream)
            self.state.zero_()  # the warm-up ran the step for real

    def bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def step(self, n: int) -> torch.Tensor:
        """Advance rows 0 .. n-1 by their tokens `tok`: their logits [n, V]."""
        if self.graphs:
            self.refresh_plans()  # the graphs read the decode plans derived from the weights
            graph, logits = self.graphs[self.bucket(n)]
            graph.replay()
            return logits[:n]
        logits, _ = self.model.step(self.tok[:n], rows_view(self.state, 0, n), cuda_graph=False)
        return logits

    def need_seen(self) -> torch.Tensor:
        if self.seen is None:
            self.seen = torch.zeros(self.max_batch, self.vocab, dtype=torch.bool,
                                    device=self.device)  # fmt: skip
        return self.seen

    def load(
        self,
        start: int,
        states: list[ModelState],  # one row each: the state after each choice's prompt
        tokens: torch.Tensor,  # [R] the token each drew last (on the device)
        seeds: torch.Tensor,  # [R]
        step: int,  # the number of the next token they draw
        seen: torch.Tensor | None,  # [R, V]
    ) -> None:
        """Put R choices in rows start .. start+R-1; nothing here waits for the device.
        Each field in one copy (the rows stacked first where there are several): a launch
        per field, not per field and row."""
        stop = start + len(states)
        fields = zip(*(state._tensors() for state in states))
        for dst, srcs in zip(self.state._tensors(), fields):
            dst[:, start:stop].copy_(srcs[0] if len(srcs) == 1 else torch.cat(srcs, dim=1))
        self.tok[start:stop].copy_(tokens)
        self.seeds[start:stop].copy_(seeds)
        self.steps[start:stop] = step
        if seen is not None:
            self.need_seen()[start:stop].copy_(seen)

    def move(self, src: int, dst: int) -> None:
        """Row src's choice into row dst (the freed one)."""
        for t in self.state._tensors():
            t[:, dst].copy_(t[:, src])
        for t in (self.tok, self.seeds, self.steps, self.seen):
            if t is not None:
                t[dst] = t[src]
