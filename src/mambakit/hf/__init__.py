"""Checkpoint formats: Hugging Face MambaForCausalLM and Mamba2ForCausalLM, the original
state-spaces ones (Mamba-1 and Mamba-2), mambakit's Mamba-3 (docs/checkpoints.md)."""

from .config import CheckpointError, checkpoint_json, config_from_json, config_to_hf_json
from .io import read_config, read_pretrained, read_state_dict, stored_dtype, write_pretrained

__all__ = [
    "CheckpointError",
    "checkpoint_json",
    "config_from_json",
    "config_to_hf_json",
    "read_config",
    "read_pretrained",
    "read_state_dict",
    "stored_dtype",
    "write_pretrained",
]
