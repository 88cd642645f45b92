"""The prefill's forwards captured as CUDA graphs (`PrefillGraphs`): one per (rows bucket,
piece length) and kind (pieces of one length from a state, pieces of different lengths
each stopped at its own last token, whole prompts from zeros left-padded, packed rows),
replayed with the prompts copied into their static buffers. prefill.py plans what these
run."""

from __future__ import annotations

import torch

from ..state import ModelState
from .prefill import (
    FORWARD_TOKENS,
    WHOLE_MIN,
    buckets,
    left_padded,
    pack_bucket,
    packed_row,
    right_padded,
    whole_bucket,
)
from .slots import to_device

GRAPH_STATE_BYTES = 2 << 30  # the static state buffers of the prefill graphs, at most
GRAPH_MAX_ROWS = 16  # rows of a captured prefill at most (a larger group runs in parts)
PACK_SLOTS = 128  # the states one packed forward keeps at most


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
        self.enabled = True  # the pieces' graphs
        self.whole_enabled = True  # the whole prompts' (a failed capture turns off its kind)
        self.packed_enabled = True  # the packed rows' (`run_packed`)
        # pieces of different lengths in one forward (`run_spans`): where the model stops
        # each row at a step of its own (`MambaLM.stops_rows`)
        self.spans_enabled = model.stops_rows()
        row = model.init_state(1)
        row_bytes = sum(t.numel() * t.element_size() for t in row._tensors())
        rows = 1  # buckets 1, 2, ... R hold 2 states of 2R - 1 rows in all
        while rows < GRAPH_MAX_ROWS and 2 * (4 * rows - 1) * row_bytes <= GRAPH_STATE_BYTES:
            rows *= 2
        self.max_rows = rows
        # the states a packed forward keeps at most (a step's state of every layer each):
        # its output buffer holds that many rows, within the same bound
        slots = 16
        while slots < PACK_SLOTS and 2 * slots * row_bytes <= GRAPH_STATE_BYTES:
            slots *= 2
        self.slots = slots
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

        graph, _ = capture(fn, warmup=2, pool=self.pool)
        self.graphs[key] = (graph, ids, last if spans else seq)
        return self.graphs[key]

    def _packed_entry(self, n: int, device, from_state: bool = False):
        """The graph of a packed row of n tokens and its buffers: (graph, ids [1, n],
        seq_idx [1, n], positions [1, slots], the initial state of its first prompt or
        None); its results go to the shared buffers of `slots` rows (`buffers[-slots]`)."""
        from ..inference.cuda_graph import capture

        key = (1, n, "packed-from" if from_state else "packed")
        if key in self.graphs:
            return self.graphs[key]
        if -self.slots not in self.buffers:
            param = next(self.model.parameters())
            vocab = self.model.config.vocab_size
            self.buffers[-self.slots] = (
                None,
                self.model.init_state(self.slots),
                torch.zeros(self.slots, vocab, dtype=param.dtype, device=device),
            )
        _, state_out, logits_out = self.buffers[-self.slots]
        ids = torch.zeros(1, n, dtype=torch.int64, device=device)
        seq = torch.zeros(1, n, dtype=torch.int32, device=device)
        pos = torch.arange(self.slots, dtype=torch.int64, device=device)[None]
        state_in = self.model.init_state(1) if from_state else None

        def fn():
            logits, state = self.model._states_at(ids, pos, state_in, seq)
            state_out.copy_(state)
            logits_out.copy_(logits[0])

        graph, _ = capture(fn, warmup=2, pool=self.pool)
        self.graphs[key] = (graph, ids, seq, pos, state_in)
        return self.graphs[key]

    def run_packed(self, ids, seq, pos, k: int, device, state: ModelState | None = None):
        """(logits [k, V], state [L, k, ...]) of the first k steps of a packed row (host
        tensors from `packed_row`, its length a `pack_bucket`, `slots` steps) whose first
        prompt starts from `state` (one row; None: zeros), or None when the graphs are
        off."""
        if not self.packed_enabled or pos.shape[1] != self.slots:
            return None
        try:
            entry = self._packed_entry(ids.shape[1], device, state is not None)
        except Exception:  # a capture that fails: packed rows run eagerly from now on
            self.packed_enabled = False
            return None
        graph, ids_buf, seq_buf, pos_buf, state_in = entry
        for buf, host in ((ids_buf, ids), (seq_buf, seq), (pos_buf, pos)):
            buf.copy_(host.pin_memory() if device.type == "cuda" else host, non_blocking=True)
        if state is not None:
            state_in.copy_(state)
        return self._replay(-self.slots, k, graph, ids.shape[1])

    def warmup(self, device, whole_max: int = 0, pack_max: int = 0) -> None:
        """Capture every graph now (a capture mid-service would stall an iteration): the
        pieces' (one length a forward, and different lengths with `spans_enabled`), then
        the whole prompts' up to `whole_max` tokens (the largest ones, which
        a capture is likeliest to fail on for want of memory, last), or the packed rows' up
        to `pack_max` tokens."""
        row_buckets = [1 << i for i in range(self.max_rows.bit_length())]
        for rows in row_buckets:
            for n in self.lengths:
                if self.enabled:
                    self._run([[0] * n] * rows, None, device)
            for n in self.lengths[1:]:
                if self.spans_enabled:
                    self._run_spans([[0] * n] + [[0]] * (rows - 1), None, n, device)
        for n in buckets(pack_bucket, pack_max):
            for start in (None, self.model.init_state(1)):
                if self.packed_enabled:
                    row = packed_row([[0] * n], [[n - 1]], n, self.slots)
                    self.run_packed(*row, 1, device, start)
        for n in buckets(whole_bucket, whole_max):
            for rows in row_buckets:
                if self.whole_enabled:
                    self._run_whole([[0] * n] * rows, n, device)
        self._measure(device)

    def _measure(self, device) -> None:
        """`forward_tokens` from two captured forwards of whole prompts, the smallest and
        the largest: the smallest's time in tokens at the rate the largest adds per token."""
        whole = [(r, n) for r, n, kind in self.graphs if kind is True]
        if device.type != "cuda" or (1, WHOLE_MIN) not in whole or len(whole) < 2:
            return
        rows, n = max(whole, key=lambda k: k[0] * k[1])
        t_small = _replay_ms(self.graphs[(1, WHOLE_MIN, True)][0])
        t_big = _replay_ms(self.graphs[(rows, n, True)][0])
        self.forward_seconds = t_small / 1e3
        per_token = (t_big - t_small) / (rows * n - WHOLE_MIN)
        if per_token > 0:
            self.forward_tokens = max(0, round(t_small / per_token) - WHOLE_MIN)

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

    def _replay(self, rows: int, g: int, graph, tokens: int):
        """Replay `graph` (`tokens` computed: rows x length), the first g rows of its results."""
        from ..inference.plan import refresh

        refresh(self.model)
        graph.replay()
        self.replays += 1
        self.replayed_tokens += tokens
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
        buf[:g].copy_(to_device(ids, device))
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
