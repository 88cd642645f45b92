"""RL benchmark: small float-input recurrent models as RL and control users run them.

The model is `MambaBackbone(MambaConfig(d_model=128, n_layers=3, input_dim=64, mixer=...))`
in f32 (d_state 16; Mamba-3 in 16 heads of 16 as mamba-rs's default Mamba-3 config,
Mamba-2 in 8 heads of 32), at batch 1, 16 and 64, on the CPU and on CUDA:

  step          `y, state = model.step(x, state)` under no_grad, x [B, 64], the one state
                from `model.init_state(B)` carried in place: wall time per call (us) of a
                loop of calls, synchronised once at the loop's end on CUDA. The library
                replays a CUDA step from a graph it captures after a few calls of one
                shape; `graph_replays` says how many timed calls did.
  train window  T = 32: `out, state = model(x, state)` from the state the previous window
                left (detached), an MSE loss of a linear head on `out` against a random
                target, `loss.backward()`, `AdamW(fused=True).step()`, `zero_grad()`: ms per
                window.
  forward+backward  the same window without the optimizer (gradients dropped after each):
                what mamba-rs's training figures time.

Each figure is the median over `--rounds` rounds, with p10 / p90 and min / max; a round
times a loop of calls long enough to last about `--round-s` seconds. The batches run
smallest first, every mixer's every workload at one batch before the next batch: on a
2-core machine the Mamba-3 batch-1 forward + backward read 3.7-5.5 ms timed after larger
batches in one process and 2.5-2.7 ms in processes that ran batch 1 alone, and a process
serving one policy runs one batch. The CPU runs with the
thread count torch has (`MambaBackbone` leaves it alone; `--threads N` sets it), recorded
per figure. Also counted, once each: the aten ops of one CPU step, the CUDA kernels of
one eager step (`cuda_graph=False`) and of one training window.

mamba-rs's figures for the same model size (its README and docs/mamba1-benchmarks.md: a
Xeon Gold 5412U and an RTX 6000 Ada) are kept in the record's context and printed beside
ours: another library on another machine, context rather than a comparison.

    python benchmarks/bench_rl.py                          # CPU, and CUDA when present
    python benchmarks/bench_rl.py --device both --out benchmarks/results/DATE-rl.json
    python benchmarks/bench_rl.py --device cpu --mixers mamba1 --batches 1 --threads 1
    python benchmarks/bench_rl.py --dry --device cpu       # every path in seconds

Prints one line (dict) per figure, then a summary with mamba-rs's figures beside ours, and
writes a results record (`--out`, JSON: benchmarks/common.py), rewritten after each figure
so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from mambakit import MambaBackbone, MambaConfig
from mambakit.training import WindowStep

sys.path.insert(0, str(Path(__file__).parent))
from bench_decode import count_aten_ops, count_kernels  # noqa: E402
from common import make_record  # noqa: E402

D_MODEL, N_LAYERS, INPUT_DIM = 128, 3, 64
WINDOW = 32  # T of a training window
ACTIONS = 8  # outputs of the user's linear head
LR = 3e-4
STEP_PROBE = 10  # step calls timed to choose the calls per round
MIXERS = {  # the fields each mixer needs beyond the shared ones (d_inner = 256)
    "mamba1": {},
    "mamba3": {"headdim": 16},  # 16 heads, as mamba-rs's Mamba3Config::default()
    "mamba2": {"headdim": 32},  # 8 heads
}
STEP = "RL step"
TRAIN = f"RL train window T={WINDOW}"
FWD_BWD = f"RL forward+backward T={WINDOW}"
TRAIN_GRAPHED = f"RL train window T={WINDOW}, WindowStep"

# mamba-rs (github.com/silvermpx/mamba-rs), d_model 128, 3 layers, f32: README "Per-step
# latency (default config)" and docs/mamba1-benchmarks.md ("GPU Inference synthetic", "CPU
# Parallel Training"). Its machine: Intel Xeon Gold 5412U (48 threads), RTX 6000 Ada.
MAMBA_RS_CPU = "Xeon Gold 5412U (mamba-rs)"
MAMBA_RS_GPU = "RTX 6000 Ada (mamba-rs)"
MAMBA_RS = [
    # (workload, mixer, device, batch or None where the source gives none, us, what)
    (STEP, "mamba1", "cpu", 1, 87.0, "CPU inference B=1"),
    (STEP, "mamba3", "cpu", 1, 65.0, "CPU inference B=1"),
    (STEP, "mamba1", "cuda", 1, 79.0, "GPU inference B=1, CUDA graph"),
    (STEP, "mamba3", "cuda", 1, 87.0, "GPU inference B=1, CUDA graph"),
    (STEP, "mamba1", "cuda", 16, 103.0, "GPU inference B=16, CUDA graph"),
    (STEP, "mamba1", "cuda", 64, 115.0, "GPU inference B=64, CUDA graph"),
    (FWD_BWD, "mamba1", "cuda", None, 1653.0, "GPU training forward+backward T=32"),
    (FWD_BWD, "mamba3", "cuda", None, 1784.0, "GPU training forward+backward T=32"),
    (FWD_BWD, "mamba1", "cpu", None, 14859.0, "CPU training forward+backward T=32"),
    (FWD_BWD, "mamba3", "cpu", None, 3635.0, "CPU training forward+backward T=32"),
    (TRAIN, "mamba1", "cpu", 16, 27808.0, "CPU parallel training T=32, B=16, 48 threads"),
    (TRAIN, "mamba1", "cpu", 64, 77400.0, "CPU parallel training T=32, B=64, 48 threads"),
]


def mamba_rs_reference() -> list[dict]:
    """mamba-rs's figures as records of the context (microseconds)."""
    return [
        {"workload": w, "mixer": m, "device": d, "batch": b, "us": us, "what": what,
         "machine": MAMBA_RS_CPU if d == "cpu" else MAMBA_RS_GPU}
        for w, m, d, b, us, what in MAMBA_RS
    ]  # fmt: skip


