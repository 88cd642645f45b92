"""linear_cross_entropy with the Triton reduction against a float64 oracle on full logits.

T tokens, M features, V classes, chunk tokens per chunk. On a machine without
CUDA the kernels run under the Triton interpreter (tiny shapes, 64-column
blocks, so rows span several blocks with a masked tail); `-m gpu` runs the
class at the bottom at the 130m model's head (V 50280, M 768).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from mambakit.ops import linear_cross_entropy
from mambakit.ops.cross_entropy import (
    cross_entropy_bwd_reference,
    cross_entropy_bwd_triton,
    cross_entropy_fwd_reference,
    cross_entropy_fwd_triton,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16

# Relative errors against the float64 oracle, which takes the same inputs (hidden
# in its dtype and the weight rounded to it, upcast exactly) and computes exact
# logits. With u the unit roundoff of the compute dtype (bf16 2^-8 = 3.9e-3, f16
# 2^-11 = 4.9e-4, f32 2^-24) and logits of size ~1 (|x| < 5 here):
# - loss (|got - ref| / |ref|): every logit carries one rounding of the GEMM
#   output, u|x|; a row's loss (~log V >= 1) moves by about u * mean|x| <= u.
#   The reductions are f32 (1e-7 relative); f32 is bounded by them.
# - gradients (max|got - ref| / max|ref|): the logits' rounding moves softmax by
#   ~u|x| relative; dL/dlogits is rounded to the dtype once (round to nearest on
#   CUDA and in torch, truncation in the interpreter: 2u); the GEMMs round their
#   output once more (u). About 5u in all; f32 has the f32 sums over V and T.
LOSS_TOL = {F32: 1e-6, F16: 5e-4, BF16: 4e-3}
GRAD_TOL = {F32: 2e-5, F16: 2.5e-3, BF16: 2e-2}


@dataclass(frozen=True)
class Case:
    T: int
    V: int
    M: int
    chunk: int
    dtype: torch.dtype
    ignored: tuple[int, ...] = ()  # token indices with target -100

    @property
    def id(self) -> str:
        dt = str(self.dtype).replace("torch.", "").replace("float", "f")
        ign = "-ign" if self.ignored else ""
        return f"T{self.T}-V{self.V}-M{self.M}-c{self.chunk}-{dt}{ign}"


CASES = [
    Case(7, 3, 8, 4, F32),
    Case(33, 65, 12, 16, F32, ignored=(0, 17)),
    Case(70, 300, 16, 16, F32, ignored=tuple(range(16, 32))),  # a whole chunk ignored
    Case(41, 129, 8, 64, BF16, ignored=(5,)),  # one chunk, V = 2 blocks + 1
    Case(70, 300, 16, 32, BF16, ignored=(3, 69)),
    Case(23, 5, 12, 8, F16),
    Case(50, 200, 16, 16, F16, ignored=(1, 2, 49)),
]


def make_inputs(c: Case, device: str = DEVICE, seed: int = 0):
    """(hidden [T, M] in c.dtype, weight [V, M] f32 (the master copy), targets [T])."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(c.T, c.M, generator=gen).to(device, c.dtype).requires_grad_()
    weight = (torch.randn(c.V, c.M, generator=gen) / c.M**0.5).to(device).requires_grad_()
    targets = torch.randint(0, c.V, (c.T,), generator=gen)
    targets[list(c.ignored)] = -100
    return hidden, weight, targets.to(device)


def run(c: Case, hidden, weight, targets, g: float = 1.7, backend: str = "triton"):
    """(loss, dL/dhidden, dL/dweight) of g * linear_cross_entropy."""
    loss = linear_cross_entropy(hidden, weight, targets, c.chunk, backend=backend)
    return (loss, *torch.autograd.grad(loss * g, (hidden, weight)))


def oracle(c: Case, hidden, weight, targets, g: float = 1.7):
    """The same in float64 on full logits, from the inputs as the compute dtype holds them."""
    h = hidden.detach().double().requires_grad_()
    w = weight.detach().to(c.dtype).double().requires_grad_()
    loss = F.cross_entropy(h @ w.t(), targets, ignore_index=-100, reduction="sum")
    return (loss, *torch.autograd.grad(loss * g, (h, w)))


def rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    assert got.shape == ref.shape, (got.shape, ref.shape)
    assert torch.isfinite(got).all(), "non-finite values (an unwritten element?)"
    return ((got.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


def check(c: Case, got, ref) -> None:
    (loss, gh, gw), (rloss, rgh, rgw) = got, ref
    assert loss.dtype == torch.float32 and gh.dtype == c.dtype and gw.dtype == torch.float32
    assert rel(loss, rloss) <= LOSS_TOL[c.dtype], (rel(loss, rloss), LOSS_TOL[c.dtype])
    assert rel(gh, rgh) <= GRAD_TOL[c.dtype], ("hidden", rel(gh, rgh))
    assert rel(gw, rgw) <= GRAD_TOL[c.dtype], ("weight", rel(gw, rgw))


@pytest.mark.parametrize("c", CASES, ids=lambda c: c.id)
def test_matches_float64_oracle(c: Case, nan_empty):
    inp = make_inputs(c)
    check(c, run(c, *inp), oracle(c, *inp))


@pytest.mark.parametrize("c", CASES[1::2], ids=lambda c: c.id)
def test_triton_and_torch_paths_agree(c: Case):
    """Same GEMMs, so the same logits: only the reduction order and one rounding differ."""
    inp = make_inputs(c)
    (loss, gh, gw), (rloss, rgh, rgw) = run(c, *inp), run(c, *inp, backend="reference")
    assert rel(loss, rloss) <= 1e-6
    assert rel(gh, rgh) <= GRAD_TOL[c.dtype] and rel(gw, rgw) <= GRAD_TOL[c.dtype]


def test_rerun_is_bit_identical(deterministic):
    c = Case(70, 300, 16, 16, BF16, ignored=(3, 40))
    inp = make_inputs(c)
    first, second = run(c, *inp), run(c, *inp)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [F32, BF16, F16], ids=str)
def test_chunk_ops_match_reference(dtype):
    """The per-chunk ops alone: loss and lse, then the in-place gradient, on given logits."""
    gen = torch.Generator().manual_seed(4)
    logits = (3 * torch.randn(9, 131, generator=gen)).to(DEVICE, dtype)
    targets = torch.randint(0, 131, (9,), generator=gen).to(DEVICE)
    targets[2] = -100
    loss, lse = cross_entropy_fwd_triton(logits, targets)
    rloss, rlse = cross_entropy_fwd_reference(logits, targets)
    assert loss.dtype == lse.dtype == torch.float32 and loss[2] == 0
    assert rel(loss, rloss) <= 1e-6 and rel(lse, rlse) <= 1e-6
    g = torch.tensor(0.3, device=DEVICE)
    want = cross_entropy_bwd_reference(logits, targets, rlse, g)
    got = cross_entropy_bwd_triton(logits.clone(), targets, lse, g)
    assert got.dtype == dtype and torch.equal(got[2], torch.zeros_like(got[2]))
    assert rel(got, want) <= {F32: 1e-6, F16: 1e-3, BF16: 8e-3}[dtype]  # <= 1 ulp


def test_masked_logits_leading_a_row():
    """Logits masked to -inf (a padded vocabulary, banned tokens) over the whole first block
    of a row, or all but one column: the loss and the gradient are the oracle's, not NaN
    (the running maximum starts at -inf)."""
    V = 2 * 2048 + 200  # blocks of 64 columns under the interpreter, up to 2048 on a GPU
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(3, V, generator=gen, dtype=torch.float64)
    logits[0, :2100] = float("-inf")  # past the first block at either size
    logits[1, :-1] = float("-inf")
    logits[2, 64:] = float("-inf")
    targets = torch.tensor([2170, V - 1, 3])
    want_loss = F.cross_entropy(logits, targets, reduction="none")
    want_lse = torch.logsumexp(logits, -1)
    x = logits.to(DEVICE, torch.float32)
    loss, lse = cross_entropy_fwd_triton(x, targets.to(DEVICE))
    assert torch.isfinite(loss).all()
    torch.testing.assert_close(loss.double().cpu(), want_loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(lse.double().cpu(), want_lse, rtol=1e-6, atol=1e-6)
    g = torch.tensor(1.0, device=DEVICE)
    got = cross_entropy_bwd_triton(x.clone(), targets.to(DEVICE), lse, g)
    want = torch.softmax(logits, -1) - F.one_hot(targets, V)
    torch.testing.assert_close(got.double().cpu(), want, rtol=1e-5, atol=1e-6)


def test_target_out_of_range_gives_nan():
    """The kernel never reads outside the row: a bad target yields NaN, not a fault."""
    logits = torch.randn(3, 10, device=DEVICE)
    loss, _ = cross_entropy_fwd_triton(logits, torch.tensor([1, 10, -5], device=DEVICE))
    assert torch.isfinite(loss[0]) and loss[1:].isnan().all()


def test_torch_compile_fullgraph():
    """The chunk ops are custom ops, so the loss traces whole and matches eager bit for bit."""
    c = Case(37, 150, 12, 16, BF16, ignored=(4,))
    hidden, weight, targets = make_inputs(c)

    def f(h, w):
        return linear_cross_entropy(h, w, targets, c.chunk, backend="triton")

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    g_c = torch.autograd.grad(compiled(hidden, weight), (hidden, weight))
    g_e = torch.autograd.grad(f(hidden, weight), (hidden, weight))
    for a, b in zip(g_c, g_e):
        assert torch.equal(a, b)


# ----------------------------------------------------------------------------- GPU, real shapes


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
class TestCrossEntropyGPU:
    """The 130m model's head: one full 4096-token chunk and a 5-token tail, V 50280, M 768."""

    @pytest.mark.parametrize("dtype", [BF16, F16, F32], ids=str)
    def test_real_shape_matches_float64_oracle(self, dtype, nan_empty):
        c = Case(4096 + 5, 50280, 768, 4096, dtype, ignored=(0, 4097, 4100))
        inp = make_inputs(c)
        check(c, run(c, *inp, backend="auto"), oracle(c, *inp))

    def test_real_shape_rerun_is_bit_identical(self, deterministic):
        c = Case(4096 + 5, 50280, 768, 4096, BF16, ignored=(7,))
        inp = make_inputs(c)
        first, second = run(c, *inp), run(c, *inp)
        for a, b in zip(first, second):
            assert torch.equal(a, b)
