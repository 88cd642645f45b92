"""generate / stream / sampling / CUDA-graph decode / `mambakit generate`.

Oracles: argmax over repeated full forwards (greedy), hand-computed distributions
(top-p, min-p), the closed form of the repetition penalty, and each prompt run
alone (ragged batches).
"""

from __future__ import annotations

import importlib
import math

import pytest
import torch

from mambakit import MambaBackbone, MambaConfig, MambaLM
from mambakit.inference import (
    CUDAGraphStep,
    SamplingConfig,
    apply_repetition_penalty,
    filter_logits,
    generate,
    sample,
    stream,
)
from mambakit.inference.generate import _prefill
from mambakit.inference.prompts import parse_prompts
from mambakit.inference.sampling import gumbel_noise, row_keys

V = 40


def make_lm(randomize, device="cpu", **kw) -> MambaLM:
    """A tiny LM whose next-token distributions are spread out (no near-ties, not peaked)."""
    torch.manual_seed(0)
    fields = dict(d_model=16, n_layers=2, vocab_size=V, d_state=4, d_conv=4)
    fields.update(kw)
    cfg = MambaConfig(tie_embeddings=False, **fields)
    model = randomize(MambaLM(cfg))
    with torch.no_grad():
        model.backbone.embeddings.weight.normal_(0, 1.0)
        model.lm_head.weight.normal_(0, 0.5)
    return model.to(device).eval()


@pytest.fixture
def lm(randomize):
    return make_lm(randomize)


def greedy_oracle(model, ids: torch.Tensor, n: int, penalty: float = 1.0) -> torch.Tensor:
    """Argmax over a full forward of the whole sequence so far, n times."""
    x = ids
    with torch.no_grad():
        for _ in range(n):
            logits = model(x).logits[:, -1].float()
            if penalty != 1.0:
                seen = torch.zeros_like(logits, dtype=torch.bool).scatter(1, x, True)
                pen = torch.where(logits > 0, logits / penalty, logits * penalty)
                logits = torch.where(seen, pen, logits)
            x = torch.cat([x, logits.argmax(-1, keepdim=True)], dim=1)
    return x


def prompts_of(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, V, (n,), generator=g) for n in lengths]


# --- greedy and sampling -------------------------------------------------------------


def test_greedy_equals_argmax_of_full_forwards(lm):
    ids = torch.randint(0, V, (3, 5), generator=torch.Generator().manual_seed(0))
    out = generate(lm, ids, max_new_tokens=12, temperature=0)
    assert out.dtype == torch.int64 and out.shape == (3, 17)
    torch.testing.assert_close(out, greedy_oracle(lm, ids, 12), rtol=0, atol=0)
    # the model's thin method and int32 prompts give the same
    torch.testing.assert_close(lm.generate(ids.int(), 12, temperature=0), out, rtol=0, atol=0)


