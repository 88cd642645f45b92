"""The engine alone (no HTTP), stepped by the test: every choice against `generate` run
for that request alone (the oracle), the prefix cache, cancellation, limits, faults."""

from __future__ import annotations

import random
import types

import numpy as np
import pytest
import torch

from mambakit.inference import generate
from mambakit.serve import (
    Engine,
    EngineStopped,
    PrefixCache,
    PromptTooLong,
    QueueFull,
    SamplingParams,
)
from mambakit.serve.cache import prefix_hashes
from mambakit.serve.detok import StopText
from mambakit.serve.prefill import (
    piece_lengths,
    plan_groups,
    plan_targets,
    span_bucket,
    span_lengths,
    whole_bucket,
)
from mambakit.text import ByteTokenizer


def alone(model, prompt, p: SamplingParams, n: int = 1, eos=None) -> list[list[int]]:
    """The oracle: `generate` on this request by itself (n copies of the prompt)."""
    out = generate(
        model,
        torch.tensor([prompt] * n),
        max_new_tokens=p.max_tokens,
        temperature=p.temperature,
        top_k=p.sampling.top_k,
        top_p=p.top_p,
        min_p=p.min_p,
        repetition_penalty=p.repetition_penalty,
        seed=p.seed,
        eos_token_id=eos,
    )
    return [row[len(prompt) :].tolist() for row in out]


def run_all(engine: Engine, reqs) -> None:
    for _ in range(10_000):
        if all(r.done for r in reqs):
            return
        engine.step()
    raise AssertionError("the engine did not finish its requests")


def served_alone(engine: Engine, oracle, work) -> list:
    """Submit every (prompt, params) of `work`, run the engine until they end, and check
    each request's tokens against `generate` on it alone; the requests."""
    reqs = [engine.submit(p, sp) for p, sp in work]
    run_all(engine, reqs)
    for (prompt, sp), req in zip(work, reqs):
        assert tokens(req) == alone(oracle, prompt, sp), (len(prompt), sp)
    return reqs


def tokens(req) -> list[list[int]]:
    out = [[] for _ in range(req.params.n)]
    for ev in req.events(timeout=5):
        out[ev.index] += ev.token_ids
    return out


def mixed_requests(seed: int, count: int):
    rng = random.Random(seed)
    settings = [
        dict(temperature=0),
        dict(temperature=0.9, seed=11),
        dict(temperature=0.7, top_k=5, seed=12),
        dict(temperature=1.0, top_p=0.8, min_p=0.05, seed=13),
        dict(temperature=0, repetition_penalty=1.3),
    ]
    out = []
    for i in range(count):
        prompt = [rng.randrange(256) for _ in range(rng.randint(1, 70))]
        params = SamplingParams(max_tokens=rng.randint(1, 24), **settings[i % len(settings)])
        out.append((prompt, params))
    return out


@pytest.mark.parametrize(
    "preset, lookahead, deferred, whole, spans",
    [("tiny", False, False, True, True), ("tiny-mamba2", False, False, True, True),
     ("tiny-mamba3", False, False, True, True), ("tiny", True, False, True, True),
     ("tiny-mamba2", True, True, True, True), ("tiny", False, False, False, True),
     ("tiny-mamba2", False, False, False, True), ("tiny-mamba3", True, True, False, True),
     ("tiny-mamba2", False, False, False, False), ("tiny-mamba3", True, True, False, False)],
    ids=["tiny", "tiny-mamba2", "tiny-mamba3", "tiny-lookahead", "tiny-mamba2-deferred",
         "tiny-blocks", "tiny-mamba2-blocks", "tiny-mamba3-blocks-deferred",
         "tiny-mamba2-powers", "tiny-mamba3-powers-deferred"],
)  # fmt: skip
def test_every_choice_is_what_generate_gives_alone(model_dirs, preset, lookahead, deferred,
                                                   whole, spans, load):  # fmt: skip
    """14 requests of mixed lengths and settings through 5 rows: requests wait, join and
    leave the batch, long prompts are prefilled over several iterations. With `lookahead`
    (the CUDA default) the tokens of a step are read after the next is launched;
    `deferred` (`async_prefill`, the CUDA default) joins a prefill at the iteration after
    its launch, and launches the next one only then. `whole`: prompts up to 40 tokens
    are prefilled in one forward, left-padded (the rest block by block); else every
    prompt runs in pieces from the state before: `spans`, up to each block boundary, many
    lengths to a forward (right-padded, each row stopped at its own last token); else cut
    into powers of two, a forward per length."""
    model = load(model_dirs[preset])
    oracle = load(model_dirs[preset])
    engine = Engine(model, max_batch=5, block_size=16, prefill_tokens=40, cache_bytes=0)
    engine.lookahead = lookahead
    engine.async_prefill = deferred
    engine.whole_max = 40 if whole else 0
    engine.spans = spans  # off: pieces cut into powers of two, a forward per length
    work = mixed_requests(0, 14)
    served_alone(engine, oracle, work)
    assert not engine.rows and not engine.prefilling and engine.idle


@pytest.mark.parametrize("cache, deferred", [(False, False), (True, True)],
                         ids=["no-cache", "cache-deferred"])  # fmt: skip
def test_packed_prefill_gives_generate_alone(model_dirs, load, cache, deferred):
    """Mamba-1's packed prefill (`Engine.packed`): prompts run end to end in rows, several
    rows to a forward, their states taken at their ends (and, with the cache, at the block
    boundaries of prompts whose first block was seen) by `states_at`. Requests whose first
    block repeats hit the cache those states filled, and continue from it at the start of
    a row."""
    model, oracle = load(model_dirs["tiny"]), load(model_dirs["tiny"])
    engine = Engine(model, max_batch=5, block_size=16, prefill_tokens=80,
                    cache_bytes=(1 << 26) if cache else 0)  # fmt: skip
    engine.packed = True
    engine.lookahead = engine.async_prefill = deferred
    engine._pack_slots = lambda: 2  # few states a row: several rows to a forward
    rows = []
    states_at = model._states_at

    def spy(ids, positions, state=None, seq_idx=None):
        rows.append(ids.shape[0])
        return states_at(ids, positions, state, seq_idx)

    model._states_at = spy
    work = mixed_requests(3, 12)
    head = [7] * 20  # a shared first block: the later ones keep their block states
    work += [(head + p[:40], sp) for p, sp in mixed_requests(4, 6)]
    reqs = served_alone(engine, oracle, work)
    # every prompt was packed: from zeros, or (starting a row) from its cached prefix
    assert all(r.whole for r in reqs) and max(rows) >= 2
    skipped = sum(r.cached for r in reqs)
    assert engine.metrics.prefill_tokens == sum(len(p) for p, _ in work) - skipped
    if cache:
        assert any(r.blocks for r in reqs) and skipped
        before = engine.metrics.prefill_tokens
        more = engine.submit(head + [1, 2], SamplingParams(max_tokens=8, temperature=0))
        run_all(engine, [more])
        assert more.cached == 16 and engine.metrics.prefill_tokens == before + 6
        assert tokens(more) == alone(oracle, head + [1, 2], more.params)


def test_packed_prefill_edges(model_dirs, load, monkeypatch):
    """A prompt found whole in the cache joins at once (nothing to pack); a prompt with more
    block boundaries than a row keeps states runs packed keeping its end state only; packing
    needs a Mamba-1 model."""
    model, oracle = load(model_dirs["tiny"]), load(model_dirs["tiny"])
    engine = Engine(model, max_batch=4, block_size=16, prefill_tokens=400, cache_bytes=1 << 26)
    engine.packed = True
    rng = random.Random(5)
    a = [rng.randrange(256) for _ in range(20)]
    greedy = SamplingParams(max_tokens=6, temperature=0)
    served_alone(engine, oracle, [(a, greedy)])
    reqs = served_alone(engine, oracle, [(a, greedy), (a + [5, 6, 7], greedy)])
    assert reqs[0].cached == 20 and not reqs[0].whole and reqs[1].whole
    # 23 boundaries of 16 tokens: more than the slots of an eager packed forward here
    monkeypatch.setattr(engine, "_pack_slots", lambda: 8)
    long = a[:16] + [rng.randrange(256) for _ in range(360)]
    (req,) = served_alone(engine, oracle, [(long, greedy)])
    assert req.whole and not req.blocks
    other = Engine(load(model_dirs["tiny-mamba2"]), max_batch=2)
    with pytest.raises(ValueError, match="Mamba-1"):
        other.packed = True


