"""generate / stream: prefill the prompt with the parallel forward, then decode with step().

B batch, T prompt length (the longest), V vocabulary, L_b the prompt length of row b.

Ragged prompts (rows of different lengths) are prefilled in ONE parallel
forward, exactly: the batch is left-aligned to the end (row b gets T - L_b
filler tokens in front of its prompt) and `seq_idx` marks the filler as
document 0 and the prompt as document 1. A change of `seq_idx` zeroes both the
conv history and the SSM state (DESIGN.md section 1), so every row's final
state and last logits are those of its prompt run alone from a zero state,
and all rows end at the same time step, ready to decode together. Plain left
padding without the reset would be wrong for a recurrent model: the filler
would leak into the state. The cost is the filler tokens (sum of T - L_b),
one forward instead of one per distinct length.

Long prompts are prefilled in chunks of `prefill_chunk` timesteps with the
state carried (bounded activation memory); only the last position's hidden
state goes through the LM head.

Short prompts (batch x bucket <= PREFILL_GRAPH_TOKENS, the bucket being the
prompt length rounded up to a power of two, at least 16) are left-padded to
their bucket with the same seq_idx reset, so a few shapes cover every prompt;
with CUDA graphs their prefill is captured once per (batch, bucket) and
replayed: an eager prefill of a few tokens is hundreds of kernel launches,
which cost more than the decode of many tokens. On CUDA the eager path pads
the same way, so graph and eager runs compute the same thing.

Decode: one step is `model.step(tok, state)` + `sampling.sample` + bookkeeping
(eos, repetition mask, output column), all on the device, with no host sync;
on CUDA it is captured once per (batch size, sampling settings) in a CUDA
graph and replayed (cuda_graph.py). `generate` syncs only every
`EOS_CHECK_EVERY` tokens to stop early when every row has emitted eos;
`stream` hands each token to the caller, so it syncs per token.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterator, Sequence

import torch

from ..state import ModelState
from ..threads import apply_threads
from .cuda_graph import (
    capture,
    graph_cache,
    params_signature,
    static_mode,
    use_cuda_graph,
)
from .plan import refresh
from .prompts import Prompts, parse_prompts
from .sampling import SamplingConfig, sample

EOS_CHECK_EVERY = 16  # tokens between host checks of "has every row emitted eos?"
PREFILL_GRAPH_TOKENS = 4096  # batch x bucket up to which the prefill is padded to its bucket
PREFILL_GRAPHS_KEPT = 4  # captured prefill graphs cached per model (the newest)
GRAPH_MIN_CAPACITY = 256  # a captured decoder holds room for at least this many new tokens
# new tokens a decoder holds at first, whatever max_new_tokens: a run that goes on past it
# moves to a decoder of twice the room (`_Run._grow`), so a large limit that an end token
# cuts short costs no buffer of the limit's size
FIRST_CAPACITY = 4096
_SEED_LIMIT = 1 << 63


def _row_seeds(seed, batch: int) -> list[int]:
    """Row b draws from seed + b (or seed[b]); no seed: a base drawn from torch's global RNG."""
    if seed is None:
        base = int(torch.randint(0, 1 << 62, (1,)).item())
        return [base + b for b in range(batch)]
    if isinstance(seed, int) and not isinstance(seed, bool):
        if not 0 <= seed < _SEED_LIMIT - batch:
            raise ValueError(f"seed must be an int in [0, 2**63 - batch), got {seed}")
        return [seed + b for b in range(batch)]
    if isinstance(seed, Sequence) and not isinstance(seed, str):
        seeds = list(seed)
        if len(seeds) != batch or not all(
            isinstance(s, int) and not isinstance(s, bool) and 0 <= s < _SEED_LIMIT for s in seeds
        ):
            raise ValueError(f"seed as a list must hold {batch} ints in [0, 2**63)")
        return seeds
    raise TypeError(f"seed must be None, an int or a list of ints, got {type(seed).__name__}")


