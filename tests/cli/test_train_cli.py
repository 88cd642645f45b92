"""`mambakit train` end to end, in-process, with a tiny model on a tmp folder of text:
metrics, the loss plot, a loadable checkpoint, resume, refusal to overwrite, errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mambakit import MambaLM
from mambakit.cli import main


def train_args(corpus, tiny_json, runs, *extra, steps=6, sample_tokens=0):
    return [
        "train",
        "--data",
        str(corpus),
        "--config",
        str(tiny_json),
        "--steps",
        str(steps),
        "--batch-size",
        "2",
        "--seqlen",
        "32",
        "--eval-every",
        "3",
        "--warmup-steps",
        "2",
        "--sample-tokens",
        str(sample_tokens),
        "--runs-dir",
        str(runs),
        "--name",
        "t",
        "--no-progress",
        "--device",
        "cpu",
        *extra,
    ]


def read_metrics(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x]


def test_train_end_to_end_then_resume_then_refuse(tmp_path, corpus, tiny_json, capsys):
    runs = tmp_path / "runs"
    run = runs / "t"
    assert main(train_args(corpus, tiny_json, runs)) == 0
    out = capsys.readouterr().out
    assert "done: step 6" in out

    records = read_metrics(run)
    assert [r["step"] for r in records if "val_loss" in r] == [3, 6]
    final = records[-1]
    assert final["step"] == 6 and "loss" in final and "val_loss" in final
    assert all(r["val_loss"] > 0 for r in records if "val_loss" in r)
    png = run / "loss.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    assert (run / "latest").read_text().strip() == "step_0000006"
    ckpt = run / "step_0000006"
    assert (ckpt / "tokenizer.txt").read_text().strip() == "byte"
    model = MambaLM.from_pretrained(ckpt)
    assert model.config.d_model == 16 and model.config.n_layers == 1
    assert model.config.vocab_size >= 256
    ids = torch.tensor([list(b"def f(x):")])
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape[:2] == (1, 9) and torch.isfinite(logits).all()

    # --resume continues from step 6 to step 9
    assert main(train_args(corpus, tiny_json, runs, "--resume", steps=9)) == 0
    out = capsys.readouterr().out
    assert "resumed" in out and "step 6" in out
    assert (run / "latest").read_text().strip() == "step_0000009"
    steps = [r["step"] for r in read_metrics(run)]
    assert steps[: len(records)] == [r["step"] for r in records]  # appended, not rewritten
    assert max(steps) == 9 and 7 <= min(s for s in steps if s > 6)
    resumed = MambaLM.from_pretrained(run / "step_0000009")
    assert any(
        not torch.equal(a, b)
        for a, b in zip(resumed.state_dict().values(), model.state_dict().values())
    )

    # a rerun without --resume must not overwrite the run
    before = sorted(p.name for p in run.iterdir())
    assert main(train_args(corpus, tiny_json, runs)) == 2
    assert "--resume" in capsys.readouterr().err
    assert sorted(p.name for p in run.iterdir()) == before


def test_train_prints_a_sample(tmp_path, corpus, tiny_json, capsys):
    runs = tmp_path / "runs"
    assert main(train_args(corpus, tiny_json, runs, steps=2, sample_tokens=10)) == 0
    out = capsys.readouterr().out
    assert "sample:" in out
    sample = out.split("sample:\n", 1)[1].split("-" * 60)[1].strip("\n")
    assert sample.startswith("def ")
    assert len(sample.encode("utf-8", errors="surrogateescape")) >= 4


def test_train_cli_resume_matches_an_uninterrupted_run(tmp_path, corpus, tiny_json):
    """The CLI's --resume restores optimizer, schedule and data cursor: 3 + 3 steps with a
    checkpoint in between give the same weights as 6 straight (deterministic)."""
    det = torch.are_deterministic_algorithms_enabled()
    try:
        a, b = tmp_path / "a", tmp_path / "b"
        main(train_args(corpus, tiny_json, a, "--deterministic", "--ckpt-every", "3"))
        main(train_args(corpus, tiny_json, b, "--deterministic", "--ckpt-every", "3"))
        # simulate b dying after step 3: roll its `latest` back and resume from there
        (b / "t" / "latest").write_text("step_0000003\n")
        main(train_args(corpus, tiny_json, b, "--deterministic", "--resume"))
    finally:
        torch.use_deterministic_algorithms(det)
    wa = MambaLM.from_pretrained(a / "t" / "step_0000006").state_dict()
    wb = MambaLM.from_pretrained(b / "t" / "step_0000006").state_dict()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k


def test_train_with_a_tokenizer_json(tmp_path, corpus, tiny_json):
    """A word-level tokenizer.json trained on the corpus: it is used and copied beside the
    checkpoint so the checkpoint can be decoded later."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    wl = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    wl.pre_tokenizer = pre_tokenizers.Whitespace()
    texts = [f.read_text() for f in sorted(corpus.iterdir())]
    wl.train_from_iterator(texts, trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
    tok = tmp_path / "tok" / "tokenizer.json"
    tok.parent.mkdir()
    wl.save(str(tok))
    runs = tmp_path / "runs"
    assert main(train_args(corpus, tiny_json, runs, "--tokenizer", str(tok), steps=2)) == 0
    ckpt = runs / "t" / "step_0000002"
    assert (ckpt / "tokenizer.json").read_bytes() == tok.read_bytes()
    model = MambaLM.from_pretrained(ckpt)
    assert model.config.vocab_size >= wl.get_vocab_size()
    assert "[UNK]" not in wl.decode(wl.encode("def f3_4(x):").ids)


def test_train_cli_errors_name_the_problem(tmp_path, corpus, tiny_json, capsys):
    """A user's mistake: exit 2 and one line naming the flag or file, no traceback."""
    runs = tmp_path / "runs"
    bad = tmp_path / "list.json"
    bad.write_text("[1, 2]")
    garbage = tmp_path / "garbage.json"
    garbage.write_text("{d_model: 16")
    cases = [
        (train_args(tmp_path / "missing_dir", tiny_json, runs), "missing_dir' does not exist"),
        (train_args(corpus, bad, runs), "JSON object"),
        (train_args(corpus, garbage, runs), f"--config {garbage}: not valid JSON"),
        (train_args(corpus, tiny_json, runs, "--batch-size", "0"), "--batch-size"),
        (train_args(corpus, tiny_json, runs, "--grad-accum", "0"), "--grad-accum"),
        (train_args(corpus, tiny_json, runs, "--max-minutes", "0"), "--max-minutes"),
        (train_args(corpus, tiny_json, runs, "--lr", "-1"), "--lr must be a positive"),
        (train_args(corpus, tiny_json, runs, "--batch-size", "100000"), "--batch-size 100000"),
        # both: it trained eagerly without a word
        (train_args(corpus, tiny_json, runs, "--cuda-graph", "--no-cuda-graph"), "contradict"),
    ]
    for argv, message in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("mambakit train: error: "), err
        assert message in lines[0], (message, err)
    with pytest.raises(SystemExit) as e:  # argparse: not a precision
        main(train_args(corpus, tiny_json, runs, "--precision", "fp8"))
    assert e.value.code == 2
    assert not (runs / "t" / "latest").exists()
    # --debug shows the traceback instead
    with pytest.raises(ValueError, match="not valid JSON"):
        main(["--debug", *train_args(corpus, garbage, runs)])


def test_train_a_mamba3_preset_then_resume(tmp_path, corpus):
    """`--preset tiny-mamba3` (a --config file shrinking it): trains, writes a checkpoint
    that loads as a Mamba-3 model, resumes."""
    small = tmp_path / "m3.json"
    small.write_text(json.dumps({"d_model": 16, "n_layers": 1, "d_state": 8, "headdim": 8}))
    runs = tmp_path / "runs"
    args = train_args(corpus, small, runs, "--preset", "tiny-mamba3", steps=3)
    assert main(args) == 0
    model = MambaLM.from_pretrained(runs / "t" / "step_0000003")
    assert model.config.mixer == "mamba3" and model.config.headdim == 8
    ids = torch.tensor([list(b"def f(x):")])
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()
    resume = train_args(corpus, small, runs, "--preset", "tiny-mamba3", "--resume", steps=5)
    assert main(resume) == 0
    assert (runs / "t" / "latest").read_text().strip() == "step_0000005"
