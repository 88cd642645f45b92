"""Checkpoints and resume (training/resume.py): a resumed run is bit-identical to an
uninterrupted one and continues its lr schedule; a checkpoint holds what it should, keeps
`keep_last`, survives an interrupted write; resume refuses what does not fit (an
incomplete checkpoint, data or a model of another size) and changes nothing then.

Tiny models (d_model 16, 2 layers) on CPU.
"""

from __future__ import annotations

import math
from dataclasses import asdict

import numpy as np
import pytest
import torch
from training_helpers import ListData, random_batch, tcfg, tiny_cfg, tiny_lm, weights_of

from mambakit import MambaLM
from mambakit.text import ByteTokenizer
from mambakit.training import RowBatches, Trainer, lm_loss
from mambakit.training.config import TrainingDiverged
from mambakit.training.data import pack_documents


def closed_form_lr(step, lr, warmup, total, min_ratio):
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


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
    """...before it changes the model or the optimizer."""
    _, _, path = trained_with_checkpoint(tmp_path)
    model = tiny_lm(seed=5, vocab=256)
    before = weights_of(model)
    other = Trainer(
        model,
        tcfg(steps=6, batch_size=2, seqlen=16, run_dir=str(tmp_path)),
        RowBatches(text_rows(seqlen=8), 2, seed=0),
    )
    with pytest.raises(ValueError, match="rows"):
        other.resume()
    for n, w in weights_of(model).items():
        assert torch.equal(w, before[n]), n
    assert other.step == 0 and not other.optimizer.state


@pytest.mark.parametrize("mixer", [dict(mixer="mamba2", headdim=8, d_ssm=32),
                                   dict(mixer="mamba3", headdim=8), dict(headdim=8)],
                         ids=["mamba2-d_ssm", "mamba3", "mamba1-headdim"])  # fmt: skip
def test_resume_takes_back_its_own_checkpoint(tmp_path, mixer):
    """A run resumes from its own checkpoint whatever fields the checkpoint's format leaves
    out (a Mamba-2 d_ssm equal to its width, a field its mixer does not read)."""
    model = tiny_lm(vocab=256, **mixer)
    trainer = Trainer(model, tcfg(steps=4, batch_size=2, seqlen=16, run_dir=str(tmp_path)),
                      RowBatches(text_rows(), 2, seed=0))  # fmt: skip
    trainer.train_step()
    trainer.save()
    again = Trainer(tiny_lm(seed=5, vocab=256, **mixer),
                    tcfg(steps=4, batch_size=2, seqlen=16, run_dir=str(tmp_path)),
                    RowBatches(text_rows(), 2, seed=0))  # fmt: skip
    assert again.resume() and again.step == 1
    for n, w in weights_of(again.model).items():
        assert torch.equal(w, weights_of(model)[n]), n


def test_fit_of_a_finished_run_runs_no_step_and_returns(tmp_path):
    """fit() with no step left (a finished run resumed, or fit called again) trains nothing,
    saves nothing new and returns (it raised UnboundLocalError)."""
    cfg = tcfg(steps=2, batch_size=2, seqlen=16, run_dir=str(tmp_path))
    trainer = Trainer(tiny_lm(vocab=256), cfg, RowBatches(text_rows(), 2, seed=0))
    trainer.fit(progress=False)
    weights = weights_of(trainer.model)
    assert trainer.step == 2 and trainer.fit(progress=False) == {} and trainer.step == 2
    again = Trainer(tiny_lm(seed=5, vocab=256), cfg, RowBatches(text_rows(), 2, seed=0))
    assert again.resume() and again.fit(progress=False) == {} and again.step == 2
    for n, w in weights_of(again.model).items():
        assert torch.equal(w, weights[n]), n
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_0000002"]


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


def test_resume_refuses_an_optimizer_state_of_another_model_before_changing_weights(tmp_path):
    """A checkpoint of an untied model resumed into a tied one: every tensor fits (the tied
    model's lm_head is its embedding), the optimizer state does not (an lm_head of its
    own); resume names it, and the weights, embedding included, are as they were."""
    model = tiny_lm(vocab=256, tie_embeddings=False)
    trainer = Trainer(model, tcfg(steps=4, batch_size=2, seqlen=16, run_dir=str(tmp_path)),
                      RowBatches(text_rows(), 2, seed=0))  # fmt: skip
    trainer.train_step()
    trainer.save()
    tied = tiny_lm(seed=5, vocab=256, tie_embeddings=True)
    before = weights_of(tied)
    again = Trainer(tied, tcfg(steps=4, batch_size=2, seqlen=16, run_dir=str(tmp_path)),
                    RowBatches(text_rows(), 2, seed=0))  # fmt: skip
    with pytest.raises(ValueError, match="optimizer state .* does not fit .*lm_head"):
        again.resume()
    for n, w in weights_of(tied).items():
        assert torch.equal(w, before[n]), n
    assert again.step == 0


