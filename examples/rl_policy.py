"""A recurrent actor-critic on a memory task: a Mamba policy acting in N parallel episodes.

    python examples/rl_policy.py                      # CPU, Mamba-2: about 25 s, accuracy 1.0
    python examples/rl_policy.py --mixer mamba3 --device cuda

On a 2-core CPU Mamba-3 takes about 35 s and Mamba-1 about 2.5 minutes (its CPU backward is
the slowest at this size); all three reach accuracy 1.0.

The task (`CueMemory`, vectorised in torch, no gym): an episode shows one of K cues at its
first step, then D blank steps (D drawn per episode, so rows end at different times), then
a query step at which the action that matches the cue earns reward 1 (any other, 0). Actions
at the other steps do nothing. The query step does not show the cue, so only a policy that
remembers it beats chance (1/K): the mean return per episode is the accuracy.

Acting runs `MambaBackbone.step(obs, state)` without autograd, one step at a time, the state
advanced in place (on CUDA the library replays a captured graph); where an episode ends,
`state.reset_(done)` zeroes that row's state before the next episode's first observation.

Training is A2C with truncated BPTT over each rollout of T steps: windows of W steps, the
first starting from the state recorded when the rollout began, each next one from the
previous window's final state, detached. An episode that begins inside a window is cut from
the one before by `seq_idx` (the state resets where it changes within a row; a forward's
initial state reaches only a row's first segment); one that begins at a window's first step
by `reset_` on the carried state. The windows' outputs equal one forward over the rollout,
and the acting steps' (tests/test_rl_example.py).

B rows (parallel episodes), T rollout steps, W window steps, F = obs_dim, K cues (actions).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from mambakit import MambaBackbone, MambaConfig
from mambakit.state import ModelState
from mambakit.threads import apply_threads


class CueMemory:
    """B parallel episodes of the cue-delay task; every row restarts itself when it ends.

    Observation [B, K + 1]: the cue one-hot at an episode's first step (zeros after), and a
    query flag at its last step. An episode lasts D + 2 steps, D uniform in
    [min_delay, max_delay]."""

    def __init__(
        self,
        n_envs: int,
        n_cues: int = 4,
        min_delay: int = 2,
        max_delay: int = 10,
        device: torch.device | str = "cpu",
        generator: torch.Generator | None = None,
    ) -> None:
        if not 0 <= min_delay <= max_delay:
            raise ValueError(f"need 0 <= min_delay <= max_delay, got {min_delay}, {max_delay}")
        self.n_envs, self.n_cues = n_envs, n_cues
        self.min_delay, self.max_delay = min_delay, max_delay
        self.device = torch.device(device)
        self.generator = generator
        z = torch.zeros(n_envs, dtype=torch.long, device=self.device)
        self.cue, self.t, self.length = z.clone(), z.clone(), z.clone()

    @property
    def obs_dim(self) -> int:
        return self.n_cues + 1

    def _randint(self, low: int, high: int) -> torch.Tensor:
        return torch.randint(
            low, high, (self.n_envs,), device=self.device, generator=self.generator
        )

    def _start(self, rows: torch.Tensor) -> None:
        """New episodes in the rows where `rows` [B] is True (no host sync)."""
        self.cue = torch.where(rows, self._randint(0, self.n_cues), self.cue)
        length = self._randint(self.min_delay, self.max_delay + 1) + 2
        self.length = torch.where(rows, length, self.length)
        self.t = torch.where(rows, 0, self.t)

    def observe(self) -> torch.Tensor:
        cue = F.one_hot(self.cue, self.n_cues).float() * (self.t == 0).unsqueeze(1)
        query = (self.t == self.length - 1).float().unsqueeze(1)
        return torch.cat([cue, query], dim=1)  # [B, K + 1]

    def reset(self) -> torch.Tensor:
        self._start(torch.ones(self.n_envs, dtype=torch.bool, device=self.device))
        return self.observe()

    def step(self, action: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """action [B] -> (next obs [B, F], reward [B], done [B], correct [B]); the rows that
        are done start a new episode, whose first observation `next obs` is."""
        done = self.t == self.length - 1
        correct = done & (action == self.cue)
        self.t = self.t + 1
        self._start(done)
        return self.observe(), correct.float(), done, correct


class Policy(nn.Module):
    """MambaBackbone over float observations, then a policy head (K logits) and a value head."""

    def __init__(self, cfg: MambaConfig, n_actions: int) -> None:
        super().__init__()
        self.backbone = MambaBackbone(cfg)
        self.pi = nn.Linear(cfg.d_model, n_actions)
        self.v = nn.Linear(cfg.d_model, 1)

    def init_state(self, batch_size: int, device=None) -> ModelState:
        return self.backbone.init_state(batch_size, device)

    def forward(
        self,
        obs: torch.Tensor,  # [B, T, F]
        state: ModelState | None = None,
        seq_idx: torch.Tensor | None = None,  # [B, T] int32
    ) -> tuple[torch.Tensor, torch.Tensor, ModelState]:
        """(logits [B, T, K], values [B, T], final state)."""
        h, state = self.backbone(obs, state, seq_idx)
        return self.pi(h).float(), self.v(h).squeeze(-1).float(), state

    def step(
        self, obs: torch.Tensor, state: ModelState, cuda_graph: bool | str = "auto"
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """obs [B, F] -> (logits [B, K], values [B]); the state advances in place (no grad)."""
        h, _ = self.backbone.step(obs, state, cuda_graph=cuda_graph)
        return self.pi(h).float(), self.v(h).squeeze(-1).float()


def make_policy(
    obs_dim: int,
    n_actions: int,
    mixer: str = "mamba2",
    d_model: int = 64,
    n_layers: int = 2,
    d_state: int = 16,
    device: torch.device | str = "cpu",
) -> Policy:
    heads = {} if mixer == "mamba1" else {"headdim": 16}  # Mamba-2/3: 2 d_model / 16 heads
    cfg = MambaConfig(
        d_model=d_model, n_layers=n_layers, d_state=d_state, input_dim=obs_dim, mixer=mixer,
        **heads,
    )  # fmt: skip
    return Policy(cfg, n_actions).to(device)


@dataclass
class Rollout:
    """T steps of B rows, with what training needs to replay them."""

    state0: ModelState  # the acting state before step 0 (rows starting there already zero)
    obs: torch.Tensor  # [B, T, F]
    first: torch.Tensor  # [B, T] bool: the step is an episode's first
    actions: torch.Tensor  # [B, T]
    rewards: torch.Tensor  # [B, T]
    dones: torch.Tensor  # [B, T] bool: the episode ended at this step
    correct: torch.Tensor  # [B, T] bool: a query step answered right
    logits: torch.Tensor  # [B, T, K] what the acting steps gave
    values: torch.Tensor  # [B, T]
    last_value: torch.Tensor  # [B] the value of the observation after step T-1


class Actor:
    """The acting side: the environment, its current observation, and the policy's state
    for each row (allocated once and advanced in place)."""

    RECORDED = ("obs", "first", "actions", "rewards", "dones", "correct", "logits", "values")

    def __init__(self, policy: Policy, env: CueMemory, generator: torch.Generator) -> None:
        self.policy, self.env, self.generator = policy, env, generator
        self.state = policy.init_state(env.n_envs, env.device)
        self.obs = env.reset()
        self.first = torch.ones(env.n_envs, dtype=torch.bool, device=env.device)

    @torch.no_grad()
    def collect(self, steps: int, greedy: bool = False) -> Rollout:
        state0 = self.state.clone()
        rec: dict[str, list[torch.Tensor]] = {k: [] for k in self.RECORDED}
        for _ in range(steps):
            logits, value = self.policy.step(self.obs, self.state)
            if greedy:
                action = logits.argmax(-1)
            else:
                action = torch.multinomial(logits.softmax(-1), 1, generator=self.generator)[:, 0]
            obs, reward, done, correct = self.env.step(action)
            got = (self.obs, self.first, action, reward, done, correct, logits, value)
            for k, v in zip(self.RECORDED, got):
                rec[k].append(v)
            self.state.reset_(done)  # the next observation starts a new episode there
            self.obs, self.first = obs, done
        # the bootstrap value: one step on a copy, so the acting state stays where it is
        _, last_value = self.policy.step(self.obs, self.state.clone(), cuda_graph=False)
        stacked = {k: torch.stack(v, dim=1) for k, v in rec.items()}
        return Rollout(state0=state0, last_value=last_value, **stacked)


def episode_ids(first: torch.Tensor) -> torch.Tensor:
    """first [B, T] bool -> seq_idx [B, T] int32: a new id at each episode's first step."""
    return torch.cumsum(first.to(torch.int32), dim=1, dtype=torch.int32)


