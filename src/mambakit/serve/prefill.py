"""Chunked, batched prefill: prompts run through the model in pieces whose lengths let
many prompts share one forward.

P = block size. A prompt is prefilled from its start (or from the end of a cached
prefix) in pieces that never cross a multiple of P, so the state at every block
boundary exists and goes into the prefix cache. Each round of the prefill is one forward
over the next pieces of many prompts, with the prompts' states stacked as its initial
state. A forward over a piece from a state gives the same state and last logits as the
prompt run whole (up to the rounding of f32 sums).

A model that stops each row of one forward at a step of its own (`MambaLM.stops_rows`:
Mamba-1 by `states_at`, Mamba-2 and Mamba-3 by a delta of 0 past the stop, which passes
the state unchanged; every model but a Mamba-2 whose `dt_limit` keeps delta above 0) runs
its pieces whole, up to the next block boundary (`span_lengths`), pieces of different
lengths sharing a forward right-padded to a power of two (`span_bucket`), each row's
state and logits taken at its own last token. A cached prefix's remainder is then one
forward, however the lengths of the prompts of a launch differ. Otherwise a piece
shorter than P is cut into powers of two, largest first (a piece of 100 tokens runs as
64, 32 and 4), and each round is one forward over every prompt whose next piece has
that round's length: at most log2(P) + 1 forwards plus one per whole block, whatever
the number of prompts.

A prompt that starts from zeros (no cached prefix) needs no state before it, so it can
run whole instead: one forward for many prompts, each left-padded to a common bucket
length with `seq_idx` marking the filler (as `generate` prefills ragged prompts). That
keeps only the state at the prompt's end; the engine does it for prompts whose first
block it has not seen before (`Engine._new_head`), and runs the others block by block
so that the states at their boundaries go into the prefix cache.

A Mamba-1 model can instead pack prompts end to end into rows (`Engine.packed`, off by
default), `seq_idx` numbering the prompts of a row, and keep the state after any
step of each row (`MambaLM.states_at`: each prompt's end, and its block boundaries):
`plan_packs` fills rows first fit and cuts them into forwards of many rows, a prompt
that continues a cached prefix starting a row from that prefix's state; `packed_rows`
builds a forward's tensors.
"""

from __future__ import annotations

from collections import deque

import numpy as np
import torch

from ..state import ModelState
from .slots import to_device


