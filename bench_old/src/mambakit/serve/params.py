"""What a request asks for: its sampling parameters, checked at construction, and the
events the engine sends back.

`SamplingParams` holds one request's settings; its fields are the OpenAI API's names
(`max_tokens`, `temperature`, `top_p`, `stop`, `seed`, `n`) plus the common extensions
(`top_k`, `min_p`, `repetition_penalty`, `stop_token_ids`, `ignore_eos`). A bad value
raises `ValueError` naming the field, which the HTTP layer answers with 400.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..inference.sampling import SamplingConfig

SEED_LIMIT = 1 << 63


def _int(name: str, v, lo: int, hi: int | None = None) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
        bound = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise ValueError(f"{name} must be an int {bound}, got {v!r}")


@dataclass(frozen=True)
class SamplingParams:
    """One request's generation settings (module docstring); validated at construction."""

    max_tokens: int = 16  # new tokens per choice at most
    temperature: float = 1.0  # 0: greedy
    top_k: int = 0  # 0 (or -1): off
    top_p: float = 1.0  # 1: off
    min_p: float = 0.0  # 0: off
    repetition_penalty: float = 1.0  # 1: off
    seed: int | None = None  # choice i draws from seed + i; None: a random base
    n: int = 1  # choices (each a sequence of its own, sharing the prompt's prefill)
    stop: tuple[str, ...] = ()  # strings that end a choice (not included in its text)
    stop_token_ids: tuple[int, ...] = ()  # token ids that end a choice
    ignore_eos: bool = False  # keep going past the model's end-of-sequence token
    sampling: SamplingConfig = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _int("max_tokens", self.max_tokens, 1)
        _int("n", self.n, 1)
        top_k = 0 if self.top_k == -1 else self.top_k
        try:
            cfg = SamplingConfig(
                temperature=self.temperature,
                top_k=top_k,
                top_p=self.top_p,
                min_p=self.min_p,
                repetition_penalty=self.repetition_penalty,
            )
        except ValueError as e:
            raise ValueError(str(e)) from None
        object.__setattr__(self, "sampling", cfg)
        if self.seed is not None:
            _int("seed", self.seed, 0, SEED_LIMIT - 1 - self.n)
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, tuple | list) or not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"stop must be a string or a list of non-empty strings, got {stop!r}")
        object.__setattr__(self, "stop", tuple(stop))
        ids = self.stop_token_ids
        if not isinstance(ids, tuple | list):
            raise ValueError(f"stop_token_ids must be a list of ints, got {ids!r}")
        for i in ids:
            _int("stop_token_ids", i, 0)
        object.__setattr__(self, "stop_token_ids", tuple(ids))
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")


@dataclass
class Event:
    """What one iteration produced for one choice of a request: new token ids, the new text
    (held back while it may be the start of a stop string), and, on the last event of the
    choice, why it ended: "stop", "length", "abort" (cancelled or drained) or "error"
    (then `error` says what went wrong)."""

    index: int  # the choice
    token_ids: list[int]
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None


class QueueFull(RuntimeError):
    """The engine's queue of waiting requests is full: try again later (HTTP 429)."""


class EngineStopped(RuntimeError):
    """The engine is draining or stopped and takes no new requests (HTTP 503)."""
