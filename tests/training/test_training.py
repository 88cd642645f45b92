"""The training engine: learning, TBPTT == BPTT, gradient accumulation, the optimizer's
groups and schedule, precision guards (f16 loss scaling, non-finite steps), exact
resume and checkpoints that survive an interrupted write.

Tiny models (d_model 16, 2 layers) on CPU; gradient comparisons run in float64.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from mambakit import MambaBackbone, MambaConfig, MambaLM
from mambakit.training import ByteTokenizer, RowBatches, TrainConfig, Trainer, lm_loss
from mambakit.training.data import pack_documents
from mambakit.training.optim import WarmupCosine
from mambakit.training.trainer import count_targets

V = 32  # vocabulary of the synthetic streams


def tiny_cfg(vocab: int = V, **kw) -> MambaConfig:
    fields = dict(d_model=16, n_layers=2, vocab_size=vocab, d_state=4, pad_vocab_size_multiple=1)
    fields.update(kw)
    return MambaConfig(**fields)


def tiny_lm(seed: int = 0, double: bool = False, **kw) -> MambaLM:
    torch.manual_seed(seed)
    model = MambaLM(tiny_cfg(**kw))
    return model.double() if double else model


def tcfg(**kw) -> TrainConfig:
    fields = dict(steps=10, batch_size=2, seqlen=32, warmup_steps=0, log_every=1, device="cpu")
    fields.update(kw)
    return TrainConfig(**fields)


class ListData:
    """Batches from a list, cycled; a cursor that checkpoints like RowBatches."""

    def __init__(self, batches: list[dict[str, torch.Tensor]]) -> None:
        self.batches, self.pos = batches, 0

    def next(self) -> dict[str, torch.Tensor]:
        b = self.batches[self.pos % len(self.batches)]
        self.pos += 1
        return {k: v.clone() for k, v in b.items()}

    def state_dict(self) -> dict[str, int]:
        return {"pos": self.pos}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.pos = int(sd["pos"])


def random_batch(B: int = 2, T: int = 32, seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (B, T + 1), generator=g)
    return {"input_ids": ids[:, :-1].contiguous(), "targets": ids[:, 1:].contiguous()}


def grads_of(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def weights_of(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.state_dict().items()}


def max_rel_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max() / b[k].abs().max().clamp(min=1e-30)) for k in a)


def forward_backward(model, batches, **cfg_kw) -> tuple[float, dict[str, torch.Tensor]]:
    """One step's loss and the parameter gradients it accumulates (no optimizer step)."""
    trainer = Trainer(model, tcfg(**cfg_kw), ListData(batches), log=lambda s: None)
    loss = trainer._forward_backward(batches)
    return float(loss), grads_of(model)


@pytest.fixture
def restore_determinism():
    """Put the process-wide deterministic flag back after a test that sets it (or whose
    Trainer fails to: it must leave the flag as it found it)."""
    before = torch.are_deterministic_algorithms_enabled()
    yield
    torch.use_deterministic_algorithms(before)


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


# -- resume and checkpoints -----------------------------------------------------------------


def text_rows(seqlen: int = 16):
    docs = [
        f"doc {i}: " + "the quick brown fox jumps over the lazy dog. " * (3 + i % 4)
        for i in range(8)
    ]
    return pack_documents(docs, ByteTokenizer(), seqlen)


class Interrupt(Exception):
    pass


class InterruptingData(RowBatches):
    """RowBatches that raise after `stop_after` batches, like a run killed mid-training."""

    def __init__(self, *args, stop_after: int, **kw) -> None:
        super().__init__(*args, **kw)
        self.left = stop_after

    def next(self):
        if self.left == 0:
            raise Interrupt
        self.left -= 1
        return super().next()


RESUME_CFG = dict(
    steps=7,
    batch_size=3,
    seqlen=16,
    tbptt_len=8,
    grad_accum=2,
    lr=5e-3,
    warmup_steps=2,
    deterministic=True,
    eval_every=0,
)


