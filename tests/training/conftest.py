"""Fixtures shared by the training tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def restore_determinism():
    """Put the process-wide deterministic flag back after a test that sets it (or whose
    Trainer fails to: it must leave the flag as it found it)."""
    before = torch.are_deterministic_algorithms_enabled()
    yield
    torch.use_deterministic_algorithms(before)
