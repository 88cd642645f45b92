"""Next-token sampling on the device: repetition penalty, temperature, top-k, top-p, min-p.

B batch, V vocabulary, C candidates (V, or top_k when top-k filtering is on).

Every function here is a fixed sequence of tensor ops with no host sync and no
data-dependent shapes, so one decode step (model step + sampling) can be
captured in a CUDA graph.

Randomness is counter-based: the Gumbel noise of token `v` in row `b` at new
token number `t` is a hash of (seed_b, t, v), computed with integer tensor ops.
So a row's draws depend only on its own seed, never on the batch it sits in,
the order of draws or a global RNG; sampling is reproducible on any device,
and a graph replays it without registering a generator. Sampling is the
Gumbel-max trick: argmax_v (logits_v / temperature + g_v) with g ~ Gumbel(0, 1)
draws v with probability softmax(logits / temperature)_v.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from ..ops import cpu_jit
from ..ops._checks import state_dtype
from ..ops.argmax import argmax_rows

_M32 = 0xFFFFFFFF
# Multipliers below 2**31: a product with a value below 2**32 stays below 2**63, so the
# int64 arithmetic never overflows and CPU and GPU compute the same bits.
_MUL1 = 0x21F0AAAD
_MUL2 = 0x735A2D97
_STEP_SALT = 0x5BD1E995
_VOCAB_SALT = 0x1B873593
_HI_SALT = 0x68E31DA4
# the same constants for the compiled CPU hash (`ops.cpu_jit.noise`)
_CONSTANTS = np.array([_M32, _MUL1, _MUL2, _STEP_SALT, _VOCAB_SALT, _HI_SALT], dtype=np.int64)


# temperatures below this draw greedily: logits of up to ~1e4 divided by one would leave
# float32's range (3.4e38), and their order is then all a draw could follow anyway
GREEDY_BELOW = 1e-30


@dataclass(frozen=True)
class SamplingConfig:
    """What `generate` does to the logits of each step; validated at construction."""

    temperature: float = 1.0  # 0 -> greedy (argmax)
    top_k: int = 0  # keep the k most likely tokens (0: all)
    top_p: float = 1.0  # keep the smallest set whose probability reaches top_p (nucleus)
    min_p: float = 0.0  # drop tokens less likely than min_p * the most likely one
    repetition_penalty: float = 1.0  # CTRL penalty on tokens already in the row (1: off)
    eos_token_id: int | None = None  # a row that emits it repeats it to the end

    def __post_init__(self) -> None:
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, int | float) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {t!r}")
        k = self.top_k
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 disables it), got {k!r}")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, int | float) or not 0 < p <= 1:
            raise ValueError(f"top_p must lie in (0, 1], got {p!r}")
        m = self.min_p
        if isinstance(m, bool) or not isinstance(m, int | float) or not 0 <= m < 1:
            raise ValueError(f"min_p must lie in [0, 1), got {m!r}")
        r = self.repetition_penalty
        if isinstance(r, bool) or not isinstance(r, int | float) or not math.isfinite(r) or r <= 0:
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {r!r}")
        e = self.eos_token_id
        if e is not None and (isinstance(e, bool) or not isinstance(e, int) or e < 0):
            raise ValueError(f"eos_token_id must be None or an int >= 0, got {e!r}")

    @property
    def greedy(self) -> bool:
        """0, or a temperature so small that the logits divided by it would overflow
        float32 (`GREEDY_BELOW`): the limit of sampling as the temperature falls, argmax."""
        return self.temperature < GREEDY_BELOW


def apply_repetition_penalty(
    logits: torch.Tensor,  # [B, V]
    seen: torch.Tensor,  # [B, V] bool: the token occurs in the row (prompt or generated)
    penalty: float,
) -> torch.Tensor:
    """CTRL (Keskar et al. 2019) as in transformers: a seen token's logit l becomes
    l / penalty when l > 0 and l * penalty otherwise. Returns f32 [B, V] (f64 for f64
    logits: a float64 model's greedy choice is not rounded to f32's ties)."""
    x = logits.to(state_dtype(logits))
    if penalty == 1.0:
        return x
    return torch.where(seen, torch.where(x > 0, x / penalty, x * penalty), x)


def filter_sorted(
    scores: torch.Tensor,  # [B, C] f32, sorted in descending order along C
    top_p: float = 1.0,
    min_p: float = 0.0,
) -> torch.Tensor:
    """Set to -inf the candidates that nucleus (top-p) and min-p filtering remove.

    top-p keeps a candidate when the probability of the candidates before it
    is below top_p (so the most likely always stays); min-p keeps a candidate
    whose probability is at least min_p times that of the most likely one
    (computed after top-p, which does not change the ratio)."""
    if top_p < 1.0:
        probs = torch.softmax(scores, dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs
        scores = scores.masked_fill(before >= top_p, float("-inf"))
    if min_p > 0.0:
        probs = torch.softmax(scores, dim=-1)
        scores = scores.masked_fill(probs < min_p * probs[:, :1], float("-inf"))
    return scores


def filter_logits(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """Full-vocabulary scores [B, V] (f32; f64 for f64 logits) after temperature, top-k,
    top-p and min-p: the distribution `sample` draws from is softmax of this. A readable
    reference for tests; `sample` does the same on the top-k candidates only."""
    scores = logits.to(state_dtype(logits)) / (cfg.temperature or 1.0)
    V = scores.shape[-1]
    order = torch.argsort(scores, dim=-1, descending=True, stable=True)
    sorted_scores = scores.gather(-1, order)
    if cfg.top_k and cfg.top_k < V:
        sorted_scores[:, cfg.top_k :] = float("-inf")
    sorted_scores = filter_sorted(sorted_scores, cfg.top_p, cfg.min_p)
    return torch.full_like(scores, float("-inf")).scatter(-1, order, sorted_scores)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xorshift-multiply rounds) of an int64 tensor, into [0, 2**32)."""
    x = x & _M32
    x = x ^ (x >> 16)
    x = (x * _MUL1) & _M32
    x = x ^ (x >> 15)
    x = (x * _MUL2) & _M32
    return x ^ (x >> 15)