@pytest.mark.parametrize(
    "device, dtype, backend",
    [
        ("cpu", torch.float32, None),
        ("cpu", torch.float32, "triton"),  # the kernels under the interpreter
        pytest.param("cuda", torch.bfloat16, None, marks=pytest.mark.gpu),
    ],
    ids=["cpu", "cpu-triton", "cuda-bf16"],
)
def test_last_logits_equal_the_forwards_last_position(
    randomize, device, dtype, backend, monkeypatch
):
    """The prefill's `last_logits` (norm_f and the head on the last position only, one
    fused kernel on the Triton backend; the last block's scan and out_proj on the last
    step alone) gives the full forward's last logits and the same final state, with and
    without documents packed by seq_idx; with autograd on, the unfused path's values."""
    model = make_lm(randomize, device=device, d_model=64, n_layers=3).to(dtype)
    ids = torch.randint(0, V, (3, 9), device=device)
    seq_idx = (torch.arange(9, device=device) >= 4).int().expand(3, 9).contiguous()
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-4)
    whole = []
    for seq in (None, seq_idx):
        with torch.no_grad():
            out = model(ids, seq_idx=seq)  # the reference ops on the CPU
            whole.append(out.logits[:, -1].float())
            if backend is not None:
                monkeypatch.setenv("MAMBAKIT_BACKEND", backend)
            logits, state = model.last_logits(ids, seq_idx=seq)
            monkeypatch.delenv("MAMBAKIT_BACKEND", raising=False)
        assert logits.shape == (3, V) and logits.dtype == out.logits.dtype
        torch.testing.assert_close(logits.float(), whole[-1], **tol)
        exact = device == "cpu" and backend is None  # the same ops: the same bits
        state_tol = dict(rtol=0, atol=0) if exact else dict(rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(state.conv, out.state.conv, **state_tol)
        torch.testing.assert_close(state.ssm, out.state.ssm, **state_tol)
    graded, _ = model.last_logits(ids)
    assert graded.requires_grad
    torch.testing.assert_close(graded.detach().float(), whole[0], **tol)


def test_greedy_with_repetition_penalty_equals_closed_form(lm):
    ids = torch.randint(0, V, (2, 6), generator=torch.Generator().manual_seed(3))
    out = generate(lm, ids, max_new_tokens=10, temperature=0, repetition_penalty=1.7)
    torch.testing.assert_close(out, greedy_oracle(lm, ids, 10, penalty=1.7), rtol=0, atol=0)
    assert not torch.equal(out, generate(lm, ids, max_new_tokens=10, temperature=0))


def test_seeded_sampling_is_reproducible_and_leaves_global_rng(lm):
    ids = torch.randint(0, V, (2, 4), generator=torch.Generator().manual_seed(0))
    rng = torch.get_rng_state()
    a = generate(lm, ids, max_new_tokens=16, seed=123)
    b = generate(lm, ids, max_new_tokens=16, seed=123)
    c = generate(lm, ids, max_new_tokens=16, seed=124)
    assert torch.equal(torch.get_rng_state(), rng)
    assert torch.equal(a, b)
    assert not torch.equal(a[:, 4:], c[:, 4:])
    # no seed: the global RNG decides, so torch.manual_seed makes it repeatable
    torch.manual_seed(5)
    d = generate(lm, ids, max_new_tokens=16)
    torch.manual_seed(5)
    assert torch.equal(d, generate(lm, ids, max_new_tokens=16))


def test_top_k_1_equals_greedy(lm):
    ids = torch.randint(0, V, (3, 5), generator=torch.Generator().manual_seed(2))
    greedy = generate(lm, ids, max_new_tokens=10, temperature=0)
    assert torch.equal(generate(lm, ids, max_new_tokens=10, top_k=1, seed=9), greedy)
    assert torch.equal(generate(lm, ids, 10, top_k=1, temperature=2.5, seed=1), greedy)


def test_a_vanishing_temperature_draws_greedily(lm):
    """Temperatures toward 0 tend to argmax: 1e-3 with a seed already gives it here, and
    ones so small that the logits divided by them overflow float32 (1e-50, 1e-300) give it
    too, not the first token that overflowed."""
    ids = torch.randint(0, V, (3, 5), generator=torch.Generator().manual_seed(2))
    greedy = generate(lm, ids, max_new_tokens=10, temperature=0)
    for t in (1e-3, 1e-50, 1e-300):
        assert torch.equal(generate(lm, ids, 10, temperature=t, seed=4), greedy), t


def test_stream_yields_what_generate_returns(lm):
    ids = torch.randint(0, V, (2, 3), generator=torch.Generator().manual_seed(4))
    kw = dict(max_new_tokens=9, top_k=8, top_p=0.9, min_p=0.05, repetition_penalty=1.2, seed=3)
    out = generate(lm, ids, **kw)
    with torch.enable_grad():
        toks = []
        for t in stream(lm, ids, **kw):
            assert torch.is_grad_enabled()  # the generator does not leak no_grad
            assert t.shape == (2,) and t.dtype == torch.int64
            toks.append(t)
    assert torch.equal(torch.stack(toks, 1), out[:, 3:])
    assert torch.equal(torch.stack(list(lm.stream(ids, **kw)), 1), out[:, 3:])


def test_max_new_tokens_zero_returns_the_prompt(lm):
    ids = torch.randint(0, V, (2, 3))
    assert torch.equal(generate(lm, ids, max_new_tokens=0), ids)
    assert list(stream(lm, ids, max_new_tokens=0)) == []


# --- ragged prompts --------------------------------------------------------------------


@pytest.mark.parametrize("chunk", [8192, 2], ids=["one-forward", "chunked"])
def test_ragged_prefill_state_equals_each_prompt_alone(lm, chunk):
    rows = prompts_of([1, 3, 7, 2])
    with torch.no_grad():
        logits, state = _prefill(lm, parse_prompts(rows, None, torch.device("cpu"), V), chunk)
        for b, r in enumerate(rows):
            out = lm(r[None])
            torch.testing.assert_close(logits[b], out.logits[0, -1], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(state.conv[:, b], out.state.conv[:, 0], rtol=0, atol=1e-5)
            torch.testing.assert_close(state.ssm[:, b], out.state.ssm[:, 0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "kw",
    [dict(temperature=0), dict(seed=11, top_k=12), dict(seed=5, top_p=0.8, repetition_penalty=1.3)],
    ids=["greedy", "top_k", "top_p-rep"],
)
def test_ragged_batch_equals_each_prompt_alone(lm, kw):
    lengths = [1, 4, 9, 2]
    rows = prompts_of(lengths)
    out = generate(lm, rows, max_new_tokens=8, **kw)
    assert isinstance(out, list) and [len(o) for o in out] == [n + 8 for n in lengths]
    for b, r in enumerate(rows):
        alone_kw = dict(kw, seed=kw["seed"] + b) if "seed" in kw else kw
        alone = generate(lm, r[None], max_new_tokens=8, **alone_kw)[0]
        torch.testing.assert_close(out[b], alone, rtol=0, atol=0)
    # right-padded tensor + prompt_lengths, and lists of ints, give the same
    padded = torch.full((4, 9), 7)
    for b, r in enumerate(rows):
        padded[b, : len(r)] = r
    same = generate(lm, padded, max_new_tokens=8, prompt_lengths=lengths, **kw)
    assert all(torch.equal(a, b) for a, b in zip(same, out))
    same = generate(lm, [r.tolist() for r in rows], max_new_tokens=8, **kw)
    assert all(torch.equal(a, b) for a, b in zip(same, out))


def test_prompt_lengths_all_shorter_than_the_padding_equal_the_prompts_alone(lm):
    """A right-padded batch whose prompts share one length below its width: the padding is
    no part of any prompt (greedy against each prompt run alone)."""
    rows = prompts_of([3, 3], seed=3)  # a draw whose greedy tokens the filler changes
    padded = torch.full((2, 8), 7)
    padded[:, :3] = torch.stack(rows)
    out = generate(lm, padded, max_new_tokens=6, prompt_lengths=[3, 3], temperature=0)
    for b, r in enumerate(rows):
        alone = generate(lm, r[None], max_new_tokens=6, temperature=0)[0]
        assert torch.equal(out[b], alone), b


# --- eos -------------------------------------------------------------------------------


def test_eos_row_repeats_eos_and_generation_stops_when_all_done(lm):
    ids = torch.randint(0, V, (3, 4), generator=torch.Generator().manual_seed(6))
    free = generate(lm, ids, max_new_tokens=40, temperature=0)[:, 4:]
    eos = int(free[0, 2])
    k0 = int((free[0] == eos).nonzero()[0])  # row 0 finishes at step k0 <= 2
    out = generate(lm, ids, max_new_tokens=40, temperature=0, eos_token_id=eos)[:, 4:]
    finished_rows = [b for b in range(3) if (free[b] == eos).any()]
    for b in range(3):
        if b in finished_rows:
            k = int((free[b] == eos).nonzero()[0])
            assert torch.equal(out[b, :k], free[b, :k])
            assert (out[b, k:] == eos).all()
        else:
            assert torch.equal(out[b], free[b, : out.shape[1]])
    if len(finished_rows) < 3:
        assert out.shape[1] == 40
    # one row: stops right after its eos, in generate and in stream
    one = generate(lm, ids[:1], max_new_tokens=40, temperature=0, eos_token_id=eos)
    assert one.shape == (1, 4 + k0 + 1) and int(one[0, -1]) == eos
    toks = list(stream(lm, ids[:1], max_new_tokens=40, temperature=0, eos_token_id=eos))
    assert torch.equal(torch.cat(toks), one[0, 4:])


def test_eos_in_seeded_sampling_batch(lm):
    ids = torch.randint(0, V, (4, 3), generator=torch.Generator().manual_seed(8))
    free = generate(lm, ids, max_new_tokens=60, seed=2, temperature=1.5)[:, 3:]
    eos = int(free[1, 5])
    out = generate(lm, ids, max_new_tokens=60, seed=2, temperature=1.5, eos_token_id=eos)[:, 3:]
    for b in range(4):
        hits = (free[b, : out.shape[1]] == eos).nonzero()
        k = int(hits[0]) if len(hits) else out.shape[1]
        assert torch.equal(out[b, :k], free[b, :k])
        assert (out[b, k:] == eos).all()


# --- sampling functions ------------------------------------------------------------------


def test_top_p_and_min_p_masks_match_hand_computed_distribution():
    probs = torch.tensor([[0.10, 0.50, 0.15, 0.25]])
    logits = probs.log()

    def dist(**kw):
        return torch.softmax(filter_logits(logits, SamplingConfig(**kw)), -1)[0]

    # nucleus 0.7: 0.5 (before: 0) and 0.25 (before: 0.5 < 0.7) stay; 0.15 (before 0.75) goes
    torch.testing.assert_close(dist(top_p=0.7), torch.tensor([0, 2 / 3, 0, 1 / 3]))
    torch.testing.assert_close(dist(top_p=0.75), torch.tensor([0, 2 / 3, 0, 1 / 3]))
    torch.testing.assert_close(dist(top_p=0.76), torch.tensor([0, 0.5, 0.15, 0.25]) / 0.9)
    torch.testing.assert_close(dist(top_p=0.01), torch.tensor([0.0, 1, 0, 0]))
    # min-p 0.25: threshold 0.125 keeps 0.5, 0.25, 0.15
    torch.testing.assert_close(dist(min_p=0.25), torch.tensor([0, 0.5, 0.15, 0.25]) / 0.9)
    torch.testing.assert_close(dist(min_p=0.31), torch.tensor([0, 2 / 3, 0, 1 / 3]))
    torch.testing.assert_close(dist(top_k=3, min_p=0.1), torch.tensor([0, 0.5, 0.15, 0.25]) / 0.9)
    # temperature 2: softmax(log p / 2) ~ sqrt(p)
    s = probs.sqrt()
    torch.testing.assert_close(dist(temperature=2.0), (s / s.sum())[0])


def test_sampling_frequencies_follow_the_filtered_distribution():
    probs = torch.tensor([0.10, 0.50, 0.15, 0.25, 0.0])
    logits = probs.clamp(min=1e-30).log().expand(20000, 5)
    step = torch.zeros(1, dtype=torch.int64)
    seeds = torch.arange(20000)
    for kw, want in [
        (dict(), probs),
        (dict(top_p=0.7), torch.tensor([0, 2 / 3, 0, 1 / 3, 0])),
        (dict(min_p=0.25, top_k=4), torch.tensor([0, 0.5, 0.15, 0.25, 0]) / 0.9),
    ]:
        tok = sample(logits, SamplingConfig(**kw), seeds, step)
        freq = torch.bincount(tok, minlength=5).float() / 20000
        sigma = (want * (1 - want) / 20000).sqrt()
        assert ((freq - want).abs() <= 4 * sigma + 1e-9).all(), (kw, freq, want)


def test_noise_is_finite_and_an_improbable_or_filtered_token_is_not_drawn():
    """The uniforms behind the Gumbel noise stay inside (0, 1) at the hash's extremes (24
    bits put the largest at exactly 1: noise +inf, drawn whatever its probability, or NaN
    beside a filtered-out token's -inf); seed 467143 drew token 20 at step 0 that way."""
    from mambakit.inference.sampling import uniform

    u = uniform(torch.tensor([0, 1, (1 << 32) - 2, (1 << 32) - 1]))
    assert (u > 0).all() and (u < 1).all()
    assert torch.isfinite(-torch.log(-torch.log(u))).all()
    logits = torch.zeros(1, 64)
    logits[0, 0], logits[0, 20] = 20.0, -20.0  # p(20) ~ 1e-17; p(0) ~ 1
    seeds, step = torch.tensor([467143]), torch.zeros(1, dtype=torch.int64)
    for kw in [dict(), dict(top_p=0.5), dict(min_p=0.5), dict(temperature=0.1, top_p=0.9)]:
        assert sample(logits, SamplingConfig(**kw), seeds, step).item() == 0, kw


def test_candidate_sampling_equals_full_vocabulary_gumbel_max():
    """top-k / sorted paths draw exactly what Gumbel-max over the filtered full vocabulary draws."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 50, generator=g) * 2
    seeds = torch.arange(64) * 7919
    step = torch.tensor([3])
    noise = gumbel_noise(row_keys(seeds, step), torch.arange(50))
    for kw in [dict(top_k=7), dict(top_p=0.8), dict(top_k=20, top_p=0.9, min_p=0.05)]:
        cfg = SamplingConfig(temperature=0.7, **kw)
        want = (filter_logits(logits, cfg) + noise).argmax(-1)
        assert torch.equal(sample(logits, cfg, seeds, step), want), kw


def test_repetition_penalty_closed_form():
    logits = torch.tensor([[2.0, -1.0, 0.0, 3.0, -4.0]])
    seen = torch.tensor([[True, True, True, False, False]])
    out = apply_repetition_penalty(logits, seen, 2.0)
    torch.testing.assert_close(out, torch.tensor([[1.0, -2.0, 0.0, 3.0, -4.0]]))
    out = apply_repetition_penalty(logits, seen, 0.5)  # < 1 rewards repeats
    torch.testing.assert_close(out, torch.tensor([[4.0, -0.5, 0.0, 3.0, -4.0]]))


def test_float64_logits_are_not_rounded_to_float32_by_the_penalty():
    # the top two differ below f32's resolution: a float64 model's greedy choice must not
    # change when a penalty on an unrelated token is on (nor sampling round them to ties)
    logits = torch.tensor([[1.0, 1.0 + 1e-12, -3.0]], dtype=torch.float64)
    seen = torch.tensor([[False, False, True]])
    assert apply_repetition_penalty(logits, seen, 1.3).dtype == torch.float64
    assert sample(logits, SamplingConfig(temperature=0)).item() == 1
    greedy = SamplingConfig(temperature=0, repetition_penalty=1.3)
    assert sample(logits, greedy, seen=seen).item() == 1
    assert filter_logits(logits, SamplingConfig(top_k=1))[0, 1] == 1.0 + 1e-12


# --- bad arguments ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw, err, match",
    [
        (dict(max_new_tokens=-1), ValueError, "max_new_tokens"),
        (dict(max_new_tokens=2.5), TypeError, "max_new_tokens"),
        (dict(temperature=-0.1), ValueError, "temperature"),
        (dict(temperature=float("nan")), ValueError, "temperature"),
        (dict(top_p=0.0), ValueError, "top_p"),
        (dict(top_p=1.5), ValueError, "top_p"),
        (dict(top_k=-1), ValueError, "top_k"),
        (dict(min_p=1.0), ValueError, "min_p"),
        (dict(repetition_penalty=0.0), ValueError, "repetition_penalty"),
        (dict(eos_token_id=V), ValueError, "eos_token_id"),
        (dict(eos_token_id=-2), ValueError, "eos_token_id"),
        (dict(seed=-1), ValueError, "seed"),
        (dict(seed="x"), TypeError, "seed"),
        (dict(seed=[1, 2, 3]), ValueError, "seed"),
        (dict(cuda_graph="yes"), ValueError, "cuda_graph"),
        (dict(cuda_graph=True), ValueError, "cuda_graph"),
        (dict(prompt_lengths=[3]), ValueError, "prompt_lengths"),
        (dict(prompt_lengths=[0, 3]), ValueError, "prompt_lengths"),
        (dict(prefill_chunk=0), ValueError, "prefill_chunk"),
    ],
)
def test_bad_arguments_raise(lm, kw, err, match):
    ids = torch.randint(0, V, (2, 3))
    with pytest.raises(err, match=match):
        generate(lm, ids, **kw)
    with pytest.raises(err, match=match):
        stream(lm, ids, **kw)  # checked at the call, before the first token


@pytest.mark.parametrize(
    "ids, err, match",
    [
        (torch.rand(2, 3), TypeError, "input_ids"),
        (torch.zeros(3, dtype=torch.int64), ValueError, "2-d"),
        (torch.zeros(2, 0, dtype=torch.int64), ValueError, "input_ids"),
        (torch.full((1, 3), V), ValueError, r"\[0, 40\)"),
        ([torch.tensor([1]), torch.tensor([], dtype=torch.int64)], ValueError, r"input_ids\[1\]"),
        ([[1, 2], [0.5]], TypeError, r"input_ids\[1\]"),
        ([], ValueError, "at least one prompt"),
        ("hello", TypeError, "input_ids"),
    ],
    ids=["float", "1-d", "empty", "out-of-vocab", "empty-row", "float-row", "no-rows", "str"],
)
def test_bad_prompts_raise(lm, ids, err, match):
    with pytest.raises(err, match=match):
        generate(lm, ids, max_new_tokens=2)


# --- CUDAGraphStep on the CPU (eager) ---------------------------------------------------


def test_cuda_graph_step_api_runs_eagerly_on_cpu():
    torch.manual_seed(0)
    bb = MambaBackbone(MambaConfig(d_model=16, n_layers=2, input_dim=5, d_state=4)).eval()
    actor = CUDAGraphStep(bb, batch_size=3)
    state = bb.init_state(3)
    xs = torch.randn(4, 3, 5)
    with torch.no_grad():
        for x in xs:
            ref, state = bb.step(x, state)
            torch.testing.assert_close(actor(x), ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(actor.state.ssm, state.ssm, rtol=1e-5, atol=1e-6)
    actor.state.reset_(torch.tensor([True, False, False]))
    assert actor.state.ssm[:, 0].abs().max() == 0 and actor.state.ssm[:, 1].abs().max() > 0
    with pytest.raises(ValueError, match="shape"):
        actor(torch.randn(2, 5))


class _FakeGraph:
    """Stands in for torch.cuda.CUDAGraph on the CPU: replay() re-runs the captured fn."""

    def __init__(self, fn):
        self.replay = fn


def fake_graphs(monkeypatch, gen, min_capacity: int) -> list:
    """generate's graph path on the CPU: captures by a stand-in whose replay reruns the call
    (after a warm-up that runs it for real on the static buffers, as the real one does);
    returns the list the captured calls go into."""
    captures = []

    def fake_capture(fn, warmup=2, pool=None):
        for _ in range(warmup):
            fn()
        captures.append(fn)
        return _FakeGraph(fn), None

    monkeypatch.setattr(gen, "capture", fake_capture)
    monkeypatch.setattr(gen, "use_cuda_graph", lambda flag, device: flag is not False)
    monkeypatch.setattr(gen, "graph_cache", lambda model, _c={"pool": None}: _c)
    monkeypatch.setattr(gen, "GRAPH_MIN_CAPACITY", min_capacity)
    return captures


def test_graph_decode_logic_on_cpu_with_a_fake_graph(lm, monkeypatch):
    """The cached-graph path (warm-up that dirties the buffers, reload, reuse, recapture
    for more tokens, a second interleaved run) with a stand-in graph."""
    gen = importlib.import_module("mambakit.inference.generate")  # the module, not the function

    captures = fake_graphs(monkeypatch, gen, min_capacity=16)
    rows = prompts_of([2, 6, 3])
    kw = dict(seed=4, top_k=9, repetition_penalty=1.2, eos_token_id=5)
    eager = generate(lm, rows, max_new_tokens=20, cuda_graph=False, **kw)
    assert not captures
    for _ in range(2):  # the second run reuses the captured graphs (prefill and decode)
        out = generate(lm, rows, max_new_tokens=20, cuda_graph=True, **kw)
        assert all(torch.equal(a, b) for a, b in zip(out, eager))
    assert len(captures) == 2
    more = generate(lm, rows, max_new_tokens=40, cuda_graph=True, **kw)  # over capacity (32)
    assert len(captures) == 3  # a new decode graph; the prefill's is reused
    assert all(torch.equal(a[: len(b)], b) for a, b in zip(more, eager))
    # two interleaved streams of the same shape must not share buffers
    s1 = stream(lm, rows, max_new_tokens=20, cuda_graph=True, **kw)
    s2 = stream(lm, rows, max_new_tokens=20, cuda_graph=True, **kw)
    t1, t2 = zip(*zip(s1, s2))
    want = [e[len(r) :] for e, r in zip(eager, rows)]
    for toks in (t1, t2):
        got = torch.stack(toks, 1)
        assert all(torch.equal(got[b, : len(want[b])], want[b]) for b in range(3))


def test_a_run_longer_than_its_first_buffer_grows_it(lm, monkeypatch):
    """A decoder holds FIRST_CAPACITY new tokens at first and doubles its room as a run goes
    on (eager, and through the graph path with a stand-in graph): the tokens equal those of
    one buffer of the whole length; a limit far past what memory holds, cut short by the
    end token, allocates no buffer of its size."""
    gen = importlib.import_module("mambakit.inference.generate")
    rows = prompts_of([2, 6, 3])
    kw = dict(seed=4, top_k=9, repetition_penalty=1.2, eos_token_id=5)
    whole = generate(lm, rows, max_new_tokens=23, cuda_graph=False, **kw)
    monkeypatch.setattr(gen, "FIRST_CAPACITY", 4)
    assert all(
        torch.equal(a, b) for a, b in zip(generate(lm, rows, 23, cuda_graph=False, **kw), whole)
    )
    streamed = torch.stack(list(stream(lm, rows, max_new_tokens=23, cuda_graph=False, **kw)), 1)
    assert all(torch.equal(streamed[b, : len(w) - len(r)], w[len(r) :])
               for b, (w, r) in enumerate(zip(whole, rows)))  # fmt: skip
    captures = fake_graphs(monkeypatch, gen, min_capacity=2)
    out = generate(lm, rows, max_new_tokens=23, cuda_graph=True, **kw)
    assert all(torch.equal(a, b) for a, b in zip(out, whole))
    assert len(captures) == 1 + 4  # the prefill; decoders of room 4, 8, 16, 23 (32)
    again = generate(lm, rows, max_new_tokens=23, cuda_graph=True, **kw)
    assert all(torch.equal(a, b) for a, b in zip(again, whole))
    assert len(captures) == 1 + 4  # the grown decoder was cached: nothing captured again
    first = greedy_oracle(lm, rows[1][None], 3)[0, -3:]
    end = int(first[2])  # greedy draws it within three tokens
    got = generate(lm, rows[1][None], max_new_tokens=10**15, temperature=0, eos_token_id=end,
                   cuda_graph=False)  # fmt: skip
    assert got.shape[1] <= len(rows[1]) + 3 and int(got[0, -1]) == end


def test_bucketed_prefill_equals_the_prompts_alone(lm):
    """Prompts left-padded to their power-of-two bucket (filler as document 0) give each
    prompt's own last logits and final state."""
    gen = importlib.import_module("mambakit.inference.generate")
    rows = prompts_of([5, 9, 1])
    prompts = parse_prompts(rows, None, torch.device("cpu"), V)
    with torch.no_grad():
        logits, state = gen._prefill_bucketed(lm, prompts, graphs=False)
        assert prompts.bucket == 16 and logits.shape == (3, V)
        for b, r in enumerate(rows):
            out = lm(r[None], state=None)
            torch.testing.assert_close(logits[b], out.logits[0, -1], rtol=1e-5, atol=1e-5)
            for part in ("conv", "ssm"):
                got, want = getattr(state, part)[:, b], getattr(out.state, part)[:, 0]
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_prefill_graph_cache_keeps_the_newest(lm, monkeypatch):
    gen = importlib.import_module("mambakit.inference.generate")
    captures = []

    def fake_capture(fn, warmup=2, pool=None):
        fn()
        captures.append(fn)
        return _FakeGraph(fn), None

    cache = {"pool": None}
    monkeypatch.setattr(gen, "capture", fake_capture)
    monkeypatch.setattr(gen, "graph_cache", lambda model: cache)
    monkeypatch.setattr(gen, "PREFILL_GRAPHS_KEPT", 2)
    with torch.no_grad():
        for n in (3, 20, 40, 5):  # buckets 16, 32, 64 (16 evicted), 16 again (32 evicted)
            prompts = parse_prompts(prompts_of([n]), None, torch.device("cpu"), V)
            logits, _ = gen._prefill_bucketed(lm, prompts, graphs=True)
            want = lm(prompts.ids).logits[:, -1]
            torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-5)
    assert len(captures) == 4
    assert sorted(k[2] for k in cache if k != "pool") == [16, 64]


# --- CLI -------------------------------------------------------------------------------


def _run_cli(argv, capsys):
    from mambakit.cli import main

    rc = main(["generate", *argv])
    return rc, capsys.readouterr()


def test_cli_generate_from_a_run_folder(tmp_path, capsys):
    torch.manual_seed(0)
    model = MambaLM(MambaConfig(d_model=16, n_layers=2, vocab_size=256, d_state=4))
    run = tmp_path / "runs" / "demo"
    model.save_pretrained(run / "step_0000007")
    (run / "step_0000007" / "tokenizer.txt").write_text("byte\n")
    (run / "latest").write_text("step_0000007\n")
    argv = ["--model", str(run), "--prompt", "héllo", "--max-new-tokens", "12"]
    rc, cap = _run_cli([*argv, "--seed", "1", "--device", "cpu", "--eos-token-id", "-1"], capsys)
    assert rc == 0
    assert cap.out.startswith("héllo") and "tokens/s" in cap.err and "12 tokens" in cap.err
    # the text is the byte decoding of what generate gives with the same settings
    ids = torch.tensor([list("héllo".encode())])
    new = generate(model, ids, max_new_tokens=12, seed=1)[0, ids.shape[1] :]
    assert cap.out == "héllo" + bytes(new.tolist()).decode("utf-8", errors="replace") + "\n"
    # the checkpoint folder itself works too (byte vocabulary, no tokenizer file needed)
    (run / "step_0000007" / "tokenizer.txt").unlink()
    argv[1] = str(run / "step_0000007")
    rc, cap = _run_cli([*argv, "--temperature", "0", "--top-k", "5", "--device", "cpu"], capsys)
    assert rc == 0 and cap.out.startswith("héllo")


def test_cli_generate_with_a_tokenizer_json(tmp_path, capsys):
    tokenizers = pytest.importorskip("tokenizers")
    words = [f"w{i}" for i in range(V - 1)]
    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(words)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.decoder = tokenizers.decoders.WordPiece()
    torch.manual_seed(0)
    model = MambaLM(MambaConfig(d_model=16, n_layers=2, vocab_size=V, d_state=4))
    model.save_pretrained(tmp_path / "ckpt")
    argv = ["--model", str(tmp_path / "ckpt"), "--prompt", "w1 w2", "--max-new-tokens", "5"]
    rc, cap = _run_cli([*argv, "--device", "cpu"], capsys)
    assert rc == 2 and "--tokenizer" in cap.err
    tok.save(str(tmp_path / "ckpt" / "tokenizer.json"))
    rc, cap = _run_cli([*argv, "--device", "cpu", "--top-p", "0.9", "--seed", "0"], capsys)
    assert rc == 0 and cap.out.startswith("w1 w2") and "tokens/s" in cap.err


def test_text_stream_holds_back_incomplete_utf8():
    from mambakit.cli.generate import TextStream
    from mambakit.training.data import ByteTokenizer

    ts = TextStream(ByteTokenizer(), [104])
    pieces = [ts.push(b) for b in "é€x".encode()]
    assert pieces == ["", "é", "", "", "€", "x"]
    assert ts.push(0xC3) == "" and ts.flush() == "\ufffd"


# --- GPU: graph replay == eager decode -------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 8])
def test_graph_replay_equals_eager_decode_greedy(randomize, batch):
    model = make_lm(randomize, device="cuda", d_model=64, n_layers=3, vocab_size=V)
    ids = torch.randint(0, V, (batch, 7), device="cuda", generator=None)
    eager = generate(model, ids, max_new_tokens=48, temperature=0, cuda_graph=False)
    graph = generate(model, ids, max_new_tokens=48, temperature=0, cuda_graph=True)
    torch.testing.assert_close(graph, eager, rtol=0, atol=0)
    again = generate(model, ids, max_new_tokens=48, temperature=0, cuda_graph=True)  # cached
    torch.testing.assert_close(again, eager, rtol=0, atol=0)
    toks = torch.stack(list(stream(model, ids, max_new_tokens=48, temperature=0)), 1)
    torch.testing.assert_close(toks, eager[:, 7:], rtol=0, atol=0)


@pytest.mark.gpu
def test_graph_replay_equals_eager_decode_sampled_ragged_eos(randomize):
    model = make_lm(randomize, device="cuda", d_model=64, n_layers=3, vocab_size=V)
    rows = [r.cuda() for r in prompts_of([1, 5, 12, 3, 8])]
    kw = dict(max_new_tokens=40, seed=3, top_k=10, top_p=0.95, repetition_penalty=1.1)
    eager = generate(model, rows, cuda_graph=False, **kw)
    graph = generate(model, rows, cuda_graph=True, **kw)
    assert all(torch.equal(a, b) for a, b in zip(graph, eager))
    eos = int(eager[0][-30])
    eager = generate(model, rows, cuda_graph=False, eos_token_id=eos, **kw)
    graph = generate(model, rows, cuda_graph=True, eos_token_id=eos, **kw)
    assert all(torch.equal(a, b) for a, b in zip(graph, eager))


@pytest.mark.gpu
def test_cuda_graph_step_backbone_equals_eager_step():
    torch.manual_seed(0)
    cfg = MambaConfig(d_model=64, n_layers=3, input_dim=11, d_state=8)
    bb = MambaBackbone(cfg).cuda().eval()
    actor = CUDAGraphStep(bb, batch_size=4)
    assert actor.graph is not None
    state = bb.init_state(4)
    with torch.no_grad():
        for t in range(6):
            x = torch.randn(4, 11, device="cuda")
            ref, state = bb.step(x, state)
            torch.testing.assert_close(actor(x), ref)  # cuBLAS may pick other kernels in a graph
            if t == 2:
                done = torch.tensor([False, True, False, False], device="cuda")
                actor.state.reset_(done)
                state.reset_(done)
    torch.testing.assert_close(actor.state.ssm, state.ssm)
    assert math.isfinite(float(actor.state.ssm.abs().sum()))


@pytest.mark.gpu
def test_cuda_graph_step_follows_parameter_updates_after_capture():
    """A policy trains in place between rollouts: the captured step must run the new
    weights, including A = -exp(A_log), D and the dt bias it derives and caches."""
    torch.manual_seed(0)
    cfg = MambaConfig(d_model=64, n_layers=2, input_dim=11, d_state=8)
    bb = MambaBackbone(cfg).cuda().eval()
    actor = CUDAGraphStep(bb, batch_size=4)
    x = torch.randn(4, 11, device="cuda")
    actor(x)
    with torch.no_grad():
        for p in bb.parameters():  # an optimizer step's worth, A_log, D and dt bias included
            p.add_(torch.randn_like(p) * 0.05)
    actor.reset()
    # the graph runs first: an eager step would refresh the layers' caches itself
    outs = [actor(x).clone() for _ in range(3)]
    state = bb.init_state(4)
    with torch.no_grad():
        for out in outs:
            ref, state = bb.step(x, state)
            torch.testing.assert_close(out, ref)


@pytest.mark.gpu
def test_graph_generate_follows_parameter_updates(randomize):
    """Cached prefill and decode graphs run the weights of the call, not those of the capture."""
    model = make_lm(randomize, device="cuda", d_model=64, n_layers=3, vocab_size=V)
    ids = torch.randint(0, V, (2, 7), device="cuda")
    generate(model, ids, max_new_tokens=16, temperature=0, cuda_graph=True)  # captured
    with torch.no_grad():
        for mixer in (layer.mixer for layer in model.backbone.layers):
            mixer.A_log.add_(0.5)
            mixer.D.mul_(-1.0)
            mixer.dt_proj.bias.sub_(1.0)
    # the graphs run first: an eager run would refresh the layers' caches itself
    graph = generate(model, ids, max_new_tokens=16, temperature=0, cuda_graph=True)
    eager = generate(model, ids, max_new_tokens=16, temperature=0, cuda_graph=False)
    torch.testing.assert_close(graph, eager, rtol=0, atol=0)
