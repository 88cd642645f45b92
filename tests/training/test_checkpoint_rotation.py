"""Resume past unreadable checkpoints and the rotation after it: the checkpoint a run resumed
from survives its next save, an unreadable one is renamed to `step_XXXXXXX.corrupt` (by the
writing rank only, never when the user named it) and no longer counts among the kept ones.

Tiny models (d_model 16, 2 layers) on CPU, saved at steps 2 and 4 with keep_last=2.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from mambakit import MambaConfig, MambaLM
from mambakit.text import ByteTokenizer
from mambakit.training import RowBatches, TrainConfig, Trainer
from mambakit.training.checkpoint import checkpoint_candidates, checkpoint_dirs
from mambakit.training.data import pack_documents
from mambakit.training.trainer import CheckpointUnreadable


def text_rows(seqlen: int = 16):
    docs = [f"doc {i}: " + "the quick brown fox jumps over the lazy dog. " * 3 for i in range(8)]
    return pack_documents(docs, ByteTokenizer(), seqlen)


def make_trainer(run_dir: Path, logged: list[str] | None = None, seed: int = 0) -> Trainer:
    torch.manual_seed(seed)
    cfg = MambaConfig(d_model=16, n_layers=2, vocab_size=256, d_state=4, pad_vocab_size_multiple=1)
    tcfg = TrainConfig(
        steps=10, batch_size=2, seqlen=16, warmup_steps=0, log_every=1, device="cpu",
        run_dir=str(run_dir), keep_last=2, eval_every=0,
    )  # fmt: skip
    log = logged.append if logged is not None else (lambda s: None)
    return Trainer(MambaLM(cfg), tcfg, RowBatches(text_rows(), 2, seed=0), log=log)


def train_to(trainer: Trainer, step: int) -> None:
    while trainer.step < step:
        trainer.train_step()


def run_with_checkpoints(run_dir: Path, steps: tuple[int, ...] = (2, 4)) -> dict[str, dict]:
    """Save at each of `steps`; returns each checkpoint's weights by folder name."""
    trainer, saved = make_trainer(run_dir), {}
    for step in steps:
        train_to(trainer, step)
        path = trainer.save()
        saved[path.name] = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    return saved


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def names(run_dir: Path) -> list[str]:
    return sorted(p.name for p in run_dir.iterdir() if not p.name.startswith("."))


def test_resume_past_a_truncated_latest_keeps_the_one_resumed_from(tmp_path):
    saved = run_with_checkpoints(tmp_path)
    truncate(tmp_path / "step_0000004" / "trainer_state.pt")

    logged: list[str] = []
    trainer = make_trainer(tmp_path, logged, seed=7)
    assert trainer.resume() is True and trainer.step == 2
    for k, w in trainer.model.state_dict().items():
        assert torch.equal(w, saved["step_0000002"][k]), k
    assert names(tmp_path) == ["latest", "step_0000002", "step_0000004.corrupt"]
    assert (tmp_path / "latest").read_text().strip() == "step_0000002"
    renamed = [line for line in logged if "renamed" in line]
    assert len(renamed) == 1
    assert "step_0000004 to step_0000004.corrupt" in renamed[0]
    assert "trainer_state.pt" in renamed[0]  # the reason

    train_to(trainer, 3)
    trainer.save()
    assert names(tmp_path) == ["latest", "step_0000002", "step_0000003", "step_0000004.corrupt"]
    assert (tmp_path / "latest").read_text().strip() == "step_0000003"
    assert [p.name for p in checkpoint_dirs(tmp_path)] == ["step_0000002", "step_0000003"]

    train_to(trainer, 4)  # a save at the corrupt one's step: the rotation goes on as usual
    trainer.save()
    assert names(tmp_path) == ["latest", "step_0000003", "step_0000004", "step_0000004.corrupt"]


def test_a_second_resume_before_any_save_goes_straight_to_the_good_one(tmp_path):
    run_with_checkpoints(tmp_path)
    truncate(tmp_path / "step_0000004" / "trainer_state.pt")
    assert make_trainer(tmp_path).resume() is True

    logged: list[str] = []
    again = make_trainer(tmp_path, logged)
    assert again.resume() is True and again.step == 2
    assert not [line for line in logged if "skipped" in line or "renamed" in line]
    assert checkpoint_candidates(tmp_path) == [tmp_path / "step_0000002"]


