"""Training on two processes (gloo, CPU) against one process over the same global batch.

Each test spawns two ranks with torchrun's environment variables set by hand. A run of
DDP or FSDP2 on 2 x 2 rows must end with the weights of one process training on the
same 4 rows (f32 tolerance: the gradient sums are ordered differently); a checkpoint
written by 2 ranks resumes on 1 and one written by 1 resumes on 2, matching an
uninterrupted run; two deterministic runs give the same bits.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from mambakit import MambaConfig, MambaLM
from mambakit.training import TrainConfig, Trainer

V, T, ROWS = 48, 16, 4  # vocabulary, row length, rows of the global batch


class Source:
    """Global batches of random tokens, the same on every rank; its cursor is checkpointed."""

    def __init__(self) -> None:
        self.i = 0

    def next(self) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(1000 + self.i)
        self.i += 1
        ids = torch.randint(0, V, (ROWS, T + 1), generator=g)
        return {"input_ids": ids[:, :-1], "targets": ids[:, 1:]}

    def state_dict(self) -> dict[str, int]:
        return {"i": self.i}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.i = sd["i"]


def _trainer(mode: str, world: int, steps: int, run_dir=None, deterministic=False) -> Trainer:
    torch.manual_seed(0)
    model = MambaLM(MambaConfig(d_model=32, n_layers=2, vocab_size=V, d_state=8))
    cfg = TrainConfig(
        steps=steps,
        batch_size=ROWS // world,
        seqlen=T,
        tbptt_len=T // 2,  # two backwards per micro-batch
        grad_accum=2,  # and two micro-batches: only the step's last backward reduces
        lr=1e-2,
        warmup_steps=0,
        min_lr_ratio=1.0,  # a constant lr: a run cut at step 2 and resumed equals one of 3
        device="cpu",
        precision="f32",
        eval_every=0,
        log_every=1,
        ckpt_every_minutes=0,
        run_dir=str(run_dir) if run_dir else None,
        deterministic=deterministic,
        distributed=mode,
    )
    return Trainer(model, cfg, Source(), log=lambda *a: None)


def _weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    full = trainer._full_weights()  # FSDP2: gathered (a collective); else the model's own
    sd = full if full is not None else trainer.model.state_dict()
    return {k: v.detach().clone() for k, v in sd.items()}


def _rank(rank, world, port, mode, steps, out, run_dir, resume, deterministic):
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
    )
    torch.set_num_threads(1)
    trainer = _trainer(mode, world, steps, run_dir, deterministic)
    if resume:
        assert trainer.resume()
    trainer.fit(progress=False)
    w = _weights(trainer)
    if rank == 0:
        torch.save({"weights": w, "step": trainer.step}, out)
    # both ranks done before the group goes (a rank leaving early can abort the other's gloo
    # threads), then out without the interpreter's teardown of the gloo threads
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    os._exit(0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(mode, world, steps, out: Path, run_dir=None, resume=False, deterministic=False):
    """Train on `world` processes (or in this one for world 1, mode none); the final
    weights as rank 0 saw them."""
    if world == 1:
        trainer = _trainer("none", 1, steps, run_dir, deterministic)
        if resume:
            assert trainer.resume()
        trainer.fit(progress=False)
        return _weights(trainer), trainer.step
    args = (world, _free_port(), mode, steps, str(out), run_dir, resume, deterministic)
    mp.spawn(_rank, args=args, nprocs=world, join=True)
    got = torch.load(out, weights_only=True)
    return got["weights"], got["step"]


def assert_close_weights(a, b, rtol=1e-4, atol=1e-6):
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=rtol, atol=atol, msg=lambda m, k=k: f"{k}: {m}")


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """One process, 4 rows a micro-batch, 3 steps: the reference for every world size."""
    return run("none", 1, 3, tmp_path_factory.mktemp("single") / "w.pt")[0]


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_two_processes_equal_one(mode, single, tmp_path):
    w, step = run(mode, 2, 3, tmp_path / "w.pt")
    assert step == 3
    # the weights moved (the comparison is not between two untrained models)
    torch.manual_seed(0)
    init = MambaLM(MambaConfig(d_model=32, n_layers=2, vocab_size=V, d_state=8)).state_dict()
    assert any(not torch.equal(w[k], init[k]) for k in init)
    assert_close_weights(w, single)


@pytest.mark.parametrize("saved_on, resumed_on", [(2, 1), (1, 2)])
def test_checkpoint_resumes_on_another_world_size(saved_on, resumed_on, single, tmp_path):
    run_dir = tmp_path / "run"
    mode = "fsdp"  # the sharded engine: full tensors must be gathered and re-sharded
    _, step = run(mode if saved_on > 1 else "none", saved_on, 2, tmp_path / "a.pt", run_dir)
    assert step == 2 and (run_dir / "latest").is_file()
    w, step = run(
        mode if resumed_on > 1 else "none", resumed_on, 3, tmp_path / "b.pt", run_dir, True
    )
    assert step == 3
    assert_close_weights(w, single)


@pytest.mark.slow
def test_deterministic_runs_are_bit_identical(tmp_path):
    a, _ = run("ddp", 2, 2, tmp_path / "a.pt", deterministic=True)
    b, _ = run("ddp", 2, 2, tmp_path / "b.pt", deterministic=True)
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_rows_must_split_over_ranks():
    from mambakit.training.distributed import Dist, shard_rows

    batch = {"input_ids": torch.zeros(3, 4, dtype=torch.long)}
    with pytest.raises(ValueError, match="does not split over 2 processes"):
        shard_rows(batch, Dist("ddp", 0, 2))
    got = shard_rows({"x": torch.arange(4)[:, None]}, Dist("ddp", 1, 2))
    assert got["x"].flatten().tolist() == [2, 3]


def test_distributed_needs_a_process_group(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(ValueError, match="launch with torchrun"):
        _trainer("ddp", 1, 1)
    with pytest.raises(ValueError, match="distributed must be one of"):
        TrainConfig(distributed="zero")


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
@pytest.mark.slow
def test_cli_under_torchrun(mode, tmp_path, corpus, tiny_json):
    """`torchrun --nproc_per_node 2 -m mambakit train --distributed MODE`: one progress
    report (rank 0's), a checkpoint that loads, metrics; then a resume on one process."""
    import subprocess
    import sys

    sys.path.insert(0, str(Path(__file__).parents[1] / "cli"))  # also when run alone
    from test_train_cli import read_metrics, train_args

    runs = tmp_path / "runs"
    args = train_args(corpus, tiny_json, runs, "--distributed", mode, steps=4, sample_tokens=8)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           "2", "-m", "mambakit", *args]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.count("done: step 4") == 1, done.stdout  # rank 0 alone prints
    assert "on each of 2 processes" in done.stdout
    run = runs / "t"
    ckpt = run / (run / "latest").read_text().strip()
    MambaLM.from_pretrained(ckpt)  # a plain, whole model
    assert [r["step"] for r in read_metrics(run) if "val_loss" in r] == [3, 4]
    # the same run continues on one process
    args = train_args(corpus, tiny_json, runs, "--resume", steps=6)
    done = subprocess.run([sys.executable, "-m", "mambakit", *args], capture_output=True,
                          text=True, env=env, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "resumed" in done.stdout and "done: step 6" in done.stdout
