"""Serving: the engine (continuous batching over state slots, chunked prefill, the
prefix-state cache) and, with the `[serve]` extra, the OpenAI-compatible HTTP server
(`mambakit.serve.server`, `mambakit serve`)."""

from .cache import PrefixCache
from .engine import Completion, Engine, PromptTooLong, Request
from .params import EngineStopped, Event, QueueFull, SamplingParams

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