def test_an_engine_built_under_inference_mode_serves(model_dirs, load):
    """Built (and stepped) inside torch.inference_mode, as a user's script may: the loop's
    buffers written in place are not inference tensors; the tokens are generate's."""
    model, oracle = load(model_dirs["tiny"]), load(model_dirs["tiny"])
    sp = SamplingParams(max_tokens=6, temperature=0)
    with torch.inference_mode():
        engine = Engine(model, max_batch=2, block_size=16)
        engine.lookahead = True  # the host buffers' path
        req = engine.submit(list(range(40, 50)), sp)
        run_all(engine, [req])
    assert tokens(req) == alone(oracle, list(range(40, 50)), sp)


def test_n_choices_are_the_rows_of_one_generate(model_dirs, load):
    model, oracle = load(model_dirs["tiny"]), load(model_dirs["tiny"])
    engine = Engine(model, max_batch=4, block_size=16)
    sp = SamplingParams(max_tokens=12, temperature=0.8, seed=5, n=3)
    req = engine.submit(list(range(30, 60)), sp)
    run_all(engine, [req])
    assert tokens(req) == alone(oracle, list(range(30, 60)), sp, n=3)
    assert engine.metrics.prefill_tokens == 30  # the prompt is prefilled once for all three


def test_prefix_cache_hits_are_exact_and_counted(model_dirs, load):
    model, oracle = load(model_dirs["tiny-mamba2"]), load(model_dirs["tiny-mamba2"])
    engine = Engine(model, max_batch=4, block_size=16, cache_bytes=1 << 26)
    rng = random.Random(1)
    a = [rng.randrange(256) for _ in range(40)]
    greedy = SamplingParams(max_tokens=16, temperature=0)
    first = engine.submit(a, greedy)
    run_all(engine, [first])
    assert engine.cache.hits == 0 and engine.cache.misses == 1
    # its first block was new: it ran whole, and only its end state was kept. The whole
    # prompt, and its end inside a longer prompt, hit; a prompt that shares the first 32
    # tokens does not, but its first block was seen: it runs block by block, and keeps the
    # state at each boundary, which the last prompt finds
    prompts = [a, a + [1, 2, 3, 4, 5], a[:32] + [7, 8, 9]]
    reqs = [engine.submit(p, greedy) for p in prompts]
    run_all(engine, reqs)
    assert engine.cache.hits == 2 and engine.cache.hit_tokens == 40 + 40
    assert not reqs[2].whole
    last = a[:32] + [4, 4]
    reqs.append(engine.submit(last, greedy))
    run_all(engine, reqs)
    assert engine.cache.hits == 3 and engine.cache.hit_tokens == 40 + 40 + 32
    assert engine.metrics.prefill_tokens == 40 + 5 + 35 + 2
    for p, req in zip([a, *prompts, last], [first, *reqs]):
        assert tokens(req) == alone(oracle, p, greedy)


def test_mamba1_pieces_of_different_lengths_share_a_forward(model_dirs, load):
    """On a Mamba-1 model the remainders of prompts after their cached prefix, of different
    lengths, run as one forward right-padded (`states_at` stops each row at its own last
    token), and a piece of one length alone as an ordinary forward; the tokens are what
    generate gives each prompt alone."""
    model, oracle = load(model_dirs["tiny"]), load(model_dirs["tiny"])
    engine = Engine(model, max_batch=8, block_size=16, prefill_tokens=400, cache_bytes=1 << 26)
    assert engine.spans
    rng = random.Random(9)
    head = [rng.randrange(256) for _ in range(32)]
    greedy = SamplingParams(max_tokens=8, temperature=0)
    # the first runs whole (a new first block); the second keeps the states at 16 and 32
    served_alone(engine, oracle, [(head + [1], greedy)])
    served_alone(engine, oracle, [(head + [2], greedy)])
    calls = []
    for name in ("_states_at", "last_logits"):
        real = getattr(model, name)

        def spy(ids, *args, real=real, name=name):
            calls.append((name, tuple(ids.shape)))
            return real(ids, *args)

        setattr(model, name, spy)
    tails = [[rng.randrange(256) for _ in range(n)] for n in (3, 7, 12, 15, 20)]
    reqs = served_alone(engine, oracle, [(head + t, greedy) for t in tails])
    assert [r.cached for r in reqs] == [32] * 5
    # round 1: the four remainders and the 20-token one's first block, one forward; round
    # 2: that one's last 4 tokens alone
    assert calls == [("_states_at", (5, 16)), ("last_logits", (1, 4))]
    assert engine.metrics.prefill_tokens == 33 + 33 + sum(map(len, tails))


def test_prefix_cache_lru_budget_and_exact_keys():
    state = torch.zeros(1, 1, 4)

    class S:  # a one-field state: what the cache reads of one
        def __init__(self, t):
            self.t = t

        def clone(self):
            return S(self.t.clone())

        def _tensors(self):
            return (self.t,)

    each = 4 * 4 + 2 * 4  # state + logits bytes
    cache = PrefixCache(max_bytes=2 * each + 1)
    logits = torch.zeros(2)
    for toks in ([1], [2], [3]):
        cache.insert(toks, prefix_hashes(toks), S(state), logits)
    assert len(cache.entries) == 2 and cache.evictions == 1 and cache.nbytes == 2 * each
    assert cache.lookup([1, 9], prefix_hashes([1, 9])) is None  # the oldest went first
    assert cache.lookup([2, 9], prefix_hashes([2, 9])).tokens == (2,)
    cache.insert([4], prefix_hashes([4]), S(state), logits)  # drops [3], not the used [2]
    assert cache.lookup([3], prefix_hashes([3])) is None
    assert cache.lookup([2], prefix_hashes([2])) is not None
    # a hash collision never hands out another prefix's state: the tokens are compared
    forged = prefix_hashes([2])
    assert cache.lookup([5], forged) is None


def test_prefix_cache_lookup_finds_the_longest_cached_prefix():
    """`lookup` against a search of every entry: the longest cached prefix of the tokens
    (longer than `longer_than`), from hashes as an array or a list, counted as a hit or a
    miss only when asked; prompts drawn from a few stems, so prefixes are shared."""

    class S:
        def __init__(self, t):
            self.t = t

        def _tensors(self):
            return (self.t,)

    rng = random.Random(5)
    stems = [[rng.randrange(7) for _ in range(40)] for _ in range(3)]
    cache = PrefixCache(max_bytes=1 << 20)
    kept = []
    for _ in range(60):
        toks = rng.choice(stems)[: rng.randint(1, 40)] + [rng.randrange(7)] * rng.randint(0, 3)
        cache.insert(toks, prefix_hashes(toks), S(torch.zeros(1, 1, 1)), torch.zeros(1))
        kept.append(tuple(toks))
    for _ in range(200):
        q = rng.choice(stems)[: rng.randint(1, 40)] + [rng.randrange(7)] * rng.randint(0, 3)
        above = rng.choice([0, 0, rng.randint(0, len(q))])
        want = max((k for k in set(kept) if len(k) > above and tuple(q[: len(k)]) == k),
                   key=len, default=None)  # fmt: skip
        hashes = prefix_hashes(q)
        hits, misses = cache.hits, cache.misses
        got = cache.lookup(q, hashes if rng.random() < 0.5 else hashes.tolist(),
                           count=False, longer_than=above)  # fmt: skip
        assert (got.tokens if got is not None else None) == want
        assert (cache.hits, cache.misses) == (hits, misses)
        got = cache.lookup(q, hashes, longer_than=above)
        assert (cache.hits, cache.misses) == (hits + (want is not None), misses + (want is None))


def test_prefix_cache_insert_many_copies_and_keys():
    """A batch of inserts (`insert_many`, what a prefill launch gives the cache) keeps
    copies, not views, of its rows; a prefix twice in a batch is kept once; of two
    prefixes under one key (a hash collision) the later is kept, as inserted one by one."""
    rows = torch.arange(12.0).view(1, 3, 4)  # a launch's state field [L, rows, ...]
    logits = torch.arange(6.0).view(3, 2)

    class S:
        def __init__(self, t):
            self.t = t

        def _tensors(self):
            return (self.t,)

    cache = PrefixCache(max_bytes=1 << 20)
    a, b, c = [1, 2], [3, 4], [5, 6]
    forged = prefix_hashes(b)  # c filed under b's key
    cache.insert_many([
        (a, prefix_hashes(a), S(rows[:, 0:1]), logits[0]),
        (a, prefix_hashes(a), S(rows[:, 0:1]), logits[0]),
        (b, prefix_hashes(b), S(rows[:, 1:2]), logits[1]),
        (c, forged, S(rows[:, 2:3]), logits[2]),
    ])  # fmt: skip
    rows.zero_()
    logits.zero_()
    assert len(cache.entries) == 2 and cache.nbytes == 2 * (4 * 4 + 2 * 4)
    got = cache.lookup(a + [9], prefix_hashes(a + [9]))
    assert got.tokens == (1, 2) and got.state.t.flatten().tolist() == [0, 1, 2, 3]
    assert got.logits.tolist() == [0, 1]
    assert cache.lookup(b, prefix_hashes(b)) is None  # its key went to c
    assert cache.lookup(c, forged).state.t.flatten().tolist() == [8, 9, 10, 11]


