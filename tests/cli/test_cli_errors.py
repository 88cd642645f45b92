"""The command line with a user's mistakes and on a busy machine: one line naming the flag
or file, exit status 2, no traceback (`--debug` shows it); the thread count chosen from
the cores that are free; the progress bar moving from the first step; `--help` complete."""

from __future__ import annotations

import argparse
import importlib
import json
import subprocess
import sys
import time

import pytest
import torch

from mambakit import MambaConfig, MambaLM, threads
from mambakit.cli import _common, main
from mambakit.cli._common import UsageError, choose_threads
from mambakit.threads import auto_threads
from mambakit.training import report, trainer


@pytest.fixture
def corpus(tmp_path):
    folder = tmp_path / "text"
    folder.mkdir()
    for i in range(6):
        (folder / f"m{i}.py").write_text(f"def f{i}(x):\n    return x + {i}\n" * 20)
    return folder


def train(tmp_path, corpus, *extra):
    cfg = tmp_path / "tiny.json"
    cfg.write_text(json.dumps({"d_model": 16, "n_layers": 1, "d_state": 4}))
    return [
        "train",
        *("--data", str(corpus), "--config", str(cfg), "--steps", "2", "--batch-size", "2"),
        *("--seqlen", "16", "--sample-tokens", "0", "--runs-dir", str(tmp_path / "runs")),
        *("--no-progress", "--device", "cpu", "--threads", "1"),
        *extra,
    ]


@pytest.fixture
def checkpoint(tmp_path):
    torch.manual_seed(0)
    MambaLM(MambaConfig(d_model=16, n_layers=1, vocab_size=256, d_state=4)).save_pretrained(
        tmp_path / "ckpt"
    )
    return tmp_path / "ckpt"


def one_error_line(capsys, command: str) -> str:
    err = capsys.readouterr().err.strip()
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"mambakit {command}: error: "), err
    return lines[0]


def test_a_user_error_in_a_real_process_is_one_line_and_exit_2(tmp_path, corpus):
    argv = train(tmp_path, corpus, "--max-minutes", "0")
    cmd = [sys.executable, "-m", "mambakit.cli", *argv]
    got = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert got.returncode == 2
    assert got.stderr.strip().splitlines() == [
        "mambakit train: error: --max-minutes must be more than 0, got 0 (leave it out for no "
        "time limit)"
    ]
    debug = subprocess.run([*cmd, "--debug"], capture_output=True, text=True, timeout=120)
    assert debug.returncode == 1 and "Traceback" in debug.stderr and "--max-minutes" in debug.stderr


def test_bad_tokenizer_file(tmp_path, corpus, checkpoint, capsys):
    bad = tmp_path / "tokenizer.json"
    bad.write_text("not json at all")
    assert main(train(tmp_path, corpus, "--tokenizer", str(bad))) == 2
    line = one_error_line(capsys, "train")
    assert f"--tokenizer {bad}" in line and "is not a valid tokenizer.json" in line
    argv = ["generate", "--model", str(checkpoint), "--prompt", "x", "--device", "cpu"]
    assert main([*argv, "--tokenizer", str(bad)]) == 2
    assert "is not a valid tokenizer.json" in one_error_line(capsys, "generate")
    assert main([*argv, "--tokenizer", str(tmp_path / "nowhere")]) == 2
    assert "no tokenizer.json at" in one_error_line(capsys, "generate")


def test_binary_data_files_are_named_as_such(tmp_path, capsys):
    folder = tmp_path / "bin"
    folder.mkdir()
    (folder / "a.txt").write_bytes(bytes(range(256)) * 4)
    (folder / "b.txt").write_bytes(b"\x00\x01\x02text")
    assert main(train(tmp_path, folder)) == 2
    line = one_error_line(capsys, "train")
    assert "--data: no text in" in line and "2 file(s) are not UTF-8 text" in line
    assert main(train(tmp_path, folder / "a.txt")) == 2
    assert "a.txt' is not UTF-8 text" in one_error_line(capsys, "train")


def test_cuda_asked_for_without_cuda(tmp_path, corpus, checkpoint, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    argv = ["generate", "--model", str(checkpoint), "--prompt", "x", "--device", "cuda"]
    assert main(argv) == 2
    assert "--device cuda: CUDA is not available" in one_error_line(capsys, "generate")
    assert main(["demo", "--device", "cuda:1"]) == 2
    assert "--device cuda:1: CUDA is not available" in one_error_line(capsys, "demo")
    assert main(train(tmp_path, corpus, "--device", "cuda")) == 2
    assert "--device cuda: CUDA is not available" in one_error_line(capsys, "train")
    assert main(train(tmp_path, corpus, "--device", "tpu9")) == 2
    assert "--device 'tpu9'" in one_error_line(capsys, "train")


def test_flag_names_in_train_config_errors():
    assert _common.flag_names("TrainConfig.batch_size must be") == "--batch-size must be"
    got = _common.flag_names("TrainConfig.ckpt_every_minutes must be a number >= 0, got nan")
    assert got == "--ckpt-minutes must be a number >= 0, got nan"


def test_garbage_config_and_missing_model(tmp_path, corpus, capsys):
    cfg = tmp_path / "c.json"
    cfg.write_bytes(b"\x89PNG\r\n")
    argv = train(tmp_path, corpus)
    argv[argv.index("--config") + 1] = str(cfg)
    assert main(argv) == 2
    assert f"--config {cfg}: not valid JSON" in one_error_line(capsys, "train")
    cfg.write_text(json.dumps({"d_modle": 16}))
    assert main(argv) == 2
    assert f"--config {cfg}:" in one_error_line(capsys, "train")
    argv[argv.index("--config") + 1] = str(tmp_path / "none.json")
    assert main(argv) == 2
    assert "none.json: no such file" in one_error_line(capsys, "train")
    assert main(["generate", "--model", str(tmp_path / "nope"), "--prompt", "x"]) == 2
    assert "--model" in one_error_line(capsys, "generate")


# -- threads and progress ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "available, physical, load, want",
    [
        (2, 2, 0.0, 2),  # idle: every core
        (2, 2, 1.0, 1),  # one busy process on 2 cores: 1 thread, not 2 spinning on 1 core
        (2, 1, 0.2, 1),
        (16, 8, 1.2, 7),  # busy: at most the physical cores minus one
        (16, 8, 12.0, 4),  # the cores left free
        (4, 4, 9.0, 1),  # overloaded: still one
    ],
)
def test_auto_threads(available, physical, load, want):
    assert auto_threads(available, physical, load) == want


