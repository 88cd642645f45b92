"""A trained task model's accuracy through every execution path, against the CPU reference:

    PYTHONPATH=src python scripts/task_paths.py CKPT selective-copying --lengths 128 1024

For each test length (one batch of validation rows): the CPU reference; on the GPU the
Triton forward with and without autograd, the reference backend, the Triton forward
replayed from a CUDA graph, and f32 matmuls in TF32. Prints accuracy and the largest
logit difference from the CPU for each, so a path that disagrees stands out.
"""

import argparse
import contextlib
import os

import torch

from mambakit.model import MambaLM
from mambakit.tasks import TaskBatches, make_task
from mambakit.tasks.evaluate import SPLIT_VAL, count_correct


@contextlib.contextmanager
def backend(name):
    old = os.environ.get("MAMBAKIT_BACKEND")
    os.environ["MAMBAKIT_BACKEND"] = name
    try:
        yield
    finally:
        if old is None:
            del os.environ["MAMBAKIT_BACKEND"]
        else:
            os.environ["MAMBAKIT_BACKEND"] = old


def graphed(model, ids):
    static = ids.clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.no_grad(), torch.cuda.stream(s):
        for _ in range(2):
            model(static)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(g):
        out = model(static).logits
    static.copy_(ids)
    g.replay()
    return out.clone()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("ckpt")
    p.add_argument("task")
    p.add_argument("--lengths", type=int, nargs="+", default=[128, 1024, 4096])
    p.add_argument("--batch", type=int, default=16)
    a = p.parse_args()
    task = make_task(a.task)
    cpu = MambaLM.from_pretrained(a.ckpt).eval()
    gpu = MambaLM.from_pretrained(a.ckpt).cuda().eval()
    for T in a.lengths:
        b = TaskBatches(task, a.batch, T, seed=0, split=SPLIT_VAL).next()
        ids, tg = b["input_ids"], b["targets"]
        with torch.no_grad():
            ref = cpu(ids).logits.float()
        idc = ids.cuda()
        paths = {}
        with torch.no_grad():
            paths["triton no_grad"] = gpu(idc).logits
        paths["triton grad"] = gpu(idc).logits.detach()
        with torch.no_grad(), backend("reference"):
            paths["reference cuda"] = gpu(idc).logits
        paths["triton graph"] = graphed(gpu, idc)
        tf32 = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = True
        with torch.no_grad():
            paths["triton tf32"] = gpu(idc).logits
        torch.backends.cuda.matmul.allow_tf32 = tf32
        c, n = count_correct(ref, tg)
        print(f"T {T} B {a.batch}: cpu reference accuracy {int(c) / int(n):.3f}", flush=True)
        for name, lg in paths.items():
            lg = lg.float().cpu()
            c, n = count_correct(lg, tg)
            print(
                f"  {name:16s} accuracy {int(c) / int(n):.3f}  max |logits - cpu| "
                f"{(lg - ref).abs().max():.3e}",
                flush=True,
            )


if __name__ == "__main__":
    main()