def test_prefix_cache_insert_many_as_inserts_in_turn():
    """`insert_many` keeps what inserting its items one at a time keeps, in the same order
    of use, with the same evictions and bytes: against a plain model of the cache's rules
    (an exact prefix per key, the later of two colliding prefixes, an entry over the
    budget skipped, least recently used dropped first), on random batches with repeats,
    forged hash collisions and oversized states."""
    import random
    from collections import OrderedDict

    class S:
        def __init__(self, t):
            self.t = t

        def _tensors(self):
            return (self.t,)

    def model_insert(model, cap, tokens, hashes, t):
        key = (len(tokens), hashes[len(tokens) - 1])
        if key in model and model[key][0] == tuple(tokens):
            model.move_to_end(key)
            return 0
        size = t.numel() * 4 + 2 * 4
        if size > cap:
            return 0
        model.pop(key, None)
        model[key] = (tuple(tokens), t.clone(), size)
        evicted = 0
        while sum(v[2] for v in model.values()) > cap:
            model.popitem(last=False)
            evicted += 1
        return evicted

    rng = random.Random(0)
    for trial in range(200):
        cap = rng.choice([1, 2, 3, 5]) * 24 + rng.choice([0, 1])
        cache, model, evictions = PrefixCache(max_bytes=cap), OrderedDict(), 0
        for _ in range(4):
            items = []
            for i in range(rng.randint(1, 6)):
                toks = [rng.randint(1, 4) for _ in range(rng.randint(1, 2))]
                hashes = (
                    prefix_hashes([9] * len(toks)) if rng.random() < 0.2 else prefix_hashes(toks)
                )
                t = torch.full((1, 1, 400 if rng.random() < 0.1 else 4), float(trial * 10 + i))
                items.append((toks, hashes, S(t), torch.zeros(2)))
            for toks, hashes, st, _ in items:
                evictions += model_insert(model, cap, toks, hashes, st.t)
            cache.insert_many(items)
            assert list(cache.entries) == list(model), trial
            assert cache.evictions == evictions and cache.nbytes == sum(
                v[2] for v in model.values()
            )
            for key, (toks, t, _) in model.items():
                assert cache.entries[key].tokens == toks and torch.equal(
                    cache.entries[key].state.t, t
                )


@pytest.mark.parametrize("lookahead", [False, True], ids=["read-at-once", "lookahead"])
def test_cancel_frees_the_row_at_once(model_dirs, lookahead, load):
    engine = Engine(load(model_dirs["tiny"]), max_batch=2, block_size=16)
    engine.lookahead = lookahead
    long = engine.submit([1, 2, 3], SamplingParams(max_tokens=10_000, temperature=0))
    waiting = engine.submit([4, 5], SamplingParams(max_tokens=3, temperature=0, n=2))
    for _ in range(4):
        engine.step()
    assert len(engine.rows) == 1 and engine.waiting  # n=2 needs both rows
    engine.cancel(long)
    engine.step()
    assert long.done and engine.rows[0].request is waiting or waiting.done
    evs = list(long.events(timeout=5))
    assert evs[-1].finish_reason == "abort" and 0 < sum(len(e.token_ids) for e in evs) < 20
    run_all(engine, [waiting])
    assert not engine.rows and engine.metrics.finished["abort"] == 1


def test_whole_prompts_stay_within_the_prefill_budget(model_dirs, load):
    """A prompt longer than `prefill_tokens` is never prefilled whole (in one piece past
    the budget): it runs block by block over several iterations."""
    model = load(model_dirs["tiny"])
    assert Engine(model, max_batch=1).prefill_tokens == 2048  # the default off CUDA
    engine = Engine(model, max_batch=2, block_size=16, prefill_tokens=24, cache_bytes=0)
    short, long = engine.submit(list(range(20)), None), engine.submit(list(range(30)), None)
    engine.step()
    assert short.whole and not long.whole


def test_a_request_cancelled_while_its_prefill_runs_never_joins(model_dirs, load):
    """With the prefill deferred (as on CUDA): a request cancelled between the launch of
    its prefill and the join ends with "abort", takes no row, and the next request gets
    the rows it had reserved."""
    model, oracle = load(model_dirs["tiny"]), load(model_dirs["tiny"])
    engine = Engine(model, max_batch=2, block_size=16, cache_bytes=0)
    engine.lookahead = engine.async_prefill = True
    greedy = SamplingParams(max_tokens=4, temperature=0)
    gone = engine.submit(list(range(10, 40)), SamplingParams(max_tokens=4, n=2))
    engine.step()  # admitted, its prefill launched
    assert len(engine._pending) == 1 and engine.reserved == 2 and not engine.rows
    engine.cancel(gone)
    nxt = engine.submit(list(range(50, 60)), greedy)
    run_all(engine, [gone, nxt])
    assert [e.finish_reason for e in gone.events(timeout=5)] == ["abort", "abort"]
    assert tokens(nxt) == alone(oracle, list(range(50, 60)), greedy)
    assert engine.reserved == 0 and not engine.rows and engine.idle


@pytest.mark.parametrize("whole", [True, False], ids=["whole", "blocks"])
def test_a_prefill_that_raises_ends_only_its_requests(model_dirs, load, monkeypatch, whole):
    """A forward that fails during the prefill ends the requests of that forward (the
    prompts sharing it) with an error event naming it and frees their rows; the others
    run on, as generate gives."""
    model, oracle = load(model_dirs["tiny"]), load(model_dirs["tiny"])
    real = model.last_logits

    def last_logits(ids, *args, **kwargs):
        if (ids == 255).any():
            raise RuntimeError("the forward broke")
        return real(ids, *args, **kwargs)

    monkeypatch.setattr(model, "last_logits", last_logits)
    engine = Engine(model, max_batch=2, block_size=16, cache_bytes=0)
    engine.whole_max = 64 if whole else 0
    greedy = SamplingParams(max_tokens=5, temperature=0)
    bad = engine.submit([255] * 20, greedy)
    good = engine.submit(list(range(8)), greedy)  # no piece length in common with bad's
    run_all(engine, [bad, good])
    evs = list(bad.events(timeout=5))
    assert evs[-1].finish_reason == "error" and "the forward broke" in evs[-1].error
    assert tokens(good) == alone(oracle, list(range(8)), greedy)
    assert engine.reserved == 0 and engine.idle


def test_limits_and_bad_input_name_the_field(model_dirs, load):
    engine = Engine(load(model_dirs["tiny"]), max_batch=2, max_queue=1, max_prompt_tokens=8)
    for kw, field in [(dict(top_p=2.0), "top_p"), (dict(temperature=-1), "temperature"),
                      (dict(max_tokens=0), "max_tokens"), (dict(n=0), "n"),
                      (dict(top_k=-2), "top_k"), (dict(seed=-1), "seed"),
                      (dict(stop=[""]), "stop")]:  # fmt: skip
        with pytest.raises(ValueError, match=field):
            SamplingParams(**kw)
    with pytest.raises(ValueError, match="prompt"):
        engine.submit([1, 256])
    with pytest.raises(ValueError, match="prompt"):
        engine.submit([])
    with pytest.raises(PromptTooLong, match="9 tokens"):
        engine.submit(list(range(9)))
    with pytest.raises(ValueError, match="n must be at most max_batch 2"):
        engine.submit([1], SamplingParams(n=3))
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        engine.submit([1], SamplingParams(stop=["x"]))
    engine.submit([1])
    with pytest.raises(QueueFull):
        engine.submit([2])
    assert engine.metrics.rejected["queue_full"] == 1
    with pytest.raises(ValueError, match="max_batch"):
        Engine(engine.model, max_batch=0)
    with pytest.raises(ValueError, match="prefills_in_flight"):
        Engine(engine.model, prefills_in_flight=0)