@pytest.fixture
def fresh_threads(monkeypatch):
    """No choice cached from an earlier test, torch's count taken as its own, and torch's
    count restored afterwards."""
    before = torch.get_num_threads()
    monkeypatch.setattr(threads, "_auto", None)
    monkeypatch.setattr(threads, "_applied", None)
    for env in (threads.THREADS_ENV, "OMP_NUM_THREADS"):
        monkeypatch.delenv(env, raising=False)
    yield
    torch.set_num_threads(before)


def test_thread_count_flag_and_environment(fresh_threads, monkeypatch):
    monkeypatch.setenv("MAMBAKIT_NUM_THREADS", "3")
    monkeypatch.setenv("OMP_NUM_THREADS", "5")
    assert choose_threads(None) == (3, "MAMBAKIT_NUM_THREADS")  # ours before OMP's
    assert choose_threads(2) == (2, "--threads")
    monkeypatch.delenv("MAMBAKIT_NUM_THREADS")
    assert choose_threads(None) == (5, "OMP_NUM_THREADS")
    monkeypatch.setenv("OMP_NUM_THREADS", "x")
    with pytest.raises(UsageError, match="OMP_NUM_THREADS='x'"):
        choose_threads(None)
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setattr(threads, "busy_cores", lambda: 1.0)
    monkeypatch.setattr(threads, "physical_cores", lambda cpus: len(cpus))
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: {0, 1})
    torch.set_num_threads(2)  # torch's own count on these 2 cores: the policy decides
    assert choose_threads(None)[0] == 1  # 2 cores, one of them busy
    monkeypatch.setattr(threads, "_auto", None)  # measure again
    monkeypatch.setattr(threads, "busy_cores", lambda: 0.1)
    assert choose_threads(None)[0] == 2  # idle
    with pytest.raises(UsageError, match="--threads"):
        choose_threads(0)


def test_busy_cores_sees_a_busy_process():
    idle = threads.busy_cores(0.3)
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        busy = threads.busy_cores(0.5)
    finally:
        spin.kill()
        spin.wait()
    assert idle is not None and busy is not None
    assert busy >= 0.7 and busy > idle - 0.5, (idle, busy)


def test_train_sets_the_thread_count(tmp_path, corpus, capsys):
    before = torch.get_num_threads()
    try:
        assert main(train(tmp_path, corpus)) == 0
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    assert "threads: 1 (--threads)" in capsys.readouterr().out


def test_progress_moves_every_step(tmp_path, corpus, monkeypatch):
    seen = []

    class Recorder(report.ProgressBar):
        def advance(self, step, record=None):
            seen.append(step)
            super().advance(step, record)

    monkeypatch.setattr(trainer, "ProgressBar", Recorder)
    argv = train(tmp_path, corpus, "--steps", "4", "--eval-every", "0")
    argv.remove("--no-progress")
    assert main(argv) == 0
    assert seen == [1, 2, 3, 4]  # metric lines come every 10 steps; the bar does not wait


def test_progress_rate_and_time_left_leave_out_the_first_step():
    """The first step pays the warm-up: counted in, a 1-hour run would first show hours."""
    pytest.importorskip("tqdm")
    bar = report.ProgressBar(total=100, start=0)
    time.sleep(0.5)  # the first step, with its warm-up
    bar.advance(1, {})
    for step in range(2, 8):
        time.sleep(0.05)
        bar.advance(step, {})
    fmt = bar._bar.format_dict
    rate = (fmt["n"] - fmt["initial"]) / fmt["elapsed"]  # what tqdm shows with smoothing=0
    bar.close()
    assert fmt["n"] == 7 and 12 < rate < 21, rate  # 20 steps/s after the first, not 9


def test_progress_without_tqdm_shows_a_rate_from_the_first_step(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tqdm", None)
    bar = report.ProgressBar(total=100, start=0)
    bar.advance(1, {})
    bar.advance(2, {})
    bar.advance(10, {"step": 10, "loss": float("nan"), "tokens_per_s": 5.0})
    out = capsys.readouterr().out.splitlines()
    assert [x.split(":")[0] for x in out] == ["step 1", "step 10"]
    assert "steps/s" in out[0] and "loss nan" in out[1]


# -- help ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["train", "generate", "demo"])
def test_help_shows_defaults_and_a_help_string_for_every_flag(command, capsys):
    with pytest.raises(SystemExit) as e:
        main([command, "--help"])
    assert e.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    parser = argparse.ArgumentParser()
    module = importlib.import_module(f"mambakit.cli.{command}")
    module.add_parser(parser.add_subparsers())
    (sub,) = parser._subparsers._group_actions[0].choices.values()
    for action in sub._actions:
        assert action.help, f"{command} {action.option_strings} has no help string"
    assert "(default: auto)" in out  # --device
    if command == "train":
        assert "(default: 0.004)" in out and "(default: 5.0)" in out and "(default: 10)" in out