def test_resume_is_bit_identical(tmp_path, restore_determinism):
    rows = text_rows()
    torch.manual_seed(0)
    straight = MambaLM(tiny_cfg(vocab=256))
    straight_run = Trainer(
        straight,
        tcfg(**RESUME_CFG, run_dir=str(tmp_path / "straight")),
        RowBatches(rows, 3, seed=1),
        log=lambda s: None,
    )
    straight_run.fit(progress=False)

    torch.manual_seed(0)
    first = MambaLM(tiny_cfg(vocab=256))  # same init seed as `straight`
    run_dir = tmp_path / "interrupted"
    interrupted = Trainer(
        first,
        tcfg(**RESUME_CFG, ckpt_every=3, run_dir=str(run_dir)),
        InterruptingData(rows, 3, seed=1, stop_after=2 * 4 + 1),  # dies inside step 5
    )
    with pytest.raises(Interrupt):
        interrupted.fit(progress=False)
    assert (run_dir / "latest").read_text().strip() == "step_0000003"

    torch.manual_seed(123)  # a different process: different global RNG, fresh weights
    second = MambaLM(tiny_cfg(vocab=256))
    resumed = Trainer(
        second,
        tcfg(**RESUME_CFG, ckpt_every=3, run_dir=str(run_dir)),
        RowBatches(rows, 3, seed=1),
    )
    assert resumed.resume() is True
    assert resumed.step == 3
    resumed.fit(progress=False)
    assert resumed.step == straight_run.step == 7
    assert resumed.tokens_seen == straight_run.tokens_seen
    ref = straight.state_dict()
    for n, w in second.state_dict().items():
        assert torch.equal(w, ref[n]), n
    ref_opt = straight_run.optimizer.state_dict()["state"]
    for i, s in resumed.optimizer.state_dict()["state"].items():
        for k, v in s.items():
            assert torch.equal(v, ref_opt[i][k]), (i, k)


def trained_with_checkpoint(tmp_path, steps_before_save: int = 2):
    model = tiny_lm(vocab=256)
    trainer = Trainer(
        model,
        tcfg(steps=6, batch_size=2, seqlen=16, run_dir=str(tmp_path), keep_last=2),
        RowBatches(text_rows(), 2, seed=0),
    )
    for _ in range(steps_before_save):
        trainer.train_step()
    path = trainer.save()
    return model, trainer, path


def checkpoint_files_write_fails(monkeypatch, which: str):
    """Make one of the checkpoint's writes raise after it has started writing bytes."""
    if which == "trainer_state":
        real = torch.save

        def broken(obj, f, *a, **k):
            with open(f, "wb") as fh:
                fh.write(b"partial")
            raise OSError("disk full (simulated)")

        monkeypatch.setattr(torch, "save", broken)
        return real
    import mambakit.hf.io as hf_io

    def broken_save_file(sd, path, metadata=None):
        with open(path, "wb") as fh:
            fh.write(b"\x00" * 10)
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(hf_io, "save_file", broken_save_file)
    return None


@pytest.mark.parametrize("which", ["trainer_state", "model"])
def test_interrupted_checkpoint_leaves_the_previous_one(tmp_path, monkeypatch, which):
    model, trainer, good = trained_with_checkpoint(tmp_path)
    saved = weights_of(model)
    trainer.train_step()
    with monkeypatch.context() as m:
        checkpoint_files_write_fails(m, which)
        with pytest.raises(OSError, match="disk full"):
            trainer.save()
    assert (tmp_path / "latest").read_text().strip() == good.name == "step_0000002"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_0000002"]
    loaded = MambaLM.from_pretrained(good)
    for n, w in loaded.state_dict().items():
        assert torch.equal(w, saved[n]), n
    fresh = Trainer(
        tiny_lm(seed=9, vocab=256),
        tcfg(steps=6, batch_size=2, seqlen=16, run_dir=str(tmp_path)),
        RowBatches(text_rows(), 2, seed=0),
    )
    assert fresh.resume() is True and fresh.step == 2
    for n, w in fresh.model.state_dict().items():
        assert torch.equal(w, saved[n]), n
    fresh.fit(progress=False)
    assert (tmp_path / "latest").read_text().strip() == "step_0000006"