def test_stops_end_a_choice(model_dirs, load):
    model, oracle = load(model_dirs["tiny"]), load(model_dirs["tiny"])
    prompt = list(b"def main():\n    ")
    sp = SamplingParams(max_tokens=40, temperature=0.9, seed=3)
    ref = alone(oracle, prompt, sp)[0]
    # a stop token, the model's end-of-sequence token, a stop string
    k = 6
    engine = Engine(model, tokenizer=ByteTokenizer(), eos_token_id=ref[k + 3])
    by_id = engine.submit(prompt, SamplingParams(**{**_kw(sp), "stop_token_ids": (ref[k],)}))
    by_eos = engine.submit(prompt, sp)
    ignore = engine.submit(prompt, SamplingParams(**{**_kw(sp), "ignore_eos": True}))
    i = next(i for i, t in enumerate(ref) if 33 <= t < 127)  # a printable byte
    stop = chr(ref[i])
    by_text = engine.submit(prompt, SamplingParams(**{**_kw(sp), "stop": (stop,)}))
    run_all(engine, [by_id, by_eos, ignore, by_text])
    first = ref.index(ref[k])
    assert tokens(by_id)[0] == ref[: first + 1]
    assert tokens(by_eos)[0] == ref[: ref.index(ref[k + 3]) + 1]
    assert tokens(ignore)[0] == ref
    evs = list(by_text.events(timeout=5))
    got = [t for e in evs for t in e.token_ids]
    assert got == ref[: ref.index(ref[i]) + 1] and evs[-1].finish_reason == "stop"
    text = "".join(e.text for e in evs)
    assert text == bytes(ref[: ref.index(ref[i])]).decode("utf-8", "replace")


def test_any_of_several_end_ids_ends_a_choice(model_dirs, load):
    """eos_token_id as a list (a chat model's end of turn and end of text): the first of
    them drawn ends the choice with "stop"; ignore_eos runs past all; ids outside the
    vocabulary are refused naming the argument."""
    model, oracle = load(model_dirs["tiny"]), load(model_dirs["tiny"])
    prompt = list(b"def main():\n    ")
    sp = SamplingParams(max_tokens=40, temperature=0.9, seed=3)
    ref = alone(oracle, prompt, sp)[0]
    late, early = ref[12], ref[5]
    engine = Engine(model, tokenizer=ByteTokenizer(), eos_token_id=[late, early])
    by_eos = engine.submit(prompt, sp)
    ignore = engine.submit(prompt, SamplingParams(**{**_kw(sp), "ignore_eos": True}))
    run_all(engine, [by_eos, ignore])
    end = min(ref.index(late), ref.index(early))
    evs = list(by_eos.events(timeout=5))
    assert [t for e in evs for t in e.token_ids] == ref[: end + 1]
    assert evs[-1].finish_reason == "stop"
    assert tokens(ignore)[0] == ref
    for bad in ([1, model.config.vocab_size], [True], "1", 2.0):
        with pytest.raises(ValueError, match="eos_token_id"):
            Engine(model, eos_token_id=bad)
    assert Engine(model, eos_token_id=np.int64(3)).eos_token_ids == (3,)
    with pytest.raises(ValueError, match=r"prompts: 3 at once, more than the queue holds \(2\)"):
        Engine(model, max_queue=2).submit_many([[1], [2], [3]])
    with pytest.raises(ValueError, match=r"prompt\[1\] token ids must lie"):
        Engine(model).submit_many([[1], [1, model.config.vocab_size]])


def _kw(sp: SamplingParams) -> dict:
    return dict(max_tokens=sp.max_tokens, temperature=sp.temperature, seed=sp.seed)


def test_stop_text_holds_back_a_possible_stop():
    s = StopText(("STOP",))
    assert s.add("ab") == ""  # the last 3 characters may begin "STOP": held back
    assert s.add("cS") == "a"
    assert s.add("TO") == "bc"
    assert s.add("Px") == "" and s.stopped and s.text == "abc"
    s = StopText(("xy",))
    assert s.add("abx") == "ab" and s.add("z") == "x" and not s.stopped
    s = StopText(())
    assert s.add("abc") == "abc" and s.flush() == ""


def test_a_request_that_raises_ends_alone(model_dirs, load):
    model, oracle = load(model_dirs["tiny"]), load(model_dirs["tiny"])
    engine = Engine(model, max_batch=4)

    def hook(seq, tok):
        if seq.request.prompt[0] == 255 and len(seq.tokens) == 2:
            raise RuntimeError("injected fault")

    engine.on_token = hook
    sp = SamplingParams(max_tokens=10, temperature=0)
    bad = engine.submit([255, 1, 2], sp)
    good = engine.submit([3, 4, 5], sp)
    run_all(engine, [bad, good])
    evs = list(bad.events(timeout=5))
    assert evs[-1].finish_reason == "error" and "injected fault" in evs[-1].error
    assert tokens(good) == alone(oracle, [3, 4, 5], sp)
    again = engine.submit([255, 1, 2], SamplingParams(max_tokens=1, temperature=0))
    run_all(engine, [again])
    assert not engine.rows and again.done


def test_prefill_failure_ends_its_requests_only(model_dirs, monkeypatch, load):
    model, oracle = load(model_dirs["tiny"]), load(model_dirs["tiny"])
    engine = Engine(model, max_batch=4, block_size=16)
    sp = SamplingParams(max_tokens=5, temperature=0)
    good = engine.submit([1, 2, 3, 4], sp)
    engine.step()
    real = model.last_logits

    def failing(ids, state=None, seq_idx=None):
        raise RuntimeError("out of memory (injected)")

    monkeypatch.setattr(model, "last_logits", failing)
    bad = engine.submit(list(range(20)), sp)
    engine.step()
    monkeypatch.setattr(model, "last_logits", real)
    run_all(engine, [good, bad])
    assert next(iter(bad.events(timeout=5))).finish_reason == "error"
    assert tokens(good) == alone(oracle, [1, 2, 3, 4], sp)


def test_shutdown_drains_then_refuses(model_dirs, load):
    engine = Engine(load(model_dirs["tiny"]), max_batch=2).start()
    req = engine.submit([1, 2, 3], SamplingParams(max_tokens=20, temperature=0))
    assert engine.shutdown(timeout=30) is True
    assert req.done and [e.finish_reason for e in req.events(timeout=5)][-1] == "length"
    with pytest.raises(EngineStopped):
        engine.submit([1])
    # a drain that runs out of time ends what is left with "abort"
    engine = Engine(load(model_dirs["tiny"]), max_batch=2).start()
    req = engine.submit([1, 2, 3], SamplingParams(max_tokens=100_000, temperature=0))
    assert engine.shutdown(timeout=0.2) is False
    assert [e.finish_reason for e in req.events(timeout=5)][-1] == "abort"


def test_prefill_pieces_share_forwards():
    assert list(piece_lengths(0, 100, 256)) == [64, 32, 4]
    assert list(piece_lengths(0, 600, 256)) == [256, 256, 64, 16, 8]
    assert list(piece_lengths(300, 520, 256)) == [128, 64, 16, 4, 8]
    # with states_at (Mamba-1): whole up to each block boundary, padded to a power of two
    assert list(span_lengths(0, 100, 256)) == [100]
    assert list(span_lengths(300, 600, 256)) == [212, 88]
    assert list(span_lengths(0, 600, 256)) == [256, 256, 88]
    assert [span_bucket(n, 256) for n in (1, 3, 88, 129, 256)] == [1, 4, 128, 256, 256]
    assert [span_bucket(n, 100) for n in (64, 65, 100)] == [64, 100, 100]

    class R:
        def __init__(self, n, pos=0, whole=False):
            self.prompt, self.pos, self.whole = [0] * n, pos, whole

    a, b, c = R(1000), R(50), R(10)
    # a stops at a block boundary within the budget; the first always advances
    assert [t for _, t in plan_targets([a, b, c], 520, 256)] == [512]
    assert [t for _, t in plan_targets([a, b, c], 600, 256)] == [512, 50, 10]
    assert [t for _, t in plan_targets([b, c, a], 600, 256)] == [50, 10, 512]
    assert [t for _, t in plan_targets([a], 100, 256)] == [256]
    # a whole prompt goes all the way, or waits when others came first
    w = R(700, whole=True)
    assert [t for _, t in plan_targets([w, b], 100, 256)] == [700]
    assert [t for _, t in plan_targets([b, w, c], 600, 256)] == [50]
    assert [t for _, t in plan_targets([b, w, c], 800, 256)] == [50, 700, 10]


class LaunchEvent:
    """A prefill launch's event in a test: done when the engine waits for it, or by hand."""

    def __init__(self):
        self.done = False

    def query(self):
        return self.done

    def synchronize(self):
        self.done = True


def deferred(engine: Engine, monkeypatch) -> list[LaunchEvent]:
    """`engine` made to prefill as on CUDA (launches joined at an iteration that finds
    them done, tokens read an iteration late), each launch's event one of the list."""
    engine.lookahead = engine.async_prefill = True
    events: list[LaunchEvent] = []
    monkeypatch.setattr(engine, "_launch_event", lambda: events.append(LaunchEvent()) or events[-1])
    return events


