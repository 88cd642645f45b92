"""The synthetic tasks: generator invariants checked row by row in Python (the oracle),
chunked generation == whole generation, seeding, the metric on a hand-computed example,
chunked evaluation == a whole forward, errors naming the argument, a short CPU training
run that generalises to 4x its length, and `mambakit task` end to end."""

from __future__ import annotations

import json
import math
from collections import Counter

import pytest
import torch

from mambakit import MambaConfig, MambaLM
from mambakit.cli import main
from mambakit.tasks import (
    MQAR,
    InductionHeads,
    SelectiveCopying,
    TaskBatches,
    TaskStream,
    accuracy,
    count_correct,
    distinct_sorted,
    evaluate_length,
    generators,
    make_task,
    powers_of_two,
)
from mambakit.training import TrainConfig, Trainer

TASKS = {
    "ih": lambda: InductionHeads(vocab=16),
    "sc": lambda: SelectiveCopying(vocab=16, n_tokens=16),
    "sc-small": lambda: SelectiveCopying(vocab=5, n_tokens=3),
    "mqar": lambda: MQAR(n_pairs=4, n_keys=10, n_values=7),
}


def whole(task, B=4, T=64, seed=0):
    return TaskStream(task, B, T, seed).whole()


# -- generator invariants --------------------------------------------------------------


@pytest.mark.parametrize("T", [3, 4, 17, 64, 300])
def test_induction_heads_answer_follows_the_earlier_trigger(T):
    task = InductionHeads(vocab=16)
    ids, targets = whole(task, B=64, T=T, seed=T)
    assert ids.shape == targets.shape == (64, T) and ids.dtype == targets.dtype == torch.long
    for row, tgt in zip(ids.tolist(), targets.tolist()):
        assert row[-1] == task.trigger
        earlier = [t for t in range(T - 1) if row[t] == task.trigger]
        assert len(earlier) == 1 and earlier[0] <= T - 3  # once, with its answer inside
        p = earlier[0]
        assert row[p + 1] < 16  # the answer is a data token
        assert tgt[:-1] == [-100] * (T - 1) and tgt[-1] == row[p + 1]  # one scored position
        assert all(0 <= x < 16 for i, x in enumerate(row) if i not in (p, T - 1))


def test_induction_heads_trigger_positions_cover_the_range():
    ids, _ = whole(InductionHeads(), B=2000, T=8, seed=1)
    p = (ids[:, :-1] == 16).float().argmax(1)
    assert set(p.tolist()) == set(range(6))  # every p in [0, T - 3]


@pytest.mark.parametrize("T", [6, 7, 40, 129])
def test_selective_copying_targets_are_the_data_tokens_in_order(T):
    task = SelectiveCopying(vocab=5, n_tokens=3)
    ids, targets = whole(task, B=50, T=T, seed=T)
    k = 3
    for row, tgt in zip(ids.tolist(), targets.tolist()):
        head, copy = row[: T - k], row[T - k :]
        data = [x for x in head if x != task.blank]
        assert len(data) == k and all(0 <= x < 5 for x in data)
        assert copy == [task.marker] * k
        assert tgt[: T - k] == [-100] * (T - k) and tgt[T - k :] == data


def test_selective_copying_paper_setting():
    task = SelectiveCopying()  # vocab 16, 16 tokens, length 4096
    ids, targets = whole(task, B=3, T=4096, seed=5)
    assert ((targets != -100).sum(1) == 16).all()
    assert ((ids[:, :-16] != task.blank).sum(1) == 16).all()
    assert torch.equal(targets[:, -16:], ids[:, :-16][ids[:, :-16] != task.blank].view(3, 16))


def test_mqar_queries_ask_for_the_value_of_their_key():
    task = MQAR(n_pairs=4, n_keys=10, n_values=7)
    ids, targets = whole(task, B=40, T=30, seed=2)
    for row, tgt in zip(ids.tolist(), targets.tolist()):
        kv = dict(zip(row[0:8:2], row[1:8:2]))
        assert len(kv) == 4 and all(k < 10 for k in kv)
        assert all(10 <= v < 17 for v in kv.values())
        queries = [(t, row[t]) for t in range(8, 30) if row[t] != task.blank]
        assert sorted(k for _, k in queries) == sorted(kv)  # each key asked once
        assert all((t - 8) % 2 == 0 for t, _ in queries)
        scored = {t: y for t, y in enumerate(tgt) if y != -100}
        assert scored == {t: kv[k] for t, k in queries}


