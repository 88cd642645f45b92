"""Mamba-3 SISO scan (reference.py: the recurrence, its chunked form and the decode step).

The CPU path and the oracle for now: there is no Triton kernel for it yet.
"""

from .reference import Mamba3State, mamba3_scan_reference, mamba3_step_reference, rotate_pairs

__all__ = ["Mamba3State", "mamba3_scan_reference", "mamba3_step_reference", "rotate_pairs"]
