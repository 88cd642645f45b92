"""The prefix-state cache: the model state after a prompt prefix, kept on the device and
reused by a later prompt that starts with the same tokens.

A Mamba model's whole context is its recurrent state (the conv history is part of it),
so the state after prefix P is exactly what a prompt P + S needs to go on with S: the
engine copies it and prefills S alone. An entry holds the state after its prefix and the
logits of the prefix's last token (so a prompt that is exactly a cached prefix draws its
first token without running the model). The engine stores one at every multiple of its
block size inside a prompt and one at each prompt's end.

Entries are keyed by the exact token prefix: a rolling hash of the tokens finds the
candidates, and the tokens themselves are compared before an entry is used, so a hash
collision can never hand a prompt another prefix's state. The least recently used
entries are dropped first to keep the total bytes within the budget.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from ..state import ModelState

_BASE = 1_000_003  # odd: invertible modulo 2**64
_INV = pow(_BASE, -1, 1 << 64)
_powers: tuple[np.ndarray, np.ndarray] | None = None  # BASE**j and BASE**-j mod 2**64


def _power_tables(n: int) -> tuple[np.ndarray, np.ndarray]:
    global _powers
    if _powers is None or len(_powers[0]) < n:
        size = max(n, 4096, 2 * len(_powers[0]) if _powers is not None else 0)
        up = np.full(size, _BASE, dtype=np.uint64)
        up[0] = 1
        down = np.full(size, _INV, dtype=np.uint64)
        down[0] = 1
        _powers = (np.cumprod(up), np.cumprod(down))  # uint64 products wrap modulo 2**64
    return _powers


def prefix_hashes(tokens) -> np.ndarray:
    """h[i] = the hash of tokens[:i + 1], for every i (uint64; its items hash and compare
    as the Python ints they equal): the polynomial sum_j (tokens[j] + 1) * BASE**(i - j)
    modulo 2**64, as BASE**i times a prefix sum of (tokens[j] + 1) * BASE**-j, so numpy
    computes every prefix at once. `tokens`: token ids, best an int64 array (a request's
    `ids`, made as it was submitted: a list of 1,000 Python ints takes numpy longer to read
    than the hashing). Only candidates are found by it (the tokens are compared), so a
    collision costs a comparison, no more."""
    n = len(tokens)
    up, down = _power_tables(n)
    t = np.asarray(tokens, dtype=np.int64).view(np.uint64) + np.uint64(1)
    return np.cumsum(t * down[:n], dtype=np.uint64) * up[:n]


@dataclass
class CacheEntry:
    tokens: tuple[int, ...]  # the exact prefix
    state: ModelState  # the state after it, one row, owned by the entry
    logits: torch.Tensor  # [V] at its last token
    nbytes: int


class PrefixCache:
    """Prefix -> (state, last logits), least recently used dropped first within
    `max_bytes` (0 turns the cache off)."""

    def __init__(self, max_bytes: int) -> None:
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
            raise ValueError(f"max_bytes must be an int >= 0, got {max_bytes!r}")
        self.max_bytes = max_bytes
        self.entries: OrderedDict[tuple[int, int], CacheEntry] = OrderedDict()
        self.nbytes = 0
        self.lengths: dict[int, int] = {}  # prefix length -> entries of that length
        self.sorted_lengths: list[int] = []  # the keys of `lengths`, ascending
        self.hits = 0  # lookups that found a prefix
        self.misses = 0
        self.hit_tokens = 0  # prompt tokens not prefilled thanks to a hit
        self.evictions = 0
        self.added = 0  # entries added so far (a prompt looked up before may look again)

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    def lookup(
        self, tokens: list[int], hashes, count: bool = True, longer_than: int = 0
    ) -> CacheEntry | None:
        """The entry of the longest cached prefix of `tokens` (the whole of it included)
        longer than `longer_than` tokens, marked as recently used; None when none is.
        `count`: in the hits, misses and hit tokens. The keys of every cached length are
        formed and tested at once (a cache of prompt ends holds hundreds of lengths: with 787,
        a miss took 156 us one key at a time on a 2-core CPU, 75 so), then the tokens of the
        candidates compared, longest first."""
        if not self.enabled:
            return None
        lengths = self.sorted_lengths
        lo = bisect.bisect_right(lengths, longer_than)
        hi = bisect.bisect_right(lengths, len(tokens))
        found = None
        if hi > lo:
            ns = np.asarray(lengths[lo:hi], dtype=np.int64)
            h = hashes if isinstance(hashes, np.ndarray) else np.asarray(hashes, np.uint64)
            keys = zip(ns.tolist(), h[ns - 1].tolist())
            for key in reversed(list(filter(self.entries.__contains__, keys))):
                entry = self.entries[key]
                if entry.tokens == tuple(tokens[: key[0]]):
                    self.entries.move_to_end(key)
                    found = entry
                    break
        if count:
            if found is not None:
                self.hits += 1
                self.hit_tokens += len(found.tokens)
            else:
                self.misses += 1
        return found

    def insert(self, tokens: list[int], hashes, state: ModelState, logits: torch.Tensor) -> None:
        """Keep a copy of the state after `tokens` (one row) and of its last `logits` [V]."""
        self.insert_many([(tokens, hashes, state, logits)])

    def insert_many(self, items: list[tuple]) -> None:
        """`insert` of each (tokens, hashes, state, logits) in turn (the same entries, order
        of use and evictions), the copies of the new ones made together first: one
        multi-tensor copy (`torch._foreach_copy_`) rather than a clone from Python of each
        tensor (a launch of 16 cached prompts made 48). It saves host time only: on CUDA a
        state row of several layers is not one dense block, so each tensor is still a copy
        of its own, launched from C++. (The copies exist before the evictions they cause:
        the device holds up to one batch over the budget for that moment.)"""
        if not self.enabled:
            return
        ops: list[tuple] = []  # ("use", key, item) or ("add", key, tokens, state, copies, nbytes)
        pending: dict[tuple[int, int], tuple[int, ...]] = {}  # the tokens each key will hold
        src: list[torch.Tensor] = []
        dst: list[torch.Tensor] = []
        for tokens, hashes, state, logits in items:
            if not tokens:
                continue
            key = (len(tokens), int(hashes[len(tokens) - 1]))
            tokens = tuple(tokens)
            held = (
                pending[key] if key in pending else getattr(self.entries.get(key), "tokens", None)
            )
            if held == tokens:
                ops.append(("use", key, (tokens, hashes, state, logits)))
                continue
            tensors = (*state._tensors(), logits)
            nbytes = sum(t.numel() * t.element_size() for t in tensors)
            if nbytes > self.max_bytes:
                continue
            pending[key] = tokens
            copies = [torch.empty_like(t) for t in tensors]  # filled below, all at once
            src += tensors
            dst += copies
            ops.append(("add", key, tokens, state, copies, nbytes))
        if src:
            torch._foreach_copy_(dst, src)
        for op in ops:
            key = op[1]
            if op[0] == "use":
                if key in self.entries:
                    self.entries.move_to_end(key)
                else:  # evicted by an entry earlier in the batch: kept again, as in turn
                    self.insert_many([op[2]])
                continue
            _, _, tokens, state, copies, nbytes = op
            self._add(key, tokens, type(state)(*copies[:-1]), copies[-1], nbytes)

    def _add(self, key, tokens: tuple, state: ModelState, logits: torch.Tensor, nbytes: int
             ) -> None:  # fmt: skip
        if key in self.entries:  # a colliding prefix: the newer one takes the key
            self._drop(key)
        self.entries[key] = CacheEntry(tokens, state, logits, nbytes)
        self.added += 1
        self.nbytes += nbytes
        n = len(tokens)
        self.lengths[n] = self.lengths.get(n, 0) + 1
        if self.lengths[n] == 1:
            bisect.insort(self.sorted_lengths, n)
        while self.nbytes > self.max_bytes:
            self._drop(next(iter(self.entries)))
            self.evictions += 1

    def _drop(self, key) -> None:
        self.nbytes -= self.entries.pop(key).nbytes
        n = key[0]
        self.lengths[n] -= 1
        if not self.lengths[n]:
            del self.lengths[n]
            self.sorted_lengths.pop(bisect.bisect_left(self.sorted_lengths, n))

    def clear(self) -> None:
        self.entries.clear()
        self.nbytes = 0
        self.lengths.clear()
        self.sorted_lengths.clear()
