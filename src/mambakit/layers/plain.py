"""Whether a fused path may read a module's weights instead of calling the module.

The fused paths (the mixer's inner node, the decode steps and their plans, the LM head's
chunked loss and its matrix-vector kernel) read the weights of the projections around
them and never call them. That computes what the model says only where calling the
module would compute exactly `F.linear(x, weight, bias)` (or the depthwise conv): a
module of exactly its class, with no hooks of its own and no global ones. Anything else
(peft's LoRA, which puts its own module in the projection's place; a forward hook; a
parametrization, which changes the module's class; a quantized layer) makes the path
call the module instead.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.modules import module as _module

_GLOBAL_HOOKS = tuple(
    getattr(_module, name, {})
    for name in (
        "_global_forward_hooks",
        "_global_forward_pre_hooks",
        "_global_backward_hooks",
        "_global_backward_pre_hooks",
    )
)


def hooked(module: nn.Module) -> bool:
    """Whether a hook watches `module` (one of its own, or a global one)."""
    return bool(
        module._forward_hooks
        or module._forward_pre_hooks
        or module._backward_hooks
        or module._backward_pre_hooks
        or any(_GLOBAL_HOOKS)
    )


def plain(module: nn.Module | None, kind: type = nn.Linear) -> bool:
    """True when `module` is exactly a `kind` (not a subclass) that no hook watches."""
    return type(module) is kind and not hooked(module)


def own_tensor(t, ref: torch.Tensor) -> bool:
    """True when `t` is a plain tensor (not None: a parametrization's; not a subclass: FSDP's
    DTensor) in ref's dtype on ref's device, which a fused path may read as it is."""
    return (
        type(t) in (torch.Tensor, nn.Parameter) and t.dtype == ref.dtype and t.device == ref.device
    )
