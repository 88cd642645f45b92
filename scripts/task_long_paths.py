"""A trained task model at long test lengths through several numerical paths, on the same rows:

    PYTHONPATH=src python scripts/task_long_paths.py CKPT induction-heads --lengths 65536 1048576

The rows are those `mambakit task` tests on (`evaluate_length`'s streams, generated on the
device), run chunk by chunk with the state carried through: the Triton kernels in f32 (what
the task command runs), the PyTorch reference in f32 and the reference in float64. For each
path: accuracy, the rows it gets wrong that float64 gets right, and the smallest margin
(target logit minus the best other logit) over scored positions, so an accuracy lost to
rounding over a million steps shows apart from one the model itself loses.
"""

import argparse

import torch
from task_paths import backend  # this script's folder is on sys.path

from mambakit.model import MambaLM
from mambakit.tasks import make_task
from mambakit.tasks.evaluate import SPLIT_TEST, stream_seed
from mambakit.tasks.generators import IGNORE, TaskStream


def margins(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Target logit minus the best other logit at each scored position ([n] f64)."""
    keep = targets != IGNORE
    lg, tg = logits[keep].double(), targets[keep]
    own = lg.gather(1, tg[:, None])[:, 0]
    other = lg.scatter(1, tg[:, None], float("-inf")).amax(1)
    return own - other


@torch.inference_mode()
def run_path(model, task, T, B, j, chunk_len):
    stream = TaskStream(task, B, T, stream_seed(SPLIT_TEST, 0, T, j), model.lm_head.weight.device)
    state, out = None, []
    for ids, targets in stream.chunks(chunk_len):
        hidden, state = model.backbone(ids, state)
        out.append(margins(model.lm_head(hidden), targets))
    return torch.cat(out).cpu()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("ckpt")
    p.add_argument("task")
    p.add_argument("--lengths", type=int, nargs="+", default=[65536, 262144, 1048576])
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--chunk-len", type=int, default=4096)
    p.add_argument("--device", default="cuda")
    a = p.parse_args()
    task = make_task(a.task)
    f32 = MambaLM.from_pretrained(a.ckpt).to(a.device).eval()
    f64 = MambaLM.from_pretrained(a.ckpt).to(a.device, torch.float64).eval()
    paths = {
        "triton f32": (f32, "triton"),
        "reference f32": (f32, "reference"),
        "reference f64": (f64, "reference"),
    }
    print(f"{a.ckpt}: {a.task}, {a.rows} rows per length, chunks of {a.chunk_len}", flush=True)
    for T in a.lengths:
        got = {}
        for name, (model, be) in paths.items():
            with backend(be):
                got[name] = torch.cat(
                    [
                        run_path(model, task, T, min(a.batch, a.rows - s), j, a.chunk_len)
                        for j, s in enumerate(range(0, a.rows, a.batch))
                    ]
                )
        exact = got["reference f64"]
        print(f"T {T}:", flush=True)
        for name, m in got.items():
            right = m > 0
            worse = int((~right & (exact > 0)).sum())
            print(
                f"  {name:14s} accuracy {right.double().mean().item():7.2%}  "
                f"wrong where f64 is right {worse:3d}  min margin {m.min().item():9.3f}  "
                f"max |margin - f64| {(m - exact).abs().max().item():.3e}",
                flush=True,
            )


if __name__ == "__main__":
    main()