def finish(engine: Engine, events: list[LaunchEvent], reqs) -> None:
    """Step `engine`, every launch done as it comes, until `reqs` have ended."""
    for _ in range(1000):
        if all(r.done for r in reqs):
            return
        for ev in events:
            ev.done = True
        engine.step()
    raise AssertionError("the engine did not finish its requests")


def decoding(engine: Engine, events: list[LaunchEvent]):
    """A request that keeps `engine` decoding for 40 tokens, once it has joined."""
    running = engine.submit(list(range(100, 110)), SamplingParams(max_tokens=40, temperature=0))
    while not engine.rows:
        engine.step()
        for ev in events:
            ev.done = True
    return running


def test_a_prompt_launches_behind_a_running_prefill(model_dirs, load, monkeypatch):
    """With the prefill deferred (as on CUDA) and its events not done yet, a prompt that
    arrives while one launch runs is launched behind it (`prefills_in_flight` 2), a third
    waits for a free place; nothing to decode, the engine waits for the oldest launch.
    Joined in launch order, every request gives what generate gives alone."""

    model, oracle = load(model_dirs["tiny-mamba2"]), load(model_dirs["tiny-mamba2"])
    engine = Engine(model, max_batch=4, block_size=16, cache_bytes=1 << 24, prefills_in_flight=2)
    events = deferred(engine, monkeypatch)
    sp = SamplingParams(max_tokens=6, temperature=0)
    a = engine.submit(list(range(10, 30)), sp)
    engine.step()
    assert [r for _, r, _ in engine._pending] == [[a]] and a.launched
    b = engine.submit(list(range(40, 75)), sp)
    engine.step()  # a's launch runs: b's is launched behind it
    assert [r for _, r, _ in engine._pending] == [[a], [b]] and not engine.rows
    c = engine.submit(list(range(80, 90)), sp)
    engine.step()  # two in flight, nothing to decode: wait for a's, join it; c behind b
    assert events[0].done and not events[1].done
    assert [s.request for s in engine.rows] == [a]
    assert [r for _, r, _ in engine._pending] == [[b], [c]]
    engine.step()  # a decodes beside the two launches
    assert len(engine._pending) == 2 and len(engine.rows) == 1
    for ev in events:
        ev.done = True
    run_all(engine, [a, b, c])
    for req in (a, b, c):
        assert tokens(req) == alone(oracle, req.prompt, sp)


def test_the_cache_copies_of_a_launch_wait_for_its_join(model_dirs, load, monkeypatch):
    """With the prefill beside the decode steps (as on CUDA), the states a launch reaches go
    into the cache once it is joined, after the next iteration has handed out its tokens:
    not while it runs, and not at the join itself; then they are found, and a prompt that
    continues one gives what generate gives alone."""

    model, oracle = load(model_dirs["tiny"]), load(model_dirs["tiny"])
    engine = Engine(model, max_batch=4, block_size=16, cache_bytes=1 << 24)
    events = deferred(engine, monkeypatch)
    sp = SamplingParams(max_tokens=5, temperature=0)
    running = decoding(engine, events)
    prompt = list(range(10, 50))  # a new head: prefilled whole, its end state kept
    a = engine.submit(prompt, sp)

    def cached_lengths():
        return {len(e.tokens) for e in engine.cache.entries.values()}

    engine.step()  # a's launch: nothing cached while it runs
    assert a.launched and len(engine._pending) == 1 and 40 not in cached_lengths()
    engine.step()
    assert engine._pending and 40 not in cached_lengths()
    events[-1].done = True
    engine.step()  # joined: a's first token drawn, its states not copied yet
    assert not engine._pending and a.seqs and 40 not in cached_lengths()
    assert engine._to_cache
    engine.step()  # the next iteration hands a's first token out, then copies them
    assert not engine._to_cache and 40 in cached_lengths()
    b = engine.submit(prompt + [7, 8, 9], sp)
    hits = engine.cache.hits
    finish(engine, events, [a, b, running])
    assert engine.cache.hits == hits + 1 and b.cached == 40
    for req in (a, b, running):
        assert tokens(req) == alone(oracle, req.prompt, req.params)


def test_a_prompt_admitted_while_its_prefix_runs_finds_it_at_its_launch(model_dirs, load,
                                                                         monkeypatch):  # fmt: skip
    """A prompt admitted while a launch that reaches its prefix is in flight (one launch
    at a time: it waits) looks the cache up again before its own launch, once that launch
    is joined and its states copied: it continues the prefix rather than starting from
    zeros, counted as a hit (its miss at admission stays counted: counters never fall),
    and gives what generate gives alone."""
    model, oracle = load(model_dirs["tiny"]), load(model_dirs["tiny"])
    engine = Engine(model, max_batch=4, block_size=16, cache_bytes=1 << 24)
    events = deferred(engine, monkeypatch)
    sp = SamplingParams(max_tokens=5, temperature=0)
    running = decoding(engine, events)
    prompt = list(range(10, 50))
    a = engine.submit(prompt, sp)
    engine.step()  # a's launch
    assert a.launched
    b = engine.submit(prompt + [7, 8, 9], sp)
    engine.step()  # b admitted: a miss (a's states are not in the cache yet); it waits
    assert b in engine.prefilling and not b.launched and b.cached == 0
    hits, misses = engine.cache.hits, engine.cache.misses
    finish(engine, events, [a, b, running])
    assert b.cached == 40 and engine.cache.hits == hits + 1 and engine.cache.misses == misses
    for req in (a, b, running):
        assert tokens(req) == alone(oracle, req.prompt, req.params)


def test_whole_prompts_group_where_the_filler_saved_pays_for_a_forward():
    """`plan_groups` against every way of cutting the sorted prompts (brute force): the
    fewest tokens computed (rows padded to a power of two, each row to the bucket of
    its group's longest) plus the fixed cost of each forward."""
    import itertools

    def cost(lengths, ends, fixed):
        total, i = 0, 0
        for end in ends:
            total += fixed + (1 << (end - i - 1).bit_length()) * whole_bucket(lengths[end - 1])
            i = end
        return total

    rng = random.Random(3)
    for _ in range(40):
        k = rng.randint(1, 9)
        lengths = sorted(rng.randint(1, 2048) for _ in range(k))
        most, fixed = rng.choice([2, 4, 16]), rng.choice([0, 300, 1024, 5000])
        ends = plan_groups(lengths, most, fixed)
        assert ends[-1] == k and all(b - a <= most for a, b in zip([0, *ends], ends))
        best = min(
            cost(lengths, [*cuts, k], fixed)
            for r in range(k)
            for cuts in itertools.combinations(range(1, k), r)
            if all(b - a <= most for a, b in zip([0, *cuts], [*cuts, k]))
        )
        assert cost(lengths, ends, fixed) == best, (lengths, most, fixed)
    # no fixed cost: every bucket its own forward; a large one: one forward
    assert plan_groups([20, 30, 600, 700], 16, 0) == [2, 4]
    assert plan_groups([20, 30, 600, 700], 16, 10**6) == [4]


