"""One decode timestep of the causal conv1d: the Triton kernel that updates the state in place.

B batch, D channels, K = d_conv taps. The state [B, K-1, D] holds the last K-1
inputs, oldest first. One step forms the window [state; x_t] [B, K, D], returns
act(bias + sum_k weight[:, k] * window[:, k]) and shifts the window's last K-1
rows back into the state.

Each program owns all K-1 rows of its channels, loads them before it stores, so
the in-place shift needs no second buffer. Its launcher (`conv_update`, launch.py) is not
autotuned (an autotuner re-runs the kernel, shifting the state twice), never reads a value
back to the host and allocates only its output, so it can be captured in a CUDA graph.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _conv_update_kernel(
    p_state,
    p_x,
    p_w,
    p_b,
    p_out,
    D,
    s_state_b,
    s_state_k,
    s_state_d,
    s_x_b,
    s_w_d,
    s_w_k,
    s_out_b,
    K: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
):
    pid_d = tl.program_id(0)
    pid_b = tl.program_id(1).to(tl.int64)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    p_s = p_state + pid_b * s_state_b + offs_d * s_state_d
    b_x = tl.load(p_x + pid_b * s_x_b + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    acc = b_x * tl.load(p_w + offs_d * s_w_d + (K - 1) * s_w_k, mask=mask_d, other=0.0).to(
        tl.float32
    )
    if HAS_BIAS:
        acc += tl.load(p_b + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    # window row k is state row k (k < K-1); the state becomes window rows 1..K-1
    b_prev = tl.load(p_s, mask=mask_d, other=0.0)
    for k in tl.static_range(K - 1):
        b_w = tl.load(p_w + offs_d * s_w_d + k * s_w_k, mask=mask_d, other=0.0)
        acc += b_prev.to(tl.float32) * b_w.to(tl.float32)
        if k < K - 2:
            b_next = tl.load(p_s + (k + 1) * s_state_k, mask=mask_d, other=0.0)
            tl.store(p_s + k * s_state_k, b_next, mask=mask_d)
            b_prev = b_next
    tl.store(p_s + (K - 2) * s_state_k, b_x.to(p_state.dtype.element_ty), mask=mask_d)
    if SILU:
        acc = acc / (1.0 + tl.exp(-acc))
    tl.store(p_out + pid_b * s_out_b + offs_d, acc.to(p_out.dtype.element_ty), mask=mask_d)
