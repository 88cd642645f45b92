"""The prefill's forwards captured as CUDA graphs (`PrefillGraphs`): one per (rows bucket,
piece length) and kind (pieces of one length from a state, pieces of different lengths
each stopped at its own last token, whole prompts from zeros left-padded, rows of packed
prompts), replayed with the prompts copied into their static buffers. prefill.py plans
what these run."""

from __future__ import annotations

from functools import partial

import numpy as np
import torch

from ..inference.plan import refresh
from ..state import ModelState
from .prefill import (
    FORWARD_TOKENS,
    PACK_MIN,
    PACK_ROWS,
    PACK_SLOTS,
    WHOLE_MIN,
    buckets,
    left_padded,
    pack_width,
    packed_rows,
    right_padded,
    whole_bucket,
)
from .slots import rows_at, to_device

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

    def __init__(self, model, block_size: int, capture_stream=None) -> None:
        """`capture_stream`: the stream every prefill graph is captured on (None: one of
        their own on CUDA), not that of graphs replayed beside them (`graph_capture`)."""
        self.model = model
        # brings the plans the graphs read up to date before a replay (the engine's: once
        # an iteration, `Engine._refresh_plans`)
        self.refresh_plans = partial(refresh, model)
        self.pool = torch.cuda.graph_pool_handle()
        self.capture_stream = capture_stream
        device = next(model.parameters()).device
        if capture_stream is None and device.type == "cuda":
            self.capture_stream = torch.cuda.Stream(device)
        self.graphs: dict[tuple[int, int], tuple] = {}  # (rows, n) -> (graph, ids buffer)
        self.buffers: dict[int, tuple] = {}  # rows -> (state in, state out, logits)
        self.enabled = True  # the pieces' graphs
        self.whole_enabled = True  # the whole prompts' (a failed capture turns off its kind)
        self.packed_enabled = True  # the packed forwards' (`run_packed`)
        # pieces of different lengths in one forward (`run_spans`): where the model stops
        # each row at a step of its own (`MambaLM.stops_rows`)
        self.spans_enabled = model.stops_rows()
        row = model.init_state(1)
        row_bytes = sum(t.numel() * t.element_size() for t in row._tensors())
        rows = 1  # buckets 1, 2, ... R hold 2 states of 2R - 1 rows in all
        while rows < GRAPH_MAX_ROWS and 2 * (4 * rows - 1) * row_bytes <= GRAPH_STATE_BYTES:
            rows *= 2
        self.max_rows = rows
        # packed forwards (`run_packed`): `slots` states kept a row, `pack_rows` rows at most,
        # whose kept states (the scan's per-layer outputs, their stack and the graphs' shared
        # output buffer: three copies, counted as four) stay within the same bound
        self.slots = PACK_SLOTS
        rows = 1
        while rows < PACK_ROWS and 2 * 2 * rows * self.slots * row_bytes <= GRAPH_STATE_BYTES:
            rows *= 2
        self.pack_rows = rows
        # tokens of a packed forward at most: twice the widest row (`warmup`, or the engine's
        # prefill budget, `Forwards._prefill_packed`)
        self.pack_tokens = 2 * PACK_MIN
        self.packed_in: dict[int, ModelState] = {}  # rows -> the rows' initial state buffer
        self.packed_out: tuple | None = None  # (state, logits) of pack_rows * slots rows
        self.lengths = [1 << i for i in range(block_size.bit_length()) if 1 << i < block_size]
        self.lengths.append(block_size)
        self.forward_tokens = FORWARD_TOKENS  # measured by `warmup` once it has the graphs
        self.forward_seconds: float | None = None  # the smallest forward's time (`warmup`)
        self.replays = 0  # forwards replayed, and the tokens they computed (rows x length)
        self.replayed_tokens = 0

    def _entry(self, rows: int, n: int, device, whole: bool = False, spans: bool = False):
        """The graph of a (rows, n) piece, its ids buffer and a third: from the state buffer
        (None), or (`whole`) from zeros with a `seq_idx` buffer marking each row's left
        filler, or (`spans`) from the state buffer, each row stopped at its step in a
        buffer of last steps [rows] (`MambaLM._last_at`)."""
        from ..inference.cuda_graph import capture

        key = (rows, n, "spans" if spans else whole)
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
        seq = torch.zeros(rows, n, dtype=torch.int32, device=device) if whole else None
        last = torch.zeros(rows, dtype=torch.int64, device=device) if spans else None

        def fn():
            if spans:
                logits, state = self.model._last_at(ids, last, state_in)
            else:
                logits, state = self.model.last_logits(ids, None if whole else state_in, seq)
            state_out.copy_(state)
            logits_out.copy_(logits)

        graph, _ = capture(fn, warmup=2, pool=self.pool, stream=self.capture_stream)
        self.graphs[key] = (graph, ids, last if spans else seq)
        return self.graphs[key]

    def _packed_entry(self, rows: int, width: int, device):
        """The graph of a packed forward of `rows` rows of `width` tokens and its buffers:
        (graph, ids [rows, width], seq_idx [rows, width], positions [rows, slots]); it
        reads the rows' initial state from `packed_in[rows]` and writes the states and
        logits at the positions (row b's j-th at b * slots + j) into `packed_out`."""
        from ..inference.cuda_graph import capture

        key = (rows, width, "packed")
        if key in self.graphs:
            return self.graphs[key]
        if self.packed_out is None:
            param = next(self.model.parameters())
            n = self.pack_rows * self.slots
            self.packed_out = (
                self.model.init_state(n),
                torch.zeros(n, self.model.config.vocab_size, dtype=param.dtype, device=device),
            )
        if rows not in self.packed_in:
            self.packed_in[rows] = self.model.init_state(rows)
        state_out, logits_out = self.packed_out
        state_in = self.packed_in[rows]
        n = rows * self.slots
        ids = torch.zeros(rows, width, dtype=torch.int64, device=device)
        seq = torch.zeros(rows, width, dtype=torch.int32, device=device)
        pos = torch.arange(self.slots, dtype=torch.int64, device=device).expand(rows, -1)
        pos = pos.contiguous()

        def fn():
            logits, state = self.model._states_at(ids, pos, state_in, seq)
            for dst, src in zip(state_out._tensors(), state._tensors()):
                dst[:, :n].copy_(src)
            logits_out[:n].copy_(logits.flatten(0, 1))

        graph, _ = capture(fn, warmup=2, pool=self.pool, stream=self.capture_stream)
        self.graphs[key] = (graph, ids, seq, pos)
        return self.graphs[key]

    def run_packed(self, prompts, steps, starts, keep, device):
        """(logits [len(keep), V], state [L, len(keep), ...]) of a packed forward: rows of
        prompts end to end (`prompts[b]`, their kept steps `steps[b]`, as `packed_rows`
        takes them; row b starts from `starts[b]`, one row, or zeros for None), padded to
        a power of two rows and a `pack_width`; the results at the kept steps `keep`, (row,
        its j-th kept step) each. None when the graphs are off or the forward is larger
        than those captured."""
        tokens = max(sum(map(len, p)) for p in prompts)
        width = pack_width(tokens)
        rows = 1 << (len(prompts) - 1).bit_length()
        if not self.packed_enabled or rows > self.pack_rows or rows * width > self.pack_tokens:
            return None
        if max(sum(map(len, st)) for st in steps) > self.slots:
            return None
        try:
            graph, ids_buf, seq_buf, pos_buf = self._packed_entry(rows, width, device)
        except Exception:  # a capture that fails: packed forwards run eagerly from now on
            self.packed_enabled = False
            return None
        pin = device.type == "cuda"
        for buf, host in zip((ids_buf, seq_buf, pos_buf),
                             packed_rows(prompts, steps, width, rows, self.slots)):  # fmt: skip
            buf.copy_(host.pin_memory() if pin else host, non_blocking=True)
        state_in = self.packed_in[rows]
        state_in.zero_()
        for b, start in enumerate(starts):
            if start is not None:
                for dst, src in zip(state_in._tensors(), start._tensors()):
                    dst[:, b].copy_(src[:, 0])
        self._replay_graph(graph, rows * width)
        idx = to_device([b * self.slots + j for b, j in keep], device)
        state_out, logits_out = self.packed_out
        return logits_out.index_select(0, idx), rows_at(state_out, idx)

    def warmup(self, device, whole_max: int = 0, pack_max: int = 0) -> None:
        """Capture every graph now (a capture mid-service would stall an iteration): the
        pieces' (one length a forward, and different lengths with `spans_enabled`), then
        the whole prompts' up to `whole_max` tokens (the largest ones, which
        a capture is likeliest to fail on for want of memory, last), or the packed
        forwards' of up to `pack_max` prompt tokens (every power of two rows and
        `pack_width` up to that of `pack_max` tokens, twice that in all at most)."""
        row_buckets = [1 << i for i in range(self.max_rows.bit_length())]
        for rows in row_buckets:
            for n in self.lengths:
                if self.enabled:
                    self._run([[0] * n] * rows, None, device)
            for n in self.lengths[1:]:
                if self.spans_enabled:
                    self._run_spans([[0] * n] + [[0]] * (rows - 1), None, n, device)
        if pack_max:
            self.pack_tokens = 2 * pack_width(pack_max)
            width = PACK_MIN
            while width <= self.pack_tokens // 2:
                rows = 1
                while rows <= self.pack_rows and (rows == 1 or rows * width <= self.pack_tokens):
                    if self.packed_enabled:
                        prompts = [[[0] * width]] * rows
                        self.run_packed(prompts, [[[width - 1]]] * rows, [None] * rows,
                                        [(0, 0)], device)  # fmt: skip
                    rows *= 2
                width *= 2
        for n in buckets(whole_bucket, whole_max):
            for rows in row_buckets:
                if self.whole_enabled:
                    self._run_whole([[0] * n] * rows, n, device)
        self._measure(device)

    def _measure(self, device) -> None:
        """`forward_tokens` and `forward_seconds` from two captured forwards of one kind
        (whole prompts, else packed rows), the smallest and the largest: the smallest's
        time, and that time in tokens at the rate the largest adds per token."""
        if device.type != "cuda":
            return
        for kind, small in ((True, (1, WHOLE_MIN)), ("packed", (1, PACK_MIN))):
            sizes = [(r, n) for r, n, k in self.graphs if k == kind]
            if small in sizes and len(sizes) >= 2:
                break
        else:
            return
        rows, n = max(sizes, key=lambda k: k[0] * k[1])
        t_small = _replay_ms(self.graphs[(*small, kind)][0])
        t_big = _replay_ms(self.graphs[(rows, n, kind)][0])
        self.forward_seconds = t_small / 1e3
        per_token = (t_big - t_small) / (rows * n - small[1])
        if per_token > 0:
            self.forward_tokens = max(0, round(t_small / per_token) - small[1])

    def run(self, ids: list[list[int]], state: ModelState | None, device):
        """(logits [g, V], state [L, g, ...]) of the pieces `ids` (g rows of one length) from
        `state` (None: zeros), or None when the graphs are off."""
        if not self.enabled:
            return None
        return self._in_parts(ids, state, lambda part, rows: self._run(part, rows, device))

    def run_spans(self, pieces: list[list[int]], state: ModelState | None, n: int, device):
        """(logits [g, V], state [L, g, ...]) of pieces of different lengths (g rows, at most
        n tokens each, n a captured length) from `state`, each row's at its own last token,
        or None when these graphs are off."""
        if not self.spans_enabled:
            return None
        return self._in_parts(
            pieces, state, lambda part, rows: self._run_spans(part, rows, n, device)
        )

    def _in_parts(self, items: list, state: ModelState | None, run_part):
        """`run_part(items, their state rows)` over parts of at most `max_rows` rows, the
        results joined; None when a part gives None."""
        parts = []
        for i in range(0, len(items), self.max_rows):
            rows = None
            if state is not None:
                rows = type(state)(*(t[:, i : i + self.max_rows] for t in state._tensors()))
            out = run_part(items[i : i + self.max_rows], rows)
            if out is None:
                return None
            parts.append(out)
        return join_parts(parts)

    def run_whole(self, prompts: list[list[int]], device):
        """(logits [g, V], state [L, g, ...]) of whole prompts from zeros, each left-padded to
        the bucket of the longest (`whole_bucket`), or None when the graphs are off."""
        if not self.whole_enabled:
            return None
        n = whole_bucket(max(map(len, prompts)))
        return self._in_parts(prompts, None, lambda part, _: self._run_whole(part, n, device))

    def _replay_graph(self, graph, tokens: int) -> None:
        """Replay `graph` (`tokens` computed: rows x length) on the plans' current weights."""
        self.refresh_plans()
        graph.replay()
        self.replays += 1
        self.replayed_tokens += tokens

    def _replay(self, rows: int, g: int, graph, tokens: int):
        """Replay `graph` (`tokens` computed: rows x length), the first g rows of its results."""
        self._replay_graph(graph, tokens)
        _, state_out, logits_out = self.buffers[rows]
        rows_out = (t[:, :g].clone() for t in state_out._tensors())
        return logits_out[:g].clone(), type(state_out)(*rows_out)

    def _run_whole(self, prompts, n, device):
        g = len(prompts)
        rows = 1 << (g - 1).bit_length()
        try:
            graph, buf, seq = self._entry(rows, n, device, whole=True)
        except Exception:  # a capture that fails: whole prompts run eagerly from now on
            self.whole_enabled = False
            return None
        ids, seq_idx = left_padded(prompts, n, device)
        buf[:g].copy_(ids)
        buf[g:].zero_()
        seq[:g].copy_(seq_idx)
        seq[g:].zero_()
        return self._replay(rows, g, graph, rows * n)

    def _run_spans(self, pieces, state, n, device):
        g = len(pieces)
        rows = 1 << (g - 1).bit_length()
        try:
            graph, buf, last_buf = self._entry(rows, n, device, spans=True)
        except Exception:  # a capture that fails: pieces of one length only from now on
            self.spans_enabled = False
            return None
        ids, last = right_padded(pieces, n)
        pin = device.type == "cuda"
        buf[:g].copy_(ids.pin_memory() if pin else ids, non_blocking=True)
        buf[g:].zero_()
        last_buf[:g].copy_(last.pin_memory() if pin else last, non_blocking=True)
        last_buf[g:].zero_()
        self._load_state(rows, g, state)
        return self._replay(rows, g, graph, rows * n)

    def _run(self, ids, state, device):
        g, n = len(ids), len(ids[0])
        rows = 1 << (g - 1).bit_length()
        try:
            graph, buf, _ = self._entry(rows, n, device)
        except Exception:  # a capture that fails: eager from now on
            self.enabled = False
            return None
        host = torch.from_numpy(np.array(ids, dtype=np.int64))  # (faster than torch.tensor)
        buf[:g].copy_(host.pin_memory() if device.type == "cuda" else host, non_blocking=True)
        buf[g:].zero_()
        self._load_state(rows, g, state)
        return self._replay(rows, g, graph, rows * n)

    def _load_state(self, rows: int, g: int, state: ModelState | None) -> None:
        """The first g rows of the rows bucket's state buffer from `state` (None: zeros),
        the rest zeros."""
        state_in = self.buffers[rows][0]
        if state is None:
            state_in.zero_()
        else:
            for dst, src in zip(state_in._tensors(), state._tensors()):
                dst[:, :g].copy_(src)
                dst[:, g:].zero_()


def _replay_ms(graph, times: int = 3) -> float:
    """The fastest of a few replays of a CUDA graph, in milliseconds."""
    best = float("inf")
    for _ in range(times):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end))
    return best


def join_parts(parts: list[tuple]) -> tuple:
    """(logits, state) of row groups run apart, as one."""
    if len(parts) == 1:
        return parts[0]
    logits = torch.cat([p[0] for p in parts])
    fields = zip(*(p[1]._tensors() for p in parts))
    return logits, type(parts[0][1])(*(torch.cat(ts, dim=1) for ts in fields))
