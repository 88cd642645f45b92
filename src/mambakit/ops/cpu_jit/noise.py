"""The sampler's counter-based uniforms on the CPU as one compiled loop: the integer hash
of `inference.sampling` (a row's seed, the number of the token being drawn and a token id
to 24 random bits), bit for bit. The tensor ops computing it there take about sixty
dispatches a token, which a CPU decode step would pay on top of the model's own step."""

from __future__ import annotations

import numpy as np
from numba import njit

from .common import JIT


@njit(inline="always", **JIT)
def _mix32(x, c):
    # sampling._mix32: c = [2**32 - 1, the two multipliers, the salts]
    x &= c[0]
    x ^= x >> 16
    x = (x * c[1]) & c[0]
    x ^= x >> 15
    x = (x * c[2]) & c[0]
    return x ^ (x >> 15)


@njit(**JIT)
def uniforms(seeds, step, ids, c, out):
    """out [B, C] float32: ((hash >> 9) + 0.5) / 2**23 of (seeds[b], the token number
    step[b] (or step[0] for step [1]), the token id ids[b, j] (or ids[j] for ids [C])), as
    `sampling.gumbel_noise(row_keys(seeds, step), ids)` draws it before its logarithms.
    c: the hash's constants (`sampling._CONSTANTS`)."""
    scale = np.float32(1.0 / (1 << 23))
    for b in range(out.shape[0]):
        seed = seeds[b]
        s = _mix32((step[0] if step.shape[0] == 1 else step[b]) + c[3], c)
        key = _mix32(_mix32(seed ^ _mix32((seed >> 32) + c[5], c), c) ^ s, c)
        for j in range(out.shape[1]):
            v = ids[j] if ids.ndim == 1 else ids[b, j]
            x = _mix32(key ^ _mix32(v * c[4] + 1, c), c)
            out[b, j] = (np.float32(x >> 9) + np.float32(0.5)) * scale
