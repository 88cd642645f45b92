"""Checkpoint formats: Hugging Face MambaForCausalLM and the original state-spaces one."""

from .config import CheckpointError, config_from_json, config_to_hf_json
from .io import read_pretrained, read_state_dict, write_pretrained

__all__ = [
    "CheckpointError",
    "config_from_json",
    "config_to_hf_json",
    "read_pretrained",
    "read_state_dict",
    "write_pretrained",
]