@pytest.mark.parametrize("name", list(TASKS))
def test_scored_positions_and_vocabulary(name):
    task = TASKS[name]()
    ids, targets = whole(task, B=8, T=64)
    assert ids.min() >= 0 and ids.max() < task.vocab_size
    scored = targets[targets != -100]
    assert scored.numel() > 0 and scored.max() < task.vocab_size
    per_row = (targets != -100).sum(1)
    assert (per_row == per_row[0]).all()


# -- seeding and streaming ---------------------------------------------------------------


@pytest.mark.parametrize("name", list(TASKS))
def test_same_seed_same_rows_other_seed_other_rows(name):
    task = TASKS[name]()
    a, b = whole(task, seed=3), whole(task, seed=3)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    c = whole(task, seed=4)
    assert not torch.equal(a[0], c[0])


def test_a_stream_leaves_the_global_rng_alone():
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    whole(InductionHeads(), seed=9)
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.parametrize("name", list(TASKS))
@pytest.mark.parametrize("chunk", [1, 5, 16, 63, 64, 1000])
@pytest.mark.parametrize("block", [8, 13, 1 << 16])
def test_chunked_generation_equals_whole(name, chunk, block, monkeypatch):
    monkeypatch.setattr(generators, "NOISE_BLOCK", block)  # draws cross block edges
    task = TASKS[name]()
    ids, targets = whole(task, B=3, T=64, seed=7)
    parts = list(TaskStream(task, 3, 64, 7).chunks(chunk))
    assert all(p[0].shape[1] == min(chunk, 64) for p in parts[:-1])
    assert torch.equal(torch.cat([p[0] for p in parts], 1), ids)
    assert torch.equal(torch.cat([p[1] for p in parts], 1), targets)


def test_uneven_reads_compose_and_the_end_is_reported():
    task = InductionHeads()
    ids, targets = whole(task, B=2, T=50, seed=1)
    s = TaskStream(task, 2, 50, 1)
    got = [s.next(n) for n in (1, 20, 3, 100)]  # the last read is cut at T
    assert torch.equal(torch.cat([g[0] for g in got], 1), ids)
    assert torch.equal(torch.cat([g[1] for g in got], 1), targets)
    with pytest.raises(ValueError, match="exhausted"):
        s.next(1)


def test_distinct_sorted_is_a_uniform_subset():
    g = torch.Generator().manual_seed(0)
    draws = distinct_sorted(30000, 5, 2, g, torch.device("cpu"))
    assert (draws[:, 0] < draws[:, 1]).all() and draws.min() >= 0 and draws.max() < 5
    counts = Counter(map(tuple, draws.tolist()))
    assert len(counts) == 10  # C(5, 2)
    for c in counts.values():  # 3000 expected each; 5 sigma is about 260
        assert abs(c - 3000) < 300
    full = distinct_sorted(4, 6, 6, g, torch.device("cpu"))
    assert torch.equal(full, torch.arange(6).expand(4, 6))


def test_task_batches_resume_where_they_stopped():
    task = InductionHeads()
    a = TaskBatches(task, 4, 32, seed=1)
    a.next()
    sd = a.state_dict()
    want = a.next()
    b = TaskBatches(task, 4, 32, seed=99)
    b.load_state_dict(sd)
    got = b.next()
    assert set(got) == {"input_ids", "targets"}
    assert torch.equal(got["input_ids"], want["input_ids"])
    assert torch.equal(got["targets"], want["targets"])
    val = TaskBatches(task, 4, 32, seed=1, split=1).next()
    assert not torch.equal(val["input_ids"], TaskBatches(task, 4, 32, seed=1).next()["input_ids"])


@pytest.mark.parametrize("task", [InductionHeads(), SelectiveCopying(n_tokens=4)])
def test_task_batches_all_targets_add_the_next_token(task):
    """targets="all": the same rows, the answers where they are scored, the next input
    everywhere else, nothing at an unscored last step."""
    answers = TaskBatches(task, 3, 32, seed=5).next()
    dense = TaskBatches(task, 3, 32, seed=5, targets="all").next()
    ids, t, d = answers["input_ids"], answers["targets"], dense["targets"]
    assert torch.equal(dense["input_ids"], ids)
    scored = t != -100
    assert torch.equal(d[scored], t[scored])
    for b in range(ids.shape[0]):
        for i in range(ids.shape[1]):
            if not scored[b, i]:
                want = ids[b, i + 1] if i + 1 < ids.shape[1] else -100
                assert d[b, i] == want
    with pytest.raises(ValueError, match="targets"):
        TaskBatches(task, 3, 32, targets="everything")