def test_packed_rows_fill_and_cut_at_the_least_cost():
    """`plan_packs`: every prompt in one row, a continued one (a cached prefix) first in a
    row of its own start, each row within its forward's width and the states a row keeps;
    the rows cut into forwards of a power of two rows at the least tokens computed plus
    the fixed cost of each (`_cut_rows` against every way of cutting the rows, brute
    force); and the host tensors of a forward (`packed_rows`)."""
    import itertools

    from mambakit.serve.prefill import _cut_rows, pack_steps, pack_width, packed_rows, plan_packs

    def req(n, pos=0, blocks=False):
        return types.SimpleNamespace(prompt=[1] * n, pos=pos, blocks=blocks)

    def rest(r):
        return len(r.prompt) - r.pos

    rng = random.Random(4)
    for _ in range(60):
        reqs = [req(rng.randint(1, 3000), rng.choice([0, 0, 0, 256]), rng.random() < 0.3)
                for _ in range(rng.randint(1, 24))]  # fmt: skip
        reqs = [r for r in reqs if rest(r) > 0] or [req(5)]
        slots, most_rows = rng.choice([2, 4, 16]), rng.choice([1, 4, 16])
        fixed = rng.choice([0, 500, 4000])
        plan = plan_packs(reqs, 256, slots, most_rows, 32768, fixed)
        placed = [r for rows, _, _ in plan for row in rows for r in row]
        assert sorted(map(id, placed)) == sorted(map(id, reqs))
        for rows, n, width in plan:
            assert n == 1 << (n.bit_length() - 1) and len(rows) <= n <= most_rows
            assert n == 1 or n * width <= 32768
            for row in rows:
                assert sum(map(rest, row)) <= width
                assert all(r.pos == 0 for r in row[1:])  # a continued prompt starts its row
                kept = sum(len(pack_steps(r.pos, len(r.prompt), 256, r.blocks)) for r in row)
                assert kept <= slots or len(row) == 1

    def cost(tokens, cuts, fixed):
        return sum(fixed + n * pack_width(tokens[i]) for i, _, n, _ in cuts)

    for _ in range(60):
        tokens = sorted((rng.randint(1, 4096) for _ in range(rng.randint(1, 7))), reverse=True)
        most_rows, fixed = rng.choice([1, 2, 4, 8]), rng.choice([0, 300, 2000, 20000])
        most = rng.choice([1 << 20, 8192])  # rows x width within it (one row: any width)
        best, cuts = _cut_rows(tokens, most_rows, most, fixed)
        assert all(n == 1 or n * w <= most for _, _, n, w in cuts)
        assert [(i, j) for i, j, _, _ in cuts] == list(
            zip([0, *[j for _, j, _, _ in cuts[:-1]]], [j for _, j, _, _ in cuts])
        )
        assert best == cost(tokens, cuts, fixed)
        k = len(tokens)

        def runs(ends, tokens=tokens):
            i, out = 0, []
            for end in ends:
                n = 1 << (end - i - 1).bit_length()
                out.append((i, end, n, pack_width(tokens[i])))
                i = end
            return out

        brute = min(
            cost(tokens, runs([*c, k]), fixed)
            for r in range(k)
            for c in itertools.combinations(range(1, k), r)
            if all(b - a <= most_rows for a, b in zip([0, *c], [*c, k]))
            and all(n == 1 or n * w <= most for _, _, n, w in runs([*c, k]))
        )
        assert best == brute, (tokens, most_rows, fixed)
    # five rows of 2,000 tokens: 4 + 1 rows without a fixed cost, 8 rows with a large one
    five = [req(2000) for _ in range(5)]
    assert [(n, w) for _, n, w in plan_packs(five, 256, 16, 16, 32768, 0)] == [(4, 2048), (1, 2048)]
    assert [(n, w) for _, n, w in plan_packs(five, 256, 16, 16, 32768, 10**5)] == [(8, 2048)]
    # two prompts of 3,000 and one of 1,000: two rows of 4,096 (the second holds both)
    three = [req(3000), req(1000), req(3000)]
    ((rows, n, width),) = plan_packs(three, 256, 16, 16, 32768, 0)
    assert (n, width) == (2, 4096) and sorted(map(len, rows)) == [1, 2]
    ids, seq, pos = packed_rows([[[5, 6, 7], [8, 9]], [[4]]], [[[2], [0, 1]], [[0]]], 6, 4, 3)
    assert ids.tolist()[:2] == [[5, 6, 7, 8, 9, 0], [4, 0, 0, 0, 0, 0]] and not ids[2:].any()
    assert seq.tolist()[:2] == [[0, 0, 0, 1, 1, 2], [0, 1, 1, 1, 1, 1]]
    assert pos[0].tolist() == [2, 3, 4] and pos[1].tolist()[0] == 0
    assert all(len(set(row)) == 3 for row in pos.tolist())  # distinct steps fill the slots


def test_prefill_hold_waits_for_tokens_or_time(model_dirs, load):
    """With `prefill_hold`, a prompt admitted while others decode waits until the prompts
    waiting reach the tokens asked or it has waited the time; with nothing decoding it
    launches at once. The tokens are generate's."""
    import time

    model, oracle = load(model_dirs["tiny"]), load(model_dirs["tiny"])
    engine = Engine(model, max_batch=4, block_size=16, cache_bytes=1 << 24)
    engine.prefill_hold = (50, 3600.0)
    greedy = SamplingParams(max_tokens=40, temperature=0)
    first = engine.submit(list(range(10, 30)), greedy)
    engine.step()  # nothing decodes: launched and joined at once
    assert engine.rows and not engine.prefilling
    short = engine.submit(list(range(40, 60)), SamplingParams(max_tokens=4, temperature=0))
    for _ in range(3):
        engine.step()
    assert engine.prefilling == [short] and short.pos == 0  # 20 tokens < 50: waits
    more = engine.submit(list(range(70, 110)), SamplingParams(max_tokens=4, temperature=0))
    engine.step()  # 60 tokens waiting: both launch
    assert not engine.prefilling and short.pos == 20 and more.pos == 40
    again = engine.submit(list(range(40, 60)), SamplingParams(max_tokens=2, temperature=0))
    engine.step()  # nothing to prefill (its whole prompt is cached): not held
    assert again.cached == 20 and not engine.prefilling
    late = engine.submit([5, 6, 7], SamplingParams(max_tokens=4, temperature=0))
    engine.prefill_hold = (50, 0.01)
    engine.step()
    assert engine.prefilling == [late]
    time.sleep(0.02)
    engine.step()  # waited long enough
    assert not engine.prefilling
    run_all(engine, [first, short, more, again, late])
    for req in (first, short, more, again, late):
        assert tokens(req) == alone(oracle, req.prompt, req.params)


def test_auto_prefill_hold_weighs_empty_rows_against_a_forward(model_dirs, load, monkeypatch):
    """prefill_hold "auto": a prompt waits while the rows it keeps empty (its choices),
    times its wait, cost less than a forward's fixed cost times the running rows; never
    where the fixed cost is not measured, past HOLD_MAX, with a full launch waiting, or
    for a prompt past its start (a cached prefix). The tokens are generate's."""
    from mambakit.serve import intake

    model, oracle = load(model_dirs["tiny"]), load(model_dirs["tiny"])
    engine = Engine(model, max_batch=8, block_size=16, cache_bytes=0, prefill_tokens=64)
    engine.prefill_hold = "auto"
    long = SamplingParams(max_tokens=80, temperature=0)
    first = engine.submit(list(range(10, 30)), long)
    engine.step()  # nothing decodes: launched at once
    second = engine.submit(list(range(40, 60)), long)
    engine.step()  # a row decodes, but the fixed cost is not measured (no graphs): no hold
    assert not engine.prefilling and len(engine.rows) == 2
    monkeypatch.setattr(intake, "HOLD_MAX", 1e9)
    engine._forward_seconds = lambda: 5.0  # 2 running rows: 10 s x rows
    pair = engine.submit(list(range(70, 90)), SamplingParams(max_tokens=8, temperature=0, n=2))
    engine.step()
    assert engine.prefilling == [pair]
    pair.admitted -= 3.0  # its 2 empty rows x 3 s = 6 < 10: held
    engine.step()
    assert engine.prefilling == [pair]
    pair.admitted -= 3.0  # 2 x 6 s = 12 >= 10: launched
    engine.step()
    assert not engine.prefilling and len(engine.rows) == 4
    big = engine.submit(list(range(100, 170)), SamplingParams(max_tokens=4, temperature=0))
    engine.step()  # 70 tokens >= prefill_tokens: launched at once (its first 64)
    assert big.pos == 64
    engine.step()  # past its start: its last 6 tokens go on at once
    assert big.pos == 70
    monkeypatch.setattr(intake, "HOLD_MAX", 0.5)
    late = engine.submit([5, 6, 7], SamplingParams(max_tokens=4, temperature=0))
    engine.step()
    assert engine.prefilling == [late]
    late.admitted -= 0.5  # waited HOLD_MAX: launched
    engine.step()
    assert not engine.prefilling
    run_all(engine, [first, second, pair, big, late])
    for req in (first, second, pair, big, late):
        assert tokens(req) == alone(oracle, req.prompt, req.params, req.params.n)
    # with the cache on, a prompt that continues a cached prefix is not held
    monkeypatch.setattr(intake, "HOLD_MAX", 1e9)
    engine = Engine(model, max_batch=4, block_size=16, cache_bytes=1 << 24)
    engine.prefill_hold = "auto"
    engine._forward_seconds = lambda: 3600.0
    first = engine.submit(list(range(10, 42)), long)
    engine.step()
    held = engine.submit(list(range(50, 70)), long)
    engine.step()
    assert engine.prefilling == [held]
    hit = engine.submit(list(range(10, 42)) + [90, 91], long)
    engine.step()  # the first prompt is cached: launched at once, the held one with it
    assert hit.cached == 32 and not engine.prefilling and len(engine.rows) == 3
    run_all(engine, [first, held, hit])
    for req in (first, held, hit):
        assert tokens(req) == alone(oracle, req.prompt, req.params)


