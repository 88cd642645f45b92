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

from collections import OrderedDict
from dataclasses import dataclass

import torch

from ..state import ModelState

_MOD = (1 << 61) - 1  # a Mersenne prime: the rolling hash works modulo it
_BASE = 1_000_003


def prefix_hashes(tokens: list[int]) -> list[int]:
    """h[i] = the hash of tokens[:i + 1], for every i."""
    out, h = [], 0
    for t in tokens:
        h = (h * _BASE + t + 1) % _MOD
        out.append(h)
    return out


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
        self.hits = 0  # lookups that found a prefix
        self.misses = 0
        self.hit_tokens = 0  # prompt tokens not prefilled thanks to a hit
        self.evictions = 0

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    def lookup(self, tokens: list[int], hashes: list[int]) -> CacheEntry | None:
        """The entry of the longest cached prefix of `tokens` (the whole of it included),
        marked as recently used; None when none is cached."""
        if not self.enabled:
            return None
        for n in range(len(tokens), 0, -1):
            entry = self.entries.get((n, hashes[n - 1]))
            if entry is not None and entry.tokens == tuple(tokens[:n]):
                self.entries.move_to_end((n, hashes[n - 1]))
                self.hits += 1
                self.hit_tokens += n
                return entry
        self.misses += 1
        return None

    def insert(
        self, tokens: list[int], hashes: list[int], state: ModelState, logits: torch.Tensor
    ) -> None:
        """Keep a copy of the state after `tokens` (one row) and of its last `logits` [V]."""
        if not self.enabled or not tokens:
            return
        key = (len(tokens), hashes[len(tokens) - 1])
        old = self.entries.get(key)
        if old is not None and old.tokens == tuple(tokens):
            self.entries.move_to_end(key)
            return
        state = state.clone()
        logits = logits.clone()
        nbytes = sum(t.numel() * t.element_size() for t in state._tensors())
        nbytes += logits.numel() * logits.element_size()
        if nbytes > self.max_bytes:
            return
        if old is not None:  # a colliding prefix: the newer one takes the key
            self._drop(key)
        self.entries[key] = CacheEntry(tuple(tokens), state, logits, nbytes)
        self.nbytes += nbytes
        while self.nbytes > self.max_bytes:
            self._drop(next(iter(self.entries)))
            self.evictions += 1

    def _drop(self, key) -> None:
        self.nbytes -= self.entries.pop(key).nbytes

    def clear(self) -> None:
        self.entries.clear()
        self.nbytes = 0
