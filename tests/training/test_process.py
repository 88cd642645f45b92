"""The process-wide state a Trainer borrows (training/process.py): its RNG stream, the
deterministic-algorithms flag and cuBLAS's workspace are installed for each call and the
caller's put back, through steps, `fit` and a checkpoint.

Tiny models (d_model 16, 2 layers) on CPU.
"""

from __future__ import annotations

import os

import torch
from training_helpers import ListData, random_batch, tcfg, tiny_lm

from mambakit.training import Trainer, lm_loss


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
