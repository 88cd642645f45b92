"""Each mixer op runs one body per backend, and the model reaches the mixers' ops only
through `ops`: for every op of the two families, which body ran (counted by wrapping the
body where `ops` looks it up) on the reference backend and on the Triton one (the
interpreter on a CPU), and that the bodies agree. The value oracle of the stack steps is the
float64 reference backend run of the same model, whose blocks call their modules one by
one (a forward hook on a norm makes the model's blocks not plain, so it takes
`MambaBlock.step`).
"""

from __future__ import annotations

import copy
import importlib

import pytest
import torch

from mambakit import MambaConfig, MambaLM
from mambakit.ops import decode as decode_ops  # where the decode step's ops look theirs up
from mambakit.ops import mamba3 as m3_ops
from mambakit.ops import mamba_step as step_pkg
from mambakit.ops.mamba3 import step as m3_step
from mambakit.ops.mamba_step import launch as step_launch

inner_pkg = importlib.import_module("mambakit.ops.mamba_inner")  # `ops.mamba_inner` is the op
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CONFIGS = {
    "mamba1": dict(d_model=16, n_layers=2, vocab_size=40, d_state=4, pad_vocab_size_multiple=1),
    "mamba3": dict(d_model=32, n_layers=2, vocab_size=40, d_state=16, headdim=16,
                   mixer="mamba3", pad_vocab_size_multiple=1),
}  # fmt: skip


class Calls:
    """Wraps module attributes and counts the calls of each."""

    def __init__(self, monkeypatch):
        self.monkeypatch = monkeypatch
        self.counts: dict[str, int] = {}

    def watch(self, module, name: str) -> None:
        fn = getattr(module, name)
        self.counts[name] = 0

        def counted(*args, **kwargs):
            self.counts[name] += 1
            return fn(*args, **kwargs)

        self.monkeypatch.setattr(module, name, counted)

    def ran(self) -> set[str]:
        return {name for name, n in self.counts.items() if n}


@pytest.fixture
def calls(monkeypatch) -> Calls:
    return Calls(monkeypatch)


def model(mixer: str, dtype=torch.float32) -> MambaLM:
    torch.manual_seed(0)
    lm = MambaLM(MambaConfig(**CONFIGS[mixer])).to(DEVICE, dtype)
    with torch.no_grad():
        for p in lm.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return lm


def ids(T: int = 7) -> torch.Tensor:
    return torch.randint(0, 40, (2, T), generator=torch.Generator().manual_seed(1)).to(DEVICE)


def decode(lm: MambaLM, tokens: torch.Tensor) -> torch.Tensor:
    """Logits [B, T, V] of `step` over the tokens from a zero state."""
    state = lm.init_state(tokens.shape[0])
    out = []
    with torch.no_grad():
        for t in range(tokens.shape[1]):
            logits, state = lm.step(tokens[:, t], state)
            out.append(logits)
    return torch.stack(out, 1)


def modules_oracle(lm: MambaLM, tokens: torch.Tensor) -> torch.Tensor:
    """`decode` of a float64 copy on the reference backend whose blocks are not plain (a
    forward hook on each norm that returns what the norm gave): `MambaBlock.step` calls
    the modules, no stack op runs."""
    lm64 = copy.deepcopy(lm).double()
    for block in lm64.backbone.layers:
        block.norm.register_forward_hook(lambda mod, args, out: out)
    return decode(lm64, tokens)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_mamba1_stack_step_body(backend, calls, monkeypatch, numba_on):
    """Reference: the whole-stack body (`stack.decode_layers`), no layer kernel. Triton: the
    three-kernel layer step per block, no whole-stack body. Both equal the module path.
    (numba off: on a CPU the LM's step would run compiled end to end instead,
    tests/inference/test_cpu_step.py.)"""
    numba_on(False)
    monkeypatch.setenv("MAMBAKIT_BACKEND", backend)
    calls.watch(decode_ops, "decode_layers")
    calls.watch(step_pkg, "mamba_layer_step_triton")
    calls.watch(decode_ops, "layer_step")
    lm = model("mamba1")
    tokens = ids()
    got = decode(lm, tokens)
    want = {"reference": {"decode_layers"}, "triton": {"mamba_layer_step_triton"}}[backend]
    assert calls.ran() == want
    monkeypatch.setenv("MAMBAKIT_BACKEND", "reference")
    assert rel(got, modules_oracle(lm, tokens)) < 1e-5


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_mamba1_stack_step_chain_when_weights_differ_from_compute_dtype(
    backend, calls, monkeypatch
):
    """f32 weights under bf16 autocast: the fused bodies do not apply; the op chain of the
    backend runs per block (`chain.layer_step`)."""
    monkeypatch.setenv("MAMBAKIT_BACKEND", backend)
    calls.watch(decode_ops, "decode_layers")
    calls.watch(step_pkg, "mamba_layer_step_triton")
    calls.watch(decode_ops, "layer_step")
    lm = model("mamba1")
    state = lm.init_state(2)
    with torch.no_grad(), torch.autocast(DEVICE, dtype=torch.bfloat16):
        logits, _ = lm.step(ids()[:, 0], state)
    assert calls.ran() == {"layer_step"}
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_mamba3_stack_step_body(backend, calls, monkeypatch, numba_on):
    """Triton: per block the streaming linear kernels around the raw step kernel.
    Reference: the whole-stack body (`mamba3/stack.py`), no per-block reference step. Both
    equal the module path. (numba off, as for Mamba-1.)"""
    numba_on(False)
    monkeypatch.setenv("MAMBAKIT_BACKEND", backend)
    calls.watch(step_launch, "linear")
    calls.watch(m3_step, "state_update_raw")
    calls.watch(m3_step, "state_update")
    calls.watch(m3_ops, "mamba3_step_reference")
    calls.watch(m3_ops, "decode_layers")
    lm = model("mamba3")
    tokens = ids()
    got = decode(lm, tokens)
    want = {
        "reference": {"decode_layers"},
        "triton": {"linear", "state_update_raw"},
    }[backend]
    assert calls.ran() == want
    monkeypatch.setenv("MAMBAKIT_BACKEND", "reference")
    assert rel(got, modules_oracle(lm, tokens)) < 1e-5


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_mamba3_scan_body(backend, calls, monkeypatch):
    """The sequence forward: the chunk kernels on Triton; otherwise, on the CPU with numba,
    the layer's compiled core (`mamba3_layer_compiled`), else the chunked reference; they
    agree (the reference in float64 is the oracle)."""
    from mambakit.layers import mamba3 as m3_layer
    from mambakit.ops.cpu_jit import available

    monkeypatch.setenv("MAMBAKIT_BACKEND", backend)
    calls.watch(m3_ops, "mamba3_scan_kernel")
    calls.watch(m3_ops, "mamba3_scan_reference")
    calls.watch(m3_layer, "mamba3_layer_compiled")
    lm = model("mamba3")
    tokens = ids()
    with torch.no_grad():
        got = lm(tokens).logits
    on_cpu = "mamba3_layer_compiled" if available() else "mamba3_scan_reference"
    want = {"reference": {on_cpu}, "triton": {"mamba3_scan_kernel"}}[backend]
    assert calls.ran() == want
    monkeypatch.setenv("MAMBAKIT_BACKEND", "reference")
    with torch.no_grad():
        oracle = copy.deepcopy(lm).double()(tokens).logits
    assert rel(got, oracle) < 1e-5