# -- the metric -------------------------------------------------------------------------


def test_accuracy_counts_only_scored_positions():
    # 2 rows x 3 positions, vocabulary 4; argmaxes: [[1, 3, 0], [2, 2, 1]]
    logits = torch.tensor(
        [
            [[0.0, 5, 1, 2], [0, 0, 1, 9], [7, 1, 1, 1]],
            [[0, 1, 8, 2], [1, 0, 3, 2], [0, 4, 1, 2]],
        ]
    )
    targets = torch.tensor([[1, -100, 3], [-100, 2, 0]])
    # scored: (0,0) right, (0,2) wrong, (1,1) right, (1,2) wrong; (0,1) would be right
    correct, scored = count_correct(logits, targets)
    assert (int(correct), int(scored)) == (2, 4)
    assert accuracy(logits, targets) == 0.5
    assert math.isnan(accuracy(logits, torch.full((2, 3), -100)))


def test_chunked_evaluation_equals_a_whole_forward(randomize):
    task = InductionHeads(vocab=6)
    torch.manual_seed(0)
    model = MambaLM(MambaConfig(d_model=16, n_layers=2, d_state=4, vocab_size=task.vocab_size))
    model = randomize(model, scale=2.0).double()
    results = [
        evaluate_length(model, task, 40, rows=64, batch_size=b, chunk_len=c, seed=3)
        for b, c in ((64, 40), (64, 7), (64, 1), (16, 13))
    ]
    # the oracle: the same rows (batch_size 64 is one stream) in one forward
    from mambakit.tasks.evaluate import SPLIT_TEST, stream_seed

    ids, targets = TaskStream(task, 64, 40, stream_seed(SPLIT_TEST, 3, 40, 0)).whole()
    with torch.no_grad():
        correct, scored = count_correct(model(ids).logits, targets)
    assert scored == 64 and 0 < int(correct) < 64  # an untrained model: some right, not all
    for r in results[:3]:
        assert (r.correct, r.scored) == (int(correct), 64)
    assert results[3].scored == 64  # other batches: other rows, the same count


# -- errors name the argument --------------------------------------------------------------


@pytest.mark.parametrize(
    "call, name",
    [
        (lambda: InductionHeads(vocab=1), "vocab"),
        (lambda: SelectiveCopying(n_tokens=0), "n_tokens"),
        (lambda: MQAR(n_pairs=8, n_keys=4), "n_keys"),
        (lambda: TaskStream(InductionHeads(), 0, 16), "batch_size"),
        (lambda: TaskStream(InductionHeads(), 2, 2), "seqlen"),
        (lambda: TaskStream(SelectiveCopying(), 2, 31), "seqlen"),
        (lambda: TaskStream(InductionHeads(), 2, 16).next(0), "n"),
        (lambda: list(TaskStream(InductionHeads(), 2, 16).chunks(0)), "chunk_len"),
        (lambda: TaskBatches(InductionHeads(), 2, 1.5), "seqlen"),
        (lambda: count_correct(torch.zeros(2, 3, 4), torch.zeros(2, 4)), "logits"),
        (lambda: powers_of_two(48, 128), "min_len"),
        (lambda: powers_of_two(64, 32), "min_len"),
        (lambda: make_task("copying"), "task"),
    ],
)
def test_errors_name_the_argument(call, name):
    with pytest.raises(ValueError, match=rf"\b{name}\b"):
        call()


def test_powers_of_two():
    assert powers_of_two(64, 1 << 20) == [1 << k for k in range(6, 21)]
    assert powers_of_two(8, 8) == [8]


# -- training: a short CPU run generalises to 4x its length --------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0])
def test_induction_heads_trained_at_32_solve_128(seed):
    """2 layers, d_model 32, d_state 8, 300 steps of 32 rows x 32 tokens, Adam lr 5e-3
    (about 45 s on one busy core). Measured over seeds 0-4: 87-100% at length 128."""
    task = InductionHeads(vocab=16)
    torch.manual_seed(seed)
    model = MambaLM(MambaConfig(d_model=32, n_layers=2, d_state=8, vocab_size=task.vocab_size))
    cfg = TrainConfig(
        steps=300, batch_size=32, seqlen=32, lr=5e-3, warmup_steps=10, weight_decay=0.0,
        min_lr_ratio=1.0, eval_every=0, seed=seed, device="cpu", ckpt_every_minutes=0,
    )  # fmt: skip
    trainer = Trainer(model, cfg, TaskBatches(task, 32, 32, seed=seed), log=lambda s: None)
    trainer.fit(progress=False)
    r = evaluate_length(model, task, 128, rows=256, batch_size=64, chunk_len=48, seed=seed)
    assert r.scored == 256
    assert r.accuracy > 0.5, f"accuracy {r.accuracy:.3f} at 4x the training length (chance 1/16)"