def row_keys(seeds: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """[B] int64 keys in [0, 2**32) from the row seeds [B] and the new-token number step [1]."""
    k = _mix32(seeds ^ _mix32((seeds >> 32) + _HI_SALT))
    return _mix32(k ^ _mix32(step + _STEP_SALT))


def gumbel_noise(keys: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Gumbel(0, 1) noise [B, C] (f32) for the given token ids ([B, C] or [C]): a function of
    (key of the row, token id) only, so a token draws the same noise whichever candidates
    surround it."""
    x = _mix32(keys[:, None] ^ _mix32(token_ids * _VOCAB_SALT + 1))
    return -torch.log(-torch.log(uniform(x)))


def uniform(x: torch.Tensor) -> torch.Tensor:
    """Hashes x in [0, 2**32) (int64) -> f32 uniform in (0, 1), from their top 23 bits:
    (2**23 - 0.5) / 2**23 is exact in f32, where 24 bits' largest, (2**24 - 0.5) / 2**24,
    rounds to 1 and its noise to +inf (a token that wins whatever its probability, or NaN
    beside a filtered-out one's -inf)."""
    return ((x >> 9).float() + 0.5) * (1.0 / (1 << 23))


def _noise(seeds: torch.Tensor, step: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """`gumbel_noise(row_keys(seeds, step), token_ids)`: on the CPU with numba its integer
    hash as one compiled loop (the same bits), the logarithms as torch computes them."""
    if seeds.device.type != "cpu" or torch.compiler.is_compiling() or not cpu_jit.available():
        return gumbel_noise(row_keys(seeds, step), token_ids)
    from ..ops.cpu_jit.noise import uniforms

    ids = token_ids.detach()
    u = torch.empty(seeds.shape[0], ids.shape[-1], dtype=torch.float32)
    uniforms(seeds.detach().numpy(), step.detach().numpy(), ids.numpy(), _CONSTANTS, u.numpy())
    return -torch.log(-torch.log(u))


def sample(
    logits: torch.Tensor,  # [B, V]
    cfg: SamplingConfig,
    seeds: torch.Tensor | None = None,  # [B] int64 row seeds (unused when greedy)
    step: torch.Tensor | None = None,  # [1] int64 number of the token being drawn
    seen: torch.Tensor | None = None,  # [B, V] bool, for the repetition penalty
) -> torch.Tensor:
    """Next tokens [B] int64, on the logits' device, with no host sync."""
    if cfg.greedy and cfg.repetition_penalty == 1.0:
        return argmax_rows(logits)  # one kernel, in the logits' dtype
    scores = logits.to(state_dtype(logits))  # f32, or f64 for a float64 model
    if cfg.repetition_penalty != 1.0:
        if seen is None:
            raise ValueError("sample: repetition_penalty != 1 needs the `seen` mask")
        scores = apply_repetition_penalty(scores, seen, cfg.repetition_penalty)
    if cfg.greedy:
        return scores.argmax(dim=-1)
    if seeds is None or step is None:
        raise ValueError("sample: sampling (temperature > 0) needs `seeds` and `step`")
    scores = scores / cfg.temperature
    V = scores.shape[-1]
    if cfg.top_k and cfg.top_k < V:
        scores, ids = torch.topk(scores, cfg.top_k, dim=-1)  # sorted, descending
    elif cfg.top_p < 1.0 or cfg.min_p > 0.0:
        scores, ids = torch.sort(scores, dim=-1, descending=True, stable=True)
    else:
        ids = None
    if ids is not None:
        scores = filter_sorted(scores, cfg.top_p, cfg.min_p)
    token_ids = ids if ids is not None else torch.arange(V, device=scores.device)
    choice = (scores + _noise(seeds, step, token_ids)).argmax(dim=-1)
    if ids is None:
        return choice
    return ids.gather(-1, choice[:, None])[:, 0]