def test_resume_refuses_a_model_that_computes_otherwise(tmp_path):
    """Same tensors, another norm eps: the checkpoint's config.json says what the weights
    were trained with, and resume names the field and changes nothing."""
    trained_with_checkpoint(tmp_path)
    model = tiny_lm(seed=5, vocab=256, rms_norm_eps=0.5)
    before = weights_of(model)
    trainer = Trainer(model, tcfg(steps=6, batch_size=2, seqlen=16, run_dir=str(tmp_path)),
                      RowBatches(text_rows(), 2, seed=0))  # fmt: skip
    with pytest.raises(ValueError, match=r"another config .*rms_norm_eps: 1e-05 -> 0\.5"):
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


# -- what a resumed run takes from its own config -------------------------------------------


def test_resume_takes_the_optimizer_settings_of_its_own_config_and_device(tmp_path):
    """Loading an optimizer state puts the saved groups' settings in place of the optimizer's:
    a run resumed with another weight decay, betas or eps trained with the checkpoint's, and
    one resumed on another device kept the fused and capturable flags of the device that
    wrote it (on CUDA, a CPU checkpoint's unfused AdamW ignores the skip of non-finite
    steps). The oracle: the groups of the optimizer a fresh run of the same config builds."""
    first = Trainer(tiny_lm(), tcfg(run_dir=str(tmp_path)), ListData([random_batch()]))
    first.train_step()
    path = first.save()
    st = torch.load(path / "trainer_state.pt", weights_only=True)
    for g in st["optimizer"]["param_groups"]:  # flags this run's device does not make
        g.update(fused=False, capturable=True)
    torch.save(st, path / "trainer_state.pt")
    cfg = tcfg(run_dir=str(tmp_path), weight_decay=0.0, betas=(0.8, 0.9), eps=1e-6)
    resumed = Trainer(tiny_lm(seed=1), cfg, ListData([random_batch()]))
    assert resumed.resume() and resumed.step == 1
    fresh = Trainer(tiny_lm(seed=1), cfg, ListData([random_batch()]))

    def settings(g):
        return {k: v for k, v in g.items() if k not in ("params", "lr", "initial_lr")}

    groups = resumed.optimizer.param_groups
    assert [settings(g) for g in groups] == [settings(g) for g in fresh.optimizer.param_groups]
    assert [g["weight_decay"] for g in groups] == [0.0, 0.0] and groups[0]["eps"] == 1e-6
    assert resumed.optimizer.state  # the moments and step counts are the checkpoint's
    resumed.train_step()


def poison_batches(poisoned: set[int], n: int = 8) -> ListData:
    """Batch i adds NaN to the loss when i is in `poisoned` (read by `poisonable_loss`)."""
    batches = []
    for i in range(n):
        b = random_batch(seed=i)
        b["poison"] = torch.full(b["targets"].shape, float("nan") if i in poisoned else 0.0)
        batches.append(b)
    return ListData(batches)


def poisonable_loss(model, batch, state):
    loss, state = lm_loss(model, batch, state)
    return loss + batch["poison"].sum(), state


def test_resume_keeps_the_streak_of_skipped_steps(tmp_path):
    """max_skipped_steps counts consecutive skipped steps across a checkpoint: a run saved in
    the middle of a streak and resumed stops at the step an uninterrupted one stops at
    (the streak restarted from 0 on resume)."""
    cfg = tcfg(steps=8, max_skipped_steps=3, run_dir=str(tmp_path / "straight"))
    straight = Trainer(tiny_lm(), cfg, poison_batches({2, 3, 4, 5}), loss_fn=poisonable_loss)
    with pytest.raises(TrainingDiverged, match="3 consecutive"):
        straight.fit(progress=False)
    assert straight.step == 5

    cfg = tcfg(steps=8, max_skipped_steps=3, run_dir=str(tmp_path / "cut"))
    first = Trainer(tiny_lm(), cfg, poison_batches({2, 3, 4, 5}), loss_fn=poisonable_loss)
    for _ in range(4):  # two applied steps, then two skipped ones
        first.train_step()
    assert first.consecutive_skipped_steps == 2
    first.save()
    resumed = Trainer(tiny_lm(), cfg, poison_batches({2, 3, 4, 5}), loss_fn=poisonable_loss)
    assert resumed.resume() and resumed.consecutive_skipped_steps == 2
    with pytest.raises(TrainingDiverged, match="3 consecutive"):
        resumed.fit(progress=False)
    assert resumed.step == straight.step and resumed.skipped_steps == straight.skipped_steps


