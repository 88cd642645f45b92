"""The engine's counters, gauges and histograms, rendered in the Prometheus text format.

The engine thread updates them; `render` (the HTTP thread) reads them under the same lock.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections import deque

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
RATE_WINDOW = 10.0  # seconds over which tokens/s is measured


class Histogram:
    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * len(buckets)
        self.count = 0
        self.sum = 0.0
        self.values: deque[float] = deque(maxlen=100_000)  # the latest, for percentiles

    def observe(self, v: float) -> None:
        self.count += 1
        self.sum += v
        self.values.append(v)
        i = bisect.bisect_left(self.buckets, v)
        if i < len(self.counts):
            self.counts[i] += 1

    def observe_many(self, values: list[float]) -> None:
        """`observe` each of `values` (sorted here; the engine hands one iteration's)."""
        if not values:
            return
        values.sort()
        self.count += len(values)
        self.sum += sum(values)
        self.values.extend(values)
        lo = 0
        for i, b in enumerate(self.buckets):
            hi = bisect.bisect_right(values, b, lo)  # v <= b, as observe counts it
            self.counts[i] += hi - lo
            lo = hi

    def quantile(self, q: float) -> float | None:
        if not self.values:
            return None
        vals = sorted(self.values)
        return vals[min(len(vals) - 1, int(q * len(vals)))]


class Metrics:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.requests = 0  # accepted
        self.rejected = {"queue_full": 0, "draining": 0}
        self.finished: dict[str, int] = {"stop": 0, "length": 0, "abort": 0, "error": 0}
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.prefill_tokens = 0  # prompt tokens run through the model (cache hits skip some)
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.iterations = 0
        self._window: deque[tuple[float, int]] = deque()

    def tokens_out(self, n: int, now: float) -> None:
        self.generation_tokens += n
        self._window.append((now, n))
        while self._window and self._window[0][0] < now - RATE_WINDOW:
            self._window.popleft()

    def tokens_per_second(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        recent = [n for t, n in self._window if t >= now - RATE_WINDOW]
        return sum(recent) / RATE_WINDOW

    def render(self, gauges: dict[str, tuple[str, float]], cache) -> str:
        """Prometheus text exposition (version 0.0.4) of every metric."""
        out: list[str] = []

        def metric(name, kind, help_, samples):
            out.append(f"# HELP mambakit_{name} {help_}")
            out.append(f"# TYPE mambakit_{name} {kind}")
            for labels, v in samples:
                out.append(f"mambakit_{name}{labels} {_num(v)}")

        with self.lock:
            metric("requests_total", "counter", "Requests accepted.", [("", self.requests)])
            metric("requests_rejected_total", "counter", "Requests refused (429, 503).",
                   [(f'{{reason="{k}"}}', v) for k, v in self.rejected.items()])  # fmt: skip
            metric("requests_finished_total", "counter", "Choices finished, by reason.",
                   [(f'{{reason="{k}"}}', v) for k, v in self.finished.items()])  # fmt: skip
            metric("prompt_tokens_total", "counter", "Prompt tokens of accepted requests.",
                   [("", self.prompt_tokens)])  # fmt: skip
            metric("prefill_tokens_total", "counter",
                   "Prompt tokens run through the model (cache hits skip the rest).",
                   [("", self.prefill_tokens)])  # fmt: skip
            metric("generation_tokens_total", "counter", "Tokens generated.",
                   [("", self.generation_tokens)])  # fmt: skip
            metric("generation_tokens_per_second", "gauge",
                   f"Tokens generated per second over the last {RATE_WINDOW:g} s.",
                   [("", self.tokens_per_second())])  # fmt: skip
            metric("iterations_total", "counter", "Engine iterations.", [("", self.iterations)])
            for name, (help_, v) in gauges.items():
                metric(name, "gauge", help_, [("", v)])
            metric("prefix_cache_hits_total", "counter", "Prompts that found a cached prefix.",
                   [("", cache.hits)])  # fmt: skip
            metric("prefix_cache_misses_total", "counter", "Prompts that found none.",
                   [("", cache.misses)])  # fmt: skip
            metric("prefix_cache_hit_tokens_total", "counter",
                   "Prompt tokens whose prefill a cache hit saved.",
                   [("", cache.hit_tokens)])  # fmt: skip
            metric("prefix_cache_evictions_total", "counter", "Entries dropped for room.",
                   [("", cache.evictions)])  # fmt: skip
            metric("prefix_cache_bytes", "gauge", "Bytes the cached states and logits hold.",
                   [("", cache.nbytes)])  # fmt: skip
            metric("prefix_cache_entries", "gauge", "Cached prefixes.",
                   [("", len(cache.entries))])  # fmt: skip
            for name, help_, h in (
                ("time_to_first_token_seconds", "From arrival to the first token.", self.ttft),
                ("inter_token_latency_seconds", "Between consecutive tokens of a choice.",
                 self.itl),
            ):  # fmt: skip
                out.append(f"# HELP mambakit_{name} {help_}")
                out.append(f"# TYPE mambakit_{name} histogram")
                acc = 0
                for b, c in zip(h.buckets, h.counts):
                    acc += c
                    out.append(f'mambakit_{name}_bucket{{le="{b:g}"}} {acc}')
                out.append(f'mambakit_{name}_bucket{{le="+Inf"}} {h.count}')
                out.append(f"mambakit_{name}_sum {_num(h.sum)}")
                out.append(f"mambakit_{name}_count {h.count}")
        return "\n".join(out) + "\n"


def _num(v) -> str:
    if isinstance(v, int):
        return str(v)
    return repr(float(v))
