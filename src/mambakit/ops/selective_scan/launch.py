"""The selective scan's Triton launchers: launch configuration and host code of the kernels,
the decode step's `state_update` included.

B batch, T time, D = d_inner, N = d_state; TC = the backward's time tile and the interval of
the saved states, FWD_TC = the forward's tile (`ScanConfig`). A program owns one row, one
block of channels, one block of states and one segment of time; it walks its segment one tile
of steps at a time, holding the [TC, BLOCK_N, BLOCK_D] decays and inputs of a tile in
registers and resolving the recurrence inside the tile with `tl.associative_scan` over time.
Each exponential is computed once per pass. Only the state between tiles is carried from one
iteration to the next.

A segment is the whole sequence unless rows x channel blocks give too few programs to fill
the GPU (a long single sequence); then time is cut into segments, each segment's summary is
computed first, then every segment gets its start (forward: each output program composes the
summaries before its segment) or its end carry (backward: a small scan over segments).

Forward (one launch; two with segments):
  [`_fwd_kernel` LOCAL: each segment but the last from a zero state: end state, decay product]
  `_fwd_kernel`: its segment's start from the summaries before it, then y_t = sum_n h_t C_t
  (+ D u_t, * silu(z_t)); the state every KS TC steps is stored for the backward:
  4 D N / (KS TC) bytes per token.
Backward (one launch; three with segments; one more with KS > 1):
  [`_replay_kernel` (KS > 1): every tile's start state from the saved ones, into a
   transient buffer of one state per tile, the intervals in parallel]
  [`_bwd_local_kernel`: each segment but the first, reverse recurrence from a zero carry;
   `_carry_bwd_kernel`: the carry into each segment's end]
  `_bwd_kernel`: per tile, the states are recomputed from the tile-start state (forward
  scan) and the adjoints by a reverse scan; a_t h_{t-1} is h_t - b_t, so nothing divides
  by a decay. dB, dC (over channel blocks), dA, dD, d delta_bias (over rows and
  segments) are per-program partials summed afterwards in a fixed order: no atomics,
  bit-identical reruns.
Exponentials use exp2 with log2(e) folded into A.

The kernels live next to this file: forward.py (`_fwd_kernel`), backward.py (`_bwd_kernel`,
`_bwd_local_kernel`), replay.py (the tile-start states from sparser saved ones), carry.py
(the backward's scan over segments), channel_sum.py (the backward's warp reduce-scatter over
channels, and the one launch that sums its partials), tiles.py (tile loads, decays, scan
combines) and step.py (the decode step's state update). They are imported here, so this
module names every kernel of the scan.
"""

import torch

from .._triton import cdiv, launch, next_power_of_2, opt, strides
from .backward import _bwd_kernel, _bwd_local_kernel
from .carry import _carry_bwd_kernel
from .channel_sum import _sum_partials_kernel
from .forward import _fwd_kernel, _fwd_last_kernel
from .programs import (
    bc_f32,
    contiguous_params,
    input_strides,
    reduce_scatter_fits,
    state_block,
    steps_need_int64,
    tile_slots,
    time_segments,
    whole_tiles,
)
from .replay import _replay_kernel
from .scan_config import ScanConfig, config, save_interval
from .step import _state_update_kernel

__all__ = ["ScanConfig", "config", "save_interval", "state_chunk", "scan_fwd", "scan_last",
           "scan_bwd", "state_update", "reduce_scatter_fits"]  # fmt: skip


def state_chunk(Dn: int, is_cuda: bool) -> int:
    """Timesteps between the states the forward saves for the backward at D = Dn channels
    (the GPU saves fewer at wide layers: `config`)."""
    return save_interval(config(Dn, not is_cuda))


def _new(shape, dtype, device) -> torch.Tensor:
    """Every buffer a kernel fills; tests swap it for a NaN-filled one."""
    return torch.empty(shape, dtype=dtype, device=device)