def _prefill(model, prompts: Prompts, chunk: int) -> tuple[torch.Tensor, ModelState]:
    """(logits at each row's last prompt token [B, V], state after the prompt)."""
    ids = prompts.ids
    T = ids.shape[1]
    seq_idx = pad = None
    if prompts.ragged:
        pad = prompts.starts()  # [B]
        seq_idx = prompts.mask().to(torch.int32)
    backbone = getattr(model, "backbone", None)
    state = None
    for s in range(0, T, chunk):
        e = min(T, s + chunk)
        part = seq_idx[:, s:e].contiguous() if seq_idx is not None else None
        if state is not None and pad is not None:
            # a prompt that starts exactly at s sees no seq_idx change in this chunk
            state.reset_(pad == s)
        if backbone is None:
            out = model(ids[:, s:e].contiguous(), state=state, seq_idx=part)
            logits, state = out.logits[:, -1], out.state
        elif e < T:  # a prompt's earlier pieces: only their state
            _, state = backbone(ids[:, s:e].contiguous(), state, part)
        else:
            logits, state = model.last_logits(ids[:, s:e].contiguous(), state, part)
    return logits, state


class _PrefillGraph:
    """The prefill of B prompts left-padded to T_b tokens, as static buffers and a graph."""

    def __init__(self, model, batch: int, T_b: int, device) -> None:
        self.model = weakref.proxy(model)
        self.ids = torch.zeros(batch, T_b, dtype=torch.int64, device=device)
        self.seq_idx = torch.zeros(batch, T_b, dtype=torch.int32, device=device)
        self.logits: torch.Tensor | None = None
        self.state: ModelState | None = None
        self.graph = None
        self.signature: tuple = ()

    def load(self, prompts: Prompts) -> None:
        """Row b: filler (document 0) then its prompt (document 1), ending at T_b."""
        T, T_b = prompts.ids.shape[1], self.ids.shape[1]
        self.ids.zero_()
        self.ids[:, T_b - T :] = prompts.ids
        self.seq_idx.copy_(prompts.mask(T_b))

    def run(self) -> None:
        self.logits, self.state = self.model.last_logits(self.ids, None, self.seq_idx)


def _prefill_bucketed(model, prompts: Prompts, graphs: bool) -> tuple[torch.Tensor, ModelState]:
    """`_prefill` of prompts padded to their bucket: replayed from a cached graph when
    `graphs`. The returned tensors are the graph's buffers: use them before the next call."""
    Bsz, T_b = prompts.batch, prompts.bucket
    device = prompts.ids.device
    if not graphs:
        pre = _PrefillGraph(model, Bsz, T_b, device)
        pre.load(prompts)
        pre.run()
        return pre.logits, pre.state
    cache = graph_cache(model)
    key = ("prefill", Bsz, T_b)
    sig = params_signature(model)
    pre = cache.get(key)
    if pre is None or pre.signature != sig:
        cache.pop(key, None)
        kept = [k for k in cache if isinstance(k, tuple) and k[0] == "prefill"]
        for k in kept[: max(0, len(kept) - PREFILL_GRAPHS_KEPT + 1)]:  # the oldest first
            del cache[k]
        pre = _PrefillGraph(model, Bsz, T_b, device)
        pre.signature = sig
        pre.load(prompts)
        pre.graph, _ = capture(pre.run, warmup=2, pool=cache["pool"])
        cache[key] = pre
    pre.load(prompts)
    pre.graph.replay()
    return pre.logits, pre.state


def _dead_ref():
    return None


