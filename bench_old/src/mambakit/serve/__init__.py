"""Serving: the engine (continuous batching over state slots, chunked prefill, the
prefix-state cache) and, with the `[serve]` extra, the OpenAI-compatible HTTP server
(`mambakit.serve.server`, `mambakit serve`)."""

from .cache import PrefixCache
from .engine import Engine
from .params import EngineStopped, Event, QueueFull, SamplingParams
from .request import Completion, PromptTooLong, Request

__all__ = [
    "Completion",
    "Engine",
    "EngineStopped",
    "Event",
    "PrefixCache",
    "PromptTooLong",
    "QueueFull",
    "Request",
    "SamplingParams",
]
