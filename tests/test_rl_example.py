"""examples/rl_policy.py: acting with per-row resets equals each episode run alone from a zero
state; the truncated-BPTT windows (carried state, resets by `seq_idx` and at window starts)
equal one forward over the rollout and the acting steps; a short run learns the task."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

PATH = Path(__file__).resolve().parents[1] / "examples" / "rl_policy.py"
_spec = importlib.util.spec_from_file_location("rl_policy", PATH)
rl = importlib.util.module_from_spec(_spec)
sys.modules["rl_policy"] = rl  # dataclasses look their module up there
_spec.loader.exec_module(rl)

MIXERS = ["mamba1", "mamba2", "mamba3"]
TOL = dict(rtol=1e-4, atol=1e-5)  # f32: the step and the sequence forward sum in other orders


def actor(mixer: str, n_envs: int, seed: int = 0) -> rl.Actor:
    """An untrained policy (actions do not change the task's dynamics) acting in short
    episodes of random length: 2 to 6 steps."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    env = rl.CueMemory(n_envs, n_cues=3, min_delay=0, max_delay=4, generator=gen)
    policy = rl.make_policy(env.obs_dim, 3, mixer, d_model=32, n_layers=2, d_state=8)
    return rl.Actor(policy, env, gen)


def segments(first: torch.Tensor) -> list[tuple[int, int]]:
    """first [T] bool -> the [start, end) of each episode piece of one row."""
    starts = [0] + [t for t in range(1, len(first)) if first[t]]
    return list(zip(starts, starts[1:] + [len(first)]))


@pytest.mark.parametrize("mixer", MIXERS)
def test_acting_with_resets_equals_each_episode_alone(mixer):
    a = actor(mixer, n_envs=5)
    ro = a.collect(20)
    assert ro.first[:, 0].all()  # a fresh actor: every row starts an episode at step 0
    ends = [tuple(t for t in range(20) if ro.dones[b, t]) for b in range(5)]
    assert len(set(ends)) > 1 and min(map(len, ends)) >= 3  # rows reset at different times
    worst_without_reset = 0.0
    with torch.no_grad():
        for b in range(5):
            for s, e in segments(ro.first[b]):
                logits, values, _ = a.policy(ro.obs[b : b + 1, s:e])  # from a zero state
                torch.testing.assert_close(ro.logits[b, s:e], logits[0], **TOL)
                torch.testing.assert_close(ro.values[b, s:e], values[0], **TOL)
            # the oracle can tell: the row run through without resets differs
            logits, _, _ = a.policy(ro.obs[b : b + 1])
            worst_without_reset = max(worst_without_reset, (logits[0] - ro.logits[b]).abs().max())
    assert worst_without_reset > 100 * TOL["atol"]


@pytest.mark.parametrize("mixer", MIXERS)
def test_windows_equal_one_forward_and_the_acting_steps(mixer):
    a = actor(mixer, n_envs=6, seed=1)
    a.collect(7)  # the rollout below starts in the middle of episodes
    ro = a.collect(24)
    assert not ro.first[:, 0].all() and ro.state0.ssm.abs().sum() > 0
    with torch.no_grad():
        whole_logits, whole_values, _ = a.policy(
            ro.obs, ro.state0.clone(), rl.episode_ids(ro.first)
        )
        torch.testing.assert_close(whole_logits, ro.logits, **TOL)
        torch.testing.assert_close(whole_values, ro.values, **TOL)
        starts_at_a_window_start = 0
        for window in (3, 5, 8, 24):
            starts_at_a_window_start += int(ro.first[:, window::window].sum())
            got = list(rl.windows(a.policy, ro, window))
            assert [w[0].start for w in got] == list(range(0, 24, window))
            logits = torch.cat([w[1] for w in got], dim=1)
            values = torch.cat([w[2] for w in got], dim=1)
            torch.testing.assert_close(logits, whole_logits, **TOL)
            torch.testing.assert_close(values, whole_values, **TOL)
            torch.testing.assert_close(logits, ro.logits, **TOL)
    # some episode began exactly at a window's first step (the reset_ on the carried state),
    # and some inside a window (seq_idx)
    assert starts_at_a_window_start > 0
    assert ro.first[:, 1:].sum() > starts_at_a_window_start


def test_windows_carry_gradients_within_a_window_only():
    a = actor("mamba2", n_envs=2)
    ro = a.collect(8)
    obs = ro.obs.clone().requires_grad_(True)
    ro.obs = obs
    (steps0, logits0, _), (steps1, logits1, _) = rl.windows(a.policy, ro, 4)
    logits1[:, -1].sum().backward()
    assert obs.grad[:, steps1].abs().sum() > 0
    assert obs.grad[:, steps0].abs().sum() == 0  # the state between windows is detached


def test_returns_cut_at_episode_ends_and_bootstrap():
    ro = rl.Rollout(
        state0=None, obs=None, first=None, actions=None, correct=None, logits=None,
        values=None,
        rewards=torch.tensor([[0.0, 1.0, 0.0, 0.0]]),
        dones=torch.tensor([[False, True, False, False]]),
        last_value=torch.tensor([2.0]),
    )  # fmt: skip
    torch.testing.assert_close(rl.returns(ro, 0.5), torch.tensor([[0.5, 1.0, 0.5, 1.0]]))


def test_a_short_run_learns_to_remember_the_cue():
    cfg = rl.TrainConfig(
        mixer="mamba2", d_model=32, n_envs=32, rollout=16, window=8, min_delay=1, max_delay=4,
        iters=40, log_every=0, seed=0,
    )  # fmt: skip
    policy, history = rl.train(cfg)
    chance = 1 / cfg.n_cues
    first = sum(h["accuracy"] for h in history[:5]) / 5
    last = sum(h["accuracy"] for h in history[-5:]) / 5
    assert first < chance + 0.1  # it starts at chance
    assert last > 0.55, [round(h["accuracy"], 2) for h in history]  # reaches 0.9 at seed 0
    assert rl.evaluate(policy, cfg) > 0.6
