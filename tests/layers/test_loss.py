"""linear_cross_entropy (chunked, logits never whole) against F.cross_entropy on full logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mambakit import MambaConfig, MambaLM
from mambakit.ops import linear_cross_entropy


def _oracle(h, W, t):
    return F.cross_entropy((h @ W.t()).double(), t, ignore_index=-100, reduction="sum")


@pytest.mark.parametrize("chunk", [1, 8, 64], ids=lambda c: f"chunk{c}")
def test_values_and_grads_match_full_logits(chunk):
    torch.manual_seed(0)
    h = torch.randn(37, 12, dtype=torch.float64, requires_grad=True)
    W = torch.randn(50, 12, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, 50, (37,))
    t[[3, 20]] = -100
    got = linear_cross_entropy(h, W, t, chunk=chunk)
    want = _oracle(h, W, t)
    g_got = torch.autograd.grad(got * 1.7, (h, W))
    g_want = torch.autograd.grad(want * 1.7, (h, W))
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for a, b in zip(g_got, g_want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_gradcheck():
    torch.manual_seed(1)
    h = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    W = torch.randn(7, 4, dtype=torch.float64, requires_grad=True)
    t = torch.tensor([1, 2, -100, 6, 0])
    assert torch.autograd.gradcheck(lambda h, W: linear_cross_entropy(h, W, t, chunk=2), (h, W))


def test_bf16_autocast_close_to_f64():
    """Under bf16 autocast the head GEMM runs in bf16 and the reduction in f32."""
    torch.manual_seed(2)
    h = torch.randn(64, 32)
    W = torch.randn(100, 32) * 0.1
    t = torch.randint(0, 100, (64,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = linear_cross_entropy(h.bfloat16(), W, t, chunk=16)
    assert got.dtype == torch.float32
    want = _oracle(h.double(), W.double(), t)
    # bf16 inputs (8-bit mantissa) on logits of size ~1: about 1e-2 relative per logit
    assert abs(got.item() - want.item()) / want.item() < 1e-2


def test_model_loss_sum_equals_logits_path():
    """MambaLM.loss_sum (no logits) == cross-entropy on MambaLM's logits, tied head grads too."""
    torch.manual_seed(3)
    model = MambaLM(MambaConfig(d_model=16, n_layers=2, vocab_size=40, d_state=4)).double()
    ids = torch.randint(0, 40, (2, 11))
    targets = torch.roll(ids, -1, 1)
    targets[:, -1] = -100
    loss, state = model.loss_sum(ids, targets)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    out = model(ids)
    ref = F.cross_entropy(out.logits.flatten(0, 1), targets.flatten(), reduction="sum")
    ref_grads = torch.autograd.grad(ref, list(model.parameters()))
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(state.ssm, out.state.ssm)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("needs", ["both", "hidden", "weight"])
def test_gradients_from_the_forward_scaled_by_the_backward(needs):
    """The forward keeps the gradients of a unit upstream gradient: the backward scales them,
    leaves them intact for a retained graph's second backward, and gives only those asked
    for; without grad mode the loss has no graph."""
    torch.manual_seed(4)
    h = torch.randn(19, 6, dtype=torch.float64, requires_grad=needs != "weight")
    W = torch.randn(23, 6, dtype=torch.float64, requires_grad=needs != "hidden")
    t = torch.randint(0, 23, (19,))
    t[5] = -100
    inputs = [x for x in (h, W) if x.requires_grad]
    loss = linear_cross_entropy(h, W, t, chunk=4)
    first = torch.autograd.grad(loss * -0.3, inputs, retain_graph=True)
    second = torch.autograd.grad(loss * 2.5, inputs)
    want = _oracle(h, W, t)
    want_first = torch.autograd.grad(want * -0.3, inputs, retain_graph=True)
    want_second = torch.autograd.grad(want * 2.5, inputs)
    for a, b in zip(first + second, want_first + want_second):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    with torch.no_grad():
        quiet = linear_cross_entropy(h, W, t, chunk=4)
    assert quiet.grad_fn is None
    torch.testing.assert_close(quiet, want.detach(), rtol=1e-12, atol=1e-12)


def test_bad_shapes_name_the_argument():
    h, W = torch.randn(3, 4), torch.randn(5, 4)
    with pytest.raises(ValueError, match="targets"):
        linear_cross_entropy(h, W, torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="weight"):
        linear_cross_entropy(h, torch.randn(5, 3), torch.zeros(3, dtype=torch.long))


def test_next_token_targets_cut_at_document_starts():
    from mambakit.targets import next_token_targets

    tokens = torch.tensor([[5, 6, 7, 8, 9]], dtype=torch.int32)
    docs = torch.tensor([[0, 0, 1, 1, 2]])
    got = next_token_targets(tokens, docs)
    assert got.dtype == torch.int64
    assert got.tolist() == [[6, -100, 8, -100]]  # 7 and 9 open documents 1 and 2
    assert next_token_targets(tokens).tolist() == [[6, 7, 8, 9]]