def scan_fwd(
    u,
    delta,
    A,
    B,
    C,
    D,
    z,
    delta_bias,
    delta_softplus,
    initial_state,
    seq_idx,
    save_states: bool,
    cfg: ScanConfig | None = None,
    at: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
):
    """(y [B, T, D] in u.dtype, final state [B, D, N] f32, the states at every (KS TC)-th
    step [B, T/(KS TC), D, N] or an empty tensor). cfg: launch parameters other than the library's
    (`config`), for scripts/scan_sweep.py and the tests. `at`: (slot int32 [B, T], tiles
    int32 [B, T / fwd_tile] (each tile's largest slot), out f32 [B, k, D, N];
    `states_at_buffers`): the state after each step t with slot[b, t] >= 0 is written to
    out[b, slot[b, t]] (`states_at`)."""
    Bsz, T, Dn = u.shape
    N = A.shape[1]
    dev = u.device
    f32 = torch.float32
    if T == 0 or Bsz == 0:  # nothing to scan: the state passes through
        hT = initial_state.float().clone() if initial_state is not None else None
        hT = hT if hT is not None else torch.zeros(Bsz, Dn, N, dtype=f32, device=dev)
        return u.new_empty(Bsz, T, Dn), hT, _new((Bsz, 0, Dn, N) if save_states else (0,), f32, dev)
    cfg_given = cfg is not None
    cfg = cfg if cfg_given else config(Dn, not u.is_cuda)
    B, C = bc_f32(B, C)
    tc, ts, bd, bn = cfg.fwd_tile, save_interval(cfg), cfg.fwd_block_d, state_block(N)
    nb, nc, ndb = cdiv(N, bn), cdiv(T, tc), cdiv(Dn, bd)
    ns = cdiv(T, ts)
    nseg, per = time_segments(nc, Bsz * ndb * nb, cfg.fwd_seg_target_per_sm, cfg, dev)
    A, D, delta_bias = contiguous_params(A, D, delta_bias)
    h0 = initial_state.contiguous() if initial_state is not None else None
    flags = dict(
        HAS_D=D is not None,
        HAS_Z=z is not None,
        HAS_BIAS=delta_bias is not None,
        SOFTPLUS=bool(delta_softplus),
        HAS_SEQ=seq_idx is not None,
        SPLIT_N=nb > 1,
        TC=tc,
        TS=ts,
        BLOCK_D=bd,
        BLOCK_N=bn,
        EVEN=whole_tiles(T, Dn, N, tc, bd, bn),
        num_warps=cfg.fwd_warps,
    )
    grid = (ndb, nseg, Bsz * nb)
    ins = (u, delta, A, B, C, opt(D, A), opt(z, u), opt(delta_bias, A), opt(seq_idx, A))
    sizes = (T, Dn, N, Bsz, nc, ns, nseg, per, *input_strides(u, delta, B, C, z, seq_idx))
    hT = _new((Bsz, Dn, N), f32, dev)
    hloc = P = A  # segment summaries: none with one segment
    if nseg > 1:  # each segment's summary; the output pass composes those before its segment
        # the last segment's summary is never used (its end is h_T, stored by the pass below)
        hloc, P = _summaries(
            u, delta, A, B, C, delta_bias, delta_softplus, seq_idx, nseg, per, False, cfg
        )
    states = _new((Bsz, ns, Dn, N), f32, dev) if save_states else _new((0,), f32, dev)
    y = _new((Bsz, T, Dn), u.dtype, dev) if nb == 1 else _new((nb, Bsz, T, Dn), f32, dev)
    slot, tiles, at_out = at if at is not None else (A, A, A)
    if at is not None and cfg_given:  # the tiles are the library's: a cfg's own may differ
        tiles = tile_slots(slot, tc)
    sizes = (*sizes[:8], at_out.shape[1] if at is not None else 0, *sizes[8:])
    launch(_fwd_kernel, grid,
        *ins, opt(h0, A), opt(states, A), hT, hloc, P, y, slot, tiles, at_out, *sizes,
        HAS_H0=h0 is not None, LOCAL=False, SAVE=save_states, HAS_AT=at is not None, **flags,
    )  # fmt: skip
    if nb > 1:  # the state blocks' partial sums, then D u and the gate
        y = y.sum(0)
        if D is not None:
            y = y + u.float() * D
        if z is not None:
            y = y * torch.nn.functional.silu(z.float())
        y = y.to(u.dtype)
    return y, hT, states