def windows(
    policy: Policy, ro: Rollout, window: int
) -> Iterator[tuple[slice, torch.Tensor, torch.Tensor]]:
    """(the steps, logits [B, W, K], values [B, W]) of each window of the rollout, in order,
    each from the previous one's final state, detached (truncated BPTT): each window's graph
    is its own, so a backward per window keeps one window's activations at a time."""
    T = ro.obs.shape[1]
    state = ro.state0
    for s in range(0, T, window):
        steps = slice(s, min(s + window, T))
        # a copy, so resetting never writes into a tensor the last window's graph holds
        state = state.detach().clone().reset_(ro.first[:, s])
        logits, values, state = policy(ro.obs[:, steps], state, episode_ids(ro.first[:, steps]))
        yield steps, logits, values


def returns(ro: Rollout, gamma: float) -> torch.Tensor:
    """Discounted returns [B, T], cut at episode ends, bootstrapped from `last_value`."""
    out = torch.empty_like(ro.rewards)
    g = ro.last_value
    for t in range(ro.rewards.shape[1] - 1, -1, -1):
        g = ro.rewards[:, t] + gamma * g * (~ro.dones[:, t])
        out[:, t] = g
    return out


@dataclass
class TrainConfig:
    # mamba1 | mamba2 | mamba3 (Mamba-1's CPU backward is several times slower at this size)
    mixer: str = "mamba2"
    d_model: int = 64
    n_layers: int = 2
    d_state: int = 16
    n_envs: int = 64  # B: parallel episodes
    rollout: int = 32  # T: steps per rollout (one update)
    window: int = 16  # W: truncated-BPTT window
    iters: int = 150
    lr: float = 3e-3
    gamma: float = 1.0  # the reward comes at the episode's end: no discount needed
    value_coef: float = 0.5
    entropy_coef: float = 0.01
    max_grad_norm: float = 1.0
    n_cues: int = 4
    min_delay: int = 2
    max_delay: int = 10
    seed: int = 0
    device: str = "cpu"
    log_every: int = 10  # print every this many iterations (0: never)


