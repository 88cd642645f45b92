"""Generators of the synthetic tasks: seeded, on the device, produced front to back in chunks.

B batch, T sequence length, k special positions per row, V data tokens. Every task
gives (input_ids [B, T], targets [B, T]) with targets already shifted as the Trainer
wants them: targets[b, t] is what the model must predict at position t, -100 where
nothing is scored. Token ids: the data tokens are 0..V-1, the special tokens follow.

Selective copying (Gu & Dao 2023, Table 1 and appendix E.1; the "variable" copying
of state-spaces/s4 `copying.py`): `n_tokens` data tokens, drawn uniformly from V,
sit at uniformly drawn distinct positions of the first T - n_tokens steps, in
increasing order; every other of those steps holds the blank token V. The last
n_tokens steps hold the marker V + 1; at the i-th marker the target is the i-th data
token. Scored: the n_tokens marker positions. The paper: T = 4096, V = 16, 16 tokens.

Induction heads (Table 2 / Table 11; HazyResearch/safari `synthetics.py`, one
trigger): T - 1 data tokens drawn uniformly from V, except that position p (uniform
in [0, T - 3]) holds the trigger V and p + 1 the answer (a uniform data token); the
last position T - 1 holds the trigger again and its target is the answer, the only
scored position of the row. The noise never holds the trigger, so the earlier
occurrence is unique and always inside the sequence. The paper trains at T = 256.

MQAR (multi-query associative recall, Arora et al. 2023, Zoology `multiquery_ar`):
the first 2 * n_pairs steps are key, value pairs (keys distinct, from
`n_keys`; values from `n_values`, with repetition); the rest is blank except that
each key is queried once, at an even offset after the pairs, in random order; the
target at a query is its value. Key ids 0..n_keys-1, values after them, then blank.
Zoology draws the query gaps from a power law; here they are uniform.

Streams: a `TaskStream` first draws each row's plan (the special positions and their
tokens, O(B * k)), then the filler block by block (blocks of `min(T, NOISE_BLOCK)`
steps, drawn in order from the stream's `torch.Generator`). The sequence therefore
depends only on (seed, B, T, device), not on how it is read: `next(n)` any number of
times gives the same tokens as `whole()`, and a 2^20-step row is never held whole.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

NOISE_BLOCK = 1 << 16  # steps of filler drawn at a time (fixes the draw order)
IGNORE = -100


def _positive_int(name: str, value, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def distinct_sorted(
    batch_size: int, n: int, k: int, gen: torch.Generator, device: torch.device
) -> torch.Tensor:
    """[B, k] distinct integers of [0, n) per row, increasing, every k-subset equally likely
    (Floyd's algorithm, vectorised over rows: k draws of [B], no [B, n] tensor)."""
    out = torch.empty(batch_size, k, dtype=torch.long, device=device)
    for i, j in enumerate(range(n - k, n)):
        t = torch.randint(0, j + 1, (batch_size,), generator=gen, device=device)
        taken = (out[:, :i] == t[:, None]).any(1)
        out[:, i] = torch.where(taken, torch.full_like(t, j), t)
    return out.sort(1).values


class Task:
    """A synthetic task: its plan (special positions and tokens) and its filler."""

    name = "task"
    n_data: int  # data tokens, the chance level of a guess is 1 / n_data
    vocab_size: int  # ids the model must embed

    def min_seqlen(self) -> int:
        raise NotImplementedError

    def check_seqlen(self, seqlen, name: str = "seqlen") -> int:
        return _positive_int(name, seqlen, self.min_seqlen())

    def plan(self, B: int, T: int, gen: torch.Generator, device) -> dict[str, torch.Tensor]:
        """Per row: in_pos / in_val [B, k] tokens written over the filler, tgt_pos / tgt_val
        [B, m] the scored targets (absolute positions)."""
        raise NotImplementedError

    def filler(self, B: int, n: int, gen: torch.Generator, device) -> torch.Tensor:
        """The next n steps of filler [B, n] (drawn from `gen` in stream order)."""
        raise NotImplementedError


class InductionHeads(Task):
    name = "induction-heads"

    def __init__(self, vocab: int = 16) -> None:
        self.n_data = _positive_int("vocab", vocab, 2)
        self.trigger = vocab
        self.vocab_size = vocab + 1

    def min_seqlen(self) -> int:
        return 3

    def plan(self, B, T, gen, device):
        p = torch.randint(0, T - 2, (B, 1), generator=gen, device=device)  # in [0, T - 3]
        answer = torch.randint(0, self.n_data, (B, 1), generator=gen, device=device)
        trig = torch.full_like(answer, self.trigger)
        last = torch.full_like(p, T - 1)
        return {
            "in_pos": torch.cat([p, p + 1, last], 1),
            "in_val": torch.cat([trig, answer, trig], 1),
            "tgt_pos": last,
            "tgt_val": answer,
        }

    def filler(self, B, n, gen, device):
        return torch.randint(0, self.n_data, (B, n), generator=gen, device=device)


class SelectiveCopying(Task):
    name = "selective-copying"

    def __init__(self, vocab: int = 16, n_tokens: int = 16) -> None:
        self.n_data = _positive_int("vocab", vocab, 2)
        self.n_tokens = _positive_int("n_tokens", n_tokens)
        self.blank, self.marker = vocab, vocab + 1
        self.vocab_size = vocab + 2

    def min_seqlen(self) -> int:
        return 2 * self.n_tokens

    def plan(self, B, T, gen, device):
        k = self.n_tokens
        pos = distinct_sorted(B, T - k, k, gen, device)
        tokens = torch.randint(0, self.n_data, (B, k), generator=gen, device=device)
        copy_pos = torch.arange(T - k, T, device=device).expand(B, k)
        return {
            "in_pos": torch.cat([pos, copy_pos], 1),
            "in_val": torch.cat([tokens, torch.full_like(tokens, self.marker)], 1),
            "tgt_pos": copy_pos,
            "tgt_val": tokens,
        }

    def filler(self, B, n, gen, device):
        return torch.full((B, n), self.blank, dtype=torch.long, device=device)


class MQAR(Task):
    name = "mqar"

    def __init__(self, n_pairs: int = 8, n_keys: int = 64, n_values: int = 64) -> None:
        self.n_pairs = _positive_int("n_pairs", n_pairs)
        self.n_keys = _positive_int("n_keys", n_keys, n_pairs)
        self.n_values = _positive_int("n_values", n_values, 2)
        self.n_data = n_values
        self.blank = n_keys + n_values
        self.vocab_size = n_keys + n_values + 1

    def min_seqlen(self) -> int:
        return 4 * self.n_pairs

    def plan(self, B, T, gen, device):
        D = self.n_pairs
        keys = torch.rand(B, self.n_keys, generator=gen, device=device).argsort(1)[:, :D]
        values = torch.randint(0, self.n_values, (B, D), generator=gen, device=device)
        values = values + self.n_keys
        slots = distinct_sorted(B, (T - 2 * D) // 2, D, gen, device)  # [B, D]
        order = torch.rand(B, D, generator=gen, device=device).argsort(1)  # key of each slot
        q_pos = 2 * D + 2 * slots
        kv_pos = torch.arange(2 * D, device=device).expand(B, 2 * D)
        kv_val = torch.stack([keys, values], 2).flatten(1)
        return {
            "in_pos": torch.cat([kv_pos, q_pos], 1),
            "in_val": torch.cat([kv_val, keys.gather(1, order)], 1),
            "tgt_pos": q_pos,
            "tgt_val": values.gather(1, order),
        }

    def filler(self, B, n, gen, device):
        return torch.full((B, n), self.blank, dtype=torch.long, device=device)


TASKS: dict[str, type[Task]] = {t.name: t for t in (SelectiveCopying, InductionHeads, MQAR)}


def make_task(name: str, **kwargs) -> Task:
    """The task called `name` (selective-copying, induction-heads, mqar)."""
    if name not in TASKS:
        raise ValueError(f"task must be one of {', '.join(TASKS)}, got {name!r}")
    return TASKS[name](**kwargs)


def _write(buf: torch.Tensor, start: int, pos: torch.Tensor, val: torch.Tensor) -> torch.Tensor:
    """buf [B, n] with val [B, k] written at absolute positions pos [B, k] that fall inside
    [start, start + n); the others go to a spare column (no host sync, no nonzero)."""
    B, n = buf.shape
    rel = pos - start
    rel = torch.where((rel >= 0) & (rel < n), rel, n)
    out = torch.cat([buf, buf.new_empty(B, 1)], 1)
    return out.scatter_(1, rel, val)[:, :n]


class TaskStream:
    """B rows of one task at length T, read front to back: `next(n)`, `chunks(n)`, `whole()`.

    `seed` seeds the stream's own `torch.Generator` on `device` (the global RNG is not
    touched); the same (seed, B, T, device) gives the same rows however they are read."""

    def __init__(
        self,
        task: Task,
        batch_size: int,
        seqlen: int,
        seed: int = 0,
        device: torch.device | str = "cpu",
    ) -> None:
        self.task = task
        self.B = _positive_int("batch_size", batch_size)
        self.T = task.check_seqlen(seqlen)
        self.device = torch.device(device)
        self.gen = torch.Generator(device=self.device).manual_seed(int(seed))
        self.plan = task.plan(self.B, self.T, self.gen, self.device)
        self.pos = 0  # the next step to produce
        self._block = min(self.T, NOISE_BLOCK)
        self._drawn = 0  # steps of filler drawn so far
        self._buf = torch.empty(self.B, 0, dtype=torch.long, device=self.device)

    def _filler(self, n: int) -> torch.Tensor:
        parts = []
        while n > 0:
            if self._buf.shape[1] == 0:
                size = min(self._block, self.T - self._drawn)
                self._buf = self.task.filler(self.B, size, self.gen, self.device)
                self._drawn += size
            take = min(n, self._buf.shape[1])
            parts.append(self._buf[:, :take])
            self._buf = self._buf[:, take:]
            n -= take
        return parts[0] if len(parts) == 1 else torch.cat(parts, 1)

    def next(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids [B, n'], targets [B, n']) of the next n' = min(n, T - pos) steps."""
        _positive_int("n", n)
        if self.pos >= self.T:
            raise ValueError(f"the stream is exhausted: all {self.T} steps were read")
        n = min(n, self.T - self.pos)
        start, p = self.pos, self.plan
        ids = _write(self._filler(n), start, p["in_pos"], p["in_val"])
        blank = torch.full((self.B, n), IGNORE, dtype=torch.long, device=self.device)
        targets = _write(blank, start, p["tgt_pos"], p["tgt_val"])
        self.pos += n
        return ids, targets

    def chunks(self, chunk_len: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The rest of the rows, chunk_len steps at a time (the last chunk may be shorter)."""
        _positive_int("chunk_len", chunk_len)
        while self.pos < self.T:
            yield self.next(chunk_len)

    def whole(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The rest of the rows in one piece (all of them on a fresh stream)."""
        return self.next(self.T - self.pos)
