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