def _summaries(u, delta, A, B, C, delta_bias, softplus, seq_idx, nseg, per, with_last, cfg):
    """(hloc, P [B, nseg, D, N] f32): each segment's end state from a zero start and its decay
    product (the LOCAL pass, segments of `per` forward tiles, in tiles of `fwd_local_tiles`
    when they divide it), for the segments before the last, or every one (`with_last`). The
    segments before the last lie inside the sequence, so only D and N may need masks there."""
    Bsz, T, Dn = u.shape
    N = A.shape[1]
    tc, bd, bn = cfg.fwd_tile, cfg.fwd_block_d, state_block(N)
    nb = cdiv(N, bn)
    m = cfg.fwd_local_tiles if per % cfg.fwd_local_tiles == 0 else 1
    if with_last:
        even = whole_tiles(T, Dn, N, tc * m, bd, bn)
    else:
        even = whole_tiles(0, Dn, N, 1, bd, bn)
    hloc = torch.empty(Bsz, nseg, Dn, N, dtype=torch.float32, device=u.device)
    P = torch.empty_like(hloc)
    launch(
        _fwd_kernel, (cdiv(Dn, bd), nseg if with_last else nseg - 1, Bsz * nb),
        u, delta, A, B, C, A, A, opt(delta_bias, A), opt(seq_idx, A), A, A, A, hloc, P, A, A, A,
        A, T, Dn, N, Bsz, cdiv(T, tc * m), 1, nseg, per // m, 0,
        *input_strides(u, delta, B, C, None, seq_idx),
        HAS_D=False, HAS_Z=False, HAS_BIAS=delta_bias is not None, SOFTPLUS=bool(softplus),
        HAS_SEQ=seq_idx is not None, HAS_H0=False, LOCAL=True, SAVE=False, HAS_AT=False,
        SPLIT_N=nb > 1,
        TC=tc * m, TS=cfg.bwd_tile, BLOCK_D=bd, BLOCK_N=bn, EVEN=even, num_warps=cfg.fwd_warps,
    )  # fmt: skip
    return hloc, P


def scan_last(
    u, delta, A, B, C, D, z_last, initial_state, seq_idx, cfg: ScanConfig | None = None
):  # fmt: skip
    """(y at the last step [B, D] in u.dtype, final state [B, D, N] f32): `scan_fwd`'s y[:, -1]
    and final state, for a prefill's last layer, where nothing reads y before the last step.
    Delta is given as the scan uses it (no bias, no softplus: the dt_proj kernel's); the gate
    z_last [B, D] (or None) is z at the last step. The summaries' pass runs over every
    segment of the row (the last one too), then one small kernel composes them from the
    initial state into h_T and takes y_T from it: the output pass over the whole row (its
    exponentials, y's sums and stores) is not run."""
    Bsz, T, Dn = u.shape
    N = A.shape[1]
    dev = u.device
    f32 = torch.float32
    cfg = cfg if cfg is not None else config(Dn, not u.is_cuda)
    B, C = bc_f32(B, C)
    bn = state_block(N)
    nc, nprog = cdiv(T, cfg.fwd_tile), Bsz * cdiv(Dn, cfg.fwd_block_d) * cdiv(N, bn)
    nseg, per = time_segments(nc, nprog, cfg.fwd_seg_target_per_sm, cfg, dev)
    A, D = contiguous_params(A, D)
    hloc, P = _summaries(u, delta, A, B, C, None, False, seq_idx, nseg, per, True, cfg)
    hT = _new((Bsz, Dn, N), f32, dev)
    y = _new((Bsz, Dn), u.dtype, dev)
    h0 = initial_state.contiguous() if initial_state is not None else None
    block_n = next_power_of_2(N)
    launch(
        _fwd_last_kernel, (cdiv(Dn, 32), Bsz),
        u, C, opt(D, A), opt(z_last, u), opt(h0, A), hloc, P, hT, y, T, Dn, N, nseg,
        u.stride(0), u.stride(1), C.stride(0), C.stride(1), *strides(z_last, 1),
        HAS_D=D is not None, HAS_Z=z_last is not None, HAS_H0=h0 is not None, BLOCK_D=32,
        BLOCK_N=block_n, num_warps=1 if block_n <= 32 else 4,
    )  # fmt: skip
    return y, hT


