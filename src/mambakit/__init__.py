"""mambakit: Mamba selective state space models in PyTorch and Triton."""
