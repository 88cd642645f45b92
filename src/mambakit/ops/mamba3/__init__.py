"""Mamba-3 SISO scan (reference.py: the recurrence, its chunked form and the decode step;
chunk.py: the sequence forward as a Triton kernel, for inference; step.py: the decode
step as one Triton kernel, the state advanced in place).

Training (autograd) runs the reference on every device: there is no backward kernel yet.
"""

from .reference import Mamba3State, mamba3_scan_reference, mamba3_step_reference, rotate_pairs

__all__ = ["Mamba3State", "mamba3_scan_reference", "mamba3_step_reference", "rotate_pairs"]