def train(cfg: TrainConfig) -> tuple[Policy, list[dict[str, float]]]:
    """A2C with truncated BPTT; returns the policy and each iteration's metrics."""
    device = torch.device(cfg.device)
    torch.manual_seed(cfg.seed)
    gen = torch.Generator(device=device).manual_seed(cfg.seed)
    env = CueMemory(cfg.n_envs, cfg.n_cues, cfg.min_delay, cfg.max_delay, device, gen)
    policy = make_policy(
        env.obs_dim, cfg.n_cues, cfg.mixer, cfg.d_model, cfg.n_layers, cfg.d_state, device
    )
    # fused: one kernel a step on the CPU as on CUDA, where the default (foreach) step runs
    # some dozen ops a tensor
    opt = torch.optim.AdamW(policy.parameters(), lr=cfg.lr, weight_decay=0.0, fused=True)
    actor = Actor(policy, env, gen)
    history = []
    start = time.perf_counter()
    for it in range(cfg.iters):
        ro = actor.collect(cfg.rollout)
        ret = returns(ro, cfg.gamma)
        n = ro.obs.shape[0] * ro.obs.shape[1]
        opt.zero_grad(set_to_none=True)
        sums = torch.zeros(3, device=device)  # policy loss, value loss, entropy
        for steps, logits, values in windows(policy, ro, cfg.window):
            logp = logits.log_softmax(-1)
            g = ret[:, steps]
            adv = (g - values).detach()
            pg = -(logp.gather(-1, ro.actions[:, steps, None])[..., 0] * adv).sum()
            vl = 0.5 * (g - values).pow(2).sum()
            ent = -(logp.exp() * logp).sum()
            loss = (pg + cfg.value_coef * vl - cfg.entropy_coef * ent) / n
            loss.backward()
            sums += torch.stack([pg, vl, ent]).detach() / n
        nn.utils.clip_grad_norm_(policy.parameters(), cfg.max_grad_norm)
        opt.step()
        episodes = ro.dones.sum().clamp(min=1)
        m = {
            "iter": it + 1,
            "return": float(ro.rewards.sum() / episodes),
            "accuracy": float(ro.correct.sum() / episodes),
            "episodes": int(ro.dones.sum()),
            "value_loss": float(sums[1]),
            "entropy": float(sums[2]),
            "seconds": time.perf_counter() - start,
        }
        history.append(m)
        if cfg.log_every and ((it + 1) % cfg.log_every == 0 or it == 0):
            print(
                f"iter {m['iter']:4d}  mean return (accuracy) {m['return']:.3f}"
                f"  ({m['episodes']} episodes)  value loss {m['value_loss']:.4f}"
                f"  {m['seconds']:.1f} s",
                flush=True,
            )
    return policy, history


