"""The backward's scan over segments: the adjoint carried into each segment's end.

Used only when time is cut into segments (a long single sequence gives too few programs):
a first pass gives every segment of a row its own summary, an affine map over the [D, N]
adjoint (decay product P and the adjoint that builds up from zero inside it), and this
kernel composes the maps of one row in reverse order with `tl.associative_scan`, CB segments
at a time, BLOCK_E state elements per program. (The forward needs no such launch: each
output program composes the summaries before its own segment.)
"""

import triton
import triton.language as tl

from .tiles import _combine

# fmt: off


@triton.jit
def _carry_bwd_kernel(
    p_W, p_P, p_gT, p_gin, nc, DN,
    HAS_GT: tl.constexpr, BLOCK_E: tl.constexpr, CB: tl.constexpr,
):
    """Gin_{nc-1} = dL/dh_T, Gin_{c-1} = W_c + P_c Gin_c: the adjoint carried into the end
    of each segment (dL/d initial_state comes out of the backward kernel's first segment, so
    the first segment has no summary W_0, P_0)."""
    e = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    b = tl.program_id(1).to(tl.int64)
    me = e < DN
    if HAS_GT:
        G = tl.load(p_gT + b * DN + e, mask=me, other=0.0)
    else:
        G = tl.zeros([BLOCK_E], tl.float32)
    base = b * nc * DN
    tl.store(p_gin + base + (nc - 1) * DN + e, G, mask=me)
    rows = tl.arange(0, CB)
    for k in range(0, nc, CB):
        cs = nc - 1 - k - rows  # row r holds chunk nc-1-k-r: the scan runs backwards in time
        m2 = (cs >= 1)[:, None] & me[None, :]
        off = base + cs[:, None].to(tl.int64) * DN + e[None, :]
        P = tl.load(p_P + off, mask=m2, other=1.0)
        W = tl.load(p_W + off, mask=m2, other=0.0)
        Pc, Wc = tl.associative_scan((P, W), 0, _combine)
        X = Wc + Pc * G[None, :]  # dL/dh just before chunk cs
        tl.store(p_gin + off - DN, X, mask=m2)
        last = tl.minimum(CB, nc - k) - 1
        G = tl.sum(tl.where((rows == last)[:, None], X, 0.0), axis=0)
