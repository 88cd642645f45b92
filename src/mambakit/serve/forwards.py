"""The forwards of a prefill launch (`Engine`'s methods, as a base class): the iteration's
prompt pieces grouped into forwards (whole prompts many to a forward, packed rows, or block
by block: `prefill.py`'s plans), each run through the captured graphs where there are
(`PrefillGraphs`) or eagerly, and what each forward reaches kept: the requests' states and
last logits, and the cache's items. The state these read and write is `Engine.__init__`'s."""

from __future__ import annotations

import numpy as np
import torch

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
from .request import Request
from .slots import rows_at, rows_view, to_device


class Forwards:
    """The forwards of a prefill launch (module docstring)."""

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
