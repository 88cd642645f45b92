"""The serving engine's prompt side (`Engine`'s methods, as a base class): admitting
waiting requests while rows are free (their prompt looked up in the prefix cache), when
to launch a prefill and the launches in flight (the forwards of a launch are
`forwards.py`'s), and joining the prompts whose prefill is complete to the decode batch,
their first tokens drawn. The state these read and write is `Engine.__init__`'s."""

from __future__ import annotations

import time
import traceback
from contextlib import nullcontext

import torch

from .cache import prefix_hashes
from .decode import _timed_event
from .prefill import pack_steps
from .request import Request, Sequence
from .slots import sample_rows, to_device

HEADS_KEPT = 1 << 16  # first blocks remembered (`Intake._new_head`)
HOLD_MAX = 0.1  # seconds a prompt waits at most for others to launch with ("auto" hold)


class Intake:
    """Admission, prefill and joining: the engine's work on prompts (module docstring)."""

    @property
    def prefill_hold(self) -> tuple[int, float] | str | None:
        """What a prefill launch waits for while decode steps run (`Intake._hold`): "auto"
        (the default: by the cost of the rows kept empty against a forward's fixed cost,
        measured by `warmup` on CUDA; without that measure, no wait), None (every iteration
        launches what is there) or (least prompt tokens, longest wait in seconds)."""
        return self._prefill_hold

    @prefill_hold.setter
    def prefill_hold(self, hold) -> None:
        ok = hold is None or hold == "auto"
        if isinstance(hold, tuple) and len(hold) == 2:
            tokens, wait = hold
            ok = (isinstance(tokens, int) and not isinstance(tokens, bool) and tokens >= 0
                  and isinstance(wait, int | float) and wait >= 0)  # fmt: skip
        if not ok:
            raise ValueError(
                f'prefill_hold must be "auto", None or (tokens >= 0, seconds >= 0), got {hold!r}'
            )
        self._prefill_hold = hold

    def _admit(self) -> None:
        """Waiting requests into prefill while rows are free, first come first served."""
        while self.waiting:
            req = self.waiting[0]
            if len(self.rows) + self.reserved + req.params.n > self.max_batch:
                break
            self.waiting.popleft()
            with self._lock:
                self._n_waiting -= 1
            self.reserved += req.params.n
            req.admitted = time.monotonic()
            if self.cache.enabled:
                req.hashes = prefix_hashes(req.ids)
                req.looked = self.cache.added
                hit = self.cache.lookup(req.prompt, req.hashes)
                if hit is not None:
                    req.pos = req.cached = len(hit.tokens)
                    req.state, req.logits = hit.state, hit.logits
            if self.packed:  # packed, with the block states unless the head is new
                self._plan_packed(req, seen=req.pos > 0 or not self._new_head(req))
            else:
                short = len(req.prompt) <= min(self.whole_max, self.prefill_tokens)
                req.whole = req.pos == 0 and short and self._new_head(req)
            self.prefilling.append(req)

    def _plan_packed(self, req: Request, seen: bool) -> None:
        """Whether `req` is packed (the rest of its prompt fits a launch) and keeps its block
        states (`seen`: its first block was seen before, or it continues a cached prefix)."""
        rest = len(req.prompt) - req.pos  # 0: the whole prompt was cached
        req.whole = 0 < rest <= self.prefill_tokens
        req.blocks = req.whole and self.cache.enabled and seen
        steps = pack_steps(req.pos, len(req.prompt), self.block_size, req.blocks)
        if len(steps) > self._pack_slots():  # more states than a row keeps
            req.blocks = False

    def _look_again(self, fresh: list[Request]) -> None:
        """Prompts not started yet, looked up again where the cache has gained entries since
        their last lookup: the states a launch in flight at their admission reaches go into
        the cache once it is joined (`_cache_joined`), and a prompt that continues one of
        them finds it before its own launch (as one admitted later would)."""
        cache = self.cache
        for r in fresh:
            if r.looked == cache.added or r.pos != r.cached or r.pos == len(r.prompt):
                continue
            r.looked = cache.added
            hit = cache.lookup(r.prompt, r.hashes, count=False, longer_than=r.pos)
            if hit is None:
                continue
            if r.cached == 0:  # a miss at its admission (still counted: counters never fall)
                cache.hits += 1
            cache.hit_tokens += len(hit.tokens) - r.cached
            r.pos = r.cached = len(hit.tokens)
            r.state, r.logits = hit.state, hit.logits
            if self.packed:
                self._plan_packed(r, seen=True)
            else:
                r.whole = False

    def _new_head(self, req: Request) -> bool:
        """Whether `req` (starting from zeros) may be prefilled whole: no cache, a prompt
        shorter than a block, or a first block not seen before (noted now). The first
        prompt with a new system prompt runs whole; the next one keeps its block states."""
        if not self.cache.enabled or len(req.prompt) < self.block_size:
            return True
        head = int(req.hashes[self.block_size - 1])
        seen = head in self._heads
        self._heads[head] = None
        self._heads.move_to_end(head)
        if len(self._heads) > HEADS_KEPT:
            self._heads.popitem(last=False)
        return not seen

    def _prefill(self) -> None:
        """Join the prefill launches that are done (oldest first; with nothing to decode
        and no launch to make, wait for the oldest); then launch the next while fewer than
        `prefills_in_flight` run: up to `prefill_tokens` prompt tokens (prefill.py) of the
        prompts not yet launched to their end. Without `async_prefill` a launch is joined
        at once. Joining draws the first tokens of the prompts it completes."""
        self._join_launches(wait=False)
        fresh = [r for r in self.prefilling if not r.launched]
        full = len(self._pending) >= self.prefills_in_flight
        if not (self.rows or self._inflight is not None) and (full or not fresh):
            self._join_launches(wait=True)  # nothing else to do: wait for the oldest launch
            fresh = [r for r in self.prefilling if not r.launched]
        if fresh and self._to_cache:  # a joined launch's states, for the prompts to launch
            self._cache_joined()
        if fresh and self.cache.enabled:
            self._look_again(fresh)
        if fresh and len(self._pending) < self.prefills_in_flight and not self._hold(fresh):
            try:
                if self.prefill_stream is None:
                    ready = self._launch_prefill(fresh)
                else:
                    self.prefill_stream.wait_stream(self.decode_stream)
                    with torch.cuda.stream(self.prefill_stream):
                        timeline = self._timeline()
                        start = _timed_event(timeline)
                        before, t0 = self._prefill_counts(), time.perf_counter()
                        ready = self._launch_prefill(fresh)
                        if start is not None:
                            done = tuple(b - a for a, b in zip(before, self._prefill_counts()))
                            host = time.perf_counter() - t0
                            span = ("prefill", (*done, host), start, _timed_event(timeline))
                            timeline.append(span)
            except BaseException:
                self._keeps = []  # a launch that failed: its states are not kept
                raise
            if not self.async_prefill:
                if ready:
                    if self.prefill_stream is not None:
                        self.decode_stream.wait_stream(self.prefill_stream)
                    self._join(ready)
                return
            keeps, self._keeps = self._keeps, []  # (an event that fails keeps none either)
            event = self._launch_event()
            for r in ready:
                r.launched = True
            self._pending.append((event, ready, keeps))

    def _prefill_counts(self) -> tuple[int, int, int]:
        """Prompt tokens prefilled, captured forwards replayed and the tokens they computed
        (padding included), so far."""
        graphs = self.prefill_graphs
        replays = (graphs.replays, graphs.replayed_tokens) if graphs is not None else (0, 0)
        return (self.metrics.prefill_tokens, *replays)

    def _launch_event(self):
        """An event recorded on the prefill stream after a launch (None off CUDA: done)."""
        if self.prefill_stream is None:
            return None
        event = torch.cuda.Event(blocking=True)  # its synchronize() sleeps, not spins
        event.record(self.prefill_stream)
        return event

    def _join_launches(self, wait: bool) -> None:
        """Join the launched prefills that are done, oldest first (`wait`: the oldest in any
        case, waiting for it)."""
        while self._pending:
            event, ready, keeps = self._pending[0]
            if event is not None and not event.query():
                if not wait:
                    return
                event.synchronize()
            wait = False
            self._pending.popleft()
            self._to_cache += keeps
            ready = [r for r in ready if r in self.prefilling]  # not cancelled meanwhile
            if ready:
                self._join(ready)

    def _hold(self, fresh: list[Request]) -> bool:
        """Whether to let the prompts not launched yet (`fresh`) wait for more to launch
        with, while decode steps keep the device busy: larger launches run as fewer, larger
        forwards, each token cheaper. `prefill_hold` (least prompt tokens, longest wait in
        seconds): until the prompts waiting have that many tokens, or the first has waited
        that long. "auto": until the rows the waiting prompts keep empty, times how long
        each has waited, reach the running rows times a forward's fixed cost (`HOLD_MAX`
        at most, and never past a full launch): the time the empty rows cost the decode
        steps then equals the time a launch of its own would cost (the rule of the
        economic order quantity). A prompt that continues a cached prefix (its time to
        first token is what the cache is for) or the rest of a prompt already partly
        launched launches at once, with the others."""
        hold = self.prefill_hold
        if hold is None or not self.rows:
            return False
        if any(r.pos == len(r.prompt) for r in fresh):  # found whole in the cache: join now
            return False
        tokens = sum(len(r.prompt) - r.pos for r in fresh)
        now = time.monotonic()
        if hold == "auto":
            cost = self._forward_seconds()
            # a prompt past its start (a cached prefix, or a long one's first launch) goes on
            if cost is None or tokens >= self.prefill_tokens or any(r.pos for r in fresh):
                return False
            if now - fresh[0].admitted >= HOLD_MAX:
                return False
            empty = sum(r.params.n * (now - r.admitted) for r in fresh)
            return empty < len(self.rows) * cost
        least, wait = hold
        if tokens >= least:
            return False
        return now - fresh[0].admitted < wait

    def _forward_seconds(self) -> float | None:
        """A prefill forward's fixed cost in seconds (the smallest captured forward's time,
        measured at warm-up on CUDA), or None where it is not measured."""
        graphs = self.prefill_graphs
        return None if graphs is None else graphs.forward_seconds

    def _cache_joined(self) -> None:
        """Give the cache the states that joined launches reached (`_forward_group`). With
        the prefill beside the decode steps, their copies wait for the launch's join and are
        made after the next iteration has handed out its tokens (or before a launch that
        might continue one of them): the first tokens of the prompts a launch completes,
        drawn at the join, are not delayed by them (a launch of 16 cached prompts makes 48
        copies). They are made on the prefill stream, where the launch made what they copy
        and where later launches read the cache's states: in that stream's order, and the
        entries' memory is the prefill stream's, as when they were made inside the launch.
        A copy that fails (out of memory) drops the batch: the cache only misses them."""
        items, self._to_cache = self._to_cache, []
        on = self.prefill_stream
        try:
            with torch.cuda.stream(on) if on is not None else nullcontext():
                self.cache.insert_many(items)
        except Exception:  # noqa: BLE001 - the cache is an optimisation: go on without them
            traceback.print_exc()

    def _join(self, ready: list[Request]) -> None:
        """`_join_rows`, in the timeline where it is on."""
        timeline = self._timeline()
        start = _timed_event(timeline)
        self._join_rows(ready)
        if start is not None:
            timeline.append(("join", len(ready), start, _timed_event(timeline)))

    def _join_rows(self, ready: list[Request]) -> None:
        """Draw the first token of every choice of the prompts in `ready` and put the
        choices into free rows. Nothing here waits for the device: with `lookahead` the
        first tokens are read at the next iteration, after its step is launched (a choice
        that ends on its first token is then stepped once more, that token dropped);
        otherwise at once."""
        seqs: list[Sequence] = []
        if self.prefill_stream is not None:  # made on the prefill stream, read on this one
            stream = torch.cuda.current_stream(self.device)
            for req in ready:
                for t in (*req.state._tensors(), req.logits):
                    t.record_stream(stream)
        for req in ready:
            self.prefilling.remove(req)
            self.reserved -= req.params.n
            p = req.params
            base = p.seed if p.seed is not None else self._rng.getrandbits(62)
            req.seqs = [Sequence(req, i, base + i, self.tokenizer, self.eos_token_ids)
                        for i in range(p.n)]  # fmt: skip
            seqs += req.seqs
        try:
            logits = torch.stack([s.request.logits for s in seqs])
            cfgs = [s.request.sampling for s in seqs]
            seeds = to_device([s.seed for s in seqs], self.device)
            steps = torch.zeros_like(seeds)
            seen = None
            if any(c.repetition_penalty != 1 for c in cfgs):
                seen = torch.zeros(len(seqs), self.vocab, dtype=torch.bool, device=self.device)
                rows = [i for i, s in enumerate(seqs) for _ in s.request.prompt]
                cols = [t for s in seqs for t in s.request.prompt]
                seen[to_device(rows, self.device), to_device(cols, self.device)] = True
            first = sample_rows(logits, cfgs, seeds, steps, seen)
            if seen is not None:
                seen[torch.arange(len(seqs), device=self.device), first] = True
            self.pool.load(len(self.rows), [s.request.state for s in seqs], first, seeds, 1,
                           seen)  # fmt: skip
            host = first.to("cpu", non_blocking=True)  # pinned, on CUDA
            event = None
            if self.device.type == "cuda":
                event = torch.cuda.Event()
                event.record()
        except Exception as e:
            msg = f"sampling failed: {type(e).__name__}: {e}"
            for req in ready:
                self._end_request(req, "error", msg)
            return
        finally:
            for req in ready:
                req.state = req.logits = None
        self.rows += seqs
        counts = self._row_settings
        for s in seqs:
            key = id(s.request.sampling)
            counts[key] = counts.get(key, 0) + 1
        if self.lookahead:
            self._joined.append((seqs, host, event))
        else:
            self._collect((seqs, host, event))
