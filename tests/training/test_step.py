"""One optimizer step (training/step.py): learning, TBPTT == BPTT, gradient
accumulation, the optimizer's groups and schedule, precision guards (f16 loss scaling,
non-finite steps), and the version counters a fused optimizer leaves behind.

Tiny models (d_model 16, 2 layers) on CPU; gradient comparisons run in float64.
"""

from __future__ import annotations

import math

import pytest
import torch
from training_helpers import (
    ListData,
    V,
    grads_of,
    random_batch,
    tcfg,
    tiny_cfg,
    tiny_lm,
    weights_of,
)

from mambakit import MambaBackbone, MambaLM
from mambakit.training import Trainer, lm_loss
from mambakit.training.optim import WarmupCosine
from mambakit.training.trainer import count_targets


def max_rel_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max() / b[k].abs().max().clamp(min=1e-30)) for k in a)


def forward_backward(model, batches, **cfg_kw) -> tuple[float, dict[str, torch.Tensor]]:
    """One step's loss and the parameter gradients it accumulates (no optimizer step)."""
    trainer = Trainer(model, tcfg(**cfg_kw), ListData(batches), log=lambda s: None)
    loss = trainer._forward_backward(batches)
    return float(loss), grads_of(model)


# -- learning -------------------------------------------------------------------------------


def test_loss_falls_on_a_repeating_pattern():
    """Rows cut at random offsets from a period-7 stream: the next token is a function of
    the current one, so a working engine drives the loss far below ln(V)."""
    g = torch.Generator().manual_seed(0)
    pattern = torch.randperm(V, generator=g)[:7]
    stream = pattern.repeat(200)

    class Stream:
        def next(self):
            starts = torch.randint(0, 7 * 150, (4,), generator=g)
            rows = torch.stack([stream[s : s + 25] for s in starts.tolist()])
            return {"input_ids": rows[:, :-1], "targets": rows[:, 1:]}

    model = tiny_lm()
    trainer = Trainer(
        model, tcfg(steps=20, batch_size=4, seqlen=24, lr=2e-2, warmup_steps=5), Stream()
    )
    losses = [float(trainer.train_step()[0]) for _ in range(20)]
    assert losses[0] > 0.9 * math.log(V)
    assert sum(losses[-3:]) / 3 < 0.3 * losses[0], losses
    assert trainer.step == 20 and trainer.skipped_steps == 0


def test_backbone_with_float_inputs_and_custom_loss():
    """The RL / regression side: a MambaBackbone on float inputs with a loss_fn that returns
    (summed loss, state); with no `targets` every (row, timestep) counts."""
    torch.manual_seed(0)
    cfg = tiny_cfg(input_dim=3)
    model = MambaBackbone(cfg)
    head = torch.nn.Linear(cfg.d_model, 1)
    model.head = head  # trained along with the backbone

    def loss_fn(m, batch, state):
        hidden, state = m(batch["x"], state=state)
        return ((m.head(hidden).squeeze(-1) - batch["y"]) ** 2).sum(), state

    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 16, 3, generator=g)
    y = torch.cumsum(x[..., 0], dim=1) * 0.2  # needs memory across time
    data = ListData([{"x": x, "y": y}])
    trainer = Trainer(
        model, tcfg(steps=20, batch_size=4, seqlen=16, tbptt_len=8, lr=1e-2), data, loss_fn=loss_fn
    )
    first = float(trainer.train_step()[0])
    for _ in range(19):
        last = float(trainer.train_step()[0])
    assert math.isfinite(first) and first > 0
    assert last < 0.5 * first


# -- truncated BPTT -------------------------------------------------------------------------


@pytest.mark.parametrize("tbptt_len", [8, 11], ids=["T8", "T11-uneven"])
def test_tbptt_all_chunks_equals_full_bptt(tbptt_len):
    """tbptt_grad_chunks=0 keeps the graph through every chunk: the same loss and the same
    parameter gradients as one backward over the whole row (float64)."""
    batch = random_batch(B=2, T=32)
    loss_full, g_full = forward_backward(tiny_lm(double=True), [batch])
    loss_tb, g_tb = forward_backward(
        tiny_lm(double=True), [batch], tbptt_len=tbptt_len, tbptt_grad_chunks=0
    )
    assert loss_tb == pytest.approx(loss_full, rel=1e-6)
    assert max_rel_diff(g_tb, g_full) < 1e-9