MAX_GRID_Y = 65535  # programs along a grid's second dimension (CUDA's limit)


def replay_states(u, delta, A, B, delta_bias, delta_softplus, seq_idx, saved, cfg):
    """The state at the start of every backward tile, [B, ceil(T / TC), D, N] f32, from the
    forward's `saved` one every KS tiles (`_replay_kernel`: one program per interval,
    channel block and row). A: [D, N] contiguous."""
    Bsz, T, Dn = u.shape
    N = A.shape[1]
    tc, ks, bn = cfg.bwd_tile, cfg.bwd_save_tiles, state_block(N)
    bd = min(cfg.fwd_block_d, next_power_of_2(Dn))
    nc, n_saved = cdiv(T, tc), saved.shape[1]
    states = _new((Bsz, nc, Dn, N), torch.float32, u.device)
    even = whole_tiles(T, Dn, N, tc * ks, bd, bn)  # whole intervals
    for k0 in range(0, n_saved, MAX_GRID_Y):
        launch(_replay_kernel, (cdiv(Dn, bd), min(n_saved - k0, MAX_GRID_Y), Bsz * cdiv(N, bn)),
            u, delta, A, B, opt(delta_bias, A), opt(seq_idx, A), saved, states,
            T, Dn, N, Bsz, n_saved, nc, k0, *u.stride()[:2], *delta.stride()[:2],
            *B.stride()[:2], *strides(seq_idx, 2),
            HAS_BIAS=delta_bias is not None, SOFTPLUS=bool(delta_softplus),
            HAS_SEQ=seq_idx is not None, KS=ks, TC=tc, BLOCK_D=bd, BLOCK_N=bn, EVEN=even,
            num_warps=cfg.fwd_warps,
        )  # fmt: skip
    return states


