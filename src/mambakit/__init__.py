"""mambakit: Mamba selective state space models in PyTorch and Triton."""

from .config import MambaConfig
from .layers.block import MambaBlock, RMSNorm
from .layers.mamba3 import Mamba3
from .layers.mixer import Mamba
from .model import MambaBackbone, MambaLM, MambaLMOutput
from .ops.mamba3 import Mamba3State
from .state import Mamba3ModelState, MambaState

__all__ = [
    "Mamba",
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