def test_tbptt_every_k_chunks_equals_full_when_k_covers_the_row():
    batch = random_batch(B=2, T=32)
    _, g_full = forward_backward(tiny_lm(double=True), [batch])
    _, g_k = forward_backward(tiny_lm(double=True), [batch], tbptt_len=8, tbptt_grad_chunks=4)
    assert max_rel_diff(g_k, g_full) < 1e-9


@pytest.mark.parametrize("k", [1, 2])
def test_tbptt_detached_state_changes_gradients_not_the_loss(k):
    """Detaching the carried state every k chunks cuts gradient paths (the gradients differ)
    but the forward pass still carries the state (the loss is identical)."""
    batch = random_batch(B=2, T=32)
    loss_full, g_full = forward_backward(tiny_lm(double=True), [batch])
    loss_tb, g_tb = forward_backward(
        tiny_lm(double=True), [batch], tbptt_len=8, tbptt_grad_chunks=k
    )
    assert loss_tb == pytest.approx(loss_full, rel=1e-6)
    assert max_rel_diff(g_tb, g_full) > 1e-4
    # the carried state still matters in the forward: without it, the loss changes
    starts_fresh = [{k2: v[:, t : t + 8] for k2, v in batch.items()} for t in range(0, 32, 8)]
    model = tiny_lm(double=True)
    with torch.no_grad():
        fresh = sum(float(lm_loss(model, c, None)[0]) for c in starts_fresh) / 64
    assert abs(fresh - loss_full) > 1e-4


def packed_batch(doc_lengths: list[list[int]], seed: int = 3) -> dict[str, torch.Tensor]:
    """Rows of packed documents with the given lengths (summing to T + 1 per row), built
    like PackedRows: -100 where the next token opens a document, seq_idx from 0."""
    g = torch.Generator().manual_seed(seed)
    rows = {"input_ids": [], "targets": [], "seq_idx": []}
    for lengths in doc_lengths:
        tok = torch.randint(0, V, (sum(lengths),), generator=g)
        doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
        targets = tok[1:].clone()
        targets[doc[1:] != doc[:-1]] = -100
        rows["input_ids"].append(tok[:-1])
        rows["targets"].append(targets)
        rows["seq_idx"].append(doc[:-1].to(torch.int32))
    return {k: torch.stack(v) for k, v in rows.items()}


@pytest.mark.parametrize(
    "doc_lengths",
    [
        [[13, 20], [30, 3]],  # boundaries inside chunks
        [[16, 17], [8, 25]],  # a document starts exactly at a chunk boundary (t=16, t=8)
    ],
    ids=["inside-chunk", "at-chunk-start"],
)
def test_tbptt_with_packed_documents_equals_full(doc_lengths):
    """Packed rows: a chunk's carried state belongs to the previous document when the
    chunk starts a new one, so it must not leak into it. Loss and gradients of the chunked
    step (all chunks in the graph) equal the whole-row step."""
    batch = packed_batch(doc_lengths)
    loss_full, g_full = forward_backward(tiny_lm(double=True), [batch])
    loss_tb, g_tb = forward_backward(
        tiny_lm(double=True), [batch], tbptt_len=8, tbptt_grad_chunks=0
    )
    assert loss_tb == pytest.approx(loss_full, rel=1e-6)  # the step loss sums in f32
    assert max_rel_diff(g_tb, g_full) < 1e-9


# -- gradient accumulation ------------------------------------------------------------------


def split_rows(batch, n):
    b = next(iter(batch.values())).shape[0] // n
    return [{k: v[i * b : (i + 1) * b] for k, v in batch.items()} for i in range(n)]


def test_grad_accum_equals_one_big_batch():
    big = random_batch(B=4, T=32, seed=5)
    loss_big, g_big = forward_backward(tiny_lm(double=True), [big], batch_size=4)
    loss_acc, g_acc = forward_backward(
        tiny_lm(double=True), split_rows(big, 2), batch_size=2, grad_accum=2
    )
    assert loss_acc == pytest.approx(loss_big, rel=1e-6)
    assert max_rel_diff(g_acc, g_big) < 1e-9