def scan_bwd(
    gy,
    g_final,
    u,
    delta,
    A,
    B,
    C,
    D,
    z,
    delta_bias,
    delta_softplus,
    initial_state,
    seq_idx,
    states,
    cfg: ScanConfig | None = None,
    dz_out: torch.Tensor | None = None,
):
    """(du, ddelta, dA, dB, dC, dD, dz, d delta_bias, d initial_state); absent ones None.
    cfg: as for `scan_fwd`, with the bwd_tile and bwd_save_tiles the states were saved at.
    dz_out: a [B, T, D] tensor (any row strides, stride 1 in D) that receives dz, returned
    as dz."""
    Bsz, T, Dn = u.shape
    N = A.shape[1]
    dev = u.device
    if T == 0 or Bsz == 0:  # the final state was the initial state: its gradient passes through
        z32 = torch.zeros(Dn, dtype=torch.float32, device=dev)
        dh0 = None
        if initial_state is not None:
            dh0 = (
                g_final.float().clone() if g_final is not None else torch.zeros_like(initial_state)
            )
        return (
            torch.empty_like(u), torch.empty_like(delta), torch.zeros_like(A, dtype=torch.float32),
            torch.empty_like(B), torch.empty_like(C), z32 if D is not None else None,
            (dz_out if dz_out is not None else torch.empty_like(z)) if z is not None else None,
            z32.clone() if delta_bias is not None else None, dh0,
        )  # fmt: skip
    cfg = cfg if cfg is not None else config(Dn, not u.is_cuda)
    tc, bd, bn, ks = cfg.bwd_tile, cfg.bwd_block_d, state_block(N), cfg.bwd_save_tiles
    nb, nc, ndb = cdiv(N, bn), cdiv(T, tc), cdiv(Dn, bd)
    nseg, per = time_segments(nc, Bsz * ndb * nb, cfg.seg_target_per_sm, cfg, dev)
    if nseg > 1 and cfg.bwd_block_d_seg and cfg.bwd_block_d_seg != bd:  # a long row
        bd = cfg.bwd_block_d_seg
        ndb = cdiv(Dn, bd)
        nseg, per = time_segments(nc, Bsz * ndb * nb, cfg.seg_target_per_sm, cfg, dev)
    ns = cdiv(T, tc * ks)
    if tuple(states.shape) != (Bsz, ns, Dn, N):
        raise ValueError(
            f"states: expected the forward's saved states of shape {(Bsz, ns, Dn, N)} "
            f"(one every {tc * ks} steps), got {tuple(states.shape)}"
        )
    f32 = torch.float32
    A, D, delta_bias = contiguous_params(A, D, delta_bias)
    DN = Dn * N
    common = dict(
        HAS_Z=z is not None,
        HAS_BIAS=delta_bias is not None,
        SOFTPLUS=bool(delta_softplus),
        HAS_SEQ=seq_idx is not None,
        TC=tc,
        BLOCK_D=bd,
        BLOCK_N=bn,
        EVEN=whole_tiles(T, Dn, N, tc, bd, bn),
        num_warps=cfg.bwd_warps,
    )
    grid = (ndb, nseg, Bsz * nb)
    cap = dict(maxnreg=cfg.bwd_maxnreg) if cfg.bwd_maxnreg else {}
    s_in = input_strides(u, delta, B, C, z, seq_idx)
    s_dy = gy.stride()
    if ks > 1:  # a state per tile again, for this backward only
        states = replay_states(u, delta, A, B, delta_bias, delta_softplus, seq_idx, states, cfg)
    gin = g_final.contiguous() if g_final is not None else None
    # the kernels add t0 * (step stride) in int32 unless some tile's offset passes it: the
    # inputs' here, and below the outputs' (Dn: du, d delta, ys; N: the dB, dC partials)
    off64 = steps_need_int64(nc * tc, *s_in[1:10:2], s_dy[1])
    if nseg > 1:  # each segment's summary, then the carry into every segment's end
        W = torch.empty(Bsz, nseg, Dn, N, dtype=f32, device=dev)
        P = torch.empty_like(W)
        # the first segment's summary is never used (its start is dL/d initial_state)
        launch(_bwd_local_kernel, (ndb, nseg - 1, Bsz * nb),
            delta, A, C, opt(z, u), opt(delta_bias, A), opt(seq_idx, A), gy, W, P,
            T, Dn, N, Bsz, nseg, per, *s_in[2:4], *s_in[6:], *s_dy, OFF64=off64, **common,
        )  # fmt: skip
        G = torch.empty_like(W)
        launch(_carry_bwd_kernel, (cdiv(DN, cfg.carry_block), Bsz),
            W, P, opt(gin, A), G, nseg, DN,
            HAS_GT=gin is not None, BLOCK_E=cfg.carry_block, CB=cfg.carry_rows,
        )  # fmt: skip
        gin = G
        del W, P
    if nb == 1:
        du = _new((Bsz, T, Dn), u.dtype, dev)
        ddt = _new((Bsz, T, Dn), delta.dtype, dev)
        dz = None
        if z is not None:
            dz = dz_out if dz_out is not None else _new((Bsz, T, Dn), z.dtype, dev)
        ys = None
    else:
        du = _new((nb, Bsz, T, Dn), f32, dev)
        ddt = _new((nb, Bsz, T, Dn), f32, dev)
        dz = None
        ys = _new((nb, Bsz, T, Dn), f32, dev) if z is not None else None
    dBp = _new((ndb, Bsz, T, N), f32, dev)
    dCp = _new((ndb, Bsz, T, N), f32, dev)
    dAp = _new((Bsz, nseg, Dn, N), f32, dev)
    dDp = _new((Bsz, nseg, Dn), f32, dev) if D is not None else None
    dbp = _new((nb, Bsz, nseg, Dn), f32, dev)
    dh0 = _new((Bsz, Dn, N), f32, dev) if initial_state is not None else None
    off64 = off64 or steps_need_int64(nc * tc, Dn, N, *strides(dz, 2)[1:])
    off64 = off64 or nc * DN >= 2**31  # the tile-start states, one [D, N] a tile
    launch(_bwd_kernel, grid,
        u, delta, A, B, C, opt(D, A), opt(z, u), opt(delta_bias, A), opt(seq_idx, A), gy,
        states, opt(gin, A), du, ddt, opt(dz, du), opt(ys, du), dBp, dCp, dAp,
        opt(dDp, A), dbp, opt(dh0, A),
        T, Dn, N, Bsz, nc, nseg, per, *s_in, *s_dy,
        *strides(dz, 2),
        HAS_D=D is not None, HAS_G=gin is not None, HAS_H0=dh0 is not None, SPLIT_N=nb > 1,
        RS=reduce_scatter_fits(tc, bd, bn, cfg.bwd_warps),
        RS_ASM=u.is_cuda, OFF64=off64,
        **common, **cap,
    )  # fmt: skip
    if nb > 1:
        du = du.sum(0).to(u.dtype)
        ddt = ddt.sum(0).to(delta.dtype)
        if z is not None:  # dz needs y over every state block
            zf = z.float()
            y_pre = ys.sum(0) + (u.float() * D if D is not None else 0.0)
            sz = torch.sigmoid(zf)
            dz = (gy.float() * y_pre * sz * (1 + zf * (1 - sz))).to(z.dtype)
            if dz_out is not None:
                dz = dz_out.copy_(dz)
    dB = _new((Bsz, T, N), B.dtype, dev)
    dC = _new((Bsz, T, N), C.dtype, dev)
    dA = _new((Dn, N), f32, dev)
    dD = _new((Dn,), f32, dev) if D is not None else None
    dbias = _new((Dn,), f32, dev) if delta_bias is not None else None
    M = Bsz * T * N
    block = 1024 if u.is_cuda else 64
    rows = Bsz * nseg  # the parameters' partials: one row per (row, segment)
    n_par = cdiv(Dn * N, block) + 2 * cdiv(Dn, block)  # dA's blocks, dD's, d delta_bias's
    launch(_sum_partials_kernel, (max(cdiv(M, block), n_par), 3),
        dBp, dCp, dB, dC, ndb, M, dAp, dA, rows, Dn * N, opt(dDp, A), opt(dD, A), rows, Dn,
        dbp, opt(dbias, A), nb * rows, Dn,
        HAS_D=D is not None, HAS_BIAS=delta_bias is not None, BLOCK_E=block,
    )  # fmt: skip
    return du, ddt, dA, dB, dC, dD, dz, dbias, dh0