# -- the command line ---------------------------------------------------------------------


def task_args(runs, task, *extra):
    return [
        "task", task,
        "--d-model", "16", "--d-state", "4", "--steps", "3", "--seqlen", "64",
        "--batch-size", "2", "--min-len", "64", "--max-len", "256", "--eval-rows", "3",
        "--eval-batch-size", "2", "--chunk-len", "40", "--runs-dir", str(runs),
        "--no-progress", "--device", "cpu", *extra,
    ]  # fmt: skip


@pytest.mark.parametrize("task", ["induction-heads", "selective-copying", "mqar"])
def test_cli_trains_tests_and_writes_the_table(task, tmp_path, capsys):
    runs = tmp_path / "runs"
    assert main(task_args(runs, task)) == 0
    out = capsys.readouterr().out
    assert "accuracy by test length (trained at 64" in out
    for T in ("64", "128", "256"):
        assert any(line.split()[:1] == [T] for line in out.splitlines()), out
    run = runs / task
    table = json.loads((run / "accuracy.json").read_text())
    assert [r["seqlen"] for r in table["results"]] == [64, 128, 256]
    per_row = {"induction-heads": 1, "selective-copying": 16, "mqar": 8}[task]
    assert all(r["scored"] == 3 * per_row for r in table["results"])
    assert all(0 <= r["accuracy"] <= 1 for r in table["results"])
    assert table["steps"] == 3 and table["train_seqlen"] == 64
    assert (run / "accuracy.png").is_file() and (run / "metrics.jsonl").is_file()
    assert (run / (run / "latest").read_text().strip() / "model.safetensors").is_file()
    # the checkpoint is a MambaLM that loads
    MambaLM.from_pretrained(run / (run / "latest").read_text().strip())
    # a second run of the same name is refused
    assert main(task_args(runs, task)) == 2
    assert "already holds a run" in capsys.readouterr().err


def test_cli_resume_trains_on_from_the_latest_checkpoint(tmp_path, capsys):
    runs = tmp_path / "runs"
    assert main(task_args(runs, "induction-heads")) == 0
    capsys.readouterr()
    args = task_args(runs, "induction-heads", "--resume")
    args[args.index("--steps") + 1] = "5"
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "at step 3" in out and "trained: step 5," in out
    table = json.loads((runs / "induction-heads" / "accuracy.json").read_text())
    assert table["steps"] == 5
    metrics = (runs / "induction-heads" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(m)["step"] for m in metrics if '"loss"' in m][-1] == 5


def test_cli_max_minutes_stops_training_then_tests(tmp_path, capsys):
    # a time limit shorter than one step: the trainer stops after its first step, checks
    # the clock, saves, and the test still runs at every length
    runs = tmp_path / "runs"
    assert main(task_args(runs, "induction-heads", "--max-minutes", "1e-9")) == 0
    table = json.loads((runs / "induction-heads" / "accuracy.json").read_text())
    assert table["steps"] == 1
    assert [r["seqlen"] for r in table["results"]] == [64, 128, 256]
    assert "trained: step 1," in capsys.readouterr().out


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--max-len", "1000"], "--max-len must be a power of two"),
        (["--min-len", "512"], "--min-len 512 exceeds --max-len 256"),
        (["--vocab", "1"], "--vocab must be at least 2"),
        (["--seqlen", "2"], "--seqlen must be at least 3"),
        (["--steps", "0"], "--steps must be at least 1"),
        (["--chunk-len", "0"], "--chunk-len must be at least 1"),
        (["--max-minutes", "0"], "--max-minutes must be positive"),
    ],
)
def test_cli_errors_are_one_line_naming_the_flag(extra, message, tmp_path, capsys):
    assert main(task_args(tmp_path, "induction-heads", *extra)) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err


def test_cli_selective_copying_min_len(tmp_path, capsys):
    args = task_args(tmp_path, "selective-copying", "--min-len", "16", "--seqlen", "64")
    assert main(args) == 2
    assert "--min-len 16 is shorter than selective-copying allows (32)" in capsys.readouterr().err
