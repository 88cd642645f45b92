"""The serving engine: continuous batching of requests over a pool of state slots, with
chunked prefill and the prefix-state cache. No HTTP here; usable from Python:

    engine = Engine(model, tokenizer=tok, max_batch=64).start()
    out = engine.generate(tok.encode("def "), SamplingParams(max_tokens=32, temperature=0))
    engine.shutdown()

One thread (the engine loop) does all the model work. Each iteration:

1. takes new requests and cancellations from the other threads (`submit`, `cancel`),
   and frees the rows of cancelled ones;
2. runs one batched decode step over every running choice (`SlotPool`) and samples
   each row with its own settings; a choice that ends (max_tokens, a stop string or
   token, end of sequence) frees its row at once; the new tokens are handed out
   before the prefill work starts;
3. admits waiting requests while rows are free (a request of n choices needs n), looks
   their prompt up in the prefix cache, and prefills up to `prefill_tokens` prompt
   tokens over the admitted prompts (`prefill.py`: packed end to end into rows, many
   rows to a forward, or whole prompts many to a forward, or block by block). On CUDA
   that prefill runs on a stream of its own, beside the next decode steps, and is
   joined at the first iteration that finds it done; elsewhere at once (then the budget
   bounds the time a prompt adds to an iteration). A prompt whose prefill completes
   draws its first token from the prompt's last logits and joins the decode batch.

Step 2 is `decode.py`'s (`Decoding`), step 3 `intake.py`'s (`Intake`, with the forwards of
a launch in `forwards.py`'s `Forwards`): the engine's two sides, methods of `Engine` on the
state its constructor sets up; the loop's thread, the drain and the stop are
`lifecycle.py`'s (`Lifecycle`).

Requests beyond the free rows wait in a queue of at most `max_queue`; `submit` raises
`QueueFull` beyond it. An exception while handling one request ends that request with
an error event; a failed batched forward ends the requests in that batch; the loop
itself carries on.

Greedy and seeded choices give what `generate` gives for the request alone: the same
sampler, seeds (choice i of a request seeded s draws from s + i) and token numbers; the
state and logits agree up to the rounding of f32 sums in a batch of another size.
"""

from __future__ import annotations

import random
import threading
import time
import traceback
from collections import OrderedDict, deque
from collections.abc import Callable
from contextlib import nullcontext

import torch

from ..inference.cuda_graph import static_mode, use_cuda_graph
from ..inference.plan import refresh
from ..threads import apply_threads
from .cache import PrefixCache
from .decode import Decoding
from .forwards import Forwards
from .intake import Intake
from .lifecycle import Lifecycle
from .metrics import Metrics
from .params import EngineStopped, Event, QueueFull, SamplingParams
from .prefill import WHOLE_MAX
from .prefill_graphs import PrefillGraphs
from .request import Completion, Request, Sequence, end_ids, make_requests
from .slots import SlotPool

PREFILL_TOKENS_CUDA = 16384  # the default prefill launch on CUDA (beside the decode steps)
PREFILL_TOKENS = 2048  # elsewhere, where it adds to an iteration's time