def test_checkpoint_contents_and_keep_last(tmp_path):
    model, trainer, path = trained_with_checkpoint(tmp_path)
    assert {p.name for p in path.iterdir()} >= {
        "config.json",
        "model.safetensors",
        "trainer_state.pt",
    }
    state = torch.load(path / "trainer_state.pt", weights_only=True)
    assert state["step"] == 2 and state["data"] == trainer.train_data.state_dict()
    for _ in range(3):
        trainer.train_step()
        trainer.save()
    kept = sorted(p.name for p in tmp_path.glob("step_*"))
    assert kept == ["step_0000004", "step_0000005"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp leftovers


def test_resume_refuses_an_incomplete_latest(tmp_path):
    """With no other checkpoint to fall back on, the error names the folder and the file."""
    _, trainer, path = trained_with_checkpoint(tmp_path)
    (path / "trainer_state.pt").unlink()
    with pytest.raises(ValueError, match="incomplete: trainer_state.pt is missing"):
        trainer.resume()


def test_resume_without_checkpoint_or_run_dir(tmp_path):
    trainer = Trainer(tiny_lm(), tcfg(run_dir=str(tmp_path / "empty")), ListData([random_batch()]))
    assert trainer.resume() is False and trainer.step == 0
    no_dir = Trainer(tiny_lm(), tcfg(), ListData([random_batch()]))
    with pytest.raises(ValueError, match="run_dir"):
        no_dir.resume()
    with pytest.raises(ValueError, match="run_dir"):
        no_dir.save()


def test_resume_refuses_data_of_another_size(tmp_path):
    _, _, path = trained_with_checkpoint(tmp_path)
    other = Trainer(
        tiny_lm(vocab=256),
        tcfg(steps=6, batch_size=2, seqlen=16, run_dir=str(tmp_path)),
        RowBatches(text_rows(seqlen=8), 2, seed=0),
    )
    with pytest.raises(ValueError, match="rows"):
        other.resume()


@pytest.mark.parametrize(
    "other",
    [dict(n_layers=1), dict(n_layers=3), dict(d_model=24), dict(tie_embeddings=False)],
    ids=["fewer-layers", "more-layers", "wider", "untied"],
)
def test_resume_into_another_model_names_the_tensor_and_changes_nothing(tmp_path, other):
    """DESIGN.md section 8: a checkpoint with a missing, extra or misshaped tensor gives an
    error naming the tensor, and nothing is partially loaded."""
    trained_with_checkpoint(tmp_path)
    model = tiny_lm(seed=5, vocab=256, **other)
    before = weights_of(model)
    trainer = Trainer(
        model,
        tcfg(steps=6, batch_size=2, seqlen=16, run_dir=str(tmp_path)),
        RowBatches(text_rows(), 2, seed=0),
    )
    with pytest.raises(ValueError, match=r"backbone\.|lm_head"):
        trainer.resume()
    for n, w in weights_of(model).items():
        assert torch.equal(w, before[n]), n
    assert trainer.step == 0


def lrs_of_steps(trainer: Trainer, until: int) -> list[float]:
    """The lr each step up to `until` applies (the optimizer's), checked against the logged
    one (`last_lr`)."""
    lrs = []
    while trainer.step < until:
        applied = trainer.optimizer.param_groups[0]["lr"]
        trainer.train_step()
        assert trainer.last_lr == applied, trainer.step
        lrs.append(applied)
    return lrs


@pytest.mark.parametrize("changed", [{}, dict(steps=14, lr=4e-3)], ids=["same", "extended"])
def test_resume_continues_the_lr_schedule(tmp_path, changed):
    """From its first step, a resumed run applies the lr its own config's schedule gives:
    with the same config, exactly the lrs of an uninterrupted run; with more steps and
    another peak lr, the new schedule's (and the one it logs)."""
    base = dict(steps=8, lr=2e-3, warmup_steps=3, min_lr_ratio=0.1, run_dir=str(tmp_path))
    first = Trainer(tiny_lm(), tcfg(**base), ListData([random_batch()]))
    before = lrs_of_steps(first, 4)
    first.save()
    cfg = {**base, **changed}
    resumed = Trainer(tiny_lm(seed=1), tcfg(**cfg), ListData([random_batch()]))
    assert resumed.resume() and resumed.step == 4
    after = lrs_of_steps(resumed, cfg["steps"])
    expected = [closed_form_lr(s, cfg["lr"], 3, cfg["steps"], 0.1) for s in range(4, cfg["steps"])]
    assert after == pytest.approx(expected, rel=1e-12)
    if not changed:
        straight = Trainer(tiny_lm(), tcfg(**{**base, "run_dir": None}), ListData([random_batch()]))
        assert before + after == lrs_of_steps(straight, 8)


def test_trainer_leaves_the_process_state_as_it_found_it(
    tmp_path, monkeypatch, restore_determinism
):
    """Building a Trainer changes no global state. Its steps run under deterministic
    algorithms (with cuBLAS's workspace setting) when asked, and draw from an RNG stream
    seeded with TrainConfig.seed and carried from call to call and through a checkpoint;
    after every call the caller's flag, environment and RNG are back."""
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    torch.use_deterministic_algorithms(False)
    seen = []

    def recording_loss(model, batch, state):
        flags = torch.are_deterministic_algorithms_enabled()
        seen.append((flags, os.environ.get("CUBLAS_WORKSPACE_CONFIG"), float(torch.rand(()))))
        return lm_loss(model, batch, state)

    def make(model, seed):
        cfg = tcfg(steps=3, seed=seed, deterministic=True, ckpt_every=2, run_dir=str(tmp_path))
        return Trainer(model, cfg, ListData([random_batch()]), loss_fn=recording_loss)

    models = [tiny_lm(), tiny_lm(seed=1)]
    torch.manual_seed(1234)
    outer = torch.get_rng_state()

    def as_found() -> bool:
        return (
            not torch.are_deterministic_algorithms_enabled()
            and "CUBLAS_WORKSPACE_CONFIG" not in os.environ
            and torch.equal(torch.get_rng_state(), outer)
        )

    trainer = make(models[0], seed=7)
    assert as_found()
    trainer.train_step()
    assert as_found()
    trainer.fit(progress=False)  # steps 2 and 3; checkpoints at both
    assert as_found()
    g = torch.Generator().manual_seed(7)
    stream = [float(torch.rand((), generator=g)) for _ in range(3)]
    assert seen == [(True, ":4096:8", x) for x in stream]
    seen.clear()
    resumed = make(models[1], seed=99)
    assert resumed.resume(tmp_path / "step_0000002") and as_found()
    resumed.train_step()  # step 3 again, with the stream as the checkpoint left it
    assert seen == [(True, ":4096:8", stream[2])] and as_found()


# -- evaluation and the loop ----------------------------------------------------------------


def test_evaluate_is_the_mean_loss_per_target(tmp_path):
    model = tiny_lm()
    val = [random_batch(seed=11), random_batch(B=1, seed=12)]
    val[0]["targets"][0, :5] = -100
    trainer = Trainer(model, tcfg(), ListData([random_batch()]), val_batches=val)
    got = trainer.evaluate()
    with torch.no_grad():
        total = sum(float(lm_loss(model, b, None)[0]) for b in val)
    n = sum(int((b["targets"] != -100).sum()) for b in val)
    assert got == pytest.approx(total / n, rel=1e-6)
    assert model.training  # evaluate puts the model back in training mode


def test_fit_writes_metrics_and_final_checkpoint(tmp_path):
    import json

    model = tiny_lm()
    trainer = Trainer(
        model,
        tcfg(steps=4, log_every=2, eval_every=3, run_dir=str(tmp_path)),
        ListData([random_batch()]),
        val_batches=[random_batch(seed=4)],
    )
    last = trainer.fit(progress=False)
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [2, 3, 4]
    assert "loss" in records[0] and "val_loss" not in records[0]
    assert "val_loss" in records[1] and "val_loss" in records[2] and "loss" in records[2]
    assert last["step"] == 4 and math.isfinite(last["val_loss"])
    assert (tmp_path / "latest").read_text().strip() == "step_0000004"


def test_fit_stops_at_max_seconds_and_checkpoints(tmp_path):
    trainer = Trainer(
        tiny_lm(),
        tcfg(steps=1000, max_seconds=1e-6, eval_every=0, run_dir=str(tmp_path)),
        ListData([random_batch()]),
    )
    last = trainer.fit(progress=False)
    assert trainer.step == 1 and last["step"] == 1
    assert (tmp_path / "latest").read_text().strip() == "step_0000001"


def test_precision_auto_is_f32_on_cpu():
    trainer = Trainer(tiny_lm(), tcfg(precision="auto"), ListData([random_batch()]))
    assert trainer.precision == "f32" and not trainer.scaler.is_enabled()
    assert Trainer(tiny_lm(), tcfg(precision="f16"), ListData([])).scaler.is_enabled()


# -- configuration errors -------------------------------------------------------------------


@pytest.mark.parametrize(
    "field,value",
    [
        ("steps", 0),
        ("steps", 2.5),
        ("batch_size", -1),
        ("seqlen", 0),
        ("grad_accum", 0),
        ("grad_accum", True),
        ("tbptt_len", 0),
        ("tbptt_len", 4.0),
        ("tbptt_grad_chunks", -1),
        ("warmup_steps", -3),
        ("ckpt_every", -1),
        ("eval_every", None),
        ("lr", 0.0),
        ("lr", float("nan")),
        ("lr", float("inf")),
        ("min_lr_ratio", 1.5),
        ("weight_decay", -0.1),
        ("grad_clip", -1.0),
        ("precision", "fp8"),
        ("max_seconds", 0),
        ("keep_last", 0),
    ],
)
def test_bad_train_config_names_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        TrainConfig(**{field: value})


def test_trainer_refuses_settings_the_device_cannot_run():
    with pytest.raises(ValueError, match="cuda_graph"):
        Trainer(tiny_lm(), tcfg(cuda_graph=True), ListData([random_batch()]))
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device"):
            Trainer(tiny_lm(), tcfg(device="cuda"), ListData([random_batch()]))


# -- the CUDA-graph step (the default on CUDA) -------------------------------------------


def test_cuda_graph_auto_trains_eagerly_on_cpu():
    trainer = Trainer(tiny_lm(), tcfg(), ListData([random_batch()]), log=lambda s: None)
    assert TrainConfig().cuda_graph == "auto"
    assert not trainer.use_graph and trainer.graph_status().startswith("eager")
    trainer.train_step()
    assert trainer.step == 1 and trainer._graph is None
    with pytest.raises(ValueError, match="cuda_graph"):
        TrainConfig(cuda_graph="yes")


def poison_batch(batch: dict[str, torch.Tensor], value: float) -> dict[str, torch.Tensor]:
    return {**batch, "poison": torch.tensor([value])}


def poison_loss(model, batch, state):
    """lm_loss plus first_param * poison: an input tensor, so it works inside a replay."""
    loss, state = lm_loss(model, {k: v for k, v in batch.items() if k != "poison"}, state)
    p = next(model.parameters())
    return loss + (p * batch["poison"].to(p.dtype)).sum(), state


def test_evaluation_after_fused_optimizer_steps_sees_the_new_weights():
    """A fused AdamW (the Trainer's on CUDA) writes the parameters without moving their
    version counters. The Trainer moves them after every step, so what no-grad forwards
    keep from the parameters (the decode plan: A = -exp(A_log), D, dt bias) follows:
    `evaluate()` after training equals the loss of a fresh copy of the weights."""
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


def gpu_trainer(data, graph, **kw) -> Trainer:
    fields = dict(device="cuda", precision="bf16", lr=1e-2, cuda_graph=graph, deterministic=True)
    fields.update(kw)
    return Trainer(tiny_lm(), tcfg(**fields), data, log=lambda s: None)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(
    "kw",
    [{}, {"grad_accum": 2}, {"tbptt_len": 8}, {"tbptt_len": 8, "tbptt_grad_chunks": 2}],
    ids=["plain", "accum2", "tbptt8", "tbptt8-k2"],
)
def test_graph_steps_equal_eager_steps(kw, restore_determinism):
    """Captured and replayed, the step gives the eager step's losses and weights bit for bit
    (deterministic mode), through gradient accumulation, TBPTT and the lr schedule."""
    batches = [random_batch(seed=s) for s in range(3)]
    runs = {}
    for graph in (False, True):
        trainer = gpu_trainer(ListData(batches), graph, warmup_steps=2, **kw)
        losses = [float(trainer.train_step()[0]) for _ in range(5)]
        assert (trainer._graph is not None) == graph
        runs[graph] = (losses, weights_of(trainer.model))
    assert runs[True][0] == runs[False][0]
    for n, w in runs[True][1].items():
        assert torch.equal(w, runs[False][1][n]), n


@pytest.mark.gpu
@needs_cuda
def test_graph_steps_refresh_what_is_cached_from_the_parameters(restore_determinism):
    """A replayed step updates the parameters in place where PyTorch does not see it; their
    version counters must still move, or what is cached from them without autograd (the
    decode plan's A = -exp(A_log), D, dt bias) would keep its first values: evaluation after
    graph training would then run a model that is not the one trained (and saved)."""
    batches = [random_batch(seed=s) for s in range(2)]
    trainer = gpu_trainer(ListData(batches), True)
    trainer.train_step()
    assert trainer._graph is not None
    bb = trainer.model.backbone
    mixer = bb.layers[0].mixer
    first = bb._decode_plan()[0][0].ssm[0].clone()  # the decode plan
    for _ in range(3):
        trainer.train_step()
    A = bb._decode_plan()[0][0].ssm[0]
    assert torch.equal(A, -torch.exp(mixer.A_log.float()))
    assert not torch.equal(A, first)  # training moved A_log
    # the trainer's validation loss is the loss of the weights it has, as a fresh copy sees them
    fresh = tiny_lm().cuda()
    fresh.load_state_dict(trainer.model.state_dict())
    val = [random_batch(seed=9)]
    trainer.val_batches = val
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):  # as gpu_trainer's
        expected, _ = lm_loss(fresh, {k: v.cuda() for k, v in val[0].items()}, None)
    expected = float(expected) / int(count_targets(val[0]))
    assert trainer.evaluate() == pytest.approx(expected, rel=1e-5)