class _Decoder:
    """Static buffers of one decode loop and the step that advances them in place."""

    def __init__(
        self, model, batch: int, vocab: int, cfg: SamplingConfig, capacity: int, device
    ) -> None:
        self.model = weakref.proxy(model)  # the per-model graph cache must not keep it alive
        self.cfg = cfg
        self.capacity = capacity
        self.state: ModelState = model.init_state(batch)
        i64 = dict(dtype=torch.int64, device=device)
        self.tok = torch.zeros(batch, **i64)  # [B] the last token, input of the next step
        self.step = torch.zeros(1, **i64)  # number of the token being drawn
        self.seeds = torch.zeros(batch, **i64)  # [B]
        self.out = torch.zeros(batch, capacity, **i64)  # [B, capacity] new tokens
        rep = cfg.repetition_penalty != 1.0
        self.seen = torch.zeros(batch, vocab, dtype=torch.bool, device=device) if rep else None
        eos = cfg.eos_token_id is not None
        self.finished = torch.zeros(batch, dtype=torch.bool, device=device) if eos else None
        self.graph = None
        self.signature: tuple = ()
        self.owner = _dead_ref  # the _Run using the buffers (weakref)

    def load(self, state: ModelState, prompts: Prompts, seeds: list[int]) -> None:
        self.state.copy_(state)
        self.step.zero_()
        self.seeds.copy_(torch.tensor(seeds, dtype=torch.int64))
        if self.seen is not None:
            self.seen.zero_()
            ids = prompts.ids
            if prompts.ragged:  # filler positions repeat the row's last token
                ids = torch.where(prompts.mask(), ids, ids[:, -1:])
            self.seen.scatter_(1, ids, True)
        if self.finished is not None:
            self.finished.zero_()

    def emit(self, logits: torch.Tensor) -> None:
        """Sample from logits [B, V] and record the token; no host sync."""
        nxt = sample(logits, self.cfg, self.seeds, self.step, self.seen)
        if self.finished is not None:
            nxt = torch.where(self.finished, self.cfg.eos_token_id, nxt)
            self.finished |= nxt == self.cfg.eos_token_id
        self.tok.copy_(nxt)
        self.out.index_copy_(1, self.step, nxt[:, None])
        if self.seen is not None:
            self.seen.scatter_(1, nxt[:, None], True)
        self.step += 1

    def decode_step(self) -> None:
        logits, _ = self.model.step(self.tok, self.state, cuda_graph=False)
        self.emit(logits)

    def advance(self) -> None:
        if self.graph is not None:
            self.graph.replay()
        else:
            self.decode_step()

    def all_finished(self) -> bool:
        return self.finished is not None and bool(self.finished.all())


def _decoder(model, prompts: Prompts, cfg: SamplingConfig, n_new: int, graphs: bool) -> _Decoder:
    """A decoder for this batch size: captured and cached per model on CUDA, fresh otherwise."""
    Bsz, device = prompts.batch, prompts.ids.device
    vocab = model.config.vocab_size
    if not graphs:
        return _Decoder(model, Bsz, vocab, cfg, max(n_new, 1), device)
    cache = graph_cache(model)
    sig = params_signature(model)
    entry = cache.get((Bsz, cfg))
    busy = entry is not None and entry.owner() is not None and entry.owner().active
    if entry is not None and not busy and entry.capacity >= n_new and entry.signature == sig:
        return entry
    capacity = max(GRAPH_MIN_CAPACITY, 1 << math.ceil(math.log2(max(n_new, 1))))
    if not busy:
        cache.pop((Bsz, cfg), None)  # free the old buffers before allocating new ones
    dec = _Decoder(model, Bsz, vocab, cfg, capacity, device)
    dec.signature = sig
    dec.graph, _ = capture(dec.decode_step, warmup=2, pool=cache["pool"])
    if not busy:  # a second, interleaved run of the same shape gets a graph of its own
        cache[(Bsz, cfg)] = dec
    return dec


