"""Shared fixtures of the op tests.

Without a GPU the Triton kernels run under the Triton interpreter: the variable
must be set before any `@triton.jit` function is created, i.e. before the
kernels modules are first imported, which this conftest (loaded before the
test modules of this folder) guarantees.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def seed() -> int:
    """A fixed seed, set before the test body runs."""
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