def test_numpy_numbers_in_the_config_train_save_and_resume(tmp_path):
    """TrainConfig takes numpy's numbers (an lr of np.logspace, a seed of np.int64) and keeps
    them as Python's: numpy scalars in the trainer state made every checkpoint of the run
    unreadable to torch.load(weights_only=True), a numpy seed failed to seed the run, and
    mixed betas were refused by AdamW."""
    cfg = tcfg(
        run_dir=str(tmp_path),
        lr=np.logspace(-4, -2, 3)[1],
        min_lr_ratio=np.float32(0.5),
        weight_decay=np.float32(0.05),
        betas=(np.float32(0.9), 0.95),
        eps=np.float64(1e-8),
        grad_clip=np.float64(1.0),
        seed=np.int64(3),
        max_seconds=np.float64(100.0),
        ckpt_every_minutes=np.float32(1.0),
    )
    for name, v in asdict(cfg).items():
        values = v if isinstance(v, tuple) else (v,)
        assert all(type(x) in (int, float, str, bool, type(None)) for x in values), name
    assert cfg.lr == 1e-3 and cfg.betas == (float(np.float32(0.9)), 0.95) and cfg.seed == 3
    first = Trainer(tiny_lm(), cfg, ListData([random_batch()]))
    first.train_step()
    first.save()
    resumed = Trainer(tiny_lm(seed=1), cfg, ListData([random_batch()]))
    assert resumed.resume() and resumed.step == 1
    for n, w in weights_of(resumed.model).items():
        assert torch.equal(w, weights_of(first.model)[n]), n


def test_trainer_state_is_on_disk_before_the_checkpoint_is_renamed_into_place(
    tmp_path, monkeypatch
):
    """The model's files are synced by their writer; trainer_state.pt was not: after a
    power loss, `latest` could name a checkpoint whose trainer state is empty (with
    keep_last=1, the run's only one)."""
    import os

    events, real_fsync, real_replace = [], os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", str(dst)))
        return real_replace(src, dst)

    trainer = Trainer(
        tiny_lm(), tcfg(run_dir=str(tmp_path), keep_last=1), ListData([random_batch()])
    )
    trainer.train_step()
    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    trainer.save()
    synced = [
        i for i, (e, p) in enumerate(events) if e == "fsync" and p.endswith("trainer_state.pt")
    ]
    renamed = events.index(("replace", str(tmp_path / "step_0000001")))
    assert synced and synced[0] < renamed


def test_a_failed_save_over_a_checkpoint_of_the_same_step_keeps_it(tmp_path, monkeypatch):
    """Saving a step that has a checkpoint already (save() called again, or a run resumed
    from an earlier step reaching a later one's) removed the old folder before the new one
    was in place: a failure then left `latest` naming nothing (with keep_last=1, the run's
    only checkpoint gone)."""
    import os

    cfg = tcfg(run_dir=str(tmp_path), keep_last=1)
    trainer = Trainer(tiny_lm(), cfg, ListData([random_batch()]))
    trainer.train_step()
    path = trainer.save()
    saved = weights_of(trainer.model)
    with torch.no_grad():
        next(trainer.model.parameters()).add_(1.0)
    real_replace, failed = os.replace, []

    def replace(src, dst):  # the new folder's rename into place fails, once
        if str(dst) == str(path) and not failed:
            failed.append(src)
            raise OSError("disk full (simulated)")
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(OSError, match="disk full"):
        trainer.save()
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", path.name]
    again = Trainer(tiny_lm(seed=1), cfg, ListData([random_batch()]))
    assert again.resume() and again.step == 1
    for n, w in weights_of(again.model).items():
        assert torch.equal(w, saved[n]), n
