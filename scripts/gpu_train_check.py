"""GPU checks of the training engine: falling loss in bf16 and f16, CUDA-graph
step == eager step (bf16, deterministic) and its speed, bit-identical deterministic runs.

    PYTHONPATH=src python scripts/gpu_train_check.py --out train_check.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from mambakit import MambaBackbone, MambaConfig, MambaLM
from mambakit.training import TrainConfig, Trainer


class SyntheticRows:
    """Rows drawn from a fixed bank of random token sequences: learnable by memorising."""

    def __init__(self, vocab: int, batch: int, seqlen: int, bank: int = 64, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.bank = torch.randint(0, vocab, (bank, seqlen + 1), generator=g)
        self.batch, self.g, self.i = batch, torch.Generator().manual_seed(seed + 1), 0

    def next(self):
        idx = torch.randint(0, self.bank.shape[0], (self.batch,), generator=self.g)
        rows = self.bank[idx]
        return {"input_ids": rows[:, :-1], "targets": rows[:, 1:]}

    def state_dict(self):
        return {"g": self.g.get_state()}

    def load_state_dict(self, sd):
        self.g.set_state(sd["g"])


class SyntheticSeries:
    """RL-sized float inputs with a regression target (the loss of a value head)."""

    def __init__(self, dim: int, batch: int, seqlen: int, seed: int = 0):
        self.g = torch.Generator().manual_seed(seed)
        self.dim, self.batch, self.seqlen = dim, batch, seqlen

    def next(self):
        x = torch.randn(self.batch, self.seqlen, self.dim, generator=self.g)
        return {"x": x, "y": x.cumsum(1)[..., :1] / 8}


def series_loss(model, batch, state):
    hidden, state = model(batch["x"], state=state)
    pred = hidden[..., :1].float()
    return F.mse_loss(pred, batch["y"].float(), reduction="sum"), state


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run(model_fn, data_fn, steps, loss_fn=None, **tcfg):
    torch.manual_seed(0)
    model = model_fn()
    kw = {"loss_fn": loss_fn} if loss_fn else {}
    trainer = Trainer(
        model, TrainConfig(steps=steps, log_every=1, eval_every=0, **tcfg), data_fn(), **kw
    )
    losses, times = [], []
    for _ in range(steps):
        _sync()
        t0 = time.perf_counter()
        loss, _ = trainer.train_step()
        losses.append(float(loss))
        _sync()
        times.append(time.perf_counter() - t0)
    steady = sorted(times[3:])[len(times[3:]) // 2] if len(times) > 4 else times[-1]
    return model, losses, steady


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--quick", action="store_true", help="CPU dry run: tiny model, no graphs")
    ap.add_argument("--out")
    args = ap.parse_args()
    out: dict = {}
    cfg = MambaConfig.preset("tiny" if args.quick else "130m")
    seq = 32 if args.quick else 2048
    graphs = (False,) if args.quick else (False, True)
    lm = lambda: MambaLM(cfg)  # noqa: E731

    for prec in ("bf16", "f16"):
        _, losses, st = run(
            lm,
            lambda: SyntheticRows(cfg.vocab_size, 8, 4 if args.quick else 512),
            args.steps,
            precision=prec,
            lr=1e-3,
            warmup_steps=20,
            batch_size=8,
            seqlen=4 if args.quick else 512,
        )
        out[f"130m_{prec}_8x512"] = {"first": losses[:3], "last": losses[-3:], "step_s": st}
        print(
            f"130m {prec} 8x512: loss {losses[0]:.3f} -> {losses[-1]:.3f}, {st * 1e3:.1f} ms/step"
        )

    # CUDA graph vs eager, bf16, deterministic, the training shape (8 x 2048)
    res = {}
    for graph in graphs:
        model, losses, st = run(
            lm,
            lambda: SyntheticRows(cfg.vocab_size, 8, seq),
            12,
            precision="bf16",
            deterministic=True,
            cuda_graph=graph,
            batch_size=8,
            seqlen=seq,
            lr=1e-3,
            warmup_steps=2,
        )
        res[graph] = (losses, st, [p.detach().clone() for p in model.parameters()])
        del model
    res.setdefault(True, res[False])
    res.setdefault(True, res[False])
    same_curve = res[False][0] == res[True][0]
    same_w = all(torch.equal(a, b) for a, b in zip(res[False][2], res[True][2]))
    out["130m_graph_vs_eager_8x2048"] = {
        "eager_losses": res[False][0],
        "graph_losses": res[True][0],
        "identical_losses": same_curve,
        "identical_weights": same_w,
        "eager_step_s": res[False][1],
        "graph_step_s": res[True][1],
        "speedup": res[False][1] / res[True][1],
    }
    print(
        f"graph vs eager 130m 8x2048: losses identical {same_curve}, weights identical {same_w}, "
        f"eager {res[False][1] * 1e3:.1f} ms, graph {res[True][1] * 1e3:.1f} ms"
    )
    del res

    # two deterministic eager runs
    w = []
    for _ in range(2):
        model, _, _ = run(
            lm,
            lambda: SyntheticRows(cfg.vocab_size, 4, seq),
            5,
            precision="bf16",
            deterministic=True,
            batch_size=4,
            seqlen=seq,
        )
        w.append([p.detach().clone() for p in model.parameters()])
        del model
    out["deterministic_bit_identical"] = all(torch.equal(a, b) for a, b in zip(*w))
    print(f"two deterministic runs bit-identical: {out['deterministic_bit_identical']}")

    # RL size: d_model 128, 3 layers, batch 16 x 64
    rl = MambaConfig(d_model=128, n_layers=3, input_dim=32)
    times = {}
    for graph in graphs:
        _, losses, st = run(
            lambda: MambaBackbone(rl),
            lambda: SyntheticSeries(32, 16, 64),
            30,
            loss_fn=series_loss,
            precision="bf16",
            cuda_graph=graph,
            batch_size=16,
            seqlen=64,
            lr=1e-3,
            warmup_steps=2,
        )
        times[graph] = (st, losses[-1])
    times.setdefault(True, times[False])
    times.setdefault(True, times[False])
    out["rl_128x3_16x64"] = {
        "eager_step_s": times[False][0],
        "graph_step_s": times[True][0],
        "speedup": times[False][0] / times[True][0],
    }
    print(
        f"RL size 16x64: eager {times[False][0] * 1e3:.2f} ms, graph {times[True][0] * 1e3:.2f} ms"
    )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
