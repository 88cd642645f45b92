"""Whole-model benchmark: the 130m training step as users run it, beside mamba_ssm.

Rows, all 130m at batch 8 x 2048, f32 parameters under bf16 autocast, forward +
loss + backward + gradient clipping + fused AdamW, timed from the host over
several steps (what a training loop sees, launch overhead included):

- mambakit `Trainer` on its default path (`cuda_graph="auto"`: one graph replay);
- mambakit `Trainer` forced eager (`cuda_graph=False`);
- mamba_ssm `MambaLMHeadModel` eager (its fused add-norm, full logits + torch
  cross-entropy, fused AdamW), when importable.

Each row gives tokens/s, peak memory (everything allocated: weights, gradients,
optimizer state, activations) and the ratio to mamba_ssm's step. Prefill (one
forward of 1 x 4096, eager and CUDA graph) follows. `--profile FILE` writes the
per-kernel table of one eager mambakit step and its kernel count.

    PYTHONPATH=src python benchmarks/bench_model.py --out bench_model.json
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from common import (  # noqa: E402
    cuda_time_ms,
    graph_time_ms,
    matmul_tflops,
    print_table,
    write_record,
)

from mambakit import MambaConfig, MambaLM  # noqa: E402
from mambakit.training import TrainConfig, Trainer  # noqa: E402


class RandomRows:
    """A few fixed random batches in pinned host memory, cycled (no data loading cost)."""

    def __init__(self, vocab: int, batch: int, seqlen: int, n: int = 4) -> None:
        g = torch.Generator().manual_seed(0)
        self.rows = []
        for _ in range(n):
            ids = torch.randint(0, vocab, (batch, seqlen + 1), generator=g)
            self.rows.append(
                {"input_ids": ids[:, :-1].pin_memory(), "targets": ids[:, 1:].pin_memory()}
            )
        self.i = 0

    def next(self):
        self.i += 1
        return self.rows[self.i % len(self.rows)]


def _reset_memory() -> None:
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


def _time_steps(step, warmup: int, iters: int) -> float:
    """Host wall time per step (ms) after `warmup` steps, synchronised at both ends."""
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters * 1e3


def trainer_for(cfg: MambaConfig, batch: int, seqlen: int, cuda_graph) -> Trainer:
    torch.manual_seed(0)
    tcfg = TrainConfig(
        steps=10**6, batch_size=batch, seqlen=seqlen, precision="bf16", device="cuda",
        cuda_graph=cuda_graph, warmup_steps=10, log_every=10**6, eval_every=0,
    )  # fmt: skip
    return Trainer(MambaLM(cfg), tcfg, RandomRows(cfg.vocab_size, batch, seqlen), log=print)


def measure_trainer(name, cfg, batch, seqlen, cuda_graph, iters) -> dict:
    _reset_memory()
    trainer = trainer_for(cfg, batch, seqlen, cuda_graph)
    ms = _time_steps(trainer.train_step, warmup=3, iters=iters)
    rec = {
        "workload": name,
        "batch": batch,
        "seqlen": seqlen,
        "step_ms": ms,
        "tokens_per_s": batch * seqlen / (ms * 1e-3),
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
        "path": trainer.graph_status(),
    }
    if trainer._graph is not None:  # the GPU time of the captured step alone
        rec["gpu_ms"] = cuda_time_ms(trainer._graph.replay, warmup=1, iters=5)
    del trainer
    return rec


# --mixer: a released size's width and depth with another mixer, at the state and head sizes
# of the released mamba2 checkpoints and of the 130m-mamba3 preset
MIXER_SIZES = {
    "mamba2": dict(mixer="mamba2", d_state=128, headdim=64, chunk_size=256),
    "mamba3": dict(mixer="mamba3", d_state=128, headdim=64),
}


def peer_ssm_cfg(cfg) -> dict:
    """mamba_ssm's `ssm_cfg` for a mambakit config: its mixer with the preset's sizes."""
    if cfg.mixer == "mamba3":  # upstream's SISO Mamba3
        return dict(layer="Mamba3", d_state=cfg.d_state, expand=cfg.expand,
                    headdim=cfg.headdim, ngroups=cfg.ngroups, rope_fraction=cfg.rope_fraction,
                    A_floor=cfg.A_floor, is_outproj_norm=False, is_mimo=False)  # fmt: skip
    if cfg.mixer == "mamba2":
        return dict(layer="Mamba2", d_state=cfg.d_state, d_conv=cfg.d_conv,
                    expand=cfg.expand, headdim=cfg.headdim, ngroups=cfg.ngroups,
                    chunk_size=cfg.chunk_size)  # fmt: skip
    return {}  # Mamba-1, the default


def measure_peer_step(cfg, batch, seqlen):
    """mamba_ssm's eager training step (fused AdamW, clipping) as a function, or None when
    mamba_ssm is not importable; the model rides along as `step.model`."""
    try:
        from mamba_ssm.models.config_mamba import MambaConfig as SSMConfig
        from mamba_ssm.models.mixer_seq_simple import MambaLMHeadModel
    except ImportError:
        print("mamba_ssm not importable: its rows are skipped")
        return None
    torch.manual_seed(0)
    model = MambaLMHeadModel(
        SSMConfig(
            d_model=cfg.d_model,
            n_layer=cfg.n_layers,
            vocab_size=cfg.vocab_size,
            ssm_cfg=peer_ssm_cfg(cfg),
        )  # fmt: skip
    ).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=True)
    data = RandomRows(cfg.vocab_size, batch, seqlen)

    def step():
        b = data.next()
        ids = b["input_ids"].cuda(non_blocking=True)
        targets = b["targets"].cuda(non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(ids).logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)

    step.model = model
    return step


def measure_peer(cfg, batch, seqlen, iters) -> dict | None:
    _reset_memory()
    step = measure_peer_step(cfg, batch, seqlen)
    if step is None:
        return None
    ms = _time_steps(step, warmup=3, iters=iters)
    rec = {
        "workload": "mamba_ssm eager",
        "batch": batch,
        "seqlen": seqlen,
        "step_ms": ms,
        "tokens_per_s": batch * seqlen / (ms * 1e-3),
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
        "path": "eager",
    }
    rec.update(measure_prefill(step.model, cfg.vocab_size))
    return rec


def forward_fn(model, ids):
    def fwd():
        with torch.inference_mode(), torch.autocast("cuda", dtype=torch.bfloat16):
            model(ids)

    return fwd


def measure_prefill(model, vocab: int, length: int = 4096) -> dict:
    ids = torch.randint(0, vocab, (1, length), device="cuda")
    ms = cuda_time_ms(forward_fn(model, ids), warmup=2, iters=5)
    rec = {"prefill_shape": f"1x{length}", "prefill_eager_ms": ms}
    try:
        rec["prefill_graph_ms"] = graph_time_ms(forward_fn(model, ids))
    except Exception as e:  # a model that cannot be captured: say so
        rec["prefill_graph_ms"] = f"n/a ({type(e).__name__})"
    return rec


def profile_step(cfg, batch, seqlen, path: str) -> None:
    """Per-kernel table of one eager Trainer step, and its number of kernel launches."""
    from torch.profiler import ProfilerActivity, profile

    _reset_memory()
    trainer = trainer_for(cfg, batch, seqlen, cuda_graph=False)
    for _ in range(2):
        trainer.train_step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        trainer.train_step()
        torch.cuda.synchronize()
    events = prof.key_averages()
    n_kernels = sum(e.count for e in events if e.device_type.name == "CUDA")
    gpu_us = sum(e.self_device_time_total for e in events if e.device_type.name == "CUDA")
    head = f"one eager step: {n_kernels} GPU kernels/copies, {gpu_us / 1e3:.1f} ms of GPU time\n"
    table = events.table(sort_by="self_cuda_time_total", row_limit=40, max_name_column_width=70)
    print(head + table)
    Path(path).write_text(
        head + table + "\n" + host_profile(trainer) + "\n" + copies_by_shape(trainer)
    )
    del trainer


COPY_OPS = ("aten::copy_", "aten::cat")  # the ops that launch the copy kernels themselves


def copies_by_shape(trainer) -> str:
    """One eager step's copies and casts (the ops behind the profile's copy kernels: casts and
    `.contiguous()` end in `copy_`) by their input shapes, with the GPU time of their own
    kernels: which tensors are copied, and how often."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                 record_shapes=True) as prof:  # fmt: skip
        trainer.train_step()
        torch.cuda.synchronize()
    rows = [e for e in prof.key_averages(group_by_input_shape=True) if e.key in COPY_OPS]
    rows.sort(key=lambda e: -e.self_device_time_total)
    lines = ["copies and casts of one eager step by input shapes (own GPU ms, calls; cat's "
             "inputs are a list, so its calls share one row):"]  # fmt: skip
    for e in rows[:30]:
        ms = e.self_device_time_total / 1e3
        lines.append(f"{ms:9.3f} ms {e.count:6d}  {e.key}  {e.input_shapes}")
    return "\n".join(lines) + "\n"


