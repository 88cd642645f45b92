"""argmax_rows (greedy decoding's token choice) against torch.argmax.

On the CPU the kernel runs under the Triton interpreter (blocks of 64 logits, so a row spans
several blocks); on the device (`-m gpu`) at a vocabulary of 50280.
"""

import pytest
import torch

from mambakit.ops.argmax import argmax_rows

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
V = 50280 if DEVICE == "cuda" else 300


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_argmax_rows_equals_torch_argmax(dtype):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(7, V, generator=gen).to(dtype)
    x[1, 5] = x[1, V - 3] = x[1].max() + 1  # a tie: the first index wins
    x[2] = 0.0  # all equal: index 0
    x[3] = float("-inf")  # all -inf: index 0
    x[4, 10], x[4, V - 1] = float("nan"), float("nan")  # NaN counts as the largest: the first
    x[5, V - 1] = float("inf")  # the last element
    x[6, 0] = 100.0  # the first element
    x = x.to(DEVICE)
    got = argmax_rows(x, backend="triton")
    assert got.dtype == torch.int64 and got.shape == (7,)
    assert torch.equal(got.cpu(), x.cpu().argmax(dim=-1))
    assert got.tolist()[1:7] == [5, 0, 0, 10, V - 1, 0]


def test_argmax_rows_strided_and_small():
    gen = torch.Generator().manual_seed(1)
    wide = torch.randn(5, 2 * V, generator=gen).to(DEVICE)
    x = wide[:, ::2]  # stride 2 along V
    assert torch.equal(argmax_rows(x, backend="triton").cpu(), x.cpu().argmax(dim=-1))
    one = torch.randn(3, 1, generator=gen).to(DEVICE)
    assert argmax_rows(one, backend="triton").tolist() == [0, 0, 0]
    assert argmax_rows(torch.empty(0, V, device=DEVICE), backend="triton").shape == (0,)


def test_argmax_rows_rejects_bad_input():
    with pytest.raises(ValueError, match="logits"):
        argmax_rows(torch.zeros(2, 3, 4, device=DEVICE))
    with pytest.raises(TypeError, match="logits"):
        argmax_rows(torch.zeros(2, 3, dtype=torch.int64, device=DEVICE))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_argmax_rows_gpu_batch_64():
    x = torch.randn(64, 50280, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))
