"""The edges a new user hits first, each in a real `mambakit` process: a typo in --resume's run
name, a mistake found after the run folder was made, flags refused before any work, unknown
flags and config fields, the exit status of a diverged run; and what a fresh model's
checkpoint says about its special tokens."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch

from mambakit import MambaConfig, MambaLM
from mambakit.hf import CheckpointError
from mambakit.hf.config import config_from_json


def mambakit(*argv: str, cwd=None) -> subprocess.CompletedProcess:
    env = {**os.environ, "MAMBAKIT_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "mambakit.cli", *argv],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=cwd,
    )


def error_line(got: subprocess.CompletedProcess, command: str) -> str:
    """The one line a user's mistake prints on stderr, with exit status 2."""
    lines = got.stderr.strip().splitlines()
    assert got.returncode == 2 and len(lines) == 1, (got.returncode, got.stderr)
    assert lines[0].startswith(f"mambakit {command}: error: "), lines
    return lines[0]


def test_resume_of_a_run_that_does_not_exist_names_it_and_the_runs_that_do(tmp_path):
    runs = tmp_path / "runs"
    for name in ("stdlib-a", "stdlib-b"):
        (runs / name / "step_0000010").mkdir(parents=True)
        (runs / name / "latest").write_text("step_0000010\n")
    (runs / "notes").mkdir()  # not a run
    line = error_line(
        mambakit("train", "--resume", "--name", "stdlib-c", "--runs-dir", str(runs)), "train"
    )
    assert f"{runs / 'stdlib-c'} does not exist" in line
    assert "stdlib-a, stdlib-b" in line and "notes" not in line
    assert not (runs / "stdlib-c").exists()  # nothing started, nothing made

    (runs / "empty").mkdir()
    line = error_line(
        mambakit("task", "mqar", "--resume", "--name", "empty", "--runs-dir", str(runs)), "task"
    )
    assert "empty holds no checkpoint" in line


def test_a_mistake_found_after_the_run_folder_was_made_leaves_no_folder(tmp_path):
    runs = tmp_path / "runs"
    got = mambakit("train", "--data", str(tmp_path / "missing.txt"), "--runs-dir", str(runs))
    assert "missing.txt" in error_line(got, "train")
    assert not runs.exists()  # neither the run folder nor its .lock stays behind


def test_seqlen_below_two_is_refused_as_a_flag(tmp_path):
    got = mambakit("train", "--seqlen", "1", "--runs-dir", str(tmp_path))
    assert error_line(got, "train").endswith("--seqlen must be at least 2, got 1")
    assert "data:" not in got.stdout  # refused before the corpus was read
    got = mambakit("train", "--seed", "-1", "--runs-dir", str(tmp_path))  # not at the sample
    assert error_line(got, "train").endswith("--seed must be an int in [0, 2**63 - 1), got -1")


def test_demo_refuses_a_seed_out_of_range_naming_it():
    got = mambakit("demo", "--seed", "99999999999999999999")
    assert error_line(got, "demo").endswith(
        "--seed must be an int in [0, 2**63 - 1), got 99999999999999999999"
    )


@pytest.mark.parametrize(
    "flags, message",
    [
        (("--max-new-tokens", "-5"), "--max-new-tokens must be at least 1, got -5"),
        (("--top-p", "1.5"), "--top-p must lie in (0, 1]"),
        (("--temperature", "-1"), "--temperature must be a finite number >= 0"),
        (("--seed", "-1"), "--seed must be an int in [0, 2**63 - 1), got -1"),
    ],
)
def test_generate_flags_are_refused_before_the_model_loads(tmp_path, flags, message):
    # the model folder does not exist: a flag refused first never gets to read it
    got = mambakit("generate", "--model", str(tmp_path / "none"), "--prompt", "x", *flags)
    assert message in error_line(got, "generate")


def test_an_unknown_flag_prints_the_subcommands_usage(tmp_path):
    got = mambakit("train", "--stpes", "3", "--runs-dir", str(tmp_path))
    assert got.returncode == 2
    assert got.stderr.startswith("usage: mambakit train ")
    assert "mambakit train: error: unrecognized arguments: --stpes 3" in got.stderr
    assert not any(tmp_path.iterdir())


def test_an_unknown_config_field_is_named_with_a_suggestion(tmp_path):
    cfg = tmp_path / "model.json"
    cfg.write_text(json.dumps({"d_modle": 64}))
    line = error_line(mambakit("train", "--config", str(cfg), "--runs-dir", str(tmp_path)), "train")
    assert "unknown MambaConfig field(s) 'd_modle' (did you mean 'd_model'?)" in line
    assert "__init__" not in line


def test_a_model_flag_that_does_not_fit_is_named(tmp_path):
    got = mambakit(
        "task", "mqar", "--mixer", "mamba3", "--headdim", "48", "--runs-dir", str(tmp_path)
    )
    assert "--headdim 48 does not divide expand * d_model = 128" in error_line(got, "task")


