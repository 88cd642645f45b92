"""The process-wide state a Trainer borrows while it runs, and gives back.

A Trainer owns an RNG stream (seeded with `TrainConfig.seed`, carried from call to call
and in checkpoints) and, with `TrainConfig.deterministic`, wants PyTorch's deterministic
algorithms with cuBLAS's fixed workspace (DESIGN.md section 5). Building a Trainer changes
none of it: the methods decorated with `in_process_state` install the run's state for the
call and put the caller's back after it. `fit` also takes SIGINT / SIGTERM for its run
(`ProcessMixin._signals_stop_training`); the run folder's lock is `checkpoint.RunLock`.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import threading

import torch


def in_process_state(method):
    """Run a Trainer method under its run's process-wide state (`Trainer._process_state`)."""

    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with self._process_state():
            return method(self, *args, **kwargs)

    return run


def seeded_rng_state(seed: int, device: torch.device) -> dict[str, torch.Tensor]:
    """A run's RNG stream at its start: the CPU's, and its GPU's on CUDA, seeded with `seed`
    (in generators of its own: the global ones are not touched)."""
    gens = {"rng_cpu": torch.Generator()}
    if device.type == "cuda":
        gens["rng_cuda"] = torch.Generator(device)
    return {k: g.manual_seed(seed).get_state() for k, g in gens.items()}


class ProcessMixin:
    """The Trainer's RNG stream, determinism flags and signal handling. Reads `cfg` and
    `device`; keeps the stream in `_rng` (installed only by `_process_state`), and the
    signal `fit` received in `_stop_signal`."""

    # -- the RNG stream and the determinism flags ------------------------------------------

    def _rng_state(self) -> dict[str, torch.Tensor]:
        """The global RNG states a run uses: the CPU's, and its GPU's on CUDA."""
        state = {"rng_cpu": torch.get_rng_state()}
        if self.device.type == "cuda":
            state["rng_cuda"] = torch.cuda.get_rng_state(self.device)
        return state

    def _load_rng_state(self, state: dict[str, torch.Tensor]) -> None:
        """Set the global RNG states from `_rng_state`'s dict (a GPU's is ignored on CPU)."""
        torch.set_rng_state(state["rng_cpu"].cpu())
        if "rng_cuda" in state and self.device.type == "cuda":
            torch.cuda.set_rng_state(state["rng_cuda"].cpu(), self.device)

    @contextlib.contextmanager
    def _process_state(self):
        """Install the run's process-wide state for a call and put the caller's back after it:
        the run's RNG stream (seeded with `cfg.seed`, carried from call to call and in
        checkpoints) and, with `cfg.deterministic`, deterministic algorithms with cuBLAS's
        fixed workspace (DESIGN.md section 5). Re-entrant: `fit` runs `train_step`."""
        if self._in_process_state:
            yield
            return
        outer_rng = self._rng_state()
        flags = (
            torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(),
        )
        workspace = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
        flip = self.cfg.deterministic and flags != (True, False)  # setting it costs ~0.4 ms
        self._load_rng_state(self._rng)
        self._in_process_state = True
        try:
            if self.cfg.deterministic:
                os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            if flip:
                torch.use_deterministic_algorithms(True)
            yield
        finally:
            self._rng = self._rng_state()
            self._in_process_state = False
            self._load_rng_state(outer_rng)
            if flip:
                torch.use_deterministic_algorithms(flags[0], warn_only=flags[1])
            if self.cfg.deterministic and workspace is None:
                os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)

    # -- signals ---------------------------------------------------------------------------

    def _on_signal(self, signum, frame) -> None:
        # only a flag: printing here could re-enter a write the signal interrupted
        if self._stop_signal is not None:  # a second signal: stop now
            raise KeyboardInterrupt
        self._stop_signal = signum

    @contextlib.contextmanager
    def _signals_stop_training(self):
        """SIGINT / SIGTERM set a flag the loop reads after each step (main thread only)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for s, handler in old.items():
                signal.signal(s, handler)