def piece_lengths(pos: int, end: int, block: int) -> deque[int]:
    """The lengths of the pieces that take a prompt from `pos` to `end`."""
    out: deque[int] = deque()
    while pos < end:
        stop = min(end, (pos // block + 1) * block)
        n = stop - pos
        if n == block:
            out.append(n)
        else:
            for bit in reversed(range(n.bit_length())):
                if n >> bit & 1:
                    out.append(1 << bit)
        pos = stop
    return out


def span_lengths(pos: int, end: int, block: int) -> deque[int]:
    """The pieces that take a prompt from `pos` to `end` when a forward stops each row at a
    step of its own (`MambaLM.stops_rows`): up to each block boundary, then the rest."""
    out: deque[int] = deque()
    while pos < end:
        stop = min(end, (pos // block + 1) * block)
        out.append(stop - pos)
        pos = stop
    return out


def span_bucket(n: int, block: int) -> int:
    """The length a forward whose longest piece has n tokens (n <= block) is right-padded
    to: the next power of two, or the block (the lengths `PrefillGraphs` captures)."""
    return min(1 << (n - 1).bit_length(), block)


def right_padded(pieces: list[list[int]], n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Host tensors of pieces of different lengths as rows of n tokens: ids [g, n] int64
    (filler 0 after each piece) and each row's last step [g] int64."""
    ids = np.zeros((len(pieces), n), np.int64)
    for i, p in enumerate(pieces):
        ids[i, : len(p)] = _ids(p)
    last = torch.tensor([len(p) - 1 for p in pieces], dtype=torch.int64)
    return torch.from_numpy(ids), last


def _ids(tokens) -> np.ndarray:
    """Token ids as an int64 array: a request's `ids` (or a slice of them) as they are; a
    list of ints through numpy, which reads it several times faster than `torch.tensor`
    (the prefill's host work is on the engine's loop, between its decode launches)."""
    if isinstance(tokens, np.ndarray):
        return tokens
    return np.fromiter(tokens, np.int64, len(tokens))


def stack_rows(states: list[ModelState | None], zero: ModelState) -> ModelState | None:
    """One state of len(states) rows (a row of zeros for None); None when every one is."""
    if all(s is None for s in states):
        return None
    fields = zip(*((s if s is not None else zero)._tensors() for s in states))
    return type(zero)(*(torch.cat(ts, dim=1) for ts in fields))


def whole_bucket(n: int) -> int:
    """The length a prompt of n tokens prefilled whole is left-padded to (on CUDA): a
    power of two from `WHOLE_MIN` up to `WHOLE_STEP`, then a multiple of `WHOLE_STEP`
    (the filler is at most a fifth of a forward past 1,024 tokens)."""
    if n > WHOLE_STEP:
        return -(-n // WHOLE_STEP) * WHOLE_STEP
    return max(WHOLE_MIN, 1 << (n - 1).bit_length())


def plan_groups(lengths: list[int], most: int, fixed: int) -> list[int]:
    """Cut whole prompts, sorted by length, into groups of at most `most`, each one forward
    of its rows (padded to a power of two, as the graphs are captured) left-padded to the
    bucket of its longest (`whole_bucket`), so that the tokens computed plus `fixed` a
    forward (its fixed cost, in tokens) are fewest; the end of each group (dynamic
    programming over the cut points: a few prompts to a few hundred)."""
    k = len(lengths)
    best = [0] + [float("inf")] * k
    cut = [0] * (k + 1)
    for j in range(1, k + 1):
        n = whole_bucket(lengths[j - 1])  # the longest of any group ending at j
        for i in range(max(0, j - most), j):
            cost = best[i] + fixed + (1 << (j - i - 1).bit_length()) * n
            if cost < best[j]:
                best[j], cut[j] = cost, i
    ends, j = [], k
    while j:
        ends.append(j)
        j = cut[j]
    return ends[::-1]


def buckets(bucket, most: int) -> list[int]:
    """Every length `bucket` (`whole_bucket`) maps 1 .. `most` tokens to."""
    out, n = [], 1
    while n <= most:
        out.append(bucket(n))
        n = out[-1] + 1
    return out


def plan_targets(prefilling: list, budget: int, block: int) -> list[tuple[object, int]]:
    """(request, the position its prefill reaches in this iteration), first come first
    served, within `budget` prompt tokens: a request stops at a block boundary unless it
    finishes its prompt; the first one always advances by at least one piece. A request
    prefilled whole (`whole`) goes all the way or waits for the next iteration."""
    plan = []
    for req in prefilling:
        if budget <= 0:
            break
        end = len(req.prompt)
        if req.whole:
            if plan and end - req.pos > budget:
                break
            plan.append((req, end))
            budget -= end - req.pos
            continue
        target = min(end, req.pos + budget)
        if target < end:
            aligned = (target // block) * block
            if aligned <= req.pos:
                if plan:
                    break
                aligned = min(end, (req.pos // block + 1) * block)
            target = aligned
        plan.append((req, target))
        budget -= target - req.pos
    return plan


def pack_width(n: int) -> int:
    """The width a packed forward whose longest row has n tokens is padded to (on CUDA): a
    power of two, `PACK_MIN` at least."""
    return max(PACK_MIN, 1 << (n - 1).bit_length())


def pack_steps(pos: int, end: int, block: int, blocks: bool) -> list[int]:
    """The steps of a prompt's packed part (tokens pos .. end - 1, counted from pos) whose
    states are kept: its last, and (`blocks`) the last of each block that ends inside it,
    for the prefix cache."""
    first = (pos // block + 1) * block  # the first boundary past pos
    inner = range(first - 1 - pos, end - 1 - pos, block) if blocks else ()
    return [*inner, end - 1 - pos]


def plan_packs(reqs: list, block: int, slots: int, most_rows: int, most_tokens: int,
               fixed: int) -> list[tuple[list[list], int, int]]:  # fmt: skip
    """The forwards of a packed prefill (`Engine._prefill_packed`): (rows, the rows it runs,
    its width) each, a row being the requests packed end to end in it. A request that
    continues a cached prefix starts a row (the state a row starts from enters its first
    prompt only); the others go first fit, longest first, into rows of one width (a
    `pack_width`, at most half of `most_tokens`), each row keeping `slots` states at most
    (`pack_steps`). The rows, longest first, are cut into forwards of a power of two rows
    (`most_rows` at most, and `most_tokens` tokens with the padding) padded to the width of
    their longest: the row width and the cuts are those of the fewest tokens computed plus
    `fixed` a forward."""
    # each request's states, once for every width tried
    states = {id(r): len(pack_steps(r.pos, len(r.prompt), block, r.blocks)) for r in reqs}

    def rest(r):
        return len(r.prompt) - r.pos

    def kept(r):
        return states[id(r)]

    best = None
    width = pack_width(max(map(rest, reqs)))
    while True:
        rows = _first_fit(reqs, width, slots, rest, kept)
        rows.sort(key=lambda row: -sum(map(rest, row)))
        cost, cuts = _cut_rows([sum(map(rest, row)) for row in rows], most_rows, most_tokens,
                               fixed)  # fmt: skip
        if best is None or cost < best[0]:
            best = (cost, rows, cuts)
        if len(rows) == 1 or 4 * width > most_tokens:  # rows at most half of it wide
            break
        width *= 2
    _, rows, cuts = best
    return [(rows[i:j], n, w) for i, j, n, w in cuts]


def _first_fit(reqs: list, width: int, slots: int, rest, kept) -> list[list]:
    """Requests into rows of `width` tokens and `slots` kept states: each continued one
    (pos > 0) at the start of a row of its own, then the others first fit, longest first."""
    rows = [[r] for r in reqs if r.pos > 0]
    room = [width - rest(r) for r in reqs if r.pos > 0]
    left = [slots - kept(r) for r in reqs if r.pos > 0]
    for r in sorted((r for r in reqs if r.pos == 0), key=rest, reverse=True):
        n, k = rest(r), kept(r)
        for i in range(len(rows)):
            if room[i] >= n and left[i] >= k:
                rows[i].append(r)
                room[i] -= n
                left[i] -= k
                break
        else:
            rows.append([r])
            room.append(width - n)
            left.append(slots - k)
    return rows


def _cut_rows(tokens: list[int], most_rows: int, most_tokens: int, fixed: int):
    """(cost, cuts): rows of `tokens` tokens each (longest first) cut into forwards of a
    power of two rows, each padded to the `pack_width` of its first row, at the least
    tokens computed plus `fixed` a forward (on a tie, the fewer forwards); cuts (first
    row, end, rows run, width)."""
    n = len(tokens)
    best = [0.0] * (n + 1)
    pick = [(0, 0, 0)] * n
    for i in reversed(range(n)):
        width = pack_width(tokens[i])
        best[i] = float("inf")
        rows = 1
        while rows <= most_rows and (rows == 1 or rows * width <= most_tokens):
            cost = fixed + rows * width + best[min(n, i + rows)]
            if cost <= best[i]:  # (on a tie, fewer forwards)
                best[i], pick[i] = cost, (min(n, i + rows), rows, width)
            rows *= 2
    cuts, i = [], 0
    while i < n:
        j, rows, width = pick[i]
        cuts.append((i, j, rows, width))
        i = j
    return best[0], cuts


def packed_rows(prompts: list[list[list[int]]], steps: list[list[list[int]]], width: int,
                rows: int, slots: int):  # fmt: skip
    """The host tensors of a packed forward of `rows` rows of `width` tokens: ids [rows,
    width] int64 (each row's prompts end to end, then filler 0), seq_idx [rows, width]
    int32 (prompt i of a row is its document i, the filler the next one) and positions
    [rows, slots] int64: the steps asked for (prompt i's `steps[b][i]`, offset to where it
    starts in row b), then distinct unused steps of the row to fill its slots (their
    states are written and never read). Rows past the prompts' are filler."""
    ids = np.zeros((rows, width), np.int64)
    seq = np.zeros((rows, width), np.int32)
    pos = np.zeros((rows, slots), np.int64)
    for b in range(rows):
        row = prompts[b] if b < len(prompts) else []
        lens = [len(p) for p in row]
        n = sum(lens)
        if n:
            ids[b, :n] = np.concatenate([_ids(p) for p in row])
            seq[b, :n] = np.repeat(np.arange(len(row), dtype=np.int32), lens)
        seq[b, n:] = len(row)
        kept, at = [], 0
        for length, st in zip(lens, steps[b] if row else []):
            kept += [at + s for s in st]
            at += length
        used = set(kept)
        free = (t for t in range(width) if t not in used)
        kept += [next(free) for _ in range(slots - len(kept))]
        pos[b] = kept
    return torch.from_numpy(ids), torch.from_numpy(seq), torch.from_numpy(pos)


PACK_MIN = 32  # the narrowest packed forward
WHOLE_MIN = 16  # the shortest bucket of a prompt prefilled whole
WHOLE_STEP = 256  # past this length, the buckets of whole prompts grow by this much
WHOLE_MAX = 2048  # prompts prefilled whole have at most this many tokens
PACK_SLOTS = 16  # the states a packed row keeps at most (its prompts' ends, block boundaries)
PACK_ROWS = 16  # rows of a packed forward at most
# a forward's fixed cost in tokens' worth of its work, where it is not measured
# (`PrefillGraphs.warmup` measures it): about a millisecond on the H200 at 130m
FORWARD_TOKENS = 1024


def left_padded(prompts: list[list[int]], n: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts as rows of n tokens, each at the end of its row after filler tokens (0):
    ids [g, n] int64 and seq_idx [g, n] int32 (0 on the filler, 1 on the prompt). The
    change of seq_idx zeroes the state where the prompt starts, so each row's final state
    and last logits are its prompt's from a zero state (generate.py does the same)."""
    host = np.zeros((len(prompts), n), np.int64)
    for i, p in enumerate(prompts):
        host[i, n - len(p) :] = _ids(p)
    host = torch.from_numpy(host)
    if device.type == "cuda":
        ids = host.pin_memory().to(device, non_blocking=True)
    else:
        ids = host
    starts = to_device([n - len(p) for p in prompts], device)
    seq_idx = torch.arange(n, device=device) >= starts[:, None]
    return ids, seq_idx.to(torch.int32)
