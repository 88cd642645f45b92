"""How the Triton ops are called: through the custom-op dispatcher only when a tracer is
watching.

Each op is a `torch.library.custom_op`, so torch.compile, export and fake tensors see a
node with a schema, a fake and an autograd formula. In eager mode those Python layers
(dispatch, autograd wrapper, output alias checks) cost 25-125 us of host time per call
on the H200's host, about a third of an eager training step's host time at 130m. An eager
call on plain tensors therefore runs the op's body directly (the same launcher, the same
kernels), and when a gradient is needed, an `autograd.Function` built from the same
`setup_context` and backward that the custom op registers.
"""

from __future__ import annotations

import torch

_PLAIN = (torch.Tensor, torch.nn.Parameter)


def traced(args) -> bool:
    """True when a tracer (torch.compile, export, jit, functorch transforms, fake or other
    subclass tensors) could see this call: it must then go through the custom op."""
    if torch.compiler.is_compiling() or torch.jit.is_tracing():
        return True
    if torch._C._are_functorch_transforms_active():
        return True
    return any(isinstance(a, torch.Tensor) and type(a) not in _PLAIN for a in args)


def _needs_grad(args) -> bool:
    return torch.is_grad_enabled() and any(
        isinstance(a, torch.Tensor) and a.requires_grad for a in args
    )


class Op:
    """A custom op called straight when nothing traces it (see the module docstring).

    `backward` and `setup_context` are the ones given to the op's `register_autograd`."""

    def __init__(self, op, setup_context=None, backward=None) -> None:
        self.op = op
        self.body = op._init_fn  # the function the op was defined from
        self.function = None
        if backward is not None:
            body = self.body

            def forward(ctx, *args):
                out = body(*args)
                setup_context(ctx, args, out)
                return out

            name = op._name
            self.function = type(
                f"{name}_eager",
                (torch.autograd.Function,),
                {"forward": staticmethod(forward), "backward": staticmethod(backward)},
            )

    def __call__(self, *args):
        if traced(args):
            return self.op(*args)
        if self.function is not None and _needs_grad(args):
            return self.function.apply(*args)
        return self.body(*args)
