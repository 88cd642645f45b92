"""The CPU thread policy (mambakit.threads) as the library applies it: a Trainer on a CPU
device and `generate` on a CPU model set torch's thread count by it, the caller's value
before the environment, a count the user set on torch kept, the automatic choice measured
once per process."""

from __future__ import annotations

import pytest
import torch

from mambakit import MambaConfig, MambaLM, threads
from mambakit.training import TrainConfig, Trainer

V = 32  # vocabulary of the tiny model


def tiny_lm() -> MambaLM:
    torch.manual_seed(0)
    return MambaLM(MambaConfig(d_model=16, n_layers=1, vocab_size=V, d_state=4))


class OneBatch:
    """The same batch forever."""

    def next(self) -> dict[str, torch.Tensor]:
        ids = torch.arange(2 * 9).remainder(V).view(2, 9)
        return {"input_ids": ids[:, :-1], "targets": ids[:, 1:]}


def make_trainer(**kw) -> Trainer:
    cfg = TrainConfig(steps=1, batch_size=2, seqlen=8, warmup_steps=0, device="cpu", **kw)
    return Trainer(tiny_lm(), cfg, OneBatch(), log=lambda s: None)


@pytest.fixture(autouse=True)
def fresh_threads(monkeypatch):
    """No environment, no choice cached or applied by an earlier test; torch's count
    restored afterwards."""
    before = torch.get_num_threads()
    for env in (threads.THREADS_ENV, "OMP_NUM_THREADS"):
        monkeypatch.delenv(env, raising=False)
    monkeypatch.setattr(threads, "_auto", None)
    monkeypatch.setattr(threads, "_applied", None)
    yield
    torch.set_num_threads(before)


def test_trainer_on_cpu_applies_the_policy(monkeypatch):
    monkeypatch.setenv(threads.THREADS_ENV, "1")
    torch.set_num_threads(2)
    make_trainer()
    assert torch.get_num_threads() == 1  # the environment
    make_trainer(threads=2)
    assert torch.get_num_threads() == 2  # TrainConfig.threads before the environment
    with pytest.raises(ValueError, match=r"TrainConfig\.threads"):
        make_trainer(threads=0)


def two_cores(monkeypatch, load: float) -> list[float]:
    """The machine seen as 2 cpus of 2 cores with `load` cores busy; returns the list of
    loads measured."""
    measured = []

    def busy_cores() -> float:
        measured.append(load)
        return load

    monkeypatch.setattr(threads, "busy_cores", busy_cores)
    monkeypatch.setattr(threads, "physical_cores", lambda cpus: 2)
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: {0, 1})
    return measured


def test_trainer_automatic_choice_is_measured_once(monkeypatch):
    measured = two_cores(monkeypatch, load=1.0)
    torch.set_num_threads(2)  # torch's own count on 2 physical cores
    make_trainer()
    assert torch.get_num_threads() == 1  # 2 cores, one of them busy
    make_trainer()
    assert torch.get_num_threads() == 1
    assert len(measured) == 1  # from the choice kept, not a second measurement
    torch.set_num_threads(2)  # the user's choice now (not what the policy set): kept
    make_trainer()
    assert torch.get_num_threads() == 2 and len(measured) == 1


def test_trainer_keeps_a_count_set_on_torch(monkeypatch):
    two_cores(monkeypatch, load=0.0)  # automatic would be 2, as torch's own default
    torch.set_num_threads(3)
    make_trainer()
    assert torch.get_num_threads() == 3


def test_a_count_set_on_torch_is_kept_at_every_later_call(monkeypatch):
    """The user's torch.set_num_threads(1) on 2 idle cores: the first call keeps it, and so
    does every later one (it is not taken for the policy's own count, so nothing measures
    the load and sets 2)."""
    measured = two_cores(monkeypatch, load=0.0)
    torch.set_num_threads(1)
    model = tiny_lm()
    for _ in range(3):
        model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2, seed=0)
        assert torch.get_num_threads() == 1
    assert measured == []


def test_an_environment_value_that_is_not_a_whole_number_is_named(monkeypatch):
    for bad in ("x", "0", "\u00b2", "-1"):
        monkeypatch.setenv(threads.THREADS_ENV, bad)
        with pytest.raises(ValueError, match=threads.THREADS_ENV):
            threads.choose_threads()


def test_generate_on_cpu_applies_the_policy(monkeypatch):
    monkeypatch.setenv(threads.THREADS_ENV, "1")
    model = tiny_lm()
    torch.set_num_threads(2)
    out = model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2, seed=0)
    assert out.shape == (1, 5)
    assert torch.get_num_threads() == 1