class _Run:
    """One generation: prefill, then tokens one at a time. Each method runs without
    autograd; `stream`'s generator yields between them, so the caller's grad mode is
    never changed while it holds a token."""

    def __init__(
        self, model, input_ids, n_new, cfg: SamplingConfig, seed, prompt_lengths, cuda_graph, chunk
    ) -> None:
        self.cfg = cfg
        vocab = model.config.vocab_size
        if cfg.eos_token_id is not None and cfg.eos_token_id >= vocab:
            raise ValueError(f"eos_token_id must be < vocab_size {vocab}, got {cfg.eos_token_id}")
        self.model = model
        self.device = next(model.parameters()).device
        if self.device.type == "cpu":
            apply_threads()
        self.graphs = use_cuda_graph(cuda_graph, self.device)
        self.n_new = n_new
        self.chunk = chunk
        with static_mode():
            self.prompts = parse_prompts(input_ids, prompt_lengths, self.device, vocab)
        self.seeds = _row_seeds(seed, self.prompts.batch)
        self.n_done = 0
        self.dec: _Decoder | None = None
        self.active = False

    @static_mode()
    def first(self) -> torch.Tensor:
        if self.graphs:  # cached graphs read the decode plan derived from the parameters
            refresh(self.model)
        T_b = self.prompts.bucket
        if (
            (self.graphs or self.device.type == "cuda")
            and hasattr(self.model, "backbone")
            and self.prompts.batch * T_b <= PREFILL_GRAPH_TOKENS
            and T_b <= self.chunk
        ):
            logits, state = _prefill_bucketed(self.model, self.prompts, self.graphs)
        else:
            logits, state = _prefill(self.model, self.prompts, self.chunk)
        room = min(self.n_new, FIRST_CAPACITY)
        self.dec = _decoder(self.model, self.prompts, self.cfg, room, self.graphs)
        self.dec.owner = weakref.ref(self)
        self.active = True
        self.dec.load(state, self.prompts, self.seeds)
        self.dec.emit(logits)
        self.n_done = 1
        return self.dec.tok

    @static_mode()
    def next(self) -> torch.Tensor:
        if self.n_done == self.dec.capacity:
            self._grow()
        self.dec.advance()
        self.n_done += 1
        return self.dec.tok

    def _grow(self) -> None:
        """Carry on in a decoder of twice the room (up to the run's limit): its buffers
        loaded from the full one's (captured anew on CUDA: a graph writes into its own)."""
        old = self.dec
        room = min(2 * old.capacity, self.n_new)
        new = _decoder(self.model, self.prompts, self.cfg, room, self.graphs)
        new.owner = weakref.ref(self)
        new.state.copy_(old.state)
        for name in ("tok", "step", "seeds", "seen", "finished"):
            if getattr(new, name) is not None:
                getattr(new, name).copy_(getattr(old, name))
        new.out[:, : old.capacity].copy_(old.out)
        old.owner = _dead_ref
        if self.graphs:  # the grown graph replaces the run's own in the cache: a later
            cache = graph_cache(self.model)  # long run finds it rather than capturing again
            key = (self.prompts.batch, self.cfg)
            if cache.get(key) is old:
                cache[key] = new
        self.dec = new

    @static_mode()
    def result(self):
        """Prompts + new tokens: [B, T + n] for a tensor prompt, else a list of 1-d tensors.
        When every row emitted eos, n stops at the step where the last row did."""
        self.active = False
        p = self.prompts
        n = self.n_done
        new = self.dec.out[:, :n].clone() if self.dec is not None else p.ids[:, :0]
        if n and self.dec.all_finished():
            first_eos = (new == self.cfg.eos_token_id).int().argmax(dim=1)  # [B]
            new = new[:, : int(first_eos.max()) + 1]
        if p.as_list:
            return [torch.cat([p.row(b), new[b]]) for b in range(p.batch)]
        return torch.cat([p.ids, new], dim=1)