def test_mamba3_scan_compiles_whole_as_custom_ops(calls, monkeypatch):
    """torch.compile(fullgraph=True) traces Mamba-3's scan as its custom ops
    (`mambakit::mamba3_scan_train` and its backward): no graph break, no reference body,
    and the compiled loss and gradients equal the eager ones."""
    monkeypatch.setenv("MAMBAKIT_BACKEND", "triton")
    calls.watch(m3_ops, "mamba3_scan_reference")
    lm = model("mamba3")
    tokens = ids()

    def loss_and_grads(fn):
        lm.zero_grad(set_to_none=True)
        loss = fn(tokens, labels=tokens).loss
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in lm.named_parameters()}

    eager_loss, eager_grads = loss_and_grads(lm)
    compiled = torch.compile(lm, backend="aot_eager", fullgraph=True)
    loss, grads = loss_and_grads(compiled)
    with torch.no_grad():  # the forward alone: `mambakit::mamba3_scan_fwd`
        assert rel(compiled(tokens).logits, lm(tokens).logits) < 1e-6
    assert calls.counts["mamba3_scan_reference"] == 0
    assert rel(loss, eager_loss) < 1e-6
    for name, g in grads.items():
        assert rel(g, eager_grads[name]) < 1e-5, name


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_mamba_last_body(backend, calls, monkeypatch):
    """A prefill's last layer (`last_logits`): the segment-summary scan on Triton, the
    mixer over every step on the reference; the logits equal the forward's last position."""
    monkeypatch.setenv("MAMBAKIT_BACKEND", backend)
    calls.watch(inner_pkg, "mamba_inner_last_triton")
    lm = model("mamba1")
    tokens = ids()
    with torch.no_grad():
        last, _ = lm.last_logits(tokens)
        full = lm(tokens).logits[:, -1]
    assert calls.ran() == ({"mamba_inner_last_triton"} if backend == "triton" else set())
    assert rel(last, full) < 1e-5  # the head's GEMM over one row or all: rounding apart


def test_mamba3_scan_backward_gets_no_filled_gradients(monkeypatch):
    """The differentiable scan returns what its backward reads beside its outputs: those take
    no gradient, and an output that no gradient reached arrives as None, so autograd fills no
    zeros of them before the backward (hundreds of MB at training shapes)."""
    from mambakit.ops.mamba3 import Mamba3State

    g = torch.Generator().manual_seed(0)
    B, T, H, P, G, N, S = 1, 8, 2, 4, 1, 8, 2

    def r(*s, scale=1.0):
        return (torch.randn(*s, generator=g) * scale).requires_grad_()

    delta = (torch.rand(B, T, H, generator=g) * 0.5 + 0.01).requires_grad_()
    A = (-torch.rand(B, T, H, generator=g) - 0.1).requires_grad_()
    inputs = (r(B, T, H, P), r(B, T, G, N), r(B, T, G, N), delta, A, r(B, T, H), r(B, T, S),
              r(H, N), r(H, N), *Mamba3State.zeros(B, H, P, N, S))  # fmt: skip
    out = m3_ops._SCAN_TRAIN(*inputs, None, None, None, m3_ops._config_id(None))
    assert [o.requires_grad for o in out] == [True] * 4 + [False] * 8
    seen = []
    bwd = m3_ops._SCAN_BWD
    monkeypatch.setattr(m3_ops, "_SCAN_BWD", lambda *a: seen.append(a[:4]) or bwd(*a))
    out[0].sum().backward()
    assert [t is None for t in seen[0]] == [False, True, True, True]
    assert inputs[0].grad is not None and torch.isfinite(inputs[0].grad).all()