def reference_for(workload: str, mixer: str, device: str, batch: int) -> dict | None:
    """mamba-rs's figure for this row: the same batch, or batch 1 where its source gives
    no batch (a training figure: its README does not say)."""
    for w, m, d, b, us, what in MAMBA_RS:
        if (w, m, d) == (workload, mixer, device) and (b == batch or (b is None and batch == 1)):
            machine = MAMBA_RS_CPU if d == "cpu" else MAMBA_RS_GPU
            note = what if b is not None else f"{what} (batch not stated)"
            return {"mamba_rs_us": us, "mamba_rs_machine": machine, "mamba_rs_what": note}
    return None


def make_config(mixer: str) -> MambaConfig:
    return MambaConfig(d_model=D_MODEL, n_layers=N_LAYERS, input_dim=INPUT_DIM, mixer=mixer,
                       **MIXERS[mixer])  # fmt: skip


def shapes(cfg: MambaConfig) -> str:
    s = f"d_model={cfg.d_model} layers={cfg.n_layers} input_dim={cfg.input_dim} "
    s += f"d_state={cfg.d_state}"
    if cfg.mixer != "mamba1":
        s += f" headdim={cfg.headdim} heads={cfg.nheads}"
    return s


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def loop_seconds(fn, n: int, device: torch.device) -> float:
    """Wall time of n calls of fn, synchronised before the first and after the last."""
    sync(device)
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    sync(device)
    return time.perf_counter() - t0


def timed_rounds(fn, device, args, probe: int, lo: int, hi: int) -> tuple[list[float], int]:
    """(seconds per call of each round, calls per round): fn warmed up (the caller's), the
    calls per round chosen from `probe` calls to last about args.round_s, within [lo, hi]."""
    per_call = loop_seconds(fn, probe, device) / probe
    calls = max(lo, min(hi, round(args.round_s / max(per_call, 1e-9))))
    return [loop_seconds(fn, calls, device) / calls for _ in range(args.rounds)], calls


def spread(seconds: list[float], unit: str) -> dict:
    """median, p10, p90, min and max of per-call times, in `unit` ("us" or "ms")."""
    scale = {"us": 1e6, "ms": 1e3}[unit]
    v = sorted(s * scale for s in seconds)
    q = statistics.quantiles(v, n=10, method="inclusive") if len(v) > 1 else [v[0]] * 9
    return {f"median_{unit}": statistics.median(v), f"p10_{unit}": q[0], f"p90_{unit}": q[-1],
            f"min_{unit}": v[0], f"max_{unit}": v[-1]}  # fmt: skip