@pytest.mark.gpu
@needs_cuda
def test_graph_step_skips_a_non_finite_step_on_the_device(restore_determinism):
    good, bad = poison_batch(random_batch(), 0.0), poison_batch(random_batch(), float("inf"))
    trainer = Trainer(
        tiny_lm(),
        tcfg(device="cuda", precision="bf16", lr=1e-2),
        ListData([good, good, bad, good]),
        loss_fn=poison_loss,
        log=lambda s: None,
    )
    trainer.train_step()
    trainer.train_step()
    assert trainer._graph is not None and trainer.skipped_steps == 0
    w = weights_of(trainer.model)
    opt = {id(p): {k: v.clone() for k, v in s.items()} for p, s in trainer.optimizer.state.items()}
    trainer.train_step()  # inf in the loss and the gradients: skipped inside the replay
    assert trainer.skipped_steps == 1
    for n, v in weights_of(trainer.model).items():
        assert torch.equal(v, w[n]), n
    for p, s in trainer.optimizer.state.items():
        for k, v in s.items():
            assert torch.equal(v, opt[id(p)][k]), k
    trainer.train_step()
    assert trainer.skipped_steps == 1
    assert any(not torch.equal(v, w[n]) for n, v in weights_of(trainer.model).items())
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


@pytest.mark.gpu
@needs_cuda
def test_graph_resume_is_bit_identical(tmp_path, restore_determinism):
    batches = [random_batch(seed=s) for s in range(4)]

    def make():
        return Trainer(
            tiny_lm(),
            tcfg(device="cuda", precision="bf16", lr=1e-2, warmup_steps=3, steps=6,
                 deterministic=True, run_dir=str(tmp_path)),
            ListData(batches),
            log=lambda s: None,
        )  # fmt: skip

    straight = make()
    for _ in range(6):
        straight.train_step()
    first = make()
    for _ in range(3):
        first.train_step()
    first.save()
    resumed = make()
    assert resumed.resume()
    for _ in range(3):
        resumed.train_step()
    assert resumed._graph is not None
    for n, v in weights_of(resumed.model).items():
        assert torch.equal(v, weights_of(straight.model)[n]), n


