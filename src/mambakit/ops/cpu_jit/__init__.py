"""Decode steps on the CPU compiled with numba: one call per step for the whole stack.
(Also here: the recurrences of Mamba-1's selective scan, `scan.py`, and of Mamba-3's scan,
`scan3.py`, forward and backward, which the PyTorch reference bodies call where these
compile; and a Mamba-3 layer's per-token terms, `terms3.py`, which with scan3 make the
layer's CPU core one autograd node, `ops.mamba3.reference.mamba3_layer_compiled`.)

At batch 1 a small model's CPU step is bound by the cost of each PyTorch call (one to a
few microseconds of dispatch, checks and allocation, against less than that in
arithmetic), so even the leanest op chain (`mamba_step/stack.py`) spends most of its
time outside the arithmetic. Here the stack's blocks run as one compiled function over
the same folded weights that chain reads (`stack_weights`), packed once per decode plan
into per-layer arrays: no allocation, no dispatch, loops the compiler vectorises. Each
row runs every block on its own (the same arithmetic whatever the batch), the rows on
numba's threads from two rows on.

numba installs from pip with no system compiler (`pip install "mambakit[cpu]"`). Without
it, or with `MAMBAKIT_NUMBA=0` in the environment, the PyTorch bodies run: they stay
the oracle of these (tests/ops/test_cpu_jit.py) and the path for tensors these do not
take (other dtypes than float32 and float64, a CUDA device). The first step of each dtype
compiles (a few seconds; the machine code is cached on disk for later processes).
"""

from __future__ import annotations

import importlib
import os
import warnings
from functools import cache

import numpy as np
import torch

__all__ = [
    "COMPILED_MAX_BYTES",
    "COMPILED_MAX_ROWS",
    "SMALL_STACK_BYTES",
    "SMALL_STACK_MAX_ROWS",
    "available",
    "compile_stack",
    "compiles",
    "compiles_stack",
    "param_array",
    "rows_max",
]

# rows up to which the compiled steps run (a row's products read every weight: they win
# while the weights stay in a core's cache), beyond which the PyTorch bodies' matrix
# products do: 8 rows, and 64 for stacks of at most SMALL_STACK_BYTES (2 threads, the RL
# shape, 1.4 MiB: level at 64 rows for Mamba-1, half the time for Mamba-3; 5 MiB: level
# at about 10 rows)
COMPILED_MAX_ROWS = 8
SMALL_STACK_MAX_ROWS = 64
SMALL_STACK_BYTES = 2 << 20
COMPILED_MAX_BYTES = (
    64 << 20
)  # weights of a stack the compiled steps take at most (`compiles_stack`)


@cache
def available() -> bool:
    """Whether the compiled steps can run: numba importable, not turned off
    (`MAMBAKIT_NUMBA=0`), and able to keep its machine code somewhere (a read-only install
    with no writable cache folder turns them off with a warning: set NUMBA_CACHE_DIR)."""
    if os.environ.get("MAMBAKIT_NUMBA", "1") == "0":
        return False
    try:
        from . import mamba1, mamba2, mamba3  # noqa: F401  (numba checks its cache here)
    except ImportError:
        return False
    except Exception as exc:  # noqa: BLE001 - numba present but unusable: the PyTorch bodies
        warnings.warn(f"mambakit's compiled CPU steps are off: {exc}", stacklevel=2)
        return False
    return True


def param_array(t: torch.Tensor):
    """A parameter's values as an array of their own: `.numpy()` on the parameter itself
    would mark its storage as never to be resized again, and FSDP frees and regrows the
    storage of the parameters it shards (a copy of a norm's or a bias's few values costs
    less than a microsecond more)."""
    return t.detach().clone().numpy()


class _Memory:
    """What `np.asarray` reads an array from (numpy's array interface): the address, shape
    and strides of a tensor's elements."""

    __slots__ = ("__array_interface__",)

    def __init__(self, t: torch.Tensor) -> None:
        if t.device.type != "cpu" or t.dtype not in _NUMPY or t.is_neg() or t.is_conj():
            raise ValueError(
                f"borrowed_array: a CPU float32 or float64 tensor without a lazy negation, "
                f"got {t.dtype} on {t.device}"
            )
        size = t.element_size()
        self.__array_interface__ = {
            "data": (t.data_ptr(), True),  # read-only
            "shape": tuple(t.shape),
            "strides": tuple(s * size for s in t.stride()),
            "typestr": np.dtype(_NUMPY[t.dtype]).str,
            "version": 3,
        }


_NUMPY = {torch.float32: np.float32, torch.float64: np.float64}


def borrowed_array(t: torch.Tensor):
    """A parameter's values as a read-only array over its own memory, for one call: no
    copy, and unlike `.numpy()` its storage stays resizable. The array holds no reference to `t`:
    the caller keeps `t` alive, and its storage unresized, while the array is read (a
    large weight read on every call, as an LM head's, where `param_array` would copy it
    each time)."""
    return np.asarray(_Memory(t))


def stack_layers(tensors) -> torch.Tensor:
    """Per-layer tensors stacked into one contiguous [L, ...] (what a `Packed` holds)."""
    return torch.stack([t.detach() for t in tensors]).contiguous()


def compiles(t) -> bool:
    """Whether the compiled steps take weights like `t`: numba there, a CPU tensor of
    float32 or float64."""
    return t.device.type == "cpu" and t.dtype in _DTYPES and available()


def rows_max(tensors) -> int:
    """The rows up to which a compiled stack on these weights runs a step."""
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    return SMALL_STACK_MAX_ROWS if nbytes <= SMALL_STACK_BYTES else COMPILED_MAX_ROWS


def compile_stack(mixer: str, blocks: list, pad: float):
    """The compiled body (`cpu_jit.<mixer>.Packed`) of a stack's lean-body weights
    (`BlockWeights` of every block, r's constant column `pad`), or None where the
    compiled steps do not take them (`compiles_stack`, and the module's own `packs` where
    it has one)."""
    if not compiles_stack(blocks):
        return None
    module = importlib.import_module(f"{__name__}.{mixer}")
    packs = getattr(module, "packs", None)
    if packs is not None and not packs(blocks):
        return None
    return module.Packed(blocks, pad)


def compiles_stack(blocks: list) -> bool:
    """Whether a stack's whole-stack weights (`BlockWeights` of every block) are compiled:
    they compile (`compiles`) and take at most `COMPILED_MAX_BYTES`. The compiled bodies
    stack them into arrays of their own (one more copy of the weights), which pays where a
    step is bound by per-call overhead: small models. At 64 MiB of weights a batch-1 step's
    arithmetic already takes several times the PyTorch bodies' overhead."""
    nbytes = sum(t.numel() * t.element_size() for b in blocks for t in b
                 if isinstance(t, torch.Tensor))  # fmt: skip
    return nbytes <= COMPILED_MAX_BYTES and compiles(blocks[0].in_wT)


_DTYPES = {torch.float32, torch.float64}
