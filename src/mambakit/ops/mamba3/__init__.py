"""Mamba-3 SISO scan (reference.py: the recurrence, its chunked form and the decode step;
step.py: the decode step as one Triton kernel, the state advanced in place).

The sequence forward and backward run on the reference (chunked PyTorch) on every device
for now; the decode step has its kernel.
"""

from .reference import Mamba3State, mamba3_scan_reference, mamba3_step_reference, rotate_pairs

__all__ = ["Mamba3State", "mamba3_scan_reference", "mamba3_step_reference", "rotate_pairs"]