def graph_status(model) -> dict:
    try:
        from mambakit.inference import step_graph_status
    except ImportError:
        return {"graphs": [], "replays": 0, "reason": "no step_graph_status"}
    return step_graph_status(model)


def bench_step(model, mixer: str, B: int, device: torch.device, args) -> dict:
    torch.manual_seed(1)
    x = torch.randn(B, INPUT_DIM, device=device)  # [B, F]
    state = model.init_state(B)

    def call():
        y, _ = model.step(x, state)  # the state advances in place

    row = {"workload": STEP, "impl": "mambakit", "mixer": mixer, "device": device.type,
           "batch": B, "dtype": "f32", "shapes": shapes(model.config),
           "threads": torch.get_num_threads()}  # fmt: skip
    with torch.no_grad():
        for _ in range(args.warmup):
            call()
        before = graph_status(model)
        seconds, calls = timed_rounds(call, device, args, probe=STEP_PROBE, lo=10, hi=20000)
        status = graph_status(model)
        row.update(rounds=args.rounds, calls_per_round=calls, **spread(seconds, "us"))
        if device.type == "cpu":
            row["aten_ops_per_step"] = count_aten_ops(call)
        else:
            row["graph_replays"] = status["replays"] - before["replays"]  # of the timed_calls
            row["graph_cloned"] = status.get("cloned", 0) - before.get("cloned", 0)
            row["timed_calls"] = STEP_PROBE + calls * args.rounds
            row["graph_reason"] = status["reason"]
            row["kernels_per_eager_step"] = _eager_kernels(model, x, state, device)
    row.update(reference_for(STEP, mixer, device.type, B) or {})
    return row


def _eager_kernels(model, x, state, device) -> int | None:
    def eager():
        with torch.no_grad():
            model.step(x, state, cuda_graph=False)

    try:
        return count_kernels(eager, device)
    except TypeError:  # a step without the cuda_graph argument
        return None


def bench_window(model, mixer: str, B: int, device: torch.device, args) -> dict:
    torch.manual_seed(2)
    head = nn.Linear(D_MODEL, ACTIONS, device=device)
    # fused: one kernel a step, on the CPU as on CUDA (on 2 CPU cores the AdamW step alone,
    # no clip, takes 0.4-0.7 ms at this size against 2.1-2.9 for the default foreach one)
    opt = torch.optim.AdamW([*model.parameters(), *head.parameters()], lr=LR, fused=True)
    x = torch.randn(B, WINDOW, INPUT_DIM, device=device)  # [B, T, F]
    target = torch.randn(B, WINDOW, ACTIONS, device=device)
    carried = [model.init_state(B)]

    def window():
        out, state = model(x, carried[0])  # [B, T, M]
        loss = F.mse_loss(head(out), target)
        loss.backward()
        opt.step()
        opt.zero_grad()
        carried[0] = state.detach()  # the TBPTT boundary

    row = {"workload": TRAIN, "impl": "mambakit", "mixer": mixer, "device": device.type,
           "batch": B, "dtype": "f32", "shapes": shapes(model.config),
           "threads": torch.get_num_threads(),
           "loss": f"MSE of Linear({D_MODEL}, {ACTIONS}) on out, random target",
           "optimizer": f"torch.optim.AdamW(lr={LR}, fused=True)"}  # fmt: skip
    for _ in range(args.warmup_windows):
        window()
    probe = 1 if args.dry else 2
    seconds, calls = timed_rounds(window, device, args, probe=probe, lo=1, hi=2000)
    row.update(rounds=args.rounds, windows_per_round=calls, **spread(seconds, "ms"))
    if device.type == "cuda":
        row["kernels_per_window"] = count_kernels(window, device)
    row.update(reference_for(TRAIN, mixer, device.type, B) or {})
    return row


