"""Eager calls skip the custom-op dispatcher (ops/_dispatch.py): both paths must agree.

The straight path (the op's body, and an autograd.Function built from the op's registered
setup_context and backward) is what eager users run; the custom op is what torch.compile
and fake tensors see. Outputs and gradients of the two are compared bit for bit, and the
custom ops themselves are checked by `torch.library.opcheck` (schema, fake, autograd
registration).
"""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from mambakit.ops._dispatch import traced
from mambakit.ops.causal_conv1d import conv_fwd_op
from mambakit.ops.rms_norm import rms_fwd_op
from mambakit.ops.rms_norm_gated import gated_fwd_op
from mambakit.ops.selective_scan import scan_fwd_op

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _scan_args(grad: bool):
    g = torch.Generator().manual_seed(0)
    Bsz, T, Dn, N = 2, 12, 8, 4

    def rn(*s, scale=1.0):
        return (torch.randn(*s, generator=g) * scale).to(DEVICE)

    args = [
        rn(Bsz, T, Dn),  # u
        rn(Bsz, T, Dn, scale=0.5),  # delta
        -(torch.rand(Dn, N, generator=g) + 0.1).to(DEVICE),  # A
        rn(Bsz, T, N),  # B
        rn(Bsz, T, N),  # C
        rn(Dn),  # D
        rn(Bsz, T, Dn),  # z
        rn(Dn, scale=0.3),  # delta_bias
        True,  # delta_softplus
        rn(Bsz, Dn, N),  # initial_state
        None,  # seq_idx
        grad,  # save_states
    ]
    if grad:
        args = [a.requires_grad_() if isinstance(a, torch.Tensor) else a for a in args]
    return args


def _conv_args(grad: bool):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 9, 8, generator=g).to(DEVICE)
    w = torch.randn(8, 4, generator=g).to(DEVICE)
    b = torch.randn(8, generator=g).to(DEVICE)
    h0 = torch.randn(2, 3, 8, generator=g).to(DEVICE)
    if grad:
        for t in (x, w, b, h0):
            t.requires_grad_()
    return [x, w, b, h0, None, True, True]


def _rms_args(grad: bool):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 5, 16, generator=g).to(DEVICE)
    w = torch.randn(16, generator=g).to(DEVICE)
    res = torch.randn(3, 5, 16, generator=g).to(DEVICE)
    if grad:
        for t in (x, w, res):
            t.requires_grad_()
    return [x, w, 1e-5, res, torch.float32]


def _gated_args(grad: bool):
    g = torch.Generator().manual_seed(3)
    x, z = (torch.randn(3, 5, 16, generator=g).to(DEVICE) for _ in range(2))
    w = torch.randn(16, generator=g).to(DEVICE)
    if grad:
        for t in (x, z, w):
            t.requires_grad_()
    return [x, z, w, 1e-5, 4, False, torch.float32]


CASES = {"scan": (scan_fwd_op, _scan_args), "conv": (conv_fwd_op, _conv_args),
         "rms": (rms_fwd_op, _rms_args), "gated": (gated_fwd_op, _gated_args)}  # fmt: skip


def _run(fn, args):
    """Outputs, and the gradients of a weighted sum of the differentiable ones."""
    outs = fn(*args)
    loss = sum((o.float() * (i + 1)).sum() for i, o in enumerate(outs) if o.requires_grad)
    leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    grads = torch.autograd.grad(loss, leaves)
    return [o.detach() for o in outs], list(grads)


@pytest.mark.parametrize("name", list(CASES))
def test_straight_path_equals_custom_op(name):
    handle, make = CASES[name]
    got, g_got = _run(handle, make(True))
    want, g_want = _run(handle.op, make(True))
    for a, b in zip(got + g_got, want + g_want, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", list(CASES))
def test_custom_op_registration(name):
    handle, make = CASES[name]
    torch.library.opcheck(
        handle.op, make(True), test_utils=("test_schema", "test_autograd_registration")
    )
    torch.library.opcheck(handle.op, make(False), test_utils=("test_faketensor",))


def test_traced_sees_tracers():
    x = torch.randn(2, 3)
    assert not traced((x, torch.nn.Parameter(torch.randn(3)), 1.0, None))
    with FakeTensorMode() as mode:
        fake = mode.from_tensor(x)
    assert traced((fake,))
    assert torch.func.vmap(lambda t: torch.tensor(traced((t,))))(x).all()