def evaluate(policy: Policy, cfg: TrainConfig, steps: int = 64) -> float:
    """Greedy accuracy on fresh episodes (a seed of their own)."""
    device = torch.device(cfg.device)
    gen = torch.Generator(device=device).manual_seed(cfg.seed + 1)
    env = CueMemory(cfg.n_envs, cfg.n_cues, cfg.min_delay, cfg.max_delay, device, gen)
    ro = Actor(policy, env, gen).collect(steps, greedy=True)
    return float(ro.correct.sum() / ro.dones.sum().clamp(min=1))


def main(argv: list[str] | None = None) -> None:
    d = TrainConfig()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mixer", choices=["mamba1", "mamba2", "mamba3"], default=d.mixer)
    p.add_argument("--device", default=d.device, help="cpu, cuda, cuda:1, ...")
    p.add_argument(
        "--threads", type=int, default=None, help="CPU threads (default: the free cores)"
    )
    for name in ("d_model", "n_layers", "d_state", "n_envs", "rollout", "window", "iters",
                 "n_cues", "min_delay", "max_delay", "seed", "log_every"):  # fmt: skip
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(d, name))
    for name in ("lr", "gamma", "entropy_coef"):
        p.add_argument(f"--{name.replace('_', '-')}", type=float, default=getattr(d, name))
    args = vars(p.parse_args(argv))
    threads = args.pop("threads")
    cfg = TrainConfig(**args)
    if torch.device(cfg.device).type == "cpu":
        print(apply_threads(threads))
    print(
        f"{cfg.mixer}, d_model {cfg.d_model}, {cfg.n_layers} layers; {cfg.n_envs} episodes in "
        f"parallel, {cfg.n_cues} cues (chance {1 / cfg.n_cues:.2f}), delay {cfg.min_delay}.."
        f"{cfg.max_delay}; rollout {cfg.rollout}, window {cfg.window}, {cfg.iters} iterations"
    )
    start = time.perf_counter()
    policy, history = train(cfg)
    last = history[-10:]
    acc = sum(h["accuracy"] for h in last) / len(last)
    print(f"accuracy over the last {len(last)} iterations (sampled actions): {acc:.3f}")
    print(f"greedy accuracy on fresh episodes: {evaluate(policy, cfg):.3f}")
    print(f"total {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
