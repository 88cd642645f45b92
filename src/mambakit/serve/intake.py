"""The serving engine's prompt side (`Engine`'s methods, as a base class): admitting
waiting requests while rows are free (their prompt looked up in the prefix cache), the
prefill launches of an iteration (whole prompts many to a forward, packed rows, or block by
block: `prefill.py`), and joining the prompts whose prefill is complete to the decode batch,
their first tokens drawn. The state these read and write is `Engine.__init__`'s."""

from __future__ import annotations

import time
import traceback
from contextlib import nullcontext

import numpy as np
import torch

from .cache import prefix_hashes
from .decode import _timed_event
from .prefill import (
    FORWARD_TOKENS,
    PACK_ROWS,
    PACK_SLOTS,
    left_padded,
    pack_steps,
    pack_width,
    packed_rows,
    piece_lengths,
    plan_groups,
    plan_packs,
    plan_targets,
    right_padded,
    span_bucket,
    span_lengths,
    stack_rows,
    whole_bucket,
)
from .request import Request, Sequence
from .slots import rows_at, rows_view, sample_rows, to_device

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

    def _launch_prefill(self, fresh: list[Request]) -> list[Request]:
        """Enqueue the forwards of this iteration's prompt pieces of the requests `fresh`
        (not launched to their prompt's end yet), grouped by length, and the cache's copies
        of the states they reach; the requests whose prompt they complete. Nothing here
        waits for the device: a later launch reads the states an earlier one writes in the
        order of the prefill stream."""
        whole = []
        block = self.block_size
        cut = span_lengths if self.spans else piece_lengths
        for req, target in plan_targets(fresh, self.prefill_tokens, block):
            if req.whole:
                whole.append(req)
            else:
                req.pieces = cut(req.pos, target, block)
        if whole and self.packed:
            self._prefill_packed(whole)
        elif whole:
            self._prefill_whole(whole)
        while True:
            active = [r for r in self.prefilling if r.pieces]
            if not active:
                break
            # a round: one forward over every prompt whose next piece has the round's
            # length; with `spans`, whose piece pads to the round's bucket, and the shorter
            # ones, longest first, while the filler (padding rows included) costs less
            # than a forward and they need no forward of their own
            size = max(span_bucket(r.pieces[0], block) for r in active)
            group = [r for r in active if span_bucket(r.pieces[0], block) == size]
            if self.spans:
                graphs = self.prefill_graphs
                tokens = sum(r.pieces[0] for r in group)
                for r in sorted((r for r in active if r not in group), key=lambda r: -r.pieces[0]):
                    if graphs is not None and len(group) % graphs.max_rows == 0:
                        break  # the next row would be a forward of its own
                    filler = self._padded_rows(len(group) + 1) * size - tokens - r.pieces[0]
                    if filler > self._forward_tokens():
                        break
                    group.append(r)
                    tokens += r.pieces[0]
            lengths = [r.pieces.popleft() for r in group]
            pieces = [r.ids[r.pos : r.pos + n] for r, n in zip(group, lengths)]
            run = self._pieces_forward if min(lengths) == size else self._spans_forward
            self._forward_group(group, lambda f=run, g=group, p=pieces, n=size: f(g, p, n),
                                [r.pos + n for r, n in zip(group, lengths)])  # fmt: skip
        return [r for r in fresh if r.pos == len(r.prompt)]

    def _pieces_forward(self, group: list[Request], pieces: list[list[int]], n: int):
        """(logits, state) of pieces of one length n, from the states of `group`."""
        state = stack_rows([r.state for r in group], self._zero)
        done = None
        if self.prefill_graphs is not None:
            done = self.prefill_graphs.run(pieces, state, self.device)
        if done is None:
            ids = torch.from_numpy(np.array(pieces, dtype=np.int64)).to(self.device)
            done = self.model.last_logits(ids, state)
        return done

    def _spans_forward(self, group: list[Request], pieces: list[list[int]], n: int):
        """(logits, state) of pieces of different lengths (at most n tokens) from the states
        of `group`, right-padded to n, each row's at its own last token (`_last_at`)."""
        state = stack_rows([r.state for r in group], self._zero)
        done = None
        if self.prefill_graphs is not None:
            done = self.prefill_graphs.run_spans(pieces, state, n, self.device)
        if done is None:
            ids, last = (t.to(self.device) for t in right_padded(pieces, n))
            done = self.model._last_at(ids, last, state)
        return done

    def _prefill_whole(self, reqs: list[Request]) -> None:
        """Prefill whole prompts from zeros. On CUDA in groups of up to the captured rows
        (16) of similar lengths (the prompts sorted by length, cut where the filler saved
        pays for another forward: `plan_groups`), each one forward padded to the bucket of
        its longest (`PrefillGraphs.run_whole`): few large
        forwards, the filler a fraction of each; elsewhere grouped by exact length."""
        if self.device.type == "cuda" or self.prefill_graphs is not None:
            size = self.prefill_graphs.max_rows if self.prefill_graphs is not None else 16
            reqs = sorted(reqs, key=lambda r: len(r.prompt))
            groups, i = {}, 0
            for end in plan_groups([len(r.prompt) for r in reqs], size, self._forward_tokens()):
                group = reqs[i:end]
                groups[(i, whole_bucket(len(group[-1].prompt)))] = group
                i = end
        else:
            groups: dict = {}
            for r in reqs:
                groups.setdefault((0, len(r.prompt)), []).append(r)
        for (_, n), group in groups.items():
            prompts = [r.ids for r in group]

            def forward(prompts=prompts, n=n):
                done = None
                if self.prefill_graphs is not None:
                    done = self.prefill_graphs.run_whole(prompts, self.device)
                if done is None:
                    ids, seq_idx = left_padded(prompts, n, self.device)
                    done = self.model.last_logits(ids, None, seq_idx)
                return done

            self._forward_group(group, forward, [len(p) for p in prompts])

    def _padded_rows(self, g: int) -> int:
        """The rows g pieces run as: with graphs, in parts of up to `max_rows` rows, each
        padded to a power of two (as `PrefillGraphs` captures them); else g."""
        graphs = self.prefill_graphs
        if graphs is None:
            return g
        full, rest = divmod(g, graphs.max_rows)
        return full * graphs.max_rows + (1 << (rest - 1).bit_length() if rest else 0)

    def _forward_tokens(self) -> int:
        """A prefill forward's fixed cost in tokens' worth of its work (measured at warm-up
        on CUDA): what a shorter piece or a smaller group must save to get a forward of
        its own."""
        graphs = self.prefill_graphs
        return graphs.forward_tokens if graphs is not None else FORWARD_TOKENS

    def _pack_slots(self) -> int:
        """The states a packed row keeps at most."""
        graphs = self.prefill_graphs
        return graphs.slots if graphs is not None else PACK_SLOTS

    def _prefill_packed(self, reqs: list[Request]) -> None:
        """Prefill the rest of prompts packed end to end into rows (`plan_packs`), each row
        keeping `_pack_slots()` states at most (each prompt's end, and its block boundaries
        when `blocks`), many rows to a forward (`MambaLM.states_at`). A prompt that
        continues a cached prefix starts a row, from that prefix's state (the state a row
        starts from enters its first prompt only); the other rows start from zeros. On
        CUDA a forward is padded to a power of two rows and a `pack_width` and replayed
        from its graph."""
        graphs = self.prefill_graphs
        slots = self._pack_slots()
        most_rows, most_tokens = PACK_ROWS, 2 * pack_width(self.prefill_tokens)
        if graphs is not None:  # (without a warm-up, the graphs are captured as first met)
            graphs.pack_tokens = max(graphs.pack_tokens, most_tokens)
            most_rows, most_tokens = graphs.pack_rows, graphs.pack_tokens
        for rows, _, _ in plan_packs(reqs, self.block_size, slots, most_rows, most_tokens,
                                     self._forward_tokens()):  # fmt: skip
            steps = [[pack_steps(r.pos, len(r.prompt), self.block_size, r.blocks) for r in row]
                     for row in rows]  # fmt: skip
            keep, ends, marks = [], [], []  # kept steps (row, j); each request's end in keep
            for b, (row, row_steps) in enumerate(zip(rows, steps)):
                j = 0
                for r, st in zip(row, row_steps):
                    for s in st[:-1]:
                        marks.append((r, r.pos + s + 1, len(keep)))
                        keep.append((b, j))
                        j += 1
                    ends.append(len(keep))
                    keep.append((b, j))
                    j += 1

            def forward(rows=rows, steps=steps, keep=keep):
                prompts = [[r.ids[r.pos :] for r in row] for row in rows]
                starts = [row[0].state for row in rows]  # a cached prefix's (one row), or None
                if graphs is not None:
                    done = graphs.run_packed(prompts, steps, starts, keep, self.device)
                    if done is not None:
                        return done
                width = max(sum(map(len, p)) for p in prompts)
                k = max(sum(map(len, st)) for st in steps)
                host = packed_rows(prompts, steps, width, len(rows), k)
                ids, seq, pos = (t.to(self.device) for t in host)
                logits, state = self.model._states_at(ids, pos, stack_rows(starts, self._zero),
                                                      seq)  # fmt: skip
                idx = to_device([b * k + j for b, j in keep], self.device)
                return logits.flatten(0, 1).index_select(0, idx), rows_at(state, idx)

            group = [r for row in rows for r in row]
            self._forward_group(group, forward, [len(r.prompt) for r in group], ends, marks)

    def _forward_group(
        self, group: list[Request], forward, ends: list[int], rows=None, marks=()
    ) -> None:
        """Run `forward` (-> logits [g, V], state [L, g, ...]) that takes the requests of
        `group` to positions `ends`; keep each one's state row and last logits, and give
        the cache those at a block boundary or a prompt's end. `rows`: the row of each
        request's end (default: its index); `marks`: (request, tokens, row) of the states
        at block boundaries inside the prompts (a packed forward's), for the cache. A
        forward that fails ends the requests of the group with an error."""
        try:
            logits, out = forward()
        except Exception as e:
            msg = f"prefill failed: {type(e).__name__}: {e}"
            for r in group:
                self._end_request(r, "error", msg)
            return
        with self.metrics.lock:
            self.metrics.prefill_tokens += sum(end - r.pos for r, end in zip(group, ends))
        keep = [(r.prompt[:n], r.hashes, rows_view(out, j, j + 1), logits[j])
                for r, n, j in marks]  # fmt: skip
        for i, (r, end) in enumerate(zip(group, ends)):
            j = i if rows is None else rows[i]
            r.pos = end
            r.state, r.logits = rows_view(out, j, j + 1), logits[j]
            if end % self.block_size == 0 or end == len(r.prompt):
                keep.append((r.prompt[:end], r.hashes, r.state, r.logits))
        if keep and self.cache.enabled:
            if self.async_prefill:  # copied into the cache once the launch is joined
                self._keeps += keep
            else:
                self.cache.insert_many(keep)  # their copies together: a launch or two

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
        stream = torch.cuda.stream(self.prefill_stream) if self.prefill_stream is not None else None
        try:
            with stream if stream is not None else nullcontext():
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
            req.seqs = [Sequence(req, i, base + i, self.tokenizer, self.eos_token_id)
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
