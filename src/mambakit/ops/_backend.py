"""Which body an op runs: "reference" (PyTorch) or "triton", resolved once per call.

`backend="auto"` picks Triton for CUDA tensors when Triton is importable, else the PyTorch
reference. The environment variable MAMBAKIT_BACKEND (`reference` | `triton`), read at
every call, overrides "auto". `"triton"` on CPU tensors runs the kernels under the Triton
interpreter (TRITON_INTERPRET=1 must be set before the kernels are first imported).
"""

from __future__ import annotations

import os

import torch

BACKENDS = ("auto", "reference", "triton")
_TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


_TRITON: list[bool] = []


def triton_available() -> bool:
    if not _TRITON:
        try:
            import triton  # noqa: F401

            _TRITON.append(True)
        except ImportError:
            _TRITON.append(False)
    return _TRITON[0]


def forced_backend() -> str:
    """MAMBAKIT_BACKEND as "reference", "triton" or "" (unset); any other value raises."""
    env = os.environ.get("MAMBAKIT_BACKEND", "").strip().lower()
    if env and env not in ("reference", "triton"):
        raise ValueError(f"MAMBAKIT_BACKEND must be 'reference' or 'triton', got {env!r}")
    return env


def resolve_backend(backend: str, x: torch.Tensor, *others: torch.Tensor | None) -> str:
    """The backend an op on `x` runs with: "reference" or "triton". The one place the
    choice is made (a model resolves it once per call and hands it to its layers' ops).

    float64 is the oracle's dtype and stays on the reference: an f64 `x` under "auto" or
    MAMBAKIT_BACKEND, and any f64 operand among `others` (as the f64 residual stream of
    an RMSNorm whose input is in a lower dtype)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        env = forced_backend()
        if env:
            backend = env
        elif x.is_cuda and triton_available() and x.dtype in _TRITON_DTYPES:
            backend = "triton"
        else:
            backend = "reference"
    if backend == "triton":
        if not triton_available():
            raise RuntimeError("backend='triton' needs the triton package (pip install triton)")
        if x.dtype not in _TRITON_DTYPES:
            if os.environ.get("MAMBAKIT_BACKEND") and x.dtype == torch.float64:
                return "reference"  # float64 oracle runs stay on the reference
            raise TypeError(f"backend='triton' supports f32, bf16 and f16 inputs, got {x.dtype}")
        if not x.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError(
                "backend='triton' on CPU tensors needs TRITON_INTERPRET=1 set before import"
            )
        if any(t is not None and t.dtype == torch.float64 for t in others):
            return "reference"
    return backend