def test_prefill_hold_is_validated(model_dirs, load):
    engine = Engine(load(model_dirs["tiny"]), max_batch=2)
    assert engine.prefill_hold == "auto"  # the default (holds only with a measured cost)
    assert engine._forward_seconds() is None  # the CPU: no prefill graphs, no cost
    engine.prefill_graphs = types.SimpleNamespace(forward_seconds=0.5)
    assert engine._forward_seconds() == 0.5
    engine.packed = True  # the packed forwards' cost, where those graphs were measured
    assert engine._forward_seconds() == 0.5
    engine.packed, engine.prefill_graphs = False, None
    for bad in ("none", "Auto", (1, 2, 3), (-1, 0.1), (10, -1.0), 5):
        with pytest.raises(ValueError, match="prefill_hold"):
            engine.prefill_hold = bad
    engine.prefill_hold = None
    engine.prefill_hold = (100, 0.5)
    assert engine.prefill_hold == (100, 0.5)


def test_timeline_is_ignored_off_cuda(model_dirs, load):
    """A timeline switched on for an engine on the CPU records nothing and breaks nothing."""
    model, oracle = load(model_dirs["tiny"]), load(model_dirs["tiny"])
    engine = Engine(model, max_batch=2)
    engine.timeline = []
    greedy = SamplingParams(max_tokens=5, temperature=0)
    (out,) = engine.generate([1, 2, 3], greedy)
    assert out.error is None and [out.token_ids] == alone(oracle, [1, 2, 3], greedy)
    assert engine.timeline == []


def stand_in(fn, warmup=2, pool=None, stream=None):
    """`capture` on the CPU: a graph whose replay reruns the call into the captured
    outputs, as a graph writes its static outputs. Each capture's stream is kept in
    `captured_on` (the graph's place in it: `Graph.number`)."""
    for _ in range(warmup):
        fn()
    out = fn()
    captured_on.append(stream)

    class Graph:
        number = len(captured_on) - 1

        def replay(self):
            new = fn()
            if out is not None:  # a call that returns its outputs (not one that copies)
                out.copy_(new)

    return Graph(), out


captured_on: list = []  # the stream of every stand-in capture


class FakeStream:
    """`torch.cuda.Stream` on the CPU: an object that only needs to be told apart."""

    def __init__(self, device=None, priority=0):
        self.device = device


def test_packed_graphs_on_the_cpu_with_a_stand_in_for_capture(model_dirs, load, monkeypatch):
    """The packed forwards' graphs (`PrefillGraphs.run_packed`): several rows a forward,
    padded to a power of two rows and a `pack_width`, rows that continue a cached prefix
    beside rows from zeros, the unused slots filled with other steps, the kept states
    gathered from the shared buffers, give what generate gives alone; a capture that
    fails turns them off, and the packed forwards run eagerly."""
    import mambakit.inference.cuda_graph as cg
    from mambakit.inference.cuda_graph import static_mode
    from mambakit.serve import slots
    from mambakit.serve.prefill_graphs import PrefillGraphs

    monkeypatch.setattr(cg, "capture", stand_in)
    monkeypatch.setattr(slots, "capture", stand_in)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    model, oracle = load(model_dirs["tiny"]), load(model_dirs["tiny"])
    engine = Engine(model, max_batch=12, block_size=16, prefill_tokens=300, cache_bytes=1 << 24)
    engine.packed = True
    with static_mode():
        engine.pool = slots.SlotPool(model, 12, graphs=True)
        engine.prefill_graphs = PrefillGraphs(model, 16)
    engine.pool.refresh_plans = engine.prefill_graphs.refresh_plans = engine._refresh_plans
    graphs = engine.prefill_graphs
    graphs.slots = 4  # few states a row: a launch of many prompts runs as several rows
    engine.lookahead = engine.async_prefill = True
    engine.warmup()
    # widths 32 .. 512 (that of 300 tokens), rows while rows x width <= 1024 (twice it)
    packed = sorted(k[:2] for k in graphs.graphs if k[2] == "packed")
    assert packed == sorted((r, 32 << i) for i in range(5) for r in (1, 2, 4, 8, 16)
                            if r == 1 or r * (32 << i) <= 1024)  # fmt: skip
    assert (16, 64) in packed and (1, 512) in packed and (2, 512) in packed
    runs = []
    run_packed = graphs.run_packed

    def spy(prompts, steps, starts, keep, device):
        out = run_packed(prompts, steps, starts, keep, device)
        continued = [len(p) for p, s in zip(prompts, starts) if s is not None]
        runs.append((len(prompts), continued, out is not None))
        return out

    monkeypatch.setattr(graphs, "run_packed", spy)
    head = [9] * 18
    work = [(head + [1], SamplingParams(max_tokens=3, temperature=0))] * 2  # the head seen
    served_alone(engine, oracle, work)
    work = [(head + p, sp) for p, sp in mixed_requests(7, 6)] + mixed_requests(6, 10)
    reqs = served_alone(engine, oracle, work)
    assert graphs.packed_enabled and any(r.blocks for r in reqs) and any(r.cached for r in reqs)
    assert all(done for *_, done in runs)
    assert max(n for n, *_ in runs) >= 3  # several rows in one forward
    # rows that continue a cached prefix, fresh prompts packed after it in its row
    assert any(max(k, default=0) >= 2 for _, k, _ in runs)

    # without a warm-up the packed graphs are captured as first met (not left to the eager
    # path by the limits of a warm-up that never ran)
    with static_mode():
        engine.prefill_graphs = graphs = PrefillGraphs(model, 16)
    graphs.slots = 4
    run_packed = graphs.run_packed
    monkeypatch.setattr(graphs, "run_packed", spy)
    runs.clear()
    served_alone(engine, oracle, mixed_requests(9, 8))
    assert runs and all(done for *_, done in runs) and max(n for n, *_ in runs) >= 2

    def broken(rows, width, device):
        raise RuntimeError("out of memory")

    graphs.graphs = {}
    monkeypatch.setattr(graphs, "_packed_entry", broken)
    work = mixed_requests(8, 6)
    reqs = served_alone(engine, oracle, work)
    assert not graphs.packed_enabled


@pytest.mark.parametrize("preset, spans", [("tiny-mamba3", False), ("tiny", True),
                                           ("tiny-mamba3", True)])  # fmt: skip
def test_graph_paths_on_the_cpu_with_a_stand_in_for_capture(model_dirs, load, monkeypatch,
                                                            preset, spans):  # fmt: skip
    """The CUDA-graph paths (decode per bucket of rows, prefill pieces per rows bucket,
    on Mamba-1 pieces of different lengths in one forward) with `capture` replaced by a
    stand-in whose replay reruns the call into the captured outputs, as a graph writes
    its static outputs: the buckets' padding rows, the copies in and out of static
    buffers and the row moves give what generate gives alone."""
    import mambakit.inference.cuda_graph as cg
    from mambakit.inference.cuda_graph import static_mode
    from mambakit.serve import slots
    from mambakit.serve.prefill_graphs import PrefillGraphs

    monkeypatch.setattr(cg, "capture", stand_in)
    monkeypatch.setattr(slots, "capture", stand_in)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    captured_on.clear()
    model, oracle = load(model_dirs[preset]), load(model_dirs[preset])
    engine = Engine(model, max_batch=6, block_size=16, prefill_tokens=40, cache_bytes=1 << 24)
    with static_mode():  # each kind on the stream it runs on, as the engine makes them on CUDA
        engine.pool = slots.SlotPool(model, 6, graphs=True, capture_stream=FakeStream())
        engine.prefill_graphs = PrefillGraphs(model, 16, FakeStream())
        engine.prefill_graphs.max_rows = 2  # groups of 3 and more run in parts
    engine.pool.refresh_plans = engine.prefill_graphs.refresh_plans = engine._refresh_plans
    engine.spans = engine.prefill_graphs.spans_enabled = spans
    assert engine.pool.buckets == [1, 2, 4, 6]
    engine.lookahead = engine.async_prefill = True  # as on CUDA
    engine.whole_max = 40  # prompts up to 40 tokens whole, longer ones in pieces
    work = mixed_requests(2, 12)
    served_alone(engine, oracle, work)
    assert engine.prefill_graphs.graphs  # the pieces ran from the stand-in graphs
    # the decode graphs and the prefill graphs, replayed beside each other on CUDA, are
    # captured on the streams given (cuBLAS keeps a workspace per capture stream)
    decode_on = {id(captured_on[g.number]) for g, _out in engine.pool.graphs.values()}
    prefill_on = {id(captured_on[v[0].number]) for v in engine.prefill_graphs.graphs.values()}
    assert decode_on == {id(engine.pool.capture_stream)}
    assert prefill_on == {id(engine.prefill_graphs.capture_stream)}
    assert isinstance(engine.pool.capture_stream, FakeStream)
    assert engine.pool.capture_stream is not engine.prefill_graphs.capture_stream
    assert any(k[2] == "spans" for k in engine.prefill_graphs.graphs) == spans
    # rows 1, 2; pieces 1 ... 16 (and on Mamba-1 pieces of different lengths up to 2 ...
    # 16), and whole prompts of 16 ... 64 tokens
    engine.whole_max = 64
    engine.warmup()
    assert len(engine.prefill_graphs.graphs) == 2 * (5 + 4 * spans + 3)
    # a whole prompts' capture that fails: those run eagerly, the pieces keep their graphs
    graphs = engine.prefill_graphs
    graphs.graphs = {k: v for k, v in graphs.graphs.items() if not k[2]}
    real_entry = graphs._entry

    def entry(rows, n, device, whole=False, spans=False):
        if whole:
            raise RuntimeError("out of memory")
        return real_entry(rows, n, device, whole, spans)

    monkeypatch.setattr(graphs, "_entry", entry)
    work = mixed_requests(5, 8)
    served_alone(engine, oracle, work)
    assert graphs.enabled and not graphs.whole_enabled
    assert graphs.spans_enabled == spans  # the pieces of different lengths keep theirs


