"""Triton kernels for the cross-entropy of one chunk of logits (launched from launch.py).

c rows (tokens), V classes; logits [c, V] in any float dtype with stride 1 in V.
Per row, with x the logits and t the target (-100: ignored):

    lse     = log(sum_v exp(x_v))                  (f32)
    loss    = lse - x_t                            (f32; 0 for an ignored row)
    dL/dx_v = g * (exp(x_v - lse) - [v == t])      (in the logits' dtype; 0 rows ignored)

Each logit is read once in its own dtype. The forward runs one program per row
and walks it in BLOCK_V columns, keeping a running max m and sum s of exp(x - m)
(online logsumexp: one exponential per logit, each block's max and sum reduced
in a fixed order); x_t is one scalar load. The backward takes the forward's lse
and needs no reduction: one program per (row, column block) overwrites the
logits with their gradient in place.
Exponentials are exp2 with log2(e) folded into x. A target outside [0, V) other
than -100 gives a NaN loss (the reference raises instead); no read goes out of
the row. No atomics: two runs are bit-identical.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _ce_fwd_kernel(
    p_logits,
    p_tgt,
    p_loss,
    p_lse,
    V,
    s_row,
    BLOCK_V: tl.constexpr,
    IGNORE: tl.constexpr,
):
    LOG2E: tl.constexpr = 1.4426950408889634
    row = tl.program_id(0).to(tl.int64)
    p_row = p_logits + row * s_row
    cols = tl.arange(0, BLOCK_V)
    b_m = tl.full([], float("-inf"), tl.float32)  # running max of x * log2(e)
    b_s = tl.zeros([], dtype=tl.float32)  # running sum of exp2(x * log2(e) - b_m)
    for v0 in range(0, V, BLOCK_V):
        b_x = tl.load(p_row + v0 + cols, mask=v0 + cols < V, other=float("-inf"))
        b_x = b_x.to(tl.float32) * LOG2E  # [BLOCK_V]
        b_m_new = tl.maximum(b_m, tl.max(b_x, axis=0))
        # while every logit so far is -inf the sum stays 0 (exp2(-inf - -inf) would be NaN)
        b_ref = tl.where(b_m_new == float("-inf"), 0.0, b_m_new)
        b_s = b_s * tl.exp2(b_m - b_ref) + tl.sum(tl.exp2(b_x - b_ref), axis=0)
        b_m = b_m_new
    b_lse = (b_m + tl.log2(b_s)) / LOG2E
    tgt = tl.load(p_tgt + row)
    in_range = (tgt >= 0) & (tgt < V)
    b_picked = tl.load(p_row + tl.where(in_range, tgt, 0)).to(tl.float32)
    b_loss = tl.where(in_range, b_lse - b_picked, float("nan"))
    b_loss = tl.where(tgt == IGNORE, 0.0, b_loss)
    tl.store(p_loss + row, b_loss)
    tl.store(p_lse + row, b_lse)


@triton.jit
def _ce_bwd_kernel(
    p_logits,
    p_tgt,
    p_lse,
    p_g,
    V,
    s_row,
    BLOCK_V: tl.constexpr,
    IGNORE: tl.constexpr,
):
    LOG2E: tl.constexpr = 1.4426950408889634
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    mask = offs < V
    p_row = p_logits + row * s_row
    tgt = tl.load(p_tgt + row)
    b_scale = tl.where(tgt == IGNORE, 0.0, tl.load(p_g).to(tl.float32))
    b_lse2 = tl.load(p_lse + row) * LOG2E
    b_x = tl.load(p_row + offs, mask=mask, other=0.0).to(tl.float32)
    b_p = tl.exp2(b_x * LOG2E - b_lse2) - tl.where(offs == tgt, 1.0, 0.0)
    tl.store(p_row + offs, (b_p * b_scale).to(p_logits.dtype.element_ty), mask=mask)
