"""Whole-model benchmark (issue 4): training step and prefill of the 130m preset in bf16.

Training step = forward + cross-entropy + backward (no optimizer), f32 parameters
under bf16 autocast, batch 8 x 2048. MFU = tokens/s * 6 * parameters / the bf16
matmul rate measured in this run. Prefill = one forward of 1 x 4096 tokens,
eager and as a CUDA-graph replay (GPU time). Peers when importable: the
reference path of mambakit, transformers' MambaForCausalLM (torch path),
mamba_ssm's MambaLMHeadModel. `--profile` adds a per-kernel table of one step.

    PYTHONPATH=src python benchmarks/bench_model.py --out bench_model.json
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from common import (  # noqa: E402
    cuda_time_ms,
    device_meta,
    graph_time_ms,
    matmul_tflops,
    print_table,
    write_json,
)

from mambakit import MambaConfig, MambaLM  # noqa: E402


def _loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())


def train_step_fn(model, ids, kind: str):
    targets = torch.roll(ids, -1, 1)
    targets[:, -1] = -100

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            if kind == "mambakit":  # the training path: the head's logits are never whole
                loss = model.loss_sum(ids, targets)[0] / targets.numel()
            else:  # transformers / mamba_ssm
                loss = _loss(model(ids).logits, ids)
        loss.backward()
        for p in model.parameters():
            p.grad = None

    return step


def forward_fn(model, ids):
    def fwd():
        with torch.inference_mode(), torch.autocast("cuda", dtype=torch.bfloat16):
            model(ids)

    return fwd


def measure(name, model, kind, batch, seqlen, prefill_len, mm_rate, n_params, note=""):
    rec = {"workload": name, "batch": batch, "seqlen": seqlen, "dtype": "bf16 autocast"}
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (batch, seqlen), device="cuda")
    try:
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        ms = cuda_time_ms(train_step_fn(model, ids, kind), warmup=2, iters=5)
        peak = (torch.cuda.max_memory_allocated() - base) / 2**30
        tps = batch * seqlen / (ms * 1e-3)
        rec.update(
            train_ms=ms,
            train_tokens_per_s=tps,
            mfu=tps * 6 * n_params / (mm_rate * 1e12),
            peak_gib=peak,
        )
    except torch.cuda.OutOfMemoryError:
        rec["train_ms"] = "OOM"
    gc.collect()
    torch.cuda.empty_cache()
    if prefill_len:
        pids = torch.randint(0, vocab, (1, prefill_len), device="cuda")
        ms = cuda_time_ms(forward_fn(model, pids), warmup=2, iters=5)
        rec.update(
            prefill_len=prefill_len,
            prefill_eager_ms=ms,
            prefill_eager_tokens_per_s=prefill_len / (ms * 1e-3),
        )
        try:
            gms = graph_time_ms(forward_fn(model, pids))
            rec.update(prefill_graph_ms=gms, prefill_graph_tokens_per_s=prefill_len / (gms * 1e-3))
        except Exception as e:  # a peer that cannot be captured: say so
            rec["prefill_graph_ms"] = f"n/a ({type(e).__name__})"
    rec["note"] = note
    return rec


def profile_step(model, batch, seqlen, path: str | None) -> None:
    from torch.profiler import ProfilerActivity, profile

    ids = torch.randint(0, model.config.vocab_size, (batch, seqlen), device="cuda")
    step = train_step_fn(model, ids, "mambakit")
    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25)
    print(table)
    # the operators behind the kernels, with their input shapes (which op launches what)
    with profile(
        activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True
    ) as p2:
        step()
        torch.cuda.synchronize()
    ops = p2.key_averages(group_by_input_shape=True).table(
        sort_by="self_cuda_time_total",
        row_limit=40,
        max_name_column_width=40,
        max_shapes_column_width=90,
    )
    if path:
        Path(path).write_text(table + "\n\nOperators by input shape\n" + ops)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--preset", default="130m")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seqlen", type=int, default=2048)
    ap.add_argument("--prefill", type=int, default=4096)
    ap.add_argument("--peers", default="reference,transformers,mamba_ssm")
    ap.add_argument("--profile", help="write a per-kernel profile of one step to this file")
    ap.add_argument("--out")
    args = ap.parse_args()
    torch.manual_seed(0)
    mm = matmul_tflops()
    print(f"bf16 matmul rate (8192^3, random): {mm:.0f} TFLOP/s")
    cfg = MambaConfig.preset(args.preset)
    model = MambaLM(cfg).cuda()
    n_params = model.num_parameters()
    records = [
        measure(
            "mambakit (triton)",
            model,
            "mambakit",
            args.batch,
            args.seqlen,
            args.prefill,
            mm,
            n_params,
        )
    ]
    if args.profile:
        profile_step(model, args.batch, args.seqlen, args.profile)
    peers = args.peers.split(",") if args.peers else []
    if "reference" in peers:
        os.environ["MAMBAKIT_BACKEND"] = "reference"
        b, t = 1, 512
        records.append(
            measure(
                "mambakit (reference)",
                model,
                "mambakit",
                b,
                t,
                1024,
                mm,
                n_params,
                note=f"smaller shape {b}x{t}: reference memory",
            )
        )
        del os.environ["MAMBAKIT_BACKEND"]
    del model
    gc.collect()
    torch.cuda.empty_cache()
    if "transformers" in peers:
        try:
            from transformers import MambaConfig as HFConfig
            from transformers import MambaForCausalLM

            hf = MambaForCausalLM(
                HFConfig(
                    vocab_size=cfg.vocab_size,
                    hidden_size=cfg.d_model,
                    num_hidden_layers=cfg.n_layers,
                )
            ).cuda()
            b, t = 8, 256
            records.append(
                measure(
                    "transformers (torch path)",
                    hf,
                    "hf",
                    b,
                    t,
                    1024,
                    mm,
                    n_params,
                    note=f"smaller shape {b}x{t}: slow path",
                )
            )
            del hf
        except ImportError:
            print("transformers not importable: skipped")
    if "mamba_ssm" in peers:
        try:
            from mamba_ssm.models.config_mamba import MambaConfig as SSMConfig
            from mamba_ssm.models.mixer_seq_simple import MambaLMHeadModel

            ms = MambaLMHeadModel(
                SSMConfig(d_model=cfg.d_model, n_layer=cfg.n_layers, vocab_size=cfg.vocab_size)
            ).cuda()
            ms.config.vocab_size = cfg.vocab_size
            records.append(
                measure("mamba_ssm", ms, "ssm", args.batch, args.seqlen, args.prefill, mm, n_params)
            )
        except ImportError:
            print("mamba_ssm not importable: skipped")
    cols = [
        "workload",
        "batch",
        "seqlen",
        "train_ms",
        "train_tokens_per_s",
        "mfu",
        "peak_gib",
        "prefill_eager_ms",
        "prefill_eager_tokens_per_s",
        "prefill_graph_ms",
        "note",
    ]
    print_table(records, cols)
    write_json(args.out, records, {**device_meta(), "matmul_tflops": mm, "params": n_params})


if __name__ == "__main__":
    main()
