"""Helpers shared by the Triton kernels and their launchers: `launch` (the kernel launch fast
path), `sm_count`, `opt`, `strides`, `next_power_of_2`, `cdiv`, programmatic dependent launch
(`pdl_args`, `pdl_start`, `pdl_wait`), the jit functions `fast_rcp`, `fast_sigmoid`,
`fast_cos_sin`, `sum_rows` and `sum_blocks_kernel` (per-block partial sums added in a fixed
order).

`kernel[grid](*args, **kwargs)` costs about 27 us of host time per call on the H200 host
(Triton 3.6: argument binding, per-argument specialization, the cache key, the launch), 11 us
of it the launch itself. An eager prefill or decode step launches a few Triton kernels per
layer, so that bookkeeping is a good part of what the host spends per token. `launch` does it
once per specialization: the first call of each goes through the JIT (which compiles if it
must, and launches); later calls with the same specialization key call the compiled kernel's
launcher directly.

The key holds everything Triton specializes on, or finer: each tensor's dtype and 16-byte
alignment, each integer's divisibility by 16, equality to 1 and 32-bit range, every keyword
argument by value (constexprs and launch options), the device. So a cached kernel is the one
the JIT itself would pick, and results are the same bits. Anything the fast path does not
model (a constexpr passed by position, a tensor passed by keyword, Triton's launch hooks, the
interpreter) goes through the JIT every time.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

_SLOW = object()  # a kernel whose calls the fast path does not model: always the JIT
_OPTIONS = {"num_warps", "num_stages", "num_ctas", "launch_pdl", "maxnreg", "enable_fp_fusion"}
_caches: dict = {}  # kernel -> {key: (launcher, function, metadata, keyword order)} or _SLOW
_MAX_KEYS = 256  # specializations kept per kernel; past it (keys that never repeat), the JIT


def _spec(a):
    """What Triton specializes an argument on (or finer), as a hashable value."""
    t = type(a)
    if t is int:
        return (a == 1, a & 15 == 0, -0x80000000 <= a <= 0x7FFFFFFF, a > 0x7FFFFFFFFFFFFFFF)
    if isinstance(a, torch.Tensor):
        return (a.dtype, a.data_ptr() & 15 == 0)
    if t is float:
        return float
    return a  # None, bools


def _hooked() -> bool:
    """Launch hooks are registered (a profiler such as proton): they need the JIT's path.
    Triton 3.6 keeps them as chains (`HookChain.calls`), older versions as one callable."""
    knobs = getattr(triton, "knobs", None)
    rt = knobs.runtime if knobs is not None else triton.compiler.CompiledKernel  # Triton < 3.4
    enter = getattr(rt, "launch_enter_hook", None)
    leave = getattr(rt, "launch_exit_hook", None)
    return bool(getattr(enter, "calls", enter)) or bool(getattr(leave, "calls", leave))


def _fast_path(kernel) -> bool:
    return isinstance(kernel, triton.runtime.JITFunction) and torch.cuda.is_available()


def launch(kernel, grid, *args, **kwargs) -> None:
    """`kernel[grid](*args, **kwargs)`, through the compiled kernel's launcher when this
    specialization was launched before (see the module docstring)."""
    cache = _caches.get(kernel)
    if cache is None:
        cache = _caches[kernel] = {} if _fast_path(kernel) else _SLOW
    if cache is _SLOW or callable(grid) or _hooked():
        kernel[grid](*args, **kwargs)
        return
    driver = triton.runtime.driver.active
    device = driver.get_current_device()
    key = (device, tuple(map(_spec, args)), tuple(kwargs.items()))
    hit = cache.get(key)
    if hit is None:
        compiled = kernel[grid](*args, **kwargs)
        order = _keyword_order(kernel, len(args), kwargs)
        if order is None or len(cache) >= _MAX_KEYS:
            _caches[kernel] = _SLOW
            return
        cache[key] = (compiled.run, compiled.function, compiled.packed_metadata, order)
        return
    run, function, metadata, order = hit
    params = args + tuple(kwargs[name] if name is not None else value for name, value in order)
    g = tuple(grid) + (1, 1)
    run(g[0], g[1], g[2], driver.get_current_stream(device), function, metadata, None, None,
        None, *params)  # fmt: skip


def _keyword_order(kernel, n_positional: int, kwargs: dict):
    """For the parameters after the positional ones, in signature order: (keyword name, None)
    or (None, default value). None when the fast path cannot model the call: a constexpr
    given by position, a runtime argument by keyword, an unknown keyword."""
    params = kernel.params
    if any(p.is_constexpr for p in params[:n_positional]):
        return None
    order = []
    for p in params[n_positional:]:
        if p.name in kwargs:
            if not p.is_constexpr:
                return None
            order.append((p.name, None))
        elif p.has_default:
            order.append((None, p.default))
        else:
            return None
    names = {p.name for p in params}
    if any(k not in names and k not in _OPTIONS for k in kwargs):
        return None
    return order


@functools.cache
def sm_count(index: int) -> int:
    """Streaming multiprocessors of CUDA device `index` (grid sizing)."""
    return torch.cuda.get_device_properties(index).multi_processor_count


def strides(t: torch.Tensor | None, n: int) -> tuple[int, ...]:
    """The first n strides of an optional input, or n zeros for an absent one (its kernel's
    HAS_* flag is off, so they are never used)."""
    return tuple(t.stride()[:n]) if t is not None else (0,) * n


def opt(t: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """A stand-in pointer for an absent optional input (never dereferenced: the kernel's
    HAS_* flag for it is off)."""
    return like if t is None else t


# Host-side twins of `triton.next_power_of_2` and `triton.cdiv`: those are constexpr
# functions (callable inside kernels too), and their wrapper costs a few us of host time per
# call from Python, where a launcher calls them several times per launch.


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (0 for 0), as `triton.next_power_of_2` gives it."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def cdiv(a: int, b: int) -> int:
    """ceil(a / b), as `triton.cdiv` gives it."""
    return (a + b - 1) // b


LOG2E = tl.constexpr(1.4426950408889634)


def _interpreting() -> bool:
    """TRITON_INTERPRET as triton.jit reads it when a kernel is defined (knobs from Triton
    3.4, the environment before)."""
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# Kernels run compiled (PTX allowed) unless Triton's interpreter runs them: the setting
# triton.jit read when it defined them decides both.
COMPILED = tl.constexpr(not _interpreting())


@triton.jit
def fast_rcp(x):
    """1 / x for f32 x by the GPU's approximate reciprocal (`rcp.approx.ftz`: one MUFU
    instruction, within an ulp or so, subnormals flushed), where `1 / x` compiles to a
    full-range division with a few more instructions. Interpreted: 1 / x."""
    if COMPILED:
        return tl.inline_asm_elementwise(
            "rcp.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1
        )
    else:
        return 1.0 / x


@triton.jit
def fast_cos_sin(x):
    """(cos x, sin x) for f32 x in [-3 pi, 3 pi] by the GPU's approximations (`cos.approx`,
    `sin.approx`: one MUFU instruction each, absolute error within 2^-20.5 on [-pi, pi],
    where x is first brought), where `tl.cos` / `tl.sin` compile to libdevice's range
    reduction and polynomial with its slow-path branches. Interpreted: tl.cos, tl.sin."""
    if COMPILED:
        x = x - 6.283185307179586 * tl.floor(x * 0.15915494309189535 + 0.5)
        c = tl.inline_asm_elementwise(
            "cos.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1
        )
        s = tl.inline_asm_elementwise(
            "sin.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1
        )
        return c, s
    else:
        return tl.cos(x), tl.sin(x)


@triton.jit
def fast_sigmoid(x):
    """sigmoid(x) for f32 x by exp2 (one MUFU instruction; `tl.exp` and `tl.sigmoid` add a
    range fix-up) and `fast_rcp`. Where e^-x overflows to inf the result is 0."""
    return fast_rcp(1.0 + tl.exp2(-x * LOG2E))


# Programmatic dependent launch (sm_90+). A kernel launched with `pdl_args` may start while
# the kernel before it in the stream is still running: its programs can load what no earlier
# kernel writes (weights, parameters) and must call `pdl_wait` before they read anything an
# earlier kernel wrote or write anything at all (the caching allocator hands a kernel memory
# that the one before may still be reading). `pdl_wait` returns once the previous kernel has
# completed and its writes are visible; every program calls it, so a kernel never completes
# before its predecessor and the chain stays ordered. `pdl_start` lets the next kernel launch
# once every program of this one has called it.
USE_PDL = True
_SM90: dict[int, bool] = {}


def pdl_args(x: torch.Tensor) -> dict:
    """Launch arguments for a kernel with a `PDL: tl.constexpr` parameter: programmatic
    dependent launch on sm_90+ devices, off on older ones, on the CPU and in the interpreter."""
    if not (USE_PDL and x.is_cuda):
        return {"PDL": False}
    dev = x.device.index if x.device.index is not None else torch.cuda.current_device()
    if dev not in _SM90:
        _SM90[dev] = torch.cuda.get_device_capability(dev)[0] >= 9
    return {"PDL": True, "launch_pdl": True} if _SM90[dev] else {"PDL": False}


@triton.jit
def pdl_start(PDL: tl.constexpr):
    """Let the next kernel launch (programmatic dependent launch): its programs load their
    weights while this kernel finishes."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """Wait for the previous kernel (and so every earlier one) to complete: nothing it writes
    may be read, and nothing may be written, before this."""
    if PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def sum_rows(src, dst, P, M, pid, BLOCK_E: tl.constexpr):
    """dst[m] = sum_p src[p, m] over block `pid` of m (src [P, M] f32, contiguous), in the
    order of p (deterministic), stored in dst's dtype."""
    offs = pid * BLOCK_E + tl.arange(0, BLOCK_E)
    mask = offs < M
    acc = tl.zeros([BLOCK_E], tl.float32)
    ptrs = src + offs
    for _ in tl.range(P, num_stages=4):
        acc += tl.load(ptrs, mask=mask, other=0.0)
        ptrs += M  # 64-bit pointers: no overflow past 2^31 elements
    tl.store(dst + offs, acc.to(dst.dtype.element_ty), mask=mask)


@triton.jit
def sum_blocks_kernel(p_pb, p_pc, p_ob, p_oc, P, M, BLOCK_E: tl.constexpr):
    """Sums of per-block partials [P, M] (contiguous, f32): out[m] = sum_p part[p, m], in
    order (deterministic), stored in the output's dtype; the first pair (pb -> ob) on
    program axis 1 = 0, the second (pc -> oc) on 1 (one launch for two sums; a grid of one
    along axis 1 sums only the first, as Mamba-3's per-head sums do)."""
    if tl.program_id(1) == 0:
        sum_rows(p_pb, p_ob, P, M, tl.program_id(0), BLOCK_E)
    else:
        sum_rows(p_pc, p_oc, P, M, tl.program_id(0), BLOCK_E)
