"""The serving engine's decode side (`Engine`'s methods, as a base class): one batched
step over the running rows, each row sampled with its own settings, and the reading of a
step's tokens (with lookahead, an iteration after its launch): stop checks, text and
events per choice, and the rows of the choices that end freed. The state these read and
write is `Engine.__init__`'s."""

from __future__ import annotations

import time

import torch

from .params import Event
from .slots import sample_rows


class Decoding:
    """The engine's decode steps and the reading of their tokens (module docstring)."""

    def _timeline(self) -> list | None:
        """`Engine.timeline` where it is recorded (on CUDA; None: off), else None. Entries:
        ("decode", rows, start, end) for each decode step, ("join", requests, start, end)
        for each join of prefilled prompts, ("prefill", (prompt tokens, forwards, tokens
        computed, host seconds), start, end) for each prefill launch, with start and end
        CUDA events timed on their streams (a span starts when its stream reaches the
        start), and ("wait", seconds) for each time the loop waited on a step's or a join's
        tokens (bench_serve --timeline)."""
        return self.timeline if self.decode_stream is not None else None

    def _decode(self) -> None:
        """Launch the decode step of the running rows; take the tokens of a step launched
        before. With `lookahead` (on CUDA) the tokens taken are those of the previous
        iteration's step, whose copy to the host was enqueued then: the host's work on one
        step's tokens overlaps the device's work on the next. A choice that ended is then
        stepped once more, its token dropped; rows moved meanwhile are copied in stream
        order, after that step. The first tokens of choices that joined last iteration
        (`_join`) are read after that iteration's step, and before their second."""
        launched = self._launch() if self.rows else None
        if self._inflight is not None:  # cleared first: a failure is not met again
            inflight, self._inflight = self._inflight, None
            self._collect(inflight)
        joined, self._joined = self._joined, []
        for first in joined:
            self._collect(first)
        if launched is not None:
            if self.lookahead:
                self._inflight = launched
            else:
                self._collect(launched)

    def _launch(self):
        """Step rows 0 .. n-1 and sample; (their choices, the host buffer their tokens are
        copied to, the event that marks the copy done), or None when the step failed."""
        pool, n = self.pool, len(self.rows)
        rows = list(self.rows)
        timeline = self._timeline()
        start = _timed_event(timeline)
        try:
            logits = pool.step(n)
            if len(self._row_settings) == 1:  # one setting: no list of them per row
                cfgs = [rows[0].request.sampling]
            else:
                cfgs = [s.request.sampling for s in rows]
            seen = pool.seen[:n] if pool.seen is not None else None
            nxt = sample_rows(logits, cfgs, pool.seeds[:n], pool.steps[:n], seen)
            pool.tok[:n].copy_(nxt)
            pool.steps[:n] += 1
            if pool.seen is not None:
                pool.seen[torch.arange(n, device=pool.device), nxt] = True
            host = self._host[self._flip]
            self._flip ^= 1
            host[:n].copy_(nxt, non_blocking=True)
            event = None
            if pool.device.type == "cuda":
                event = torch.cuda.Event()
                event.record()
            if start is not None:
                timeline.append(("decode", n, start, _timed_event(timeline)))
        except Exception as e:  # the batch's step failed: every running choice ends
            msg = f"decode step failed: {type(e).__name__}: {e}"
            for req in {s.request for s in rows}:
                self._end_request(req, "error", msg)
            return None
        return rows, host, event

    def _collect(self, launched) -> None:
        """The new tokens of a launched step (or of a join): one read of the host buffer,
        then per choice its stop checks, text and event; a failure ends that request."""
        rows, host, event = launched
        if event is not None:
            timeline = self._timeline()
            t0 = time.perf_counter()
            event.synchronize()
            if timeline is not None:
                timeline.append(("wait", time.perf_counter() - t0))
        tokens = host[: len(rows)].tolist()
        now = time.monotonic()
        hook, outbox, itl, ttft = self.on_token, self._outbox, self._itl, self._ttft
        n_out = 0
        for seq, tok in zip(rows, tokens):
            if seq.finished is not None:
                continue
            req = seq.request
            try:
                if hook is not None:
                    hook(seq, tok)
                n_out += 1
                if seq.tokens:
                    itl.append(now - seq.last_time)
                elif seq.index == 0:
                    ttft.append(now - req.arrival)
                seq.last_time = now
                text, reason = seq.push(tok)
                outbox.append((req, Event(seq.index, [tok], text, reason)))
                if reason is not None:
                    self._finish(seq, reason)
            except Exception as e:
                self._end_request(req, "error", f"{type(e).__name__}: {e}")
        self._n_out += n_out
        self._free_rows()

    def _finish(self, seq, reason: str) -> None:
        seq.finished = reason
        seq.request.open -= 1
        with self.metrics.lock:
            self.metrics.finished[reason] += 1

    def _free_rows(self) -> None:
        """Drop finished choices from the pool, moving the last rows into the holes."""
        rows, counts = self.rows, self._row_settings
        for i in reversed(range(len(rows))):
            if rows[i].finished is not None:
                key = id(rows[i].request.sampling)
                counts[key] -= 1
                if not counts[key]:
                    del counts[key]
                last = len(rows) - 1
                if i != last:
                    self.pool.move(last, i)
                    rows[i] = rows[last]
                rows.pop()


def _timed_event(timeline: list | None):
    """A timing CUDA event recorded on the current stream where the engine's timeline is
    on (`Engine._timeline`: CUDA only), else None."""
    if timeline is None:
        return None
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event
