"""Shared fixtures of every test folder (the folders mirror src/mambakit).

Without a GPU the Triton kernels run under the Triton interpreter: the variable must be
set before any `@triton.jit` function is created, i.e. before a kernels module is first
imported, which this root conftest (loaded before any test module) guarantees. Besides: one
CPU thread (below), a fixed seed, tiny random configs (model tests), NaN-filled
`torch.empty` (kernel tests), deterministic algorithms for one test, a small corpus and a
tiny config file (CLI tests).
Nothing here is autouse.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# One CPU thread for the suite and every process it starts (the library's thread policy
# reads MAMBAKIT_NUM_THREADS): the tests' shapes are tiny, so a second thread gains nothing,
# and on a machine whose other core is busy two spinning threads run several times slower.
os.environ.setdefault("MAMBAKIT_NUM_THREADS", "1")
torch.set_num_threads(int(os.environ["MAMBAKIT_NUM_THREADS"]))

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


# prepended to a child program: `import triton` then raises ModuleNotFoundError, as on a
# machine without it (a CPU torch wheel brings none, and the `[train]` extra adds none)
HIDE_TRITON = """
import sys

class _NoTriton:
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, _NoTriton())
"""


@pytest.fixture
def hide_triton() -> str:
    """Code that hides Triton from the interpreter that runs it (a meta-path finder)."""
    return HIDE_TRITON


@pytest.fixture
def seed() -> int:
    """Seed torch's global RNG so a test draws the same weights and inputs every run."""
    torch.manual_seed(0)
    return 0


@pytest.fixture
def device() -> str:
    return DEVICE


@pytest.fixture
def nan_empty(monkeypatch):
    """torch.empty returns NaN-filled float tensors, so an element a kernel never writes fails."""
    real_empty = torch.empty

    def empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        if t.is_floating_point():
            t.fill_(float("nan"))
        return t

    monkeypatch.setattr(torch, "empty", empty)


@pytest.fixture
def deterministic():
    """torch.use_deterministic_algorithms(True) for one test: no mambakit op may raise under it."""
    prev = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(prev)


@pytest.fixture
def tiny_config():
    """Factory for a tiny MambaConfig with odd sizes; keyword overrides win."""
    from mambakit import MambaConfig

    def make(**overrides):
        fields = dict(
            d_model=12,
            n_layers=2,
            vocab_size=24,
            d_state=3,
            d_conv=3,
            expand=2,
            dt_rank=None,
            pad_vocab_size_multiple=1,
        )
        fields.update(overrides)
        return MambaConfig(**fields)

    return make


def randomize_(module: torch.nn.Module, scale: float = 0.5) -> torch.nn.Module:
    """Give every SSM-specific parameter a non-default random value, in place.

    Fresh inits set A_log = log(1..N), D = 1, norm weights = 1 and conv bias = 0,
    which would let a wrong layout or a dropped term pass unnoticed.
    """
    with torch.no_grad():
        for name, p in module.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if name.endswith("A_log"):
                p.copy_(torch.randn_like(p) * 0.5)
            elif leaf == "D" or "norm" in name:
                p.copy_(1.0 + torch.randn_like(p) * 0.3)
            elif name.endswith("dt_proj.bias"):
                p.copy_(torch.randn_like(p) * 0.7 - 2.0)
            elif name.endswith("bias"):
                p.copy_(torch.randn_like(p) * 0.2)
            else:
                p.add_(torch.randn_like(p) * scale * p.detach().std().clamp(min=0.05))
    return module


@pytest.fixture
def randomize():
    """The `randomize_` helper as a fixture (conftest modules are not imported by tests)."""
    return randomize_


@pytest.fixture
def corpus(tmp_path) -> Path:
    """A folder of small Python files: the CLI tests' training data."""
    folder = tmp_path / "text"
    folder.mkdir()
    for i in range(12):
        body = "".join(f"def f{i}_{j}(x):\n    return x * {j} + {i}\n\n" for j in range(8))
        (folder / f"mod_{i:02d}.py").write_text(body)
    return folder


@pytest.fixture
def tiny_json(tmp_path) -> Path:
    """A model config file for the CLI tests: one layer, d_model 16."""
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps({"d_model": 16, "n_layers": 1, "d_state": 4}))
    return path


@pytest.fixture
def numba_on(monkeypatch):
    """`numba_on(True | False)` turns the compiled CPU bodies (`ops.cpu_jit`) on or off,
    whatever the environment says; on at the start, back as it was after."""
    from mambakit.ops import cpu_jit

    def turn(on: bool) -> None:
        monkeypatch.setenv("MAMBAKIT_NUMBA", "1" if on else "0")
        cpu_jit.available.cache_clear()

    turn(True)
    yield turn
    monkeypatch.undo()
    cpu_jit.available.cache_clear()


@pytest.fixture
def torch_bodies(numba_on):
    """The PyTorch bodies, not the compiled ones that replace them where numba is (the
    tests of `ops.cpu_jit` check those against these)."""
    numba_on(False)
