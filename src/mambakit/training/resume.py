"""The Trainer's side of checkpoints: what a checkpoint holds of a run, writing one, and
continuing from one bit for bit.

`trainer_state` is everything besides the weights: step, skipped steps (and the current
streak of them), tokens seen, the optimizer's state with its parameters named (full
tensors, so N ranks resume on M and any engine loads it), the lr schedule, the loss
scaler, the run's RNG stream, the config and the data cursor. The optimizer's settings
(weight decay, betas, eps, fused) are the resuming run's, from its config and device.
`save` refuses weights that are not finite and writes through
`checkpoint.save_checkpoint` (rank 0 only); `resume` reads a named folder, or the one
run_dir's `latest` names, falling back past unreadable ones (which it sets aside), checks
that every tensor fits the model before it changes anything, and restores the rest. The
files themselves (folders, `latest`, rotation, the run lock) are `checkpoint.py`'s.
"""

from __future__ import annotations

import pickle
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from ..config import MambaConfig
from ..hf import CheckpointError, checkpoint_json, config_from_json, read_config, read_state_dict
from . import distributed as dist_
from .checkpoint import (
    RunLock,
    checkpoint_candidates,
    checkpoint_step,
    load_trainer_state,
    point_latest,
    save_checkpoint,
    set_aside,
)
from .config import CheckpointUnreadable, TrainingDiverged
from .process import in_process_state

# MambaConfig fields that change what a model of the same tensor shapes computes (the
# shapes themselves are checked tensor by tensor): a resumed model must have the
# checkpoint's. Init-only fields (dt_init, initializer_range, ...) and tiling (chunk_size)
# may change between runs.
_COMPUTES = (
    "mixer", "rms_norm_eps", "tie_embeddings", "headdim", "ngroups", "d_ssm", "rope_fraction",
    "A_floor", "D_has_hdim", "rmsnorm", "norm_before_gate", "dt_limit",
)  # fmt: skip


def checkpoint_config(path: Path):
    """The MambaConfig of a checkpoint folder's config.json, or None where it has none;
    CheckpointUnreadable where it does not parse."""
    if not (path / "config.json").is_file():
        return None
    try:
        return read_config(path)
    except (CheckpointError, ValueError, TypeError, OSError) as e:
        raise CheckpointUnreadable(f"{path / 'config.json'}: {e}") from e


def config_changes(theirs, model) -> list[str]:
    """The `_COMPUTES` fields in which a checkpoint's config (`checkpoint_config`) differs
    from `model.config`, as "field: checkpoint's -> model's"; none where either is not a
    MambaConfig. The model's is compared as its own checkpoint would hold it (written and
    read back: a field the format leaves out, or one its mixer does not read, is dropped
    alike on both sides)."""
    own = getattr(model, "config", None)
    if not isinstance(theirs, MambaConfig) or not isinstance(own, MambaConfig):
        return []
    try:
        mine, _ = config_from_json(checkpoint_json(own)[0])
    except (CheckpointError, ValueError, TypeError):
        mine = own
    a, b = asdict(theirs), asdict(mine)
    return [f"{k}: {a[k]!r} -> {b[k]!r}" for k in _COMPUTES if a[k] != b[k]]


