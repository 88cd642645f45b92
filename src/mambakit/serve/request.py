"""A submitted request and its choices, as the engine tracks them.

A `Request` is one prompt with its `SamplingParams`; each of its `n` choices is a
`Sequence` with its own seed, tokens, text and, while it runs, a row of the slot pool.
"""

from __future__ import annotations

import numbers
import queue
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from ..state import ModelState
from ..text import TextStream
from .detok import StopText
from .params import Event, SamplingParams


class PromptTooLong(ValueError):
    """The prompt has more tokens than the engine's limit (HTTP 413)."""


def end_ids(eos_token_id, vocab: int) -> tuple[int, ...]:
    """The end ids of an engine (`Engine`'s eos_token_id: None, one id or a list), checked
    to lie in the vocabulary; ints of any kind (numpy's too), never bools."""
    ids = () if eos_token_id is None else eos_token_id
    ids = tuple(ids) if isinstance(ids, list | tuple) else (ids,)
    if not all(isinstance(t, numbers.Integral) and not isinstance(t, bool) and 0 <= t < vocab
               for t in ids):  # fmt: skip
        raise ValueError(
            f"eos_token_id must be ids in [0, {vocab}) (one or a list), got {eos_token_id!r}"
        )
    return tuple(int(t) for t in ids)


def make_requests(prompts, params, sinks, request_id, vocab: int, most: int) -> list[Request]:
    """A `Request` per prompt (checked by `prompt_ids`; errors name the prompt's number
    where there are several: "prompt[1] ..."), ids `request_id-k` where one is given."""
    reqs = []
    for k, (prompt, sink) in enumerate(zip(prompts, sinks)):
        try:
            prompt, ids = prompt_ids(prompt, vocab, most)
        except ValueError as e:  # which prompt, where there are several
            if len(prompts) == 1 or not str(e).startswith("prompt "):
                raise
            raise type(e)(f"prompt[{k}]{str(e)[len('prompt') :]}") from None
        rid = request_id if request_id is None or len(prompts) == 1 else f"{request_id}-{k}"
        reqs.append(Request(prompt, params, sink, rid, ids))
    return reqs


def prompt_ids(prompt, vocab: int, most: int) -> tuple[list[int], np.ndarray]:
    """A submitted prompt checked (a non-empty list of ints, each in [0, vocab), at most
    `most` of them; a tensor is read as its list): the list and its int64 array, read once
    here for the engine's loop (`Request.ids`). Raises ValueError naming what is wrong, or
    PromptTooLong."""
    if isinstance(prompt, torch.Tensor):
        prompt = prompt.tolist()
    if not isinstance(prompt, list | tuple) or not prompt:
        raise ValueError("prompt must be a non-empty list of token ids")
    types = set(map(type, prompt))  # one pass in C; the general check when not all int
    if types != {int} and not all(isinstance(t, int) and not isinstance(t, bool)
                                  for t in prompt):  # fmt: skip
        raise ValueError("prompt must hold token ids (ints)")
    ids = None
    try:
        ids = np.asarray(prompt, dtype=np.int64)
        lo, hi = int(ids.min()), int(ids.max())
    except OverflowError:  # past int64: outside the vocabulary either way
        lo, hi = min(prompt), max(prompt)
    if lo < 0 or hi >= vocab:
        raise ValueError(f"prompt token ids must lie in [0, {vocab}), got [{lo}, {hi}]")
    if len(prompt) > most:
        raise PromptTooLong(f"prompt has {len(prompt)} tokens, more than the limit {most}")
    return list(prompt), ids


@dataclass
class Completion:
    """One finished choice, as `Engine.generate` returns it."""

    index: int
    token_ids: list[int]
    text: str
    finish_reason: str | None
    error: str | None = None


