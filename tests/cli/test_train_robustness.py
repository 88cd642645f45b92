"""`mambakit train` survives what happens to long runs: Ctrl-C and SIGTERM, divergence, a
corrupt metrics line or checkpoint, a second run on the same folder, killed saves; files
get the process umask. Tiny models on a tmp folder of text; the signal and the lock are
exercised across real processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from mambakit import MambaConfig, MambaLM
from mambakit.cli import main
from mambakit.training import RowBatches, TrainConfig, Trainer, build_splits, lm_loss
from mambakit.training.checkpoint import RunLock, RunLockedError
from mambakit.training.data import ByteTokenizer
from mambakit.training.report import json_line, plot_loss, read_metrics
from mambakit.training.trainer import TrainingDiverged


def train_args(corpus, tiny_json, runs, *extra, steps=6):
    return [
        "train",
        *("--data", str(corpus), "--config", str(tiny_json), "--steps", str(steps)),
        *("--batch-size", "2", "--seqlen", "32", "--eval-every", "3", "--warmup-steps", "2"),
        *("--sample-tokens", "0", "--runs-dir", str(runs), "--name", "t", "--no-progress"),
        *("--device", "cpu", "--threads", "1"),
        *extra,
    ]


def strict_metrics(run: Path) -> list[dict]:
    """Every line parsed as strict JSON (a bare NaN fails)."""

    def no_constants(name):
        raise ValueError(f"{name} is not JSON")

    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [json.loads(x, parse_constant=no_constants) for x in lines if x]


def latest_step(run: Path) -> int:
    return int((run / "latest").read_text().strip().removeprefix("step_"))


def cli_process(argv: list[str]) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "mambakit.cli", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def wait_for(predicate, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    t0 = time.monotonic()
    while not predicate():
        if proc.poll() is not None:
            out, err = proc.communicate()
            raise AssertionError(f"the process ended early ({proc.returncode}):\n{out}\n{err}")
        if time.monotonic() - t0 > timeout:
            proc.kill()
            raise AssertionError("timed out waiting for the process")
        time.sleep(0.05)


def text_trainer(corpus, run_dir, **kw) -> Trainer:
    train, _ = build_splits([corpus], ByteTokenizer(), 32)
    torch.manual_seed(0)
    model = MambaLM(MambaConfig(d_model=16, n_layers=1, vocab_size=256, d_state=4))
    fields = dict(steps=3, batch_size=2, seqlen=32, warmup_steps=0, device="cpu", eval_every=0)
    fields.update(kw)
    return Trainer(model, TrainConfig(run_dir=str(run_dir), **fields), RowBatches(train, 2))


# -- interrupts -------------------------------------------------------------------------------


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_signal_checkpoints_prints_resume_and_exits_130(tmp_path, corpus, tiny_json, sig):
    runs = tmp_path / "runs"
    run = runs / "t"
    argv = train_args(corpus, tiny_json, runs, "--eval-every", "0", steps=1_000_000)
    proc = cli_process(argv)
    metrics = run / "metrics.jsonl"
    wait_for(lambda: metrics.is_file() and metrics.read_text().count("\n") >= 1, proc)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, (out, err)
    assert "Traceback" not in err
    k = latest_step(run)
    assert k >= 10
    assert f"stopped at step {k}" in out and str(run / f"step_{k:07d}") in out
    resume_line = next(x for x in out.splitlines() if x.startswith("resume with: mambakit "))
    assert resume_line.endswith("--resume") and "--name t" in resume_line
    MambaLM.from_pretrained(run / f"step_{k:07d}")  # a complete checkpoint

    # the printed command continues the run (with a nearer goal than a million steps)
    assert main(train_args(corpus, tiny_json, runs, "--resume", steps=k + 2)) == 0
    assert latest_step(run) == k + 2
    steps = [r["step"] for r in strict_metrics(run)]
    assert steps == sorted(set(steps)) and steps[-1] == k + 2


def test_checkpoint_every_few_minutes_of_wall_time(tmp_path, corpus):
    trainer = text_trainer(corpus, tmp_path, steps=3, keep_last=5, ckpt_every_minutes=1e-9)
    trainer.fit(progress=False)
    assert sorted(p.name for p in tmp_path.glob("step_*")) == [
        "step_0000001",
        "step_0000002",
        "step_0000003",
    ]
    assert TrainConfig().ckpt_every_minutes == 5.0  # on by default
    with pytest.raises(ValueError, match="ckpt_every_minutes"):
        TrainConfig(ckpt_every_minutes=-1)


# -- divergence -------------------------------------------------------------------------------


def test_divergent_cli_run_stops_with_a_message_and_no_nan_checkpoint(tmp_path, corpus, tiny_json):
    runs = tmp_path / "runs"
    argv = train_args(corpus, tiny_json, runs, "--lr", "1e6", "--max-skipped-steps", "3", steps=40)
    proc = subprocess.run(
        [sys.executable, "-m", "mambakit.cli", *argv],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 1, (proc.stdout, proc.stderr)
    # the message on stderr, exit status 1 (2 is a mistake in the input)
    assert "training diverged: 3 consecutive steps skipped" in proc.stderr
    assert "--lr 1e+06" in proc.stderr and "--max-skipped-steps 3" in proc.stderr
    assert "training diverged" not in proc.stdout and "Traceback" not in proc.stderr
    records = strict_metrics(runs / "t")
    assert records[-1]["loss"] is None and records[-1]["skipped_steps"] >= 3
    run = runs / "t"
    if (run / "latest").exists():  # whatever `latest` names holds finite weights
        model = MambaLM.from_pretrained(run / (run / "latest").read_text().strip())
        assert all(torch.isfinite(p).all() for p in model.parameters())


def test_consecutive_skipped_steps_raise_and_save_nothing(tmp_path, corpus, recwarn):
    def nan_loss(model, batch, state):
        loss, state = lm_loss(model, batch, state)
        return loss * float("nan"), state

    trainer = text_trainer(corpus, tmp_path, steps=50, max_skipped_steps=4)
    trainer.loss_fn = nan_loss
    with pytest.raises(TrainingDiverged, match="4 consecutive steps skipped"):
        trainer.fit(progress=False)
    assert trainer.step == 4 and trainer.skipped_steps == 4
    assert not (tmp_path / "latest").exists()
    assert strict_metrics(tmp_path)[-1]["loss"] is None
    # max_skipped_steps=0: never stops
    trainer = text_trainer(corpus, tmp_path / "b", steps=6, max_skipped_steps=0)
    trainer.loss_fn = nan_loss
    trainer.fit(progress=False)
    assert trainer.step == 6 and trainer.skipped_steps == 6
    # the schedule advancing past skipped steps is intended: no call-order warning
    assert not [w for w in recwarn if "lr_scheduler" in str(w.message)]


def test_non_finite_weights_are_never_saved_as_latest(tmp_path, corpus):
    trainer = text_trainer(corpus, tmp_path, steps=2)
    trainer.fit(progress=False)
    assert latest_step(tmp_path) == 2
    with torch.no_grad():
        next(trainer.model.parameters())[0] = float("nan")
    trainer.step = 3
    with pytest.raises(TrainingDiverged, match="not finite at step 3.*step_0000002"):
        trainer.save()
    assert latest_step(tmp_path) == 2 and not (tmp_path / "step_0000003").exists()


def test_json_line_writes_null_for_non_finite_values():
    line = json_line({"step": 1, "loss": float("nan"), "grad_norm": float("inf"), "lr": 0.1})
    assert json.loads(line) == {"step": 1, "loss": None, "grad_norm": None, "lr": 0.1}


# -- the metrics log --------------------------------------------------------------------------


def test_read_metrics_skips_and_counts_bad_lines(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 2.0}\ngarbage\n[1]\n\n{"step": 2, "loss": 1.5}\n{"st')
    warnings = []
    rows = read_metrics(path, warn=warnings.append)
    assert [r["step"] for r in rows] == [1, 2]
    assert warnings == [f"{path}: skipped 3 unreadable line(s) (line 2, 3, 6)"]
    png = plot_loss(path, tmp_path / "loss.png")
    assert png is None or png.read_bytes()[:4] == b"\x89PNG"


def test_a_corrupt_metrics_line_does_not_break_the_run(tmp_path, corpus, tiny_json, capsys):
    runs = tmp_path / "runs"
    metrics = runs / "t" / "metrics.jsonl"
    assert main(train_args(corpus, tiny_json, runs, steps=3)) == 0
    with open(metrics, "a") as f:
        f.write("garbage\n")
    assert main(train_args(corpus, tiny_json, runs, "--resume", steps=6)) == 0
    out = capsys.readouterr().out
    assert f"{metrics}: skipped 1 unreadable line(s) (line 2)" in out
    assert [r["step"] for r in strict_metrics(runs / "t")] == [3, 6]


def test_resume_after_a_crash_does_not_duplicate_logged_steps(tmp_path, corpus, tiny_json):
    """Steps logged after the checkpoint a crash falls back to are logged again by the
    resumed run: the earlier copies go (and a line the crash cut short with them)."""
    runs = tmp_path / "runs"
    run = runs / "t"
    assert main(train_args(corpus, tiny_json, runs, "--ckpt-every", "3")) == 0
    assert [r["step"] for r in strict_metrics(run)] == [3, 6]
    (run / "latest").write_text("step_0000003\n")  # died after logging 6, before saving it
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 7, "lo')
    assert main(train_args(corpus, tiny_json, runs, "--resume", steps=9)) == 0
    assert [r["step"] for r in strict_metrics(run)] == [3, 6, 9]


# -- one run per folder -----------------------------------------------------------------------


def test_a_second_run_on_a_locked_folder_names_the_holder(tmp_path, corpus, tiny_json, capsys):
    runs = tmp_path / "runs"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\n"
            "from mambakit.training.checkpoint import RunLock\n"
            "RunLock(sys.argv[1]).acquire()\n"
            "print('locked', flush=True)\n"
            "time.sleep(120)\n",
            str(runs / "t"),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        assert main(train_args(corpus, tiny_json, runs)) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("mambakit train: error: ") and len(err.splitlines()) == 1
        assert f"in use by another training process (pid {holder.pid}" in err
        assert not (runs / "t" / "latest").exists() and not (runs / "t" / "metrics.jsonl").exists()
    finally:
        holder.kill()
        holder.wait()
    assert main(train_args(corpus, tiny_json, runs, steps=2)) == 0  # the lock died with it


def test_run_lock_is_reentrant_in_one_process_and_exclusive_across(tmp_path):
    with RunLock(tmp_path / "r"), RunLock(tmp_path / "r"):
        assert (tmp_path / "r" / ".lock").read_text().strip() == str(os.getpid())
        code = (
            "import sys\n"
            "from mambakit.training.checkpoint import RunLock, RunLockedError\n"
            "try:\n    RunLock(sys.argv[1]).acquire()\n"
            "except RunLockedError as e:\n    print(e)\n"
        )
        got = subprocess.run(
            [sys.executable, "-c", code, str(tmp_path / "r")], capture_output=True, text=True
        )
        assert f"pid {os.getpid()}" in got.stdout
    RunLock(tmp_path / "r").acquire()  # released: free again
    RunLock(tmp_path / "r").release()
    assert issubclass(RunLockedError, RuntimeError)


# -- corrupt checkpoints, killed saves, file modes ----------------------------------------------


@pytest.mark.parametrize("name", ["model.safetensors", "trainer_state.pt"])
def test_a_truncated_latest_falls_back_to_the_newest_readable(
    tmp_path, corpus, tiny_json, capsys, name
):
    runs = tmp_path / "runs"
    run = runs / "t"
    assert main(train_args(corpus, tiny_json, runs, "--ckpt-every", "3")) == 0
    target = run / "step_0000006" / name
    target.write_bytes(target.read_bytes()[: target.stat().st_size // 2])
    capsys.readouterr()
    assert main(train_args(corpus, tiny_json, runs, "--resume", steps=8)) == 0
    out = capsys.readouterr().out
    assert f"resume: skipped checkpoint step_0000006: {target}" in out
    assert "resumed" in out and "at step 3" in out
    assert latest_step(run) == 8


def test_resume_with_no_readable_checkpoint_says_so(tmp_path, corpus, tiny_json, capsys):
    runs = tmp_path / "runs"
    assert main(train_args(corpus, tiny_json, runs, steps=2)) == 0
    (runs / "t" / "step_0000002" / "model.safetensors").write_bytes(b"\x00" * 10)
    assert main(train_args(corpus, tiny_json, runs, "--resume", steps=4)) == 2
    err = capsys.readouterr().err
    assert "no readable checkpoint in" in err and "model.safetensors" in err


def test_stale_temporaries_of_killed_saves_are_removed(tmp_path, corpus, tiny_json, capsys):
    runs = tmp_path / "runs"
    run = runs / "t"
    assert main(train_args(corpus, tiny_json, runs, steps=2)) == 0
    stale = [run / ".step_0000004.k1ll3d", run / ".latest.abc123"]
    stale[0].mkdir()
    (stale[0] / "model.safetensors").write_bytes(b"half")
    stale[1].write_text("step_0000004\n")
    keep = run / "notes.txt"
    keep.write_text("mine")
    assert main(train_args(corpus, tiny_json, runs, "--resume", steps=3)) == 0
    assert not any(p.exists() for p in stale) and keep.read_text() == "mine"
    assert f"removed {stale[0]}" in capsys.readouterr().out


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_saved_files_follow_the_umask(tmp_path, corpus, tiny_json, umask):
    runs = tmp_path / "runs"
    old = os.umask(umask)
    try:
        assert main(train_args(corpus, tiny_json, runs, steps=2)) == 0
    finally:
        os.umask(old)
    run = runs / "t"
    ckpt = run / "step_0000002"
    assert ckpt.stat().st_mode & 0o777 == 0o777 & ~umask
    for f in [run / "latest", *ckpt.iterdir()]:
        assert f.stat().st_mode & 0o777 == 0o666 & ~umask, f


@pytest.mark.gpu
def test_consecutive_skips_stop_a_cuda_graph_run_when_it_logs(tmp_path, corpus):
    """On CUDA the skip streak is counted on the device and read only with a metric line."""

    def nan_loss(model, batch, state):
        loss, state = lm_loss(model, batch, state)
        return loss * float("nan"), state

    trainer = text_trainer(
        corpus, tmp_path, steps=50, device="cuda", log_every=5, max_skipped_steps=3
    )
    trainer.loss_fn = nan_loss
    with pytest.raises(TrainingDiverged, match="5 consecutive steps skipped"):
        trainer.fit(progress=False)
    assert trainer._graph is not None  # the steps were replayed from the graph
    assert trainer.step == 5 and trainer.skipped_steps == 5
    assert not (tmp_path / "latest").exists()