def test_grad_accum_weights_every_token_equally():
    """Micro-batches with different numbers of valid targets (packed documents give -100s):
    the step's loss is a sum over tokens divided by the step's token count, so splitting
    the rows into micro-batches must not reweight them."""
    big = random_batch(B=4, T=32, seed=6)
    big["targets"][0, :20] = -100  # first micro-batch: 44 targets, second: 64
    loss_big, g_big = forward_backward(tiny_lm(double=True), [big], batch_size=4)
    loss_acc, g_acc = forward_backward(
        tiny_lm(double=True), split_rows(big, 2), batch_size=2, grad_accum=2
    )
    assert loss_acc == pytest.approx(loss_big, rel=1e-6)
    assert max_rel_diff(g_acc, g_big) < 1e-9


@pytest.mark.parametrize("bad", [-1, -7, V, V + 3])
def test_targets_outside_the_vocabulary_are_refused_before_the_step(bad):
    """A target that is neither a token id nor -100 is refused naming it, before the weights
    change (the loss clamps targets, so -1 trained as token 0 and raised nothing)."""
    batch = random_batch()
    batch["targets"][1, 5] = bad
    model = tiny_lm()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = Trainer(model, tcfg(), ListData([batch]))
    with pytest.raises(
        ValueError, match=rf"targets must be token ids in \[0, {V}\) or -100 .*got {bad}"
    ):
        trainer.train_step()
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    batch["targets"][1, 5] = -100  # ignored, as documented
    trainer.train_step()


def test_compile_compiles_the_loss_and_trains_as_eager(monkeypatch):
    """TrainConfig(compile=True) runs the step's loss through torch.compile (dynamo captures
    a graph; the compiled module's loss_sum had been the eager method), with eager's losses.
    Dynamo's graphs run by its eager backend here: inductor's compile takes a minute."""
    import functools

    from torch._dynamo.utils import counters

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    torch._dynamo.reset()
    counters.clear()
    losses = {}
    for compile in (False, True):
        trainer = Trainer(tiny_lm(), tcfg(compile=compile), ListData([random_batch()]))
        losses[compile] = [float(trainer.train_step()[0]) for _ in range(2)]
    assert counters["stats"]["unique_graphs"] >= 1
    assert losses[True] == pytest.approx(losses[False], rel=1e-5)
    trainer.loss_fn = lambda model, batch, state: (model.loss_sum(**batch, state=state)[0] * 0,
                                                   None)  # fmt: skip
    assert float(trainer.train_step()[0]) == 0.0  # a replaced loss_fn is compiled and used


