"""The one exception of the checkpoint readers and writers."""

from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be read as a mambakit model, or a model that
    cannot be written in a format that runs it faithfully."""