@pytest.mark.gpu
@pytest.mark.parametrize("preset, packed", [("tiny", False), ("tiny-mamba2", False),
                                            ("tiny-mamba3", False), ("tiny", True)])  # fmt: skip
def test_engine_on_cuda_gives_generate_alone(model_dirs, preset, packed):
    """On the GPU, with the decode and prefill graphs (f32, so that batching changes no
    greedy token); `packed`: Mamba-1's packed forwards, several rows each, some rows
    continuing a cached prefix."""
    from mambakit import MambaLM

    model = MambaLM.from_pretrained(model_dirs[preset], device="cuda").eval()
    oracle = MambaLM.from_pretrained(model_dirs[preset], device="cuda").eval()
    # packed: a budget of several rows of the narrowest packed width (`PACK_MIN`, 32 tokens);
    # 40 tokens would fit one row a forward
    budget = 300 if packed else 40
    engine = Engine(model, max_batch=8, block_size=16, prefill_tokens=budget, cache_bytes=1 << 26)
    assert engine.graphs and engine.prefill_graphs is not None
    # each kind of graph captured on the stream it runs on: two streams, two cuBLAS workspaces
    assert engine.pool.capture_stream is engine.decode_stream
    assert engine.prefill_graphs.capture_stream is engine.prefill_stream
    assert engine.decode_stream.cuda_stream != engine.prefill_stream.cuda_stream
    engine.packed = packed
    graphs = engine.prefill_graphs
    graphs.slots = 2  # few states a row: several rows to a packed forward
    engine.warmup()
    runs = []
    run_packed = graphs.run_packed

    def spy(prompts, steps, starts, keep, device):
        out = run_packed(prompts, steps, starts, keep, device)
        runs.append((len(prompts), out is not None))
        return out

    graphs.run_packed = spy
    head = [3] * 20
    work = mixed_requests(0, 14) + [(head + p[:30], sp) for p, sp in mixed_requests(1, 6)]
    reqs = [engine.submit(p, sp) for p, sp in work]
    run_all(engine, reqs)
    assert graphs.enabled and graphs.packed_enabled
    if packed:  # replayed packed forwards, several rows in some; a cached prefix continued
        assert runs and all(done for _, done in runs) and max(n for n, _ in runs) >= 2
        assert any(r.whole and r.cached for r in reqs)
    else:
        assert not runs
    for (prompt, sp), req in zip(work, reqs):
        assert tokens(req) == alone(oracle, prompt, sp), (len(prompt), sp)


def test_detokenizer_with_a_tokenizer_json(tmp_path):
    """Text of each token as it arrives, with a byte-level BPE tokenizer.json: the pieces
    join to the text of all the tokens (word-initial spaces and multi-byte characters
    included)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from mambakit.text import HFTokenizer
    from mambakit.text import TextStream as Detokenizer

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ["def main():\n    return 'héllo wörld' + str(42)", "naïve café ☕ résumé"] * 20
    trainer = trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(corpus, trainer)
    tok.save(str(tmp_path / "tokenizer.json"))
    hf = HFTokenizer(tmp_path)
    prompt = hf.encode("def main():")
    for text in ("\n    return 'héllo wörld'", " naïve café ☕ résumé"):
        ids = hf.encode(text)
        d = Detokenizer(hf, prompt)
        pieces = [d.push(i) for i in ids] + [d.flush()]
        assert "".join(pieces) == hf.decode(prompt + ids)[len(hf.decode(prompt)) :]
    d = Detokenizer(ByteTokenizer(), [])
    assert [d.push(b) for b in "é!".encode()] == ["", "é", "!"]


def test_histogram_observe_many_counts_as_observe():
    from mambakit.serve.metrics import ITL_BUCKETS, Histogram

    rng = random.Random(3)
    values = [
        rng.choice([0.0, *ITL_BUCKETS, 9.0]) * rng.choice([1, 1, 0.5, 1.5]) for _ in range(500)
    ]
    one, many = Histogram(ITL_BUCKETS), Histogram(ITL_BUCKETS)
    for v in values:
        one.observe(v)
    many.observe_many(list(values[:200]))
    many.observe_many(list(values[200:]))
    assert (many.counts, many.count) == (one.counts, one.count)
    assert many.sum == pytest.approx(one.sum)


def test_prefix_hashes_are_the_polynomial_of_every_prefix():
    rng = random.Random(4)
    toks = [rng.randrange(50280) for _ in range(5000)]
    h, want = 0, []
    for t in toks:
        h = (h * 1_000_003 + t + 1) % (1 << 64)
        want.append(h)
    assert prefix_hashes(toks).tolist() == want
    assert prefix_hashes(np.asarray(toks, dtype=np.int64)).tolist() == want  # a request's ids
    assert prefix_hashes(toks[:3]).tolist() == want[:3]
    # the items key the cache's dict as the ints they equal (keys are made with either)
    got = prefix_hashes(toks)
    assert all(hash(got[i]) == hash(want[i]) and got[i] == want[i] for i in range(0, 5000, 7))


def test_text_held_back_for_a_stop_string_is_sent_when_the_choice_is_aborted(model_dirs, load):
    """A stop string no output reaches: its choice's text is held back token by token while
    it might start one; an abort (shutdown's drain timeout) sends it with the end, so the
    text received is that of the token ids received."""
    engine = Engine(load(model_dirs["tiny"]), tokenizer=ByteTokenizer(), max_batch=2)
    req = engine.submit(list(b"hello"), SamplingParams(max_tokens=50, temperature=0,
                                                       stop=["\x00" * 60]))  # fmt: skip
    for _ in range(12):
        engine.step()
    engine.shutdown(timeout=0)
    ids, text, reason = [], "", None
    for ev in req.events(timeout=5):
        ids += ev.token_ids
        text += ev.text
        reason = ev.finish_reason or reason
    assert reason == "abort" and ids
    assert text == ByteTokenizer().decode(ids)


class _FailingTokenizer:
    """Bytes (not a ByteTokenizer: text streams decode it as any tokenizer) whose decode
    fails from its eleventh call on."""

    vocab_size = 256

    def __init__(self) -> None:
        self.calls = 0

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, ids) -> str:
        self.calls += 1
        if self.calls > 10:
            raise RuntimeError("decode failed")
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


def test_a_tokenizer_that_fails_ends_the_request_with_an_error(model_dirs, load):
    """A decode that raises while a choice's text is made: the request ends with an error
    event naming it (its held-back text is not decoded again on the way out), and the
    engine serves the next request."""
    engine = Engine(load(model_dirs["tiny"]), tokenizer=_FailingTokenizer(), max_batch=2)
    req = engine.submit(list(b"hello"), SamplingParams(max_tokens=20, temperature=0,
                                                       stop=["\x00" * 8]))  # fmt: skip
    run_all(engine, [req])
    last = list(req.events(timeout=5))[-1]
    assert last.finish_reason == "error" and "decode failed" in last.error
    engine.tokenizer = ByteTokenizer()
    again = engine.submit(list(b"hi"), SamplingParams(max_tokens=3, temperature=0))
    run_all(engine, [again])
    assert list(again.events(timeout=5))[-1].finish_reason == "length"
