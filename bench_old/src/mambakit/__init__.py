"""mambakit: Mamba selective state space models in PyTorch and Triton.

The public names load on first use (PEP 562), so `import mambakit` and the command
line's `--help` do not pay for importing torch until something needs it."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_WHERE = {  # public name -> the module that defines it
    "Mamba": ".layers.mixer",
    "Mamba2": ".layers.mamba2",
    "Mamba2ModelState": ".state",
    "Mamba2State": ".state",
    "Mamba3": ".layers.mamba3",
    "Mamba3ModelState": ".state",
    "Mamba3State": ".state",
    "MambaBackbone": ".backbone",
    "MambaBlock": ".layers.block",
    "MambaConfig": ".config",
    "MambaLM": ".model",
    "MambaLMOutput": ".model",
    "MambaState": ".state",
    "RMSNorm": ".layers.block",
}
__all__ = [
    "Mamba",
    "Mamba2",
    "Mamba2ModelState",
    "Mamba2State",
    "Mamba3",
    "Mamba3ModelState",
    "Mamba3State",
    "MambaBackbone",
    "MambaBlock",
    "MambaConfig",
    "MambaLM",
    "MambaLMOutput",
    "MambaState",
    "RMSNorm",
]
__version__ = "0.1.0"


def __getattr__(name: str):
    where = _WHERE.get(name)
    if where is None:  # (_WHERE and __all__ list the same names: tests/test_import.py)
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(where, __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:
    from .backbone import MambaBackbone
    from .config import MambaConfig
    from .layers.block import MambaBlock, RMSNorm
    from .layers.mamba2 import Mamba2
    from .layers.mamba3 import Mamba3
    from .layers.mixer import Mamba
    from .model import MambaLM, MambaLMOutput
    from .state import Mamba2ModelState, Mamba2State, Mamba3ModelState, Mamba3State, MambaState