class Sequence:
    """One choice of a request: its tokens, text and row in the pool while it runs."""

    def __init__(
        self, request: Request, index: int, seed: int, tokenizer, eos_token_ids: tuple[int, ...]
    ) -> None:
        self.request = request
        self.index = index
        self.seed = seed
        self.tokens: list[int] = []
        p = request.params
        # what push checks per token, worked out once: the ids that end the choice, and
        # whether there is text at all (no tokenizer: none, and no stop strings)
        stop_ids = set(p.stop_token_ids)
        if not p.ignore_eos:
            stop_ids.update(eos_token_ids)
        self.stop_ids = frozenset(stop_ids)
        self.max_tokens = p.max_tokens
        self.text = tokenizer is not None
        self.detok = TextStream(tokenizer, request.prompt) if self.text else None
        self.stop_text = StopText(p.stop)
        self.finished: str | None = None
        self.last_time = 0.0

    def push(self, tok: int) -> tuple[str, str | None]:
        """Append a new token: (the text that can be sent now, why the choice ends or None).
        A stop token (or end of sequence) adds no text; a stop string cuts the text before
        it; the end flushes what was held back."""
        self.tokens.append(tok)
        if not self.text:  # token ids only: the stop ids and the length end it
            if tok in self.stop_ids:
                return "", "stop"
            return "", "length" if len(self.tokens) >= self.max_tokens else None
        reason = None
        if tok in self.stop_ids:
            reason = "stop"
            text = ""
        else:
            text = self.stop_text.add(self.detok.push(tok))
            if self.stop_text.stopped:
                reason = "stop"
        if reason is None and len(self.tokens) >= self.max_tokens:
            reason = "length"
        if reason is not None and not self.stop_text.stopped:
            text += self.stop_text.add(self.detok.flush()) + self.stop_text.flush()
        return text, reason

    def held(self) -> str:
        """The text held back so far (it might have started a stop string), as the choice
        is aborted: the tokens sent have their text. "" where the tokenizer fails on it
        (the choice is ending either way)."""
        if not self.text or self.stop_text.stopped:
            return ""
        try:
            return self.stop_text.add(self.detok.flush()) + self.stop_text.flush()
        except Exception:  # noqa: BLE001 - a failing tokenizer must not keep it open
            return ""


class Request:
    """A submitted prompt and its choices; `events()` yields what the engine sends when no
    `sink` was given."""

    def __init__(
        self,
        prompt: list[int],
        params: SamplingParams,
        sink,
        request_id,
        ids: np.ndarray | None = None,
    ) -> None:
        self.id = request_id or uuid.uuid4().hex
        self.prompt = prompt
        # the prompt as an int64 array, made by the submitting thread: what the engine's
        # loop hashes (`cache.prefix_hashes`) without reading a list of ints
        self.ids = np.asarray(prompt, dtype=np.int64) if ids is None else ids
        self.params = params
        self.arrival = time.monotonic()
        self._queue: queue.Queue | None = None if sink is not None else queue.Queue()
        self.sink: Callable[[Event], None] = sink if sink is not None else self._queue.put
        self.seqs: list[Sequence] = []
        self.open = params.n  # choices not finished yet
        # prefill
        self.pos = 0
        self.hashes: np.ndarray | None = None  # `cache.prefix_hashes(ids)`, with the cache on
        self.state: ModelState | None = None  # after prompt[:pos], one row
        self.logits: torch.Tensor | None = None  # [V] at prompt[pos - 1]
        self.pieces: deque[int] = deque()
        self.whole = False  # prefilled in one piece from zeros (Engine._admit)
        self.blocks = False  # packed (Engine.packed): its block boundaries' states kept too
        self.cached = 0  # prompt tokens found in the prefix cache
        self.looked = -1  # `PrefixCache.added` at its last lookup
        self.admitted = 0.0  # when it left the queue for the prefill (time.monotonic)
        self.launched = False  # its prefill is launched to the prompt's end, not joined yet
        self.sampling = params.sampling  # the engine's one object for equal settings

    @property
    def done(self) -> bool:
        return self.open == 0

    def events(self, timeout: float | None = None):
        """The request's events, until every choice has ended (no `sink` given)."""
        if self._queue is None:
            raise RuntimeError("events(): this request sends its events to its sink")
        left = self.params.n
        while left:
            ev = self._queue.get(timeout=timeout)
            left -= ev.finish_reason is not None
            yield ev
