"""The Triton kernel of `argmax_rows`: one program per row walks the vocabulary in blocks.

Each of the BLOCK lanes of a program keeps the largest value it has seen and its first index
(a strict comparison keeps the earlier of equal values); at the end the row's answer is the
smallest index among the lanes holding the largest value, so ties resolve to the first
index, as torch.argmax does. NaN counts as larger than any number, also as torch.argmax does.
The launcher is in launch.py.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _argmax_kernel(p_x, p_out, V, s_x, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    idx = tl.zeros([BLOCK], tl.int32)
    for v0 in tl.range(0, V, BLOCK, num_stages=3):
        v = v0 + offs
        x = tl.load(p_x + row * s_x + v, mask=v < V, other=float("-inf")).to(tl.float32)
        better = (x > best) | ((x != x) & (best == best))  # a NaN beats any number
        best = tl.where(better, x, best)
        idx = tl.where(better, v, idx)
    nan = best != best
    has_nan = tl.max(nan.to(tl.int32), axis=0) > 0
    top = tl.max(tl.where(nan, float("-inf"), best), axis=0)
    hit = tl.where(has_nan, nan, best == top)
    tl.store(p_out + row, tl.min(tl.where(hit, idx, 0x7FFFFFFF), axis=0).to(tl.int64))
