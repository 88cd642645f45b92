"""ops/_triton.launch: the launch fast path reuses a compiled kernel only for calls the JIT
would specialize the same way, and falls back to the JIT for calls it does not model."""

import pytest
import torch
import triton
import triton.language as tl

from mambakit.ops import _triton
from mambakit.ops._triton import _keyword_order, _spec, launch


def _affine(p_out, p_x, n, shift, BLOCK: tl.constexpr, TWICE: tl.constexpr = True):
    """out[i] = x[i] * (2 if TWICE else 1) + shift for i < n."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    x = tl.load(p_x + i, mask=m)
    if TWICE:
        x = x * 2
    tl.store(p_out + i, x + shift, mask=m)


_affine_kernel = triton.jit(_affine)
_compiled_kernel = triton.runtime.JITFunction(_affine)  # a JIT kernel even under the interpreter


def test_keyword_order_follows_the_signature_and_defaults():
    assert _keyword_order(_compiled_kernel, 4, {"BLOCK": 64}) == [("BLOCK", None), (None, True)]
    order = _keyword_order(_compiled_kernel, 4, {"TWICE": False, "BLOCK": 8, "num_warps": 2})
    assert order == [("BLOCK", None), ("TWICE", None)]


@pytest.mark.parametrize(
    "n_positional, kwargs",
    [
        (5, {}),  # a constexpr by position: its value is not in the key
        (2, {"n": 4, "shift": 0, "BLOCK": 8}),  # runtime arguments by keyword
        (4, {"BLOCK": 8, "colour": 1}),  # an unknown keyword
        (4, {}),  # a constexpr without default missing
    ],
)
def test_calls_the_fast_path_cannot_model_go_to_the_jit(n_positional, kwargs):
    assert _keyword_order(_compiled_kernel, n_positional, kwargs) is None


def test_spec_separates_what_triton_specializes_on():
    x = torch.zeros(64, dtype=torch.float32)
    assert _spec(x) != _spec(x[1:])  # 16-byte alignment
    assert _spec(x) != _spec(x.to(torch.bfloat16))  # dtype
    assert _spec(32) != _spec(33) and _spec(33) == _spec(35)  # divisibility by 16
    assert _spec(1) != _spec(3)  # equal to one
    assert _spec(2**31 + 16) != _spec(16)  # 32-bit range
    assert _spec(2**63 + 16) != _spec(2**62 + 16)  # signed 64-bit range
    assert _spec(None) is None and _spec(True) is True


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_reused_kernels_give_the_jit_results():
    """Every launch equals the closed form, whether it compiled a specialization, reused one,
    or needed a new one (misaligned pointer, n divisible by 16, other constexpr)."""
    _triton._caches.pop(_affine_kernel, None)
    x = torch.randn(80, device="cuda")
    entries = []
    cases = [
        (x, 40, 1.5, True),  # compiles
        (x, 40, -2.0, True),  # reuses
        (x[1:], 40, 0.25, True),  # misaligned: a new specialization
        (x, 48, 0.0, True),  # n % 16 == 0: a new specialization
        (x[3:], 33, 1.0, True),  # reuses the misaligned one
        (x, 40, 1.0, False),  # another constexpr value
    ]
    for src, n, shift, twice in cases:
        out = torch.full((n,), float("nan"), device="cuda")
        launch(_affine_kernel, (triton.cdiv(n, 16),), out, src, n, shift, BLOCK=16, TWICE=twice)
        expect = src[:n] * (2 if twice else 1) + shift
        torch.testing.assert_close(out, expect, rtol=0, atol=0)
        entries.append(len(_triton._caches[_affine_kernel]))
    assert entries == [1, 1, 2, 3, 3, 4]


def test_host_helpers_equal_tritons():
    """The launchers' host-side next_power_of_2 and cdiv give triton's values."""
    for n in [*range(0, 4100), 2**20 - 1, 2**20, 2**20 + 1, 2**31 - 1, 2**31]:
        assert _triton.next_power_of_2(n) == triton.next_power_of_2(n), n
        for d in (1, 3, 16, 64, 1000):
            assert _triton.cdiv(n, d) == triton.cdiv(n, d), (n, d)