def bench_fwd_bwd(model, mixer: str, B: int, device: torch.device, args) -> dict:
    torch.manual_seed(2)
    head = nn.Linear(D_MODEL, ACTIONS, device=device)
    params = [*model.parameters(), *head.parameters()]
    x = torch.randn(B, WINDOW, INPUT_DIM, device=device)  # [B, T, F]
    target = torch.randn(B, WINDOW, ACTIONS, device=device)
    state = model.init_state(B)

    def fwd_bwd():
        out, _ = model(x, state)
        F.mse_loss(head(out), target).backward()
        for p in params:
            p.grad = None

    row = {"workload": FWD_BWD, "impl": "mambakit", "mixer": mixer, "device": device.type,
           "batch": B, "dtype": "f32", "shapes": shapes(model.config),
           "threads": torch.get_num_threads(),
           "loss": f"MSE of Linear({D_MODEL}, {ACTIONS}) on out, random target"}  # fmt: skip
    for _ in range(args.warmup_windows):
        fwd_bwd()
    seconds, calls = timed_rounds(fwd_bwd, device, args, probe=1 if args.dry else 2, lo=1,
                                  hi=2000)  # fmt: skip
    row.update(rounds=args.rounds, windows_per_round=calls, **spread(seconds, "ms"))
    row.update(reference_for(FWD_BWD, mixer, device.type, B) or {})
    return row


def bench_window_graphed(model, mixer: str, B: int, device: torch.device, args) -> dict:
    """The same window through `training.WindowStep` (on CUDA replayed whole from one CUDA
    graph), with AdamW(capturable=True), which a captured step needs."""
    torch.manual_seed(2)
    head = nn.Linear(D_MODEL, ACTIONS, device=device)
    capturable = device.type == "cuda"
    opt = torch.optim.AdamW([*model.parameters(), *head.parameters()], lr=LR,
                            capturable=capturable)  # fmt: skip
    inputs = {"x": torch.randn(B, WINDOW, INPUT_DIM, device=device),
              "y": torch.randn(B, WINDOW, ACTIONS, device=device)}  # fmt: skip

    def loss_fn(m, batch, state):
        out, final = m(batch["x"], state)
        return F.mse_loss(head(out), batch["y"]), final

    step = WindowStep(model, opt, loss_fn, B)

    def window():
        step(inputs)

    row = {"workload": TRAIN_GRAPHED, "impl": "mambakit", "mixer": mixer,
           "device": device.type, "batch": B, "dtype": "f32", "shapes": shapes(model.config),
           "threads": torch.get_num_threads(),
           "loss": f"MSE of Linear({D_MODEL}, {ACTIONS}) on out, random target",
           "optimizer": f"torch.optim.AdamW(lr={LR}, capturable={capturable})"}  # fmt: skip
    for _ in range(max(args.warmup_windows, 3)):  # past WindowStep's warm calls
        window()
    probe = 1 if args.dry else 2
    seconds, calls = timed_rounds(window, device, args, probe=probe, lo=1, hi=5000)
    row.update(rounds=args.rounds, windows_per_round=calls, **spread(seconds, "ms"))
    row["graph_reason"] = step.graph_reason
    row.update(reference_for(TRAIN, mixer, device.type, B) or {})
    return row


def cpu_jit_status() -> str:
    """Whether the compiled CPU paths (numba: the step, the Mamba-3 window) run here."""
    from mambakit.ops import cpu_jit

    if not cpu_jit.available():
        return "off: numba missing or unusable (the PyTorch bodies run)"
    import numba

    return f"numba {numba.__version__}"


def load_1m() -> float | None:
    """The host's 1-minute load average: other work on the CPU moves the CPU figures (with
    torch's threads spin-waiting, one busy core slows every thread)."""
    return round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None


