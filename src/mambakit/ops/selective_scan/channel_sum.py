"""Warp reduce-scatter: the backward's sums over the channels of a tile (dB, dC).

A [TC, BLOCK_N, BLOCK_D] tile of the backward puts its BLOCK_D channels on the low lane bits
of one warp and NL = 32 / BLOCK_D states on the others (Triton's default layout for these
shapes). Summing over channels with `tl.sum` costs log2(BLOCK_D) shuffles for every value a
thread holds; the reduce-scatter halves the values at each level instead and leaves every
lane finished sums to store. `reduce_scatter_fits` (programs.py) says on the host when the layout
allows it; otherwise `_store_channel_sum` sums with `tl.sum`.

`_sum_partials_kernel` then sums every per-program partial of the backward in one launch:
dB and dC over the channel blocks, dA, dD and d delta_bias over rows and segments.
"""

import triton
import triton.language as tl

from .._triton import sum_rows
from .tiles import _st, _tile_ptrs

# fmt: off


@triton.jit
def _shfl_xor(x, M: tl.constexpr, ASM: tl.constexpr):
    """y[..., d] = x[..., d ^ M] over the last dim of x [V, NL, BD], whose index d is lane bits
    0.. of the warp: one butterfly shuffle per element on the GPU (ASM), tensor ops otherwise
    (the interpreter runs no PTX)."""
    if ASM:
        xi = x.to(tl.int32, bitcast=True)
        if M == 1:
            asm: tl.constexpr = "shfl.sync.bfly.b32 $0, $1, 1, 0x1f, 0xffffffff;"
        elif M == 2:
            asm: tl.constexpr = "shfl.sync.bfly.b32 $0, $1, 2, 0x1f, 0xffffffff;"
        elif M == 4:
            asm: tl.constexpr = "shfl.sync.bfly.b32 $0, $1, 4, 0x1f, 0xffffffff;"
        elif M == 8:
            asm: tl.constexpr = "shfl.sync.bfly.b32 $0, $1, 8, 0x1f, 0xffffffff;"
        else:
            asm: tl.constexpr = "shfl.sync.bfly.b32 $0, $1, 16, 0x1f, 0xffffffff;"
        yi = tl.inline_asm_elementwise(asm, "=r,r", [xi], dtype=tl.int32, is_pure=True, pack=1)
        return yi.to(tl.float32, bitcast=True)
    else:
        V: tl.constexpr = x.shape[0]
        NL: tl.constexpr = x.shape[1]
        BD: tl.constexpr = x.shape[2]
        x5 = tl.permute(tl.reshape(x, [V, NL, BD // (2 * M), 2, M]), (0, 1, 2, 4, 3))
        lo, hi = tl.split(x5)
        return tl.reshape(tl.permute(tl.join(hi, lo), (0, 1, 2, 4, 3)), [V, NL, BD])


@triton.jit
def _halve(r, d, M: tl.constexpr, ASM: tl.constexpr):
    """One reduce-scatter step over lane bit M: lanes with that bit clear keep the first half
    of their values and receive their partner's first half, the others the second halves."""
    V: tl.constexpr = r.shape[0]
    NL: tl.constexpr = r.shape[1]
    BD: tl.constexpr = r.shape[2]
    lo, hi = tl.split(tl.permute(tl.reshape(r, [2, V // 2, NL, BD]), (1, 2, 3, 0)))
    up = ((d & M) != 0)[None, None, :]
    return tl.where(up, hi, lo) + _shfl_xor(tl.where(up, lo, hi), M, ASM)


@triton.jit
def _store_channel_sum(
    ptr, p, t0, rows, n, mtn, T, N, pid_n, TC: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, RS: tl.constexpr, ASM: tl.constexpr, EVEN: tl.constexpr,
):
    """Store sum_d p[t, n, d] of a [TC, BN, BD] tile at ptr + (t0 + t) N + n.

    RS: the tile's layout has the BD channels on lane bits 0.. and NL = 32 / BD states on the
    other lanes, the rest in registers; a reduce-scatter (halve the values, swap a half with
    the partner lane, add) leaves each lane V / BD finished sums, V = TC BN / NL, with log2(BD)
    levels of V/2 + V/4 + ... shuffles instead of log2(BD) shuffles for every one of V values.
    Lane (l, d)'s value j is the sum for flat = j + (V / BD) d, flat = t (BN / NL) + n // NL,
    l = n % NL."""
    if RS:
        NL: tl.constexpr = 32 // BLOCK_D
        NH: tl.constexpr = BLOCK_N // NL
        V: tl.constexpr = TC * NH
        VF: tl.constexpr = V // BLOCK_D
        d = tl.arange(0, BLOCK_D)
        r = tl.reshape(p, [V, NL, BLOCK_D])
        if BLOCK_D >= 32:
            r = _halve(r, d, 16, ASM)
        if BLOCK_D >= 16:
            r = _halve(r, d, 8, ASM)
        if BLOCK_D >= 8:
            r = _halve(r, d, 4, ASM)
        if BLOCK_D >= 4:
            r = _halve(r, d, 2, ASM)
        if BLOCK_D >= 2:
            r = _halve(r, d, 1, ASM)
        flat = tl.arange(0, VF)[:, None, None] + VF * d[None, None, :]
        tt = flat // NH
        nn = pid_n * BLOCK_N + (flat % NH) * NL + tl.arange(0, NL)[None, :, None]
        off = (t0 + tt) * N + nn
        if EVEN:
            tl.store(ptr + off, r)
        else:
            tl.store(ptr + off, r, mask=((t0 + tt) < T) & (nn < N))
    else:
        _st(_tile_ptrs(ptr, 0, N, 0, t0, rows, n, 1), tl.sum(p, axis=2), mtn, EVEN)


@triton.jit
def _sum_partials_kernel(
    p_dBp, p_dCp, p_dB, p_dC, P, M, p_dAp, p_dA, PA, MA, p_dDp, p_dD, PD, MD, p_dbp, p_db,
    Pb, Mb, HAS_D: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_E: tl.constexpr,
):
    """Every sum of the backward's partials in one launch: dB and dC over the channel blocks
    (program axis 1 = 0 and 1), and on axis 1 = 2 the parameters' gradients over rows and
    segments, their blocks one after the other along axis 0: dA, then dD, then d delta_bias."""
    job = tl.program_id(1)
    pid = tl.program_id(0)
    if job == 0:
        sum_rows(p_dBp, p_dB, P, M, pid, BLOCK_E)
    elif job == 1:
        sum_rows(p_dCp, p_dC, P, M, pid, BLOCK_E)
    else:
        nA = tl.cdiv(MA, BLOCK_E)
        nD = tl.cdiv(MD, BLOCK_E) if HAS_D else 0
        if pid < nA:
            sum_rows(p_dAp, p_dA, PA, MA, pid, BLOCK_E)
        elif pid < nA + nD:
            sum_rows(p_dDp, p_dD, PD, MD, pid - nA, BLOCK_E)
        elif HAS_BIAS:
            sum_rows(p_dbp, p_db, Pb, Mb, pid - nA - nD, BLOCK_E)
