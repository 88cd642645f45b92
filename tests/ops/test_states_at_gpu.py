"""`states_at` on the GPU: the scan's masked store with the time split into segments (long
rows), and a model's packed row against each prompt's own prefill."""

from __future__ import annotations

import pytest
import torch

from mambakit import MambaConfig, MambaLM
from mambakit.ops import selective_scan

pytestmark = pytest.mark.gpu


def test_scan_states_at_long_rows_match_the_f64_prefix_scan():
    """1 x 8192 at D 1536 (several time segments on the H200): the states after steps in
    different segments, at document ends and inside documents, against the float64
    reference scan run to each step."""
    torch.manual_seed(0)
    dev = "cuda"
    Bsz, T, D, N = 1, 8192, 1536, 16
    u = torch.randn(Bsz, T, D, device=dev)
    dt = torch.randn(Bsz, T, D, device=dev) * 0.5 - 1
    A = -torch.rand(D, N, device=dev) - 0.5
    Bm, C = torch.randn(Bsz, T, N, device=dev), torch.randn(Bsz, T, N, device=dev)
    Dv, z = torch.randn(D, device=dev), torch.randn(Bsz, T, D, device=dev)
    seq = torch.zeros(Bsz, T, dtype=torch.int32, device=dev)
    for start in (1000, 3000, 7000):
        seq[:, start:] += 1
    pos = torch.tensor([[5, 999, 1000, 2047, 2999, 4095, 6000, 6999, 8191]], device=dev)
    y, hT, states = selective_scan(u, dt, A, Bm, C, Dv, z, None, True, None, seq,
                                   return_final_state=True, states_at=pos)  # fmt: skip
    y0, h0 = selective_scan(u, dt, A, Bm, C, Dv, z, None, True, None, seq,
                            return_final_state=True)  # fmt: skip
    assert torch.equal(y, y0) and torch.equal(hT, h0)
    for j, p in enumerate(pos[0].tolist()):
        args = (t[:, : p + 1].double() for t in (u, dt))
        bc = (t[:, : p + 1].double() for t in (Bm, C))
        _, want = selective_scan(*args, A.double(), *bc, Dv.double(), z[:, : p + 1].double(),
                                 None, True, None, seq[:, : p + 1], return_final_state=True,
                                 backend="reference")  # fmt: skip
        err = (states[0, j].double() - want[0]).abs().max() / want.abs().max()
        assert err < 1e-4, (p, err.item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_model_states_at_a_packed_row_matches_each_prompts_prefill(dtype):
    torch.manual_seed(0)
    cfg = MambaConfig(d_model=256, n_layers=4, vocab_size=512)
    model = MambaLM(cfg).to("cuda", dtype).eval()
    lengths = [700, 1, 33, 2048, 300, 1111]
    prompts = [torch.randint(0, 512, (n,), device="cuda") for n in lengths]
    ids = torch.cat(prompts)[None]
    seq = torch.cat([torch.full((n,), i, dtype=torch.int32, device="cuda")
                     for i, n in enumerate(lengths)])[None]  # fmt: skip
    ends = torch.tensor(lengths, device="cuda").cumsum(0) - 1
    pos = torch.cat([ends, torch.tensor([255, 1000], device="cuda")])[None]
    with torch.no_grad():
        logits, state = model.states_at(ids, pos, seq_idx=seq)
        tol = 2e-3 if dtype == torch.float32 else 5e-2
        starts = [0, *ends[:-1].add(1).tolist()]
        for j, p in enumerate(pos[0].tolist()):
            start = max(s for s in starts if s <= p)
            want_logits, want = model.last_logits(ids[:, start : p + 1])
            scale = want_logits.float().abs().max()
            assert (logits[0, j].float() - want_logits[0].float()).abs().max() / scale < tol
            for got, ref in zip(state._tensors(), want._tensors()):
                err = (got[:, j] - ref[:, 0]).abs().max() / ref.abs().max()
                assert err < tol, (p, err.item())