def cpu_model_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def line(r: dict) -> str:
    """A figure in one line of the summary table."""
    unit = "us" if "median_us" in r else "ms"
    fig = f"{r[f'median_{unit}']:,.1f} {unit} ({r[f'p10_{unit}']:,.1f}, {r[f'p90_{unit}']:,.1f})"
    s = f"{r['device']:<4} {r['mixer']:<6} {r['workload']:<34} {r['batch']:<5} {fig:>36}"
    if "mamba_rs_us" in r:
        ref = r["mamba_rs_us"] / (1 if unit == "us" else 1e3)
        s += f"   {ref:,.1f} {unit} ({r['mamba_rs_what']}, {r['mamba_rs_machine']})"
    return s


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", choices=["cpu", "cuda", "both"], default=None,
                   help="default: cpu, and cuda too when present")  # fmt: skip
    p.add_argument("--mixers", nargs="+", choices=list(MIXERS), default=list(MIXERS))
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--round-s", type=float, default=0.25, help="seconds a round lasts")
    p.add_argument("--warmup", type=int, default=50, help="step calls before timing (>= 20)")
    p.add_argument("--warmup-windows", type=int, default=5)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads(N)")
    p.add_argument("--no-train", action="store_true", help="only the step")
    p.add_argument("--dry", action="store_true", help="tiny counts: a check of every path")
    p.add_argument("--out", default=None, help="write the results record (JSON) here")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    if args.threads is not None:
        if args.threads < 1:
            p.error("--threads must be at least 1")
        torch.set_num_threads(args.threads)
    if args.device is None:
        args.device = "both" if torch.cuda.is_available() else "cpu"
    if args.device != "cpu" and not torch.cuda.is_available():
        p.error(f"--device {args.device}: CUDA is not available")
    devices = {"cpu": ["cpu"], "cuda": ["cuda"], "both": ["cpu", "cuda"]}[args.device]
    if args.dry:
        args.rounds, args.round_s = min(args.rounds, 2), 0.005
        args.warmup_windows = min(args.warmup_windows, 1)
    args.warmup = max(args.warmup, 20)  # the CUDA step is captured after a few calls

    context = {
        "model": f"MambaBackbone d_model={D_MODEL} n_layers={N_LAYERS} input_dim={INPUT_DIM}",
        "mixers": {m: shapes(make_config(m)) for m in args.mixers},
        "window": WINDOW,
        "cpu_model": cpu_model_name(),
        "cpu_threads": torch.get_num_threads(),
        "cpu_jit": cpu_jit_status(),
        "load_1m_at_start": load_1m(),
        "threads_source": "--threads" if args.threads else "torch's count (left alone)",
        "rounds": args.rounds,
        "round_s": args.round_s,
        "warmup_steps": args.warmup,
        "cuda_matmul_tf32": torch.backends.cuda.matmul.allow_tf32,
        "dry": args.dry,
        "mamba_rs": {
            "source": "github.com/silvermpx/mamba-rs README (per-step latency, default "
            "config d_model 128, 3 layers) and docs/mamba1-benchmarks.md",
            "note": "another library on another machine (Xeon Gold 5412U, RTX 6000 Ada): "
            "context, not measured here; its training figures are forward+backward, "
            "beside our forward+backward rows (the train window rows add AdamW)",
            "figures": mamba_rs_reference(),
        },
    }
    record_device = "cuda" if "cuda" in devices else "cpu"
    rows: list[dict] = []

    def save() -> None:
        if args.out:
            record = make_record("bench_rl", rows, context=context, device=record_device)
            Path(args.out).write_text(json.dumps(record, indent=1, default=str) + "\n")

    print(f"threads: {torch.get_num_threads()} ({context['threads_source']}), "
          f"cpu: {context['cpu_model']}", flush=True)  # fmt: skip
    for dev_name in devices:
        device = torch.device(dev_name)
        models = {}
        for mixer in args.mixers:
            torch.manual_seed(0)
            models[mixer] = MambaBackbone(make_config(mixer), device=device)
        benches = [bench_step] + ([] if args.no_train else [bench_window, bench_fwd_bwd])
        if (device.type == "cuda" or args.dry) and not args.no_train:  # (dry: the path)
            benches.append(bench_window_graphed)
        for B in sorted(args.batches):  # every model's rows at a batch before a larger one
            for mixer, model in models.items():
                for bench in benches:
                    row = bench(model, mixer, B, device, args)
                    row["load_1m"] = load_1m()
                    rows.append(row)
                    print(row, flush=True)
                    save()
        del models
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print(f"\n{'dev':<4} {'mixer':<6} {'workload':<34} {'batch':<5} "
          f"{'median (p10, p90)':>36}   mamba-rs, another machine")  # fmt: skip
    for row in rows:
        print(line(row))
    if args.out:
        save()
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
