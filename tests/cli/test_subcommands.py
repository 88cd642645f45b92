"""Every subcommand with every mixer, as a user runs them: `python -m mambakit.cli` in a fresh
process, with Triton hidden (tests/test_import.py), on tiny shapes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

MIXER_PRESETS = {"mamba1": "tiny", "mamba3": "tiny-mamba3"}


@pytest.fixture
def cli(hide_triton):
    """Runs `mambakit ARGV...` in a fresh process without Triton."""

    def run(*argv: str, timeout: float = 300) -> subprocess.CompletedProcess:
        program = hide_triton + "from mambakit.cli import main\nsys.exit(main(sys.argv[1:]))\n"
        env = {**os.environ, "MAMBAKIT_NUM_THREADS": "1"}
        return subprocess.run(
            [sys.executable, "-c", program, *argv],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
        )

    return run


@pytest.mark.parametrize("mixer", list(MIXER_PRESETS))
def test_demo(mixer, cli):
    got = cli("demo", "--preset", MIXER_PRESETS[mixer], "--seqlen", "48", "--steps", "6")
    assert got.returncode == 0, got.stderr[-3000:]
    diff = float(got.stdout.split("logits ")[1].split(",")[0])
    assert diff < 1e-4, got.stdout  # step() x 6 against the forward's first 6 positions


@pytest.mark.parametrize("mixer", list(MIXER_PRESETS))
def test_train_then_generate(mixer, tmp_path, corpus, cli):
    runs = tmp_path / "runs"
    got = cli(
        "train", "--preset", MIXER_PRESETS[mixer], "--data", str(corpus), "--steps", "3",
        "--batch-size", "2", "--seqlen", "32", "--eval-every", "0", "--warmup-steps", "1",
        "--sample-tokens", "8", "--runs-dir", str(runs), "--name", "r", "--no-progress",
        "--device", "cpu",
    )  # fmt: skip
    assert got.returncode == 0, got.stderr[-3000:]
    assert "done: step 3" in got.stdout and "sample:" in got.stdout
    assert (runs / "r" / "latest").read_text().strip() == "step_0000003"
    got = cli(
        "generate", "--model", str(runs / "r"), "--prompt", "def ", "--max-new-tokens", "12",
        "--temperature", "0", "--device", "cpu",
    )  # fmt: skip
    assert got.returncode == 0, got.stderr[-3000:]
    assert got.stdout.startswith("def ")
    # greedy from a fresh byte-vocabulary model: no stop at byte 0 (no eos in its config)
    assert "[12 tokens" in got.stderr, got.stderr


@pytest.mark.parametrize("mixer", list(MIXER_PRESETS))
def test_task(mixer, tmp_path, cli):
    got = cli(
        "task", "induction-heads", "--mixer", mixer, "--steps", "3", "--batch-size", "4",
        "--max-len", "128", "--runs-dir", str(tmp_path), "--no-progress", "--device", "cpu",
    )  # fmt: skip
    assert got.returncode == 0, got.stderr[-3000:]
    assert f"({mixer}, 2 layers" in got.stdout
    assert Path(tmp_path / "induction-heads" / "accuracy.json").is_file()
