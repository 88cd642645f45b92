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
