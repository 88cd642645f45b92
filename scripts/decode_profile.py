"""Where a decode step and an eager prefill spend GPU time: per-kernel tables (profiler).

For each preset (bf16, random weights): one eager `MambaLM.step` at each batch size
(kernels, GPU time per kernel, and the step's total against the time its weights take
to stream at the copy rate), then one eager prefill forward of 1 x 4096 tokens under
inference_mode, with mamba_ssm's prefill beside it when importable.

    python scripts/decode_profile.py --presets 130m 1.4b --batch 1 64 --out profile.txt
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from mambakit import MambaConfig, MambaLM

COPY_RATE = 4.27e12


def kernel_sequence(prof, first: int, count: int) -> list[str]:
    """Kernels `first` .. `first + count` in launch order, with their GPU times: one layer's
    kernels one by one, where the table above sums them by name."""
    events = [e for e in prof.events() if e.device_type.name == "CUDA"]
    events.sort(key=lambda e: e.time_range.start)
    return [
        f"  {e.name[:72]:<72} {e.self_device_time_total:>8.1f} us" for e in events[first:][:count]
    ]


def kernel_table(
    fn, title: str, rows: int = 25, sequence: tuple[int, int] | None = None, first: int = 0
) -> str:
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    n = sum(e.count for e in events)
    gpu_us = sum(e.self_device_time_total for e in events)
    lines = [f"== {title}: {n} kernels, {gpu_us:.1f} us of GPU time"]
    lines.append(f"{'kernel':<72} {'count':>6} {'total us':>9} {'avg us':>8}")
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:rows]:
        lines.append(
            f"{e.key[:72]:<72} {e.count:>6} {e.self_device_time_total:>9.1f} "
            f"{e.self_device_time_total / e.count:>8.2f}"
        )
    if first:
        lines.append(f"-- kernels 0.. ({first}) in launch order")
        lines += kernel_sequence(prof, 0, first)
    if sequence is not None:
        lines.append(f"-- kernels {sequence[0]}.. ({sequence[1]}) in launch order")
        lines += kernel_sequence(prof, *sequence)
    return "\n".join(lines)


def peer_model(cfg: MambaConfig, dtype):
    """mamba_ssm's Mamba-1 model of cfg's sizes (None for a Mamba-3 config or without it)."""
    if cfg.mixer != "mamba1":
        return None
    try:
        from mamba_ssm.models.config_mamba import MambaConfig as SSMConfig
        from mamba_ssm.models.mixer_seq_simple import MambaLMHeadModel
    except ImportError:
        return None
    c = SSMConfig(d_model=cfg.d_model, n_layer=cfg.n_layers, vocab_size=cfg.vocab_size, ssm_cfg={})
    return MambaLMHeadModel(c, device="cuda", dtype=dtype).eval()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--presets", nargs="+", default=["130m", "1.4b"])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--prefill", type=int, default=4096, help="0: no prefill profile")
    ap.add_argument("--first", type=int, default=0, help="the step's first kernels in order")
    ap.add_argument("--last-logits", nargs="*", default=[], metavar="RxN",
                    help="also the serving engine's prefill forward (`last_logits`: the state "
                         "and the last position's logits) of R rows of N tokens")  # fmt: skip
    ap.add_argument("--states-at", nargs="*", default=[], metavar="RxN",
                    help="also the packed prefill forward (`_states_at`: two prompts a row, 16 "
                         "kept steps a row) of R rows of N tokens, and `last_logits` of the "
                         "same rows with seq_idx, to set beside it")  # fmt: skip
    ap.add_argument("--out")
    args = ap.parse_args()
    out = []
    for name in args.presets:
        cfg = MambaConfig.preset(name)
        torch.manual_seed(0)
        model = MambaLM(cfg, device="cuda").to(torch.bfloat16).eval()
        wbytes = model.num_parameters() * 2
        out.append(f"##### {name}: {wbytes / 1e6:.0f} MB of bf16 weights, "
                   f"{wbytes / COPY_RATE * 1e6:.1f} us at the copy rate")  # fmt: skip
        for B in args.batch:
            state = model.init_state(B)
            tok = torch.randint(0, cfg.vocab_size, (B,), device="cuda")

            def step(model=model, state=state, tok=tok):
                with torch.inference_mode():
                    model.step(tok, state)

            # the last kernels: out_proj of the last block, then the LM head
            title = f"{name} eager step, batch {B}"
            out.append(kernel_table(step, title, sequence=(-3, 3), first=args.first))
            print(out[-1], flush=True)
        for shape in args.last_logits:
            r, n = map(int, shape.split("x"))
            ids = torch.randint(0, cfg.vocab_size, (r, n), device="cuda")

            def last(m=model, ids=ids):
                with torch.inference_mode():
                    m.last_logits(ids)

            title = f"{name} last_logits {r}x{n} (the engine's prefill forward, eager)"
            out.append(kernel_table(last, title, sequence=(0, 24)))
            print(out[-1], flush=True)
        for shape in args.states_at:
            r, n = map(int, shape.split("x"))
            ids = torch.randint(0, cfg.vocab_size, (r, n), device="cuda")
            seq = (torch.arange(n, device="cuda") >= n // 2).to(torch.int32).expand(r, n)
            seq = seq.contiguous()
            pos = torch.arange(n - 16, n, device="cuda").expand(r, 16).contiguous()
            pos[:, 0] = n // 2 - 1  # the first prompt's end

            def packed(m=model, ids=ids, pos=pos, seq=seq):
                with torch.inference_mode():
                    m._states_at(ids, pos, None, seq)

            def whole(m=model, ids=ids, seq=seq):
                with torch.inference_mode():
                    m.last_logits(ids, None, seq)

            for fn, what in ((whole, "last_logits"), (packed, "_states_at")):
                title = f"{name} {what} {r}x{n} with seq_idx (eager)"
                out.append(kernel_table(fn, title, rows=40))
                print(out[-1], flush=True)
        if not args.prefill:
            del model
            continue
        ids = torch.randint(0, cfg.vocab_size, (1, args.prefill), device="cuda")

        def prefill(m=model, ids=ids):
            with torch.inference_mode():
                m(ids)

        title = f"{name} eager prefill 1x{args.prefill} (mambakit)"
        out.append(kernel_table(prefill, title, sequence=(0, 24)))
        print(out[-1], flush=True)
        del model
        peer = peer_model(cfg, torch.bfloat16)
        if peer is not None:
            title = f"{name} prefill (mamba_ssm)"
            out.append(kernel_table(lambda p=peer: prefill(p), title, sequence=(0, 24)))
            print(out[-1], flush=True)
            del peer
        torch.cuda.empty_cache()
    if args.out:
        Path(args.out).write_text("\n\n".join(out) + "\n")


if __name__ == "__main__":
    main()