def _check_counts(max_new_tokens, prefill_chunk) -> None:
    """Checked before SamplingConfig's fields: of several bad arguments, these are reported."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int):
        raise TypeError(f"max_new_tokens must be an int, got {type(max_new_tokens).__name__}")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, int) or prefill_chunk <= 0:
        raise ValueError(f"prefill_chunk must be a positive int, got {prefill_chunk!r}")


def generate(
    model,
    input_ids: torch.Tensor | Sequence,
    max_new_tokens: int = 64,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    repetition_penalty: float = 1.0,
    eos_token_id: int | None = None,
    seed: int | Sequence[int] | None = None,
    prompt_lengths: Sequence[int] | torch.Tensor | None = None,
    cuda_graph: bool | str = "auto",
    prefill_chunk: int = 8192,
) -> torch.Tensor | list[torch.Tensor]:
    """Continue each prompt by up to `max_new_tokens` tokens.

    input_ids: a [B, T] tensor of token ids (every row a full prompt); or a
        right-padded [B, T] tensor with `prompt_lengths` [B]; or a list of 1-d
        tensors / lists of ints (prompts of any lengths). Ragged prompts are
        prefilled together and exactly (module docstring: left-aligned to the
        end, `seq_idx` resets the state where each prompt starts).
    Returns: for a tensor without `prompt_lengths`, a LongTensor [B, T + n];
        otherwise a list of B 1-d LongTensors, row b = its prompt + its n new
        tokens. n = max_new_tokens, or fewer when every row emitted
        `eos_token_id` (then n ends at the step where the last row did; a row
        that finished earlier is filled with eos).
    Sampling: `temperature` 0 is greedy; else softmax(logits / temperature)
        restricted by `top_k` (0: off), `top_p` (nucleus; 1: off) and `min_p`
        (0: off), after the CTRL `repetition_penalty` (1: off) on tokens in the
        row's prompt or output. Ties at the k-th score keep exactly k tokens.
    seed: row b draws from its own counter-based stream seed + b (or seed[b] for
        a list), so its tokens do not depend on the other rows: a row in a batch
        seeded s gives what it gives alone seeded s + b. The global RNG is only
        read (to draw a base seed) when seed is None, never reseeded.
    cuda_graph: "auto" (on CUDA), True or False: capture model step + sampling
        once per batch size and settings, replay per token.
    prefill_chunk: the prompt is prefilled in pieces of at most this many steps.
    """
    _check_counts(max_new_tokens, prefill_chunk)
    cfg = SamplingConfig(temperature, top_k, top_p, min_p, repetition_penalty, eos_token_id)
    run = _Run(
        model, input_ids, max_new_tokens, cfg, seed, prompt_lengths, cuda_graph, prefill_chunk
    )
    if run.n_new > 0:
        run.first()
        while run.n_done < run.n_new:
            if run.n_done % EOS_CHECK_EVERY == 0 and run.dec.all_finished():
                break
            run.next()
    return run.result()


def stream(
    model,
    input_ids: torch.Tensor | Sequence,
    max_new_tokens: int = 64,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    repetition_penalty: float = 1.0,
    eos_token_id: int | None = None,
    seed: int | Sequence[int] | None = None,
    prompt_lengths: Sequence[int] | torch.Tensor | None = None,
    cuda_graph: bool | str = "auto",
    prefill_chunk: int = 8192,
) -> Iterator[torch.Tensor]:
    """Like `generate` (same arguments and tokens), but yields each new step's tokens
    [B] (LongTensor on the model's device) as soon as they are drawn; stops after the
    step where every row has emitted eos. Arguments are checked at the call."""
    _check_counts(max_new_tokens, prefill_chunk)
    cfg = SamplingConfig(temperature, top_k, top_p, min_p, repetition_penalty, eos_token_id)
    run = _Run(
        model, input_ids, max_new_tokens, cfg, seed, prompt_lengths, cuda_graph, prefill_chunk
    )
    return _stream(run)


def _stream(run: _Run) -> Iterator[torch.Tensor]:
    if run.n_new == 0:
        return
    try:
        yield run.first().clone()
        while run.n_done < run.n_new and not run.dec.all_finished():
            yield run.next().clone()
    finally:
        run.active = False
