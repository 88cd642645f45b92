"""Building a Trainer from its TrainConfig (training/config.py: every bad field named;
what the device cannot run refused), evaluation and the loop (training/trainer.py:
metrics, the final checkpoint, max_seconds).

Tiny models (d_model 16, 2 layers) on CPU.
"""

from __future__ import annotations

import math

import pytest
import torch
from training_helpers import ListData, random_batch, tcfg, tiny_lm

from mambakit.training import TrainConfig, Trainer, lm_loss


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
        ("max_seconds", float("nan")),
        ("max_seconds", "10"),
        ("keep_last", 0),
        ("lr", "1e-3"),
        ("tbptt_len", True),
        ("ckpt_every_minutes", True),
        ("betas", (1.5, 0.9)),
        ("betas", 0.9),
        ("betas", (0.9,)),
        ("seed", 1.5),
        ("seed", "x"),
        ("seed", -1),  # the sample after training (generate) takes seeds in [0, 2**63 - 1)
        ("seed", 1 << 63),
        ("device", "foo"),
        ("compile", "yes"),
        ("deterministic", "no"),
        ("cuda_graph", 0),  # == False, but `is not False`: it read as on
        ("cuda_graph", 1),
        ("cuda_graph", "yes"),
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