@pytest.mark.gpu
@needs_cuda
def test_a_loss_that_syncs_the_host_falls_back_to_eager(restore_determinism):
    def syncing_loss(model, batch, state):
        loss, state = lm_loss(model, batch, state)
        if float(loss) < 0:  # a host sync: not capturable
            raise AssertionError
        return loss, state

    said = []
    batches = [random_batch(seed=s) for s in range(2)]
    stream = torch.cuda.current_stream()
    trainer = Trainer(
        tiny_lm(),
        tcfg(device="cuda", precision="bf16", lr=1e-2, deterministic=True),
        ListData(batches),
        loss_fn=syncing_loss,
        log=said.append,
    )
    rng = torch.cuda.get_rng_state()
    losses = [float(trainer.train_step()[0]) for _ in range(3)]
    assert not trainer.use_graph and trainer._graph is None
    assert any("cuda graph off" in s for s in said), said
    # the failed capture left the caller's stream current and the default generator where
    # it was (a step draws no random numbers): random ops work and continue its sequence
    assert torch.cuda.current_stream() == stream
    assert torch.equal(torch.cuda.get_rng_state(), rng)
    same = torch.Generator(device="cuda")
    same.set_state(rng)
    drawn = torch.randn(64, device="cuda")
    assert torch.equal(drawn, torch.randn(64, device="cuda", generator=same))
    eager = gpu_trainer(ListData(batches), False)
    assert losses == [float(eager.train_step()[0]) for _ in range(3)]
    for n, v in weights_of(trainer.model).items():
        assert torch.equal(v, weights_of(eager.model)[n]), n
