"""`MambaLM._last_at`: one forward over right-padded rows, each row stopped at a step of its
own (the serve engine's prefill of pieces of different lengths). The oracle is the float64
model's `last_logits` over each row's tokens up to its stop, from the row's state: the
logits there and every field of the state after it. The steps past a stop are filler
(random tokens, which would move a state): Mamba-1 reads the states at the stop
(`states_at`); Mamba-2 and Mamba-3 give the filler a delta of 0, which passes their state
unchanged, and take what else the state holds (the conv's inputs; the last key and value)
at the stop.
Without CUDA the Triton kernels run under the interpreter, on tiny shapes."""

from __future__ import annotations

import copy

import pytest
import torch

from mambakit import MambaConfig, MambaLM

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
T = 21  # the padded rows; Mamba-2's chunks of 8 put stops in three chunks
STOPS = [20, 0, 7, 13]  # a full row, one step, a chunk's end, mid-chunk


def tiny(mixer: str, randomize, **over) -> MambaLM:
    torch.manual_seed(0)
    sizes = dict(d_model=32, n_layers=2, vocab_size=64, d_state=8)
    if mixer != "mamba1":
        sizes.update(headdim=8, chunk_size=8)
    cfg = MambaConfig(mixer=mixer, **sizes, **over)
    return randomize(MambaLM(cfg).to(DEVICE)).eval()


def random_state(model: MambaLM, rows: int):
    s = model.init_state(rows)
    return type(s)(*(torch.randn_like(t) * 0.5 for t in s._tensors()))


def rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    assert got.shape == ref.shape and torch.isfinite(got).all()
    got, ref = got.double(), ref.double()
    return ((got - ref).norm() / ref.norm().clamp(min=1e-30)).item()


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("mixer", ["mamba1", "mamba2", "mamba3"])
@pytest.mark.parametrize("with_state", [False, True], ids=["from-zero", "from-a-state"])
def test_last_at_is_last_logits_of_each_row_up_to_its_stop(mixer, backend, with_state,
                                                           randomize, monkeypatch):  # fmt: skip
    model = tiny(mixer, randomize)
    assert model.stops_rows()
    torch.manual_seed(1)
    ids = torch.randint(0, 64, (len(STOPS), T), device=DEVICE)
    for b, s in enumerate(STOPS):  # filler past the stop, of a kind that moves a state
        ids[b, s + 1 :] = torch.randint(0, 64, (T - s - 1,))
    stop = torch.tensor(STOPS, device=DEVICE)
    state = random_state(model, len(STOPS)) if with_state else None
    monkeypatch.setenv("MAMBAKIT_BACKEND", backend)
    with torch.no_grad():
        logits, out = model._last_at(ids, stop, state)
    monkeypatch.delenv("MAMBAKIT_BACKEND")
    ref = copy.deepcopy(model).double()
    with torch.no_grad():
        for b, s in enumerate(STOPS):
            row = (
                None
                if state is None
                else type(state)(*(t[:, b : b + 1].double() for t in state._tensors()))
            )
            want_logits, want = ref.last_logits(ids[b : b + 1, : s + 1], row)
            assert rel(logits[b], want_logits[0]) < 1e-5, ("logits", b)
            for i, (got_t, want_t) in enumerate(zip(out._tensors(), want._tensors())):
                assert rel(got_t[:, b], want_t[:, 0]) < 1e-5, ("state field", i, b)


def test_a_lower_delta_limit_cannot_stop_rows(randomize):
    """A Mamba-2 layer whose delta is clamped above 0 cannot freeze its state: the model
    says so, and the serve engine cuts its pieces into powers of two instead."""
    from mambakit.serve import Engine

    model = tiny("mamba2", randomize)
    for block in model.backbone.layers:
        block.mixer.dt_limit = (0.01, float("inf"))
    assert not model.stops_rows()
    assert not Engine(model.cpu(), max_batch=2).spans
