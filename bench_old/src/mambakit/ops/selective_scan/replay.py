"""The backward's tile-start states from the forward's sparser ones.

With `bwd_save_tiles` KS > 1 the forward saves the state every KS backward tiles (KS TC
steps) only. Before the backward runs, `_replay_kernel` recomputes every tile's start state
into a transient [B, ceil(T / TC), D, N] f32 buffer (one layer's, freed after its backward):
each program takes one interval's saved state and runs the forward recurrence over the
interval's first KS - 1 tiles, storing the state at each tile's start. The intervals are
independent, so the grid has B x intervals x channel blocks programs: enough resident warps
to hide the loads, where a replay inside the backward's own walk stalls on them.
"""

import triton
import triton.language as tl

from .tiles import LOG2E, _combine, _in_range, _program_block, _row, _tile_decay, _tile_rows

# fmt: off


@triton.jit
def _replay_kernel(
    p_u, p_dt, p_A, p_B, p_bias, p_seq, p_saved, p_states,
    T, Dn, N, Bsz, n_saved, nc, k0,
    s_u_b, s_u_t, s_dt_b, s_dt_t, s_B_b, s_B_t, s_seq_b, s_seq_t,
    HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr, HAS_SEQ: tl.constexpr, KS: tl.constexpr,
    TC: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, EVEN: tl.constexpr,
):
    """Program (channel block, interval k = k0 + its place, row x state block):
    states[b, k KS + j] for j < KS (the tiles of interval k), from saved[b, k] by the
    recurrence over tiles k KS .. k KS + KS - 2. EVEN: T is a multiple of KS TC and D, N of
    the blocks (no masks)."""
    pid_d, k, b, pid_n, d, n, md, mn, mdn, A, bias = _program_block(
        p_A, p_bias, Dn, N, Bsz, HAS_BIAS, BLOCK_D, BLOCK_N
    )
    k += k0  # (a grid's second dimension holds at most 65535 intervals a launch)
    A2 = A * LOG2E
    rows = tl.arange(0, TC)
    off = d[None, :] * N + n[:, None]
    h = tl.load(p_saved + (b * n_saved + k) * Dn * N + off, mask=mdn, other=0.0)
    for j in tl.static_range(KS):
        c = k * KS + j
        tl.store(p_states + (b * nc + c) * Dn * N + off, h, mask=_in_range(mdn, c, nc))
        if j < KS - 1:
            t0 = c * TC
            mt = (t0 + rows) < T
            m2, _raw, dt, a = _tile_decay(
                t0, rows, mt, b, d, md, p_dt, s_dt_b, s_dt_t, p_seq, s_seq_b, s_seq_t, A2,
                bias, HAS_BIAS, SOFTPLUS, HAS_SEQ, EVEN,
            )
            u = _tile_rows(p_u, s_u_b, s_u_t, b, t0, rows, d, m2, EVEN)
            Bt = _tile_rows(p_B, s_B_b, s_B_t, b, t0, rows, n, mt[:, None] & mn[None, :], EVEN)
            bx = (dt * u)[:, None, :] * Bt[:, :, None]  # as the backward's tiles compute it
            bx = tl.where((rows == 0)[:, None, None], bx + a * h[None, :, :], bx)
            _pa, hs = tl.associative_scan((a, bx), 0, _combine)
            h = _row(hs, rows, TC - 1)