def test_a_taken_corrupt_name_gets_a_number(tmp_path):
    run_with_checkpoints(tmp_path)
    (tmp_path / "step_0000004.corrupt").mkdir()
    (tmp_path / "step_0000004" / "model.safetensors").unlink()  # incomplete

    trainer = make_trainer(tmp_path)
    assert trainer.resume() is True and trainer.step == 2
    assert names(tmp_path) == [
        "latest",
        "step_0000002",
        "step_0000004.corrupt",
        "step_0000004.corrupt.1",
    ]
    assert not (tmp_path / "step_0000004.corrupt.1" / "model.safetensors").exists()


def test_latest_naming_a_missing_folder_falls_back_and_is_repointed(tmp_path):
    run_with_checkpoints(tmp_path)
    (tmp_path / "latest").write_text("step_0000009\n")

    logged: list[str] = []
    trainer = make_trainer(tmp_path, logged)
    assert trainer.resume() is True and trainer.step == 4
    assert any("skipped checkpoint step_0000009" in line for line in logged)
    assert (tmp_path / "latest").read_text().strip() == "step_0000004"
    assert names(tmp_path) == ["latest", "step_0000002", "step_0000004"]


def test_every_checkpoint_unreadable_raises_and_renames_nothing(tmp_path):
    run_with_checkpoints(tmp_path)
    for step in ("step_0000002", "step_0000004"):
        truncate(tmp_path / step / "trainer_state.pt")

    with pytest.raises(CheckpointUnreadable, match="no readable checkpoint in"):
        make_trainer(tmp_path).resume()
    assert names(tmp_path) == ["latest", "step_0000002", "step_0000004"]
    assert (tmp_path / "latest").read_text().strip() == "step_0000004"


def test_an_unreadable_checkpoint_named_by_the_user_raises_and_stays(tmp_path):
    run_with_checkpoints(tmp_path)
    truncate(tmp_path / "step_0000004" / "trainer_state.pt")

    with pytest.raises(CheckpointUnreadable, match="trainer_state.pt"):
        make_trainer(tmp_path).resume(tmp_path / "step_0000004")
    assert names(tmp_path) == ["latest", "step_0000002", "step_0000004"]


def test_only_the_writing_rank_renames(tmp_path):
    run_with_checkpoints(tmp_path)
    truncate(tmp_path / "step_0000004" / "trainer_state.pt")

    other = make_trainer(tmp_path)
    other.dist = dataclasses.replace(other.dist, rank=1)  # not the rank that writes
    assert other.resume() is True and other.step == 2
    assert names(tmp_path) == ["latest", "step_0000002", "step_0000004"]
    assert (tmp_path / "latest").read_text().strip() == "step_0000004"


def test_a_run_resumed_from_an_earlier_step_keeps_that_checkpoint(tmp_path):
    """An explicit rewind: the next save counts only the checkpoints before its step."""
    run_with_checkpoints(tmp_path)
    trainer = make_trainer(tmp_path)
    assert trainer.resume(tmp_path / "step_0000002") is True
    train_to(trainer, 3)
    trainer.save()
    assert names(tmp_path) == ["latest", "step_0000002", "step_0000003", "step_0000004"]
    assert (tmp_path / "latest").read_text().strip() == "step_0000003"


def test_rotation_and_resume_ignore_folders_not_named_step_and_digits(tmp_path):
    run_with_checkpoints(tmp_path, steps=(2,))
    (tmp_path / "step_0000001.old").mkdir()
    (tmp_path / "step_0000009.corrupt").mkdir()
    trainer = make_trainer(tmp_path)
    assert trainer.resume() is True and trainer.step == 2
    for step in (3, 4):
        train_to(trainer, step)
        trainer.save()
    assert [p.name for p in checkpoint_dirs(tmp_path)] == ["step_0000003", "step_0000004"]
    assert (tmp_path / "step_0000001.old").is_dir() and (tmp_path / "step_0000009.corrupt").is_dir()