class Engine(Intake, Forwards, Decoding, Lifecycle):
    """Continuous batching over `max_batch` state slots (module docstring).

    model: a MambaLM (eval mode; its device and dtype are the engine's).
    tokenizer: encodes nothing here, but turns tokens into text for the events and stop
        strings (`mambakit.text`); None: token ids only.
    eos_token_id: a choice that draws it ends with "stop" (unless `ignore_eos`); a list:
        any of them (a chat model's end of turn beside its end of text).
    block_size: prefill pieces never cross a multiple of it; the prefix cache keeps the
        state at each multiple inside a prompt and at the prompt's end.
    prefill_tokens: prompt tokens in one prefill launch at most (None: 16,384 on CUDA,
        2,048 elsewhere). On CUDA a launch runs beside the decode steps and the next
        waits for its end (larger launches group more prompts to a forward); elsewhere it
        bounds the time a new prompt adds to an iteration.
    cache_bytes: the prefix cache's budget on the device (0: off).
    max_queue: requests waiting for a free row at most.
    max_prompt_tokens: longer prompts are refused (`PromptTooLong`).
    cuda_graph: "auto" (on CUDA), True or False: the decode step of each bucket of batch
        sizes captured once and replayed.
    prefills_in_flight: prefill launches running at once (with `async_prefill`, on CUDA).
        1: the next launch waits for the last one's join. 2 or more: a prompt that arrives
        while a launch runs is launched behind it on the prefill stream (less time to first
        token for it, smaller launches; within the spread of 1 at 256 clients on an H100,
        docs/serving.md).
    """

    def __init__(
        self,
        model,
        *,
        tokenizer=None,
        eos_token_id: int | list[int] | tuple[int, ...] | None = None,
        max_batch: int = 64,
        block_size: int = 256,
        prefill_tokens: int | None = None,
        cache_bytes: int = 1 << 30,
        max_queue: int = 1024,
        max_prompt_tokens: int = 32768,
        cuda_graph: bool | str = "auto",
        prefills_in_flight: int = 1,
    ) -> None:
        if not hasattr(model, "last_logits") or not hasattr(model, "step"):
            raise TypeError(f"model must be a MambaLM, got {type(model).__name__}")
        self.device = next(model.parameters()).device
        if prefill_tokens is None:
            cuda = self.device.type == "cuda"
            prefill_tokens = PREFILL_TOKENS_CUDA if cuda else PREFILL_TOKENS
        for name, v, lo in (("max_batch", max_batch, 1), ("block_size", block_size, 1),
                            ("prefill_tokens", prefill_tokens, 1), ("max_queue", max_queue, 1),
                            ("max_prompt_tokens", max_prompt_tokens, 1),
                            ("prefills_in_flight", prefills_in_flight, 1)):  # fmt: skip
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"{name} must be an int >= {lo}, got {v!r}")
        vocab = model.config.vocab_size
        self.model = model
        self.tokenizer = tokenizer
        self.eos_token_ids = end_ids(eos_token_id, vocab)
        self.vocab = vocab
        self.max_batch = max_batch
        self.block_size = block_size
        self.prefill_tokens = prefill_tokens
        self.max_queue = max_queue
        self.max_prompt_tokens = max_prompt_tokens
        if self.device.type == "cpu":
            apply_threads()
        self.graphs = use_cuda_graph(cuda_graph, self.device)
        self.cache = PrefixCache(cache_bytes)
        self.metrics = Metrics()
        pin = self.device.type == "cuda"
        # on CUDA the prefill runs on a stream of its own, beside the decode steps (which
        # run on a stream of higher priority): a prefill delays no decode step but for
        # the share of the device it takes. A launched prefill is joined at the first
        # iteration that finds its event done; up to `prefills_in_flight` run at once.
        # Each kind of graph is captured on the stream it is replayed on: cuBLAS keeps a
        # workspace per stream and a graph keeps its capture stream's (`graph_capture`), so
        # the decode and prefill graphs, replayed beside each other, must be captured on two
        # streams (the two priorities' stream pools give two different ones).
        self.async_prefill = self.device.type == "cuda"
        self.decode_stream = self.prefill_stream = None
        if self.device.type == "cuda":
            with self._on_device():
                self.decode_stream = torch.cuda.Stream(self.device, priority=-1)
                self.prefill_stream = torch.cuda.Stream(self.device)
        # buffers written in place by the loop: ordinary tensors even when the engine is
        # built under inference_mode; CUDA graphs captured on the model's device
        with static_mode(), self._on_device():
            self.pool = SlotPool(model, max_batch, self.graphs, self.decode_stream)
            self._zero = model.init_state(1)
            self._host = [torch.zeros(max_batch, dtype=torch.int64, pin_memory=pin) for _ in "ab"]
        self.prefill_graphs = (
            PrefillGraphs(model, block_size, self.prefill_stream) if self.graphs else None
        )
        # the plans the graphs read (`inference.plan`) brought up to date once an iteration,
        # at its first replay, rather than at every replay: a check of every parameter, about
        # 0.1-0.16 ms at 130m, before each decode step and each prefill forward otherwise
        self._plans_fresh = False
        self.pool.refresh_plans = self._refresh_plans
        if self.prefill_graphs is not None:
            self.prefill_graphs.refresh_plans = self._refresh_plans
        # (event, requests whose prompt it completes, its cache items) of each prefill
        # launched, not joined
        self._pending: deque[tuple] = deque()
        # the cache's items (tokens, hashes, state, logits) of the launch being made, and of
        # the launches joined, not yet copied into the cache (`Intake._cache_joined`)
        self._keeps: list[tuple] = []
        self._to_cache: list[tuple] = []
        # launches in flight at most: a prompt that arrives while one runs is launched
        # behind it on the prefill stream rather than an iteration after its join
        self.prefills_in_flight = prefills_in_flight
        # prompts of at most `whole_max` tokens (and at most `prefill_tokens`) that start
        # from zeros are prefilled whole, many prompts to a forward (`_prefill_whole`),
        # rather than block by block; with the prefix cache on, only when their first
        # block is new: the states at the block boundaries are kept for a prompt whose
        # first block was seen before
        self.whole_max = WHOLE_MAX
        # the other prompts run in pieces up to each block boundary; a model that stops each
        # row of a forward at a step of its own (`MambaLM.stops_rows`: every mixer unless a
        # Mamba-2 dt_limit keeps delta above 0) runs pieces of different lengths in one
        # forward, right-padded (a cached prefix's remainder is one forward); otherwise
        # pieces are cut into powers of two, a forward per length
        self.spans = model.stops_rows()
        self.prefill_hold = "auto"  # (`Intake.prefill_hold`, validated)
        # packed (a Mamba-1 model; off by default): the prompts that run whole are packed end
        # to end into rows instead, many rows to a forward, which gives the state at each
        # prompt's end and at its block boundaries (`MambaLM.states_at`,
        # `_prefill_packed`): less padding and fewer forwards than the left-padded groups,
        # but each packed forward costs more than a padded one of the same tokens; in three
        # H100 runs it was not reliably faster, and its time to first token was longer
        # (docs/serving.md)
        self._packed = False
        self._heads: OrderedDict[int, None] = OrderedDict()  # first blocks seen (hashes)
        self.rows: list[Sequence] = []  # the choice in each leading row of the pool
        # decode: the step launched and not yet read (lookahead), two host buffers of tokens
        self.lookahead = self.device.type == "cuda"
        self._inflight = None
        self._joined: list = []  # the first tokens of choices that joined, not yet read
        self._flip = 0
        self._row_settings: dict[int, int] = {}  # id(SamplingConfig) -> running rows
        self.waiting: deque[Request] = deque()
        self.prefilling: list[Request] = []
        self.reserved = 0  # rows promised to prefilling requests
        # test hook: called with (sequence, token) for every new token; an exception it
        # raises ends that request with an error event
        self.on_token: Callable[[Sequence, int], None] | None = None
        # hands an iteration's events out; the default calls each request's sink
        self.deliver: Callable[[list[tuple[Request, Event]]], None] = self._deliver
        self._outbox: list[tuple[Request, Event]] = []
        self._n_out = 0  # this iteration's tokens, time to first token and inter-token gaps
        self._ttft: list[float] = []
        self._itl: list[float] = []
        self._lock = threading.Lock()
        self._shutting = threading.Lock()  # one shutdown at a time
        self._wake = threading.Condition(self._lock)
        self._inbox: list[Request] = []
        self._cancels: list[Request] = []
        self._n_waiting = 0  # inbox + waiting, under the lock
        self._draining = False
        self._abort = False
        self._stop = False
        self._thread: threading.Thread | None = None
        self._rng = random.Random()
        self.timeline: list | None = None  # a list to record into on CUDA (`_timeline`)
        self._settings: dict = {}  # SamplingConfig -> its one instance (sample_rows groups by id)

    # ---- the other threads' side ----------------------------------------------------

    def submit(
        self,
        prompt: list[int],
        params: SamplingParams | None = None,
        sink: Callable[[Event], None] | None = None,
        request_id: str | None = None,
    ) -> Request:
        """Queue a prompt (token ids); events go to `sink` (called on the engine thread
        through `deliver`) or to the request's `events()`. Raises ValueError naming the
        field, PromptTooLong, QueueFull or EngineStopped."""
        return self.submit_many([prompt], params, [sink], request_id)[0]

    def submit_many(
        self,
        prompts: list[list[int]],
        params: SamplingParams | None = None,
        sinks: list[Callable[[Event], None] | None] | None = None,
        request_id: str | None = None,
    ) -> list[Request]:
        """`submit` for several prompts with the same settings (a completions request
        with a list of prompts), all or none: each is checked first, and they join the
        queue together only where it has room for all of them (QueueFull otherwise)."""
        params = params or SamplingParams()
        sinks = sinks if sinks is not None else [None] * len(prompts)
        if len(sinks) != len(prompts):
            raise ValueError(f"sinks must be one a prompt: {len(sinks)} for {len(prompts)}")
        if params.n > self.max_batch:
            raise ValueError(f"n must be at most max_batch {self.max_batch}, got {params.n}")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this model has none")
        if len(prompts) > self.max_queue:  # QueueFull would be a retry that never succeeds
            raise ValueError(
                f"prompts: {len(prompts)} at once, more than the queue holds ({self.max_queue})"
            )
        reqs = make_requests(prompts, params, sinks, request_id, self.vocab, self.max_prompt_tokens)
        with self._lock:
            if len(self._settings) > 4096:  # many distinct settings: only grouping suffers
                self._settings.clear()
            sampling = self._settings.setdefault(params.sampling, params.sampling)
            if self._draining or self._stop:
                self.metrics.rejected["draining"] += 1
                raise EngineStopped("the engine is shutting down")
            if self._n_waiting + len(reqs) > self.max_queue:
                self.metrics.rejected["queue_full"] += 1
                raise QueueFull(
                    f"{self._n_waiting} requests are waiting, the limit is {self.max_queue}"
                    + (f" ({len(reqs)} more asked for)" if len(reqs) > 1 else "")
                )
            for req in reqs:
                req.sampling = sampling
                self._inbox.append(req)
                self.metrics.prompt_tokens += len(req.prompt)
            self._n_waiting += len(reqs)
            self.metrics.requests += len(reqs)
            self._wake.notify()
        return reqs

    def cancel(self, req: Request) -> None:
        """End `req` (its client went away): its rows are freed at the next iteration."""
        with self._lock:
            self._cancels.append(req)
            self._wake.notify()

    @static_mode()
    def warmup(self) -> None:
        """Capture the prefill graphs of every rows bucket and piece length now (on CUDA;
        the decode graphs are captured at construction): otherwise the first prompts that
        need one pay for its capture. Call before `start`."""
        if self.prefill_graphs is not None:
            with self._on_device():
                if self.packed:
                    self.prefill_graphs.warmup(self.device, pack_max=self.prefill_tokens)
                else:
                    self.prefill_graphs.warmup(self.device, self.whole_max)

    @property
    def packed(self) -> bool:
        """Whether prompts are prefilled packed (`_prefill_packed`): a Mamba-1 model only."""
        return self._packed

    @packed.setter
    def packed(self, on: bool) -> None:
        mixer = self.model.config.mixer
        if on and mixer != "mamba1":
            raise ValueError(f"packed prefill needs a Mamba-1 model (states_at), not {mixer}")
        self._packed = bool(on)

    def _on_device(self):
        """The model's CUDA device as the current one (graphs capture on the current
        device's streams), or nothing on the CPU."""
        return torch.cuda.device(self.device) if self.device.type == "cuda" else nullcontext()

    def generate(self, prompt: list[int], params: SamplingParams | None = None) -> list[Completion]:
        """Submit and wait: the request's choices when every one has ended."""
        params = params or SamplingParams()
        req = self.submit(prompt, params)
        outs = [Completion(i, [], "", None) for i in range(params.n)]
        if self._thread is None:
            while not req.done:
                self.step()
        for ev in req.events():
            o = outs[ev.index]
            o.token_ids += ev.token_ids
            o.text += ev.text
            o.finish_reason = ev.finish_reason or o.finish_reason
            o.error = ev.error or o.error
        return outs

    def gauges(self) -> dict[str, tuple[str, float]]:
        """The engine's gauges for /metrics: name -> (help, value)."""
        n = len(self.rows)
        return {
            "running": ("Choices in the decode batch.", n),
            "prefilling": ("Requests being prefilled.", len(self.prefilling)),
            "waiting": ("Requests waiting for a free row (queue depth).", self._n_waiting),
            "batch_occupancy": ("Running choices over max_batch.", n / self.max_batch),
            "max_batch": ("State slots.", self.max_batch),
        }

    # ---- the engine thread -------------------------------------------------------------

    @static_mode()
    def step(self) -> None:
        """One iteration (module docstring); the loop thread calls it, or the caller when
        the engine was not started."""
        if self.decode_stream is None:
            self._step()
            return
        self.decode_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.decode_stream):
            self._step()

    def _refresh_plans(self) -> None:
        if not self._plans_fresh:
            refresh(self.model)
            self._plans_fresh = True

    def _step(self) -> None:
        self._plans_fresh = False  # weights changed between iterations are followed
        with self._lock:
            new, self._inbox = self._inbox, []
            cancels, self._cancels = self._cancels, []
            abort = self._abort
        self.waiting.extend(new)
        try:
            for req in cancels:
                self._end_request(req, "abort")
            if abort:
                for req in [*self.waiting, *self.prefilling, *{s.request for s in self.rows}]:
                    self._end_request(req, "abort", "the server is shutting down")
                with self._lock:
                    self._abort = False
            if self.rows or self._inflight is not None or self._joined:
                self._decode()
            self._flush()
            if self._to_cache:
                self._cache_joined()
            self._admit()
            if self.prefilling or self._pending:
                self._prefill()
            self._flush()
            if self._to_cache and not (self.rows or self.prefilling or self._joined):
                self._cache_joined()  # going idle: nothing to hand out first
        except Exception as e:  # a bug in the bookkeeping: end what runs, keep the loop
            msg = f"internal error: {type(e).__name__}: {e}"
            traceback.print_exc()
            for req in [*self.prefilling, *{s.request for s in self.rows}]:
                self._end_request(req, "error", msg)
            self._flush()
        m = self.metrics
        with m.lock:  # once per iteration: the per-token path takes no lock
            m.iterations += 1
            m.tokens_out(self._n_out, time.monotonic())
            m.ttft.observe_many(self._ttft)
            m.itl.observe_many(self._itl)
        self._n_out = 0
        self._ttft = []
        self._itl = []

    def _deliver(self, outbox: list[tuple[Request, Event]]) -> None:
        for req, ev in outbox:
            try:
                req.sink(ev)
            except Exception:  # a consumer that fails is treated as gone
                if not req.done:
                    self.cancel(req)

    def _flush(self) -> None:
        if self._outbox:
            out, self._outbox = self._outbox, []
            self.deliver(out)

    def _end_request(self, req: Request, reason: str, error: str | None = None) -> None:
        """End every open choice of `req` with `reason` and take it out of the engine."""
        if req.done:
            return
        if req in self.waiting:
            self.waiting.remove(req)
            with self._lock:
                self._n_waiting -= 1
        if req in self.prefilling:
            self.prefilling.remove(req)
            self.reserved -= req.params.n
            req.state = req.logits = None
        started = {s.index for s in req.seqs}
        for seq in req.seqs:
            if seq.finished is None:
                text = seq.held() if reason == "abort" else ""  # ("error": its text goes)
                self._outbox.append((req, Event(seq.index, [], text, reason, error)))
                self._finish(seq, reason)
        for i in range(req.params.n):
            if i not in started:
                self._outbox.append((req, Event(i, [], "", reason, error)))
                req.open -= 1
                with self.metrics.lock:
                    self.metrics.finished[reason] += 1
        self._free_rows()