def host_profile(trainer) -> str:
    """Where the host's time of one eager step goes: the time to enqueue the step (no sync
    inside it; the GPU lags behind), and the Python functions by own time (cProfile)."""
    import cProfile
    import io
    import pstats

    torch.cuda.synchronize()
    enqueue = []
    for _ in range(3):
        t0 = time.perf_counter()
        trainer.train_step()
        enqueue.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    trainer.train_step()
    prof.disable()
    torch.cuda.synchronize()
    buf = io.StringIO()
    stats = pstats.Stats(prof, stream=buf)
    stats.sort_stats("tottime").print_stats(45)
    stats.sort_stats("cumulative").print_stats(45)
    # the profiler's CPU table: host time per op on every thread (a custom op's row includes
    # its Triton launches)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as tprof:
        trainer.train_step()
    torch.cuda.synchronize()
    ops = tprof.key_averages().table(
        sort_by="cpu_time_total", row_limit=45, max_name_column_width=60
    )
    head = "host enqueue time of one eager step (ms): " + ", ".join(f"{m:.1f}" for m in enqueue)
    print(head)
    return head + "\n" + ops + "\n" + buf.getvalue()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--preset", default="130m")
    ap.add_argument(
        "--mixer", choices=sorted(MIXER_SIZES), help="the preset's sizes with this mixer instead "
        "(its state and head sizes as in the released mamba2 / mamba3 presets), e.g. 1.4b's "
        "width and depth with Mamba-3; rows are labelled preset-mixer",
    )  # fmt: skip
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seqlen", type=int, default=2048)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--no-peer", action="store_true", help="skip mamba_ssm")
    ap.add_argument(
        "--prune-peer", action="store_true", help="with --mixer mamba3: mamba_ssm's Mamba-3 "
        "autotune cut to one configuration per kernel (its full autotune takes minutes; the "
        "peer's figure is then a quick check, not its best speed)",
    )  # fmt: skip
    ap.add_argument("--profile", help="write a per-kernel profile of one eager step here")
    ap.add_argument("--out", help="write the results record (JSON) here")
    args = ap.parse_args()
    mm = matmul_tflops()
    print(f"bf16 matmul rate (8192^3, random): {mm:.0f} TFLOP/s")
    cfg = MambaConfig.preset(args.preset, **MIXER_SIZES.get(args.mixer, {}))
    label = f"{args.preset}-{args.mixer}" if args.mixer else args.preset
    b, t = args.batch, args.seqlen
    records = [
        measure_trainer("mambakit Trainer (default)", cfg, b, t, "auto", args.iters),
        measure_trainer("mambakit Trainer eager", cfg, b, t, False, args.iters),
    ]
    _reset_memory()
    model = MambaLM(cfg).cuda()
    n_params = model.num_parameters()
    records[0].update(measure_prefill(model, cfg.vocab_size))
    del model
    pruned = args.prune_peer and cfg.mixer == "mamba3" and not args.no_peer
    if pruned:
        from bench_mamba3 import _upstream_module, prune_upstream_autotune

        pruned = _upstream_module() is not None
        if pruned:
            prune_upstream_autotune()
    peer = None if args.no_peer else measure_peer(cfg, b, t, args.iters)
    if peer is not None:
        if pruned:
            peer["peer_autotune"] = "one configuration per kernel (--prune-peer)"
        records.append(peer)
    for r in records:
        r["preset"] = label
        r["mfu"] = r["tokens_per_s"] * 6 * n_params / (mm * 1e12)
        if peer is not None:
            r["x_peer"] = peer["step_ms"] / r["step_ms"]
    cols = ["workload", "path", "step_ms", "gpu_ms", "tokens_per_s", "x_peer", "mfu", "peak_gib"]
    print_table(records, cols)
    print_table(records, ["workload", "prefill_eager_ms", "prefill_graph_ms"])
    if args.profile:
        profile_step(cfg, b, t, args.profile)
    context = {"preset": label, "matmul_tflops": mm, "params": n_params}
    write_record(args.out, "bench_model", records, context=context)


if __name__ == "__main__":
    main()
