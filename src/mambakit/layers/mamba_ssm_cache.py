"""mamba_ssm's inference cache protocol for `Mamba`, in mamba_ssm's layouts.

Code written for `mamba_ssm.modules.mamba_simple.Mamba` keeps working: a prefill
`forward(hidden_states, inference_params)` with `seqlen_offset == 0` fills the layer's
cache in `inference_params.key_value_memory_dict[layer_idx]`, later calls (offset > 0)
step one token; `step(hidden_states [B, 1, M], conv_state, ssm_state)` and
`allocate_inference_cache` are mamba_ssm's too. The layouts (B batch, D = d_inner,
K = d_conv, N = d_state):

    mamba_ssm conv cache [B, D, K]: the last K inputs of the conv (the newest last)
    mambakit  conv state [B, K-1, D]: the last K-1 (a step needs no more)
    ssm [B, D, N] in both

so mambakit's conv state is `conv[..., 1:].mT`. The caches keep mamba_ssm's dtypes
(the module's, unless `dtype` is given); each step computes in the state dtype as
mambakit's own step does (f32; f64 for a float64 model) and writes the cache back.
"""

from __future__ import annotations

import torch

from ..ops._checks import state_dtype


def allocate(layer, batch_size: int, dtype=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(conv [B, D, K], ssm [B, D, N]) zeros, in the conv weight's / dt_proj's dtype or
    `dtype`, as mamba_ssm's `allocate_inference_cache`."""
    conv_w, dt_w = layer.conv1d.weight, layer.dt_proj.weight
    D = layer.d_inner
    conv = torch.zeros(batch_size, D, layer.d_conv, device=conv_w.device,
                       dtype=dtype or conv_w.dtype)  # fmt: skip
    ssm = torch.zeros(batch_size, D, layer.d_state, device=dt_w.device, dtype=dtype or dt_w.dtype)
    return conv, ssm


def states_from_cache(layer, params, batch_size: int, initialize_states: bool = False):
    """The layer's (conv, ssm) cache in `params.key_value_memory_dict`, created on first use
    (zeroed again with `initialize_states`)."""
    if layer.layer_idx is None:
        raise ValueError(
            "Mamba: inference_params needs the layer's layer_idx (its key in "
            "key_value_memory_dict): construct it with Mamba(..., layer_idx=i)"
        )
    cache = params.key_value_memory_dict
    if layer.layer_idx not in cache:
        cache[layer.layer_idx] = allocate(layer, batch_size)
    conv, ssm = cache[layer.layer_idx]
    if initialize_states:
        conv.zero_()
        ssm.zero_()
    return conv, ssm


def cached_forward(layer, hidden: torch.Tensor, params) -> torch.Tensor:
    """mamba_ssm's forward with `inference_params`: the prefill fills the cache (made anew
    for a batch of another size than the cache's), a later call (seqlen_offset > 0) steps
    one token."""
    conv, ssm = states_from_cache(layer, params, hidden.shape[0])
    if params.seqlen_offset > 0:
        return step(layer, hidden, conv, ssm)[0]
    if conv.shape[0] != hidden.shape[0]:  # a new batch size: the prefill overwrites it all
        conv, ssm = (
            conv.new_zeros(hidden.shape[0], *conv.shape[1:]),
            ssm.new_zeros(hidden.shape[0], *ssm.shape[1:]),
        )
        params.key_value_memory_dict[layer.layer_idx] = (conv, ssm)
    out, (conv_out, ssm_out) = layer(hidden, return_state=True)
    K, T = layer.d_conv, hidden.shape[1]
    with torch.no_grad():
        conv[..., 1:].copy_(conv_out.mT)
        # the oldest of the last K inputs: x at T - K (zeros before the sequence, as
        # mamba_ssm pads)
        if T >= K:  # in_proj called as the module (its adapters and hooks take part)
            conv[..., 0].copy_(layer.in_proj(hidden[:, T - K])[:, : layer.d_inner])
        else:
            conv[..., 0].zero_()
        ssm.copy_(ssm_out)
    return out


def step(layer, hidden: torch.Tensor, conv: torch.Tensor, ssm: torch.Tensor):
    """mamba_ssm's `step`: hidden [B, 1, M], conv [B, D, K] and ssm [B, D, N] (advanced in
    place) -> (out [B, 1, M], conv, ssm)."""
    if hidden.dim() != 3 or hidden.shape[1] != 1:
        raise ValueError(f"Mamba.step: hidden_states must be [B, 1, M], got {list(hidden.shape)}")
    D, K = layer.d_inner, layer.d_conv
    if conv.shape != (hidden.shape[0], D, K):
        raise ValueError(
            f"Mamba.step: conv_state must be mamba_ssm's [B, D, K] = "
            f"{[hidden.shape[0], D, K]}, got {list(conv.shape)}"
        )
    if ssm.shape != (hidden.shape[0], D, layer.d_state):
        raise ValueError(
            f"Mamba.step: ssm_state must be [B, D, N] = "
            f"{[hidden.shape[0], D, layer.d_state]}, got {list(ssm.shape)}"
        )
    f = state_dtype(layer.A_log)  # f32; f64 for a float64 model
    history = conv[..., 1:].mT.to(f).contiguous()  # mambakit's [B, K-1, D] (a copy)
    state = ssm.to(f).contiguous()
    out = layer.step(hidden[:, 0], history, state)
    with torch.no_grad():
        conv[..., 0].copy_(conv[..., 1])  # the window moves on: its oldest input drops out
        conv[..., 1:].copy_(history.mT)
        ssm.copy_(state)
    return out.unsqueeze(1), conv, ssm