def state_update(
    ssm_state: torch.Tensor,  # [B, D, N], updated in place
    u: torch.Tensor,  # [B, D]
    delta: torch.Tensor,  # [B, D]
    A: torch.Tensor,  # [D, N]
    B: torch.Tensor,  # [B, N]
    C: torch.Tensor,  # [B, N]
    D: torch.Tensor | None,  # [D]
    z: torch.Tensor | None,  # [B, D]
    delta_bias: torch.Tensor | None,  # [D]
    delta_softplus: bool,
) -> torch.Tensor:
    Bsz, Dn = u.shape
    N = ssm_state.shape[2]
    y = torch.empty(Bsz, Dn, dtype=u.dtype, device=u.device)
    block_n = next_power_of_2(N)
    block_d = max(1, min(next_power_of_2(Dn), 2048 // block_n))
    if not u.is_cuda:  # the interpreter: small blocks
        block_d = min(block_d, 16)
    grid = (Bsz, cdiv(Dn, block_d))
    launch(_state_update_kernel, grid,
        ssm_state, u, delta, A, B, C,
        D if D is not None else A, z if z is not None else u,
        delta_bias if delta_bias is not None else A, y,
        Dn, N,
        *ssm_state.stride(), u.stride(0), *delta.stride(), *A.stride(), B.stride(0), C.stride(0),
        D.stride(0) if D is not None else 0, *strides(z, 2),
        delta_bias.stride(0) if delta_bias is not None else 0, y.stride(0),
        HAS_D=D is not None, HAS_Z=z is not None, HAS_BIAS=delta_bias is not None,
        SOFTPLUS=bool(delta_softplus), BLOCK_D=block_d, BLOCK_N=block_n,
        num_warps=4 if block_d * block_n >= 1024 else 2,
    )  # fmt: skip
    return y