def _named(sd: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """An optimizer state dict with its parameters named (`names[i]` for number i)."""
    return {
        "state": {names[i]: v for i, v in sd["state"].items()},
        "param_groups": [
            {**g, "params": [names[i] for i in g["params"]]} for g in sd["param_groups"]
        ],
    }


class CheckpointMixin:
    """`trainer_state`, `save` and `resume` of the Trainer."""

    @in_process_state
    def trainer_state(self) -> dict[str, Any]:
        state = {
            "step": self.step,
            "skipped_steps": self.skipped_steps,
            # the current run of skipped steps: max_skipped_steps counts across a resume
            "skip_streak": self.consecutive_skipped_steps,
            "tokens_seen": self.tokens_seen,
            "optimizer": self._optimizer_state(),
            "schedule": self.schedule.state_dict(),
            "scaler": self.scaler.state_dict(),
            **self._rng_state(),  # the run's stream: the global one under _process_state
            "train_config": {k: v for k, v in asdict(self.cfg).items() if k != "betas"},
        }
        if hasattr(self.train_data, "state_dict"):
            state["data"] = self.train_data.state_dict()
        return state

    def weights_finite(self) -> bool:
        """Whether every parameter is finite (one host sync; every rank's shards)."""
        with torch.no_grad():
            local = [getattr(p, "_local_tensor", p) for p in self.params]
            ok = torch.stack([p.isfinite().all() for p in local]).all()
        return not dist_.any_rank(not bool(ok), self.dist, self.device)

    def save(self) -> Path:
        """Write a checkpoint of this step and point `latest` at it. Refuses (with
        `TrainingDiverged`) weights that are not finite: `latest` keeps naming the last
        good checkpoint."""
        if self.run_dir is None:
            raise ValueError("TrainConfig.run_dir is not set: nowhere to save a checkpoint")
        if not self.weights_finite():
            latest = checkpoint_candidates(self.run_dir)
            kept = f"; {latest[0]} is the newest checkpoint" if latest else ""
            raise TrainingDiverged(
                f"training diverged: the weights are not finite at step {self.step}, so no "
                f"checkpoint was written{kept} (lower the learning rate, TrainConfig.lr "
                f"{self.cfg.lr:g})"
            )
        weights = self._full_weights()  # FSDP2: gathered by every rank, written by rank 0
        state = self.trainer_state()
        path = self.run_dir / f"step_{self.step:07d}"
        if self.dist.main:
            path = save_checkpoint(
                self.run_dir, self.step, self.model, state, self.cfg.keep_last, weights
            )
        dist_.barrier(self.dist)  # no rank goes on before the checkpoint is complete
        self._saved_step = self.step
        return path

    def _full_weights(self) -> dict[str, torch.Tensor] | None:
        """The whole model's tensors under FSDP2 (None: `save_pretrained` reads the model)."""
        if self.dist.mode != "fsdp":
            return None
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_model_state_dict(self.model, options=opts)

    def _param_names(self) -> list[str]:
        """The model's name of each parameter, in the optimizer's order."""
        name = {id(p): n for n, p in self.model.named_parameters()}
        return [name[id(p)] for p in self.params]

    def _optimizer_state(self) -> dict[str, Any]:
        """The optimizer's state dict with parameters named (not numbered) and full tensors,
        so that it loads into any number of ranks and any engine."""
        if self.dist.mode == "fsdp":
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                get_optimizer_state_dict,
            )

            opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
            return get_optimizer_state_dict(self.model, self.optimizer, options=opts)
        return _named(self.optimizer.state_dict(), self._param_names())

    def _paired_groups(self, sd: dict[str, Any]) -> list[tuple[list[str], dict[str, Any]]]:
        """(the names of this optimizer's group's parameters, the saved group) for each
        group of `sd`, in order (`self.params` lists the groups' parameters in order)."""
        names, start, pairs = self._param_names(), 0, []
        for g, saved in zip(self.optimizer.param_groups, sd["param_groups"]):
            pairs.append((names[start : start + len(g["params"])], saved))
            start += len(g["params"])
        return pairs

    def _check_optimizer_state(self, sd: dict[str, Any], path: Path) -> None:
        """Raise ValueError, naming the parameters, where the optimizer state `sd` does not
        fit this model's optimizer: called before anything of the model is changed."""
        groups = self.optimizer.param_groups
        if len(sd["param_groups"]) != len(groups):
            raise ValueError(
                f"resume: the optimizer state in {path} has {len(sd['param_groups'])} "
                f"parameter groups, this model's optimizer {len(groups)}"
            )
        for own, saved in self._paired_groups(sd):
            theirs = saved["params"]
            if all(isinstance(p, str) for p in theirs):
                off = sorted(set(own) ^ set(theirs))
            else:  # numbered (older checkpoints): only the count can be checked
                off = [] if len(theirs) == len(own) else [f"{len(theirs)} != {len(own)}"]
            if off:
                raise ValueError(
                    f"resume: the optimizer state in {path} does not fit this model: {off}"
                )

    def _load_optimizer_state(self, sd: dict[str, Any]) -> None:
        """Load `_optimizer_state`'s format (or the numbered one of older checkpoints),
        checked by `_check_optimizer_state`."""
        names = self._param_names()
        index = {n: i for i, n in enumerate(names)}
        named = all(isinstance(p, str) for g in sd["param_groups"] for p in g["params"])
        if self.dist.mode == "fsdp":
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                set_optimizer_state_dict,
            )

            if not named:
                sd = _named(sd, names)
            opts = StateDictOptions(full_state_dict=True)
            set_optimizer_state_dict(self.model, self.optimizer, sd, options=opts)
            return
        if named:  # numbered; load_state_dict pairs each group's parameters by position
            numbered = [
                {**saved, "params": [index[n] for n in own]}
                for own, saved in self._paired_groups(sd)
            ]
            sd = {"state": {index[n]: v for n, v in sd["state"].items()}, "param_groups": numbered}
        self.optimizer.load_state_dict(sd)

    def _read_checkpoint(self, path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any], Any]:
        """(weights, trainer state, config or None) of a checkpoint folder; read errors
        propagate."""
        if not path.is_dir():
            raise FileNotFoundError(f"{path} does not exist")
        for name in ("model.safetensors", "trainer_state.pt"):
            if not (path / name).is_file():
                raise FileNotFoundError(f"{path} is incomplete: {name} is missing")
        try:
            weights = read_state_dict(path)  # the one reader of model files (hf/io.py)
        except CheckpointError as e:
            raise CheckpointUnreadable(str(e)) from e
        try:
            st = load_trainer_state(path, self.device)
        except (RuntimeError, EOFError, pickle.UnpicklingError, OSError) as e:
            raise CheckpointUnreadable(f"{path / 'trainer_state.pt'}: {e}") from e
        return weights, st, checkpoint_config(path)

    @in_process_state
    def resume(self, path: str | Path | None = None) -> bool:
        """Continue from a checkpoint folder, or else the one run_dir's `latest` names;
        when that one cannot be read, from the newest readable `step_XXXXXXX` folder (each
        skipped one is logged with the reason, then renamed to `step_XXXXXXX.corrupt` and
        `latest` pointed at the one resumed from). False when run_dir holds none."""
        skipped: list[tuple[Path, str]] = []  # run_dir's checkpoints that failed to load
        if path is not None:
            path = Path(path)
            weights, st, saved_cfg = self._read_checkpoint(path)
        else:
            if self.run_dir is None:
                raise ValueError("resume: no path given and TrainConfig.run_dir is not set")
            candidates = checkpoint_candidates(self.run_dir)
            if not candidates:
                return False
            for path in candidates:
                try:
                    weights, st, saved_cfg = self._read_checkpoint(path)
                    break
                except (FileNotFoundError, CheckpointUnreadable) as e:
                    skipped.append((path, str(e).splitlines()[0]))
                    self.log(f"resume: skipped checkpoint {path.name}: {skipped[-1][1]}")
            else:  # nothing set aside: the run folder stays as the user may want to repair it
                raise CheckpointUnreadable(
                    f"resume: no readable checkpoint in {self.run_dir}: "
                    + "; ".join(why for _, why in skipped)
                )
            if skipped:
                self.log(f"resume: continuing from {path}")
        own = self.model.state_dict()
        tied = getattr(getattr(self.model, "config", None), "tie_embeddings", False)
        expected = {k for k in own if not (tied and k == "lm_head.weight")}
        extra, missing = sorted(set(weights) - set(own)), sorted(expected - set(weights))
        if extra or missing:
            raise ValueError(
                f"resume: checkpoint {path} does not fit the model: tensors not in the model "
                f"{extra}, model tensors missing from it {missing}"
            )
        for k, v in weights.items():
            if tuple(v.shape) != tuple(own[k].shape):
                raise ValueError(
                    f"resume: tensor {k!r} has shape {list(v.shape)} in {path}, "
                    f"the model has {list(own[k].shape)}"
                )
        if self.dist.mode != "fsdp":  # (FSDP2's loader checks its own)
            self._check_optimizer_state(st["optimizer"], path)
        changed = config_changes(saved_cfg, self.model)
        if changed:
            raise ValueError(
                f"resume: checkpoint {path} was written by a model of another config "
                f"(checkpoint's -> this model's): {'; '.join(changed)}"
            )
        if self.scaler.is_enabled() and not st["scaler"]:
            raise ValueError(
                f"resume: checkpoint {path} was written without a loss scaler (not in f16); "
                "this run scales its loss: resume it in the precision it was trained in"
            )
        # the data cursor first of what changes: the one load left that refuses (data of
        # another size), and nothing else has changed when it does
        if "data" in st and hasattr(self.train_data, "load_state_dict"):
            self.train_data.load_state_dict(st["data"])
        if skipped and self.dist.main:  # the rank that writes checkpoints tidies run_dir
            # out of the fallback and rotation's count for good: a later save must not keep
            # an unreadable checkpoint in place of the one this run resumed from
            with RunLock(self.run_dir):
                for bad, why in skipped:
                    if bad.is_dir() and checkpoint_step(bad) is not None:
                        aside = set_aside(bad)
                        self.log(f"resume: renamed unreadable {bad.name} to {aside.name} ({why})")
                point_latest(self.run_dir, path.name)
        if self.dist.mode == "fsdp":  # every rank holds the full tensors and keeps its shards
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                set_model_state_dict,
            )

            full = dict(weights)
            if tied and "lm_head.weight" not in full:  # written once, as the embedding
                full["lm_head.weight"] = full["backbone.embeddings.weight"]
            set_model_state_dict(self.model, full, options=StateDictOptions(full_state_dict=True))
        else:
            with torch.no_grad():
                for k, v in weights.items():
                    own[k].copy_(v)
        # the groups' settings as this run's config and device make them (loading puts the
        # checkpoint's in their place: its weight decay, betas and eps, and its device's fused
        # and capturable flags), the lr a tensor for graphs; then the schedule of this run's
        # config at the step (a resumed run may extend steps or change lr)
        own_groups = [
            {k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups
        ]
        self._load_optimizer_state(st["optimizer"])
        for g, own in zip(self.optimizer.param_groups, own_groups):
            g.update(own)
            lr_tensor = isinstance(g["lr"], torch.Tensor)
            g["lr"] = torch.tensor(self.cfg.lr, device=self.device) if lr_tensor else self.cfg.lr
            g.pop("initial_lr", None)
        self.schedule = self._lr_schedule(int(st["step"]))
        self.scaler.load_state_dict(st["scaler"])
        self._load_rng_state(st)
        self.step = int(st["step"])
        self.skipped_steps = int(st["skipped_steps"])  # zeroes the on-device count too
        self._streak_host = int(st.get("skip_streak", 0))  # (older checkpoints: none)
        if self._streak_dev is not None:
            self._streak_dev.fill_(self._streak_host)
        self.tokens_seen = int(st["tokens_seen"])
        self._saved_step = self.step
        self._graph = None
        return True