def test_the_default_loss_trains_a_model_without_a_config():
    """lm_loss's path for any module whose forward gives .logits and .state (no .config,
    no loss_sum): the targets are checked without a vocabulary there."""

    class Wrap(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lm = tiny_lm()

        def forward(self, ids, state=None, seq_idx=None):
            return self.lm(ids, state=state, seq_idx=seq_idx)

    trainer = Trainer(Wrap(), tcfg(), ListData([random_batch()]))
    assert math.isfinite(float(trainer.train_step()[0]))


# -- optimizer: groups and schedule ---------------------------------------------------------


def test_weight_decay_groups():
    model = MambaLM(tiny_cfg(tie_embeddings=False))
    trainer = Trainer(model, tcfg(weight_decay=0.07), ListData([random_batch()]))
    names = {id(p): n for n, p in model.named_parameters()}
    decay_of = {}
    for group in trainer.optimizer.param_groups:
        for p in group["params"]:
            assert names[id(p)] not in decay_of, "a parameter in two groups"
            decay_of[names[id(p)]] = group["weight_decay"]
    assert set(decay_of) == set(names.values())  # every parameter is optimized
    no_decay = [
        n
        for n in decay_of
        if n.endswith(("A_log", ".D", "dt_proj.bias", "conv1d.bias"))
        or "norm" in n
        or n.endswith("bias")
    ]
    assert any(n.endswith("A_log") for n in no_decay)  # A_log is 2-d: needs the marker
    for n in no_decay:
        assert decay_of[n] == 0.0, n
    matrices = [n for n in decay_of if n not in no_decay]
    assert {"lm_head.weight", "backbone.embeddings.weight"} <= set(matrices)
    assert any("in_proj.weight" in n for n in matrices)
    assert any("dt_proj.weight" in n for n in matrices)
    for n in matrices:
        assert decay_of[n] == 0.07, n


@pytest.mark.parametrize("preset", ["tiny", "tiny-mamba3"])
def test_a_loaded_checkpoint_has_the_fresh_models_weight_decay_groups(tmp_path, preset):
    """from_pretrained makes its parameters anew (to_empty): A_log (Mamba-1, 2-d) and the B
    and C biases (Mamba-3, 3-d) stay out of weight decay, as in the model it was saved from."""
    from mambakit import MambaConfig
    from mambakit.training.optim import param_groups

    def groups(model):
        names = {id(p): n for n, p in model.named_parameters()}
        return [sorted(names[id(p)] for p in g["params"]) for g in param_groups(model, 0.1)]

    model = MambaLM(MambaConfig.preset(preset, n_layers=1))
    model.save_pretrained(tmp_path / "m")
    loaded = MambaLM.from_pretrained(tmp_path / "m")
    assert groups(loaded) == groups(model)
    no_decay = groups(model)[1]
    assert any(n.endswith(("A_log", "B_bias")) and "layers.0" in n for n in no_decay)
    assert all(getattr(p, "_no_weight_decay", False) == getattr(q, "_no_weight_decay", False)
               for p, q in zip(model.parameters(), loaded.parameters()))  # fmt: skip


def test_tied_head_is_optimized_once():
    model = MambaLM(tiny_cfg(tie_embeddings=True))
    trainer = Trainer(model, tcfg(), ListData([random_batch()]))
    params = [p for g in trainer.optimizer.param_groups for p in g["params"]]
    assert len(params) == len({id(p) for p in params}) == len(list(model.parameters()))


def test_weight_decay_applied_only_to_matrices():
    """With zero gradients AdamW's only effect is decay: decayed matrices shrink by
    lr * wd, the no-decay parameters do not move."""
    model = tiny_lm()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = Trainer(model, tcfg(weight_decay=0.5, lr=0.1), ListData([random_batch()]))

    def zero_loss(m, batch, state):
        out = m(batch["input_ids"], state=state)
        return out.logits.sum() * 0.0, out.state

    trainer.loss_fn = zero_loss
    trainer.train_step()
    for n, p in model.named_parameters():
        if p.dim() >= 2 and not n.endswith("A_log"):
            torch.testing.assert_close(p.detach(), before[n] * (1 - 0.1 * 0.5))
        else:
            assert torch.equal(p.detach(), before[n]), n


def closed_form_lr(step, lr, warmup, total, min_ratio):
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def test_warmup_cosine_schedule():
    lr, warmup, total, min_ratio = 2e-3, 4, 20, 0.1
    model = tiny_lm()
    trainer = Trainer(
        model,
        tcfg(steps=total, lr=lr, warmup_steps=warmup, min_lr_ratio=min_ratio),
        ListData([random_batch()]),
    )
    seen = []
    for _ in range(total):
        seen.append(trainer.optimizer.param_groups[0]["lr"])  # the lr the next step uses
        trainer.train_step()
    for s in range(total):
        assert seen[s] == pytest.approx(closed_form_lr(s, lr, warmup, total, min_ratio), rel=1e-12)
    # landmarks: linear ramp, peak at the end of warmup, half-way, the floor at the end
    assert seen[0] == pytest.approx(lr / warmup)
    assert seen[warmup - 1] == pytest.approx(lr) and seen[warmup] == pytest.approx(lr)
    assert seen[warmup + (total - warmup) // 2] == pytest.approx(lr * (min_ratio + 1) / 2)
    assert WarmupCosine(warmup, total, min_ratio)(total) == pytest.approx(min_ratio)
    assert WarmupCosine(0, 10, 0.0)(0) == pytest.approx(1.0)


# -- precision: f16 loss scaling and the non-finite guard -----------------------------------


def poisoned(loss_fn, bad_calls: set[int], value: float):
    """A loss whose gradient is `value` (inf or nan) on the listed calls (0-based)."""
    calls = {"n": 0}

    def fn(model, batch, state):
        loss, state = loss_fn(model, batch, state)
        if calls["n"] in bad_calls:
            p = next(model.parameters())
            loss = loss + (p * value).sum()
        calls["n"] += 1
        return loss, state

    return fn


def test_f16_overflow_step_is_skipped_not_applied():
    model = tiny_lm()
    trainer = Trainer(
        model,
        tcfg(precision="f16", steps=5, lr=1e-2),
        ListData([random_batch()]),
        loss_fn=poisoned(lm_loss, {1}, float("inf")),
    )
    assert trainer.scaler.is_enabled()
    trainer.train_step()  # a normal f16 step: applied
    assert trainer.skipped_steps == 0
    w1, scale1 = weights_of(model), trainer.scaler.get_scale()
    adam_steps = [float(s["step"]) for s in trainer.optimizer.state.values()]
    loss, _ = trainer.train_step()  # overflow
    assert trainer.skipped_steps == 1
    assert trainer.scaler.get_scale() == scale1 * 0.5
    for n, w in weights_of(model).items():
        assert torch.equal(w, w1[n]), n
    assert [float(s["step"]) for s in trainer.optimizer.state.values()] == adam_steps
    assert all(p.grad is None for p in model.parameters())  # nothing left for the next step
    trainer.train_step()  # recovers: applied again
    assert trainer.skipped_steps == 1
    assert any(not torch.equal(w, w1[n]) for n, w in weights_of(model).items())
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("precision", ["f32", "bf16"])
@pytest.mark.parametrize("value", [float("inf"), float("nan")], ids=["inf", "nan"])
@pytest.mark.parametrize("grad_clip", [1.0, 0.0], ids=["clip", "noclip"])
def test_non_finite_gradient_step_is_skipped(precision, value, grad_clip):
    model = tiny_lm()
    trainer = Trainer(
        model,
        tcfg(precision=precision, grad_clip=grad_clip, lr=1e-2),
        ListData([random_batch()]),
        loss_fn=poisoned(lm_loss, {1}, value),
    )
    trainer.train_step()
    w1 = weights_of(model)
    opt_state = {
        id(p): {k: v.clone() for k, v in s.items()} for p, s in trainer.optimizer.state.items()
    }
    trainer.train_step()
    assert trainer.skipped_steps == 1
    for n, w in weights_of(model).items():
        assert torch.equal(w, w1[n]), n
    for p, s in trainer.optimizer.state.items():
        for k, v in s.items():
            assert torch.equal(v, opt_state[id(p)][k]), k
    trainer.train_step()
    assert trainer.skipped_steps == 1
    assert all(torch.isfinite(p).all() for p in model.parameters())


# -- a fused optimizer's writes -------------------------------------------------------------


def test_evaluation_after_fused_optimizer_steps_sees_the_new_weights():
    """A fused AdamW (the Trainer's on CUDA) writes the parameters without moving their
    version counters. The post-step hook of `inference.plan` moves those a plan watches, so
    what no-grad forwards keep from the parameters (the decode plan: A = -exp(A_log), D,
    dt bias) follows: `evaluate()` after training equals the loss of a fresh copy of the
    weights."""
    trainer = Trainer(tiny_lm(), tcfg(lr=5e-2), ListData([random_batch(seed=s) for s in range(2)]))
    val = [random_batch(seed=9)]
    trainer.val_batches = val
    before = trainer.evaluate()  # the plan is made here
    trainer.optimizer = torch.optim.AdamW(trainer.params, lr=5e-2, fused=True)
    for _ in range(3):
        trainer.train_step()
    fresh = tiny_lm()
    fresh.load_state_dict(trainer.model.state_dict())
    with torch.no_grad():
        expected, _ = lm_loss(fresh, val[0], None)
    expected = float(expected) / int(count_targets(val[0]))
    assert expected != pytest.approx(before, rel=1e-3)  # training moved the weights
    assert trainer.evaluate() == pytest.approx(expected, rel=1e-6)
