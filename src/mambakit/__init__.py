"""mambakit: Mamba selective state space models in PyTorch and Triton."""

from .config import MambaConfig
from .layers.block import MambaBlock, RMSNorm
from .layers.mixer import Mamba
from .model import MambaBackbone, MambaLM, MambaLMOutput
from .state import MambaState

__all__ = [
    "Mamba",
    "MambaBackbone",
    "MambaBlock",
    "MambaConfig",
    "MambaLM",
    "MambaLMOutput",
    "MambaState",
    "RMSNorm",
]
__version__ = "0.1.0"
