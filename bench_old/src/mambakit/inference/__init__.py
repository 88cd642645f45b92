"""Inference: prefill + decode (`generate`, `stream`), sampling and CUDA-graph decode steps."""

from .cuda_graph import CUDAGraphStep, clear_cuda_graphs
from .generate import generate, stream
from .sampling import SamplingConfig, apply_repetition_penalty, filter_logits, sample
from .step_graph import step_graph_status

__all__ = [
    "CUDAGraphStep",
    "SamplingConfig",
    "apply_repetition_penalty",
    "clear_cuda_graphs",
    "filter_logits",
    "generate",
    "sample",
    "step_graph_status",
    "stream",
]