def test_a_diverged_run_says_so_on_stderr_with_status_1(tmp_path, corpus, tiny_json):
    got = mambakit(
        "train", "--data", str(corpus), "--config", str(tiny_json), "--steps", "30",
        "--lr", "1e6", "--max-skipped-steps", "3", "--batch-size", "2", "--seqlen", "32",
        "--sample-tokens", "0", "--no-progress", "--runs-dir", str(tmp_path / "runs"),
    )  # fmt: skip
    assert got.returncode == 1, got.stderr
    assert "training diverged" in got.stderr and "training diverged" not in got.stdout


def test_help_is_quick_and_the_task_example_is_one_runnable_line():
    t0 = time.perf_counter()
    got = mambakit("--help")
    assert got.returncode == 0 and "generate" in got.stdout
    print(f"mambakit --help: {time.perf_counter() - t0:.2f} s")  # the figure, not a test
    got = mambakit("task", "--help")
    examples = [ln.strip() for ln in got.stdout.splitlines() if ln.strip().startswith("mambakit")]
    assert examples, got.stdout
    from mambakit.cli import _parser

    for line in examples:
        assert "  " not in line and not line.endswith("\\"), line
        argv = line.split()[1:]
        _parser(argv[0]).parse_args(argv)  # exits (SystemExit) on a flag that is not there


def test_a_fresh_models_checkpoint_names_no_special_tokens(tmp_path):
    """0 is a real token (the NUL byte): written as eos, generation would stop at it."""
    MambaLM(MambaConfig.preset("tiny", n_layers=1)).save_pretrained(tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        assert cfg[key] is None, (key, cfg[key])
    loaded = MambaLM.from_pretrained(tmp_path / "m")
    assert loaded.config.extra.get("eos_token_id") is None
    transformers = pytest.importorskip("transformers")
    hf = transformers.MambaForCausalLM.from_pretrained(tmp_path / "m")
    assert hf.config.eos_token_id is None


def test_generate_stops_at_every_end_id_of_the_checkpoint(tmp_path):
    """A checkpoint whose eos_token_id lists two ids (end of text, end of turn): `mambakit
    generate` stops at the second one too, where greedy decoding draws it."""
    model = MambaLM(MambaConfig.preset("tiny", n_layers=1)).eval()
    prompt = list(b"def ")
    greedy = model.generate(torch.tensor([prompt]), 12, temperature=0)[0, len(prompt) :]
    end = int(greedy[3])
    first = greedy.tolist().index(end)  # where the end of turn is first drawn
    never = next(t for t in range(256) if t not in greedy.tolist())
    model.config.extra["eos_token_id"] = [never, end]
    model.save_pretrained(tmp_path / "m")
    got = mambakit("generate", "--model", str(tmp_path / "m"), "--prompt", "def ",
                   "--max-new-tokens", "12", "--temperature", "0", "--device", "cpu")  # fmt: skip
    assert got.returncode == 0, got.stderr[-2000:]
    assert f"[{first + 1} tokens" in got.stderr, got.stderr


def test_generate_with_bytes_over_a_padded_vocabulary(tmp_path):
    """A byte-level run of a preset with a word vocabulary (`train --preset 130m`: 50280 ids,
    tokenizer.txt 'byte'): the ids past 255 the model draws print nothing, not an error."""
    torch.manual_seed(0)
    model = MambaLM(MambaConfig(d_model=16, n_layers=1, d_state=4, vocab_size=50280)).eval()
    prompt = torch.tensor([list(b"def ")])
    drawn = model.generate(prompt, 20, seed=0)[0, 4:].tolist()
    assert max(drawn) > 255  # the run below draws these ids
    model.save_pretrained(tmp_path / "m")
    (tmp_path / "m" / "tokenizer.txt").write_text("byte\n")
    got = mambakit("generate", "--model", str(tmp_path / "m"), "--prompt", "def ",
                   "--max-new-tokens", "20", "--seed", "0", "--device", "cpu")  # fmt: skip
    assert got.returncode == 0, got.stderr[-2000:]
    assert "[20 tokens" in got.stderr, got.stderr
    want = bytes(t for t in drawn if t < 256).decode("utf-8", errors="replace")
    assert got.stdout == "def " + want + "\n"


def test_a_hybrid_checkpoint_is_refused_naming_what_is_supported():
    with pytest.raises(CheckpointError, match="not a Mamba-1, Mamba-2 or Mamba-3 model"):
        config_from_json({"model_type": "zamba2", "hidden_size": 64})


def test_an_incomplete_mamba2_config_names_the_missing_field():
    with pytest.raises(CheckpointError, match="num_hidden_layers"):
        config_from_json({"model_type": "mamba2", "hidden_size": 64})
