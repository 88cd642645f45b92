"""Mamba-3 SISO scan (reference.py: the recurrence, its chunked form and the decode step;
terms.py: the per-token terms as Triton kernels, forward and backward; chunk.py: the
sequence scan as Triton kernels, forward and backward; step.py: the decode step as one
Triton kernel, the state advanced in place). README.md says which runs where.
"""

from ...state import Mamba3State  # (defined with the other states; kept importable here)
from .reference import mamba3_scan_reference, mamba3_step_reference, rotate_pairs

__all__ = ["Mamba3State", "mamba3_scan_reference", "mamba3_step_reference", "rotate_pairs"]
