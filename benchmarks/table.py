"""docs/performance.md from the results records under benchmarks/results/.

    python benchmarks/table.py            # writes docs/performance.md
    python benchmarks/table.py --check    # exit status 1 when docs/performance.md is stale

Each benchmark program writes one record with `--out` (benchmarks/common.py lists its
fields); copy the record into benchmarks/results/ as DATE-WHAT.json and rerun this. The
page has one table per workload family (training step, decode, prefill, selective scan,
Mamba-3 layer). A table row is one workload on one device, taken from the newest record
that measured mambakit on it (ordered by `date`; records of one date by file name), and
every figure of the row comes from that record, so mambakit and the peer beside it ran in
the same process. The output depends on the records alone: running it twice gives the
same file.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import textwrap
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
PAGE = REPO / "docs" / "performance.md"
sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernel_roofline import GROUPS as KERNEL_GROUPS  # noqa: E402

PRESETS = ["tiny", "130m", "370m", "790m", "1.4b", "2.8b", "tiny-mamba3", "130m-mamba3"]
DASH = "—"


@dataclass(frozen=True)
class Record:
    file: str  # the file's name under the results folder
    data: dict

    @property
    def device(self) -> str:
        return (self.data.get("device") or {}).get("name", "unknown")

    def sort_key(self) -> tuple[str, str]:
        return str(self.data.get("date", "")), self.file


def load_records(folder: Path) -> list[Record]:
    """Every *.json under folder, oldest first; a file that is not a record is an error."""
    records = []
    for path in sorted(folder.glob("*.json")):
        data = json.loads(path.read_text())
        if not isinstance(data, dict) or not isinstance(data.get("figures"), list):
            raise ValueError(f"{path}: not a results record (no 'figures' list)")
        records.append(Record(path.name, data))
    return sorted(records, key=Record.sort_key)


# --- reading rows: which family, workload and implementation each figure belongs to --------


def _impl(row: dict) -> str:
    """'mambakit' or the peer's package name, from a row's impl or workload label."""
    label = str(row.get("impl") or row.get("workload", ""))
    for peer in ("mamba_ssm", "transformers", "reference"):
        if label.startswith(peer):
            return peer
    return "mambakit"


def _preset(row: dict, record: Record) -> str:
    return str(row.get("preset") or record.data.get("context", {}).get("preset") or "?")


def training_rows(row: dict, record: Record) -> Iterator[tuple[tuple, str]]:
    """bench_model, bench_mamba2 and bench_mamba3: one optimizer step of a preset (a probe's
    steps at launch parameters other than the library's, such as save_tiles_probe's, are
    not the default path)."""
    if "step_ms" not in row or "seqlen" not in row:  # (bench_serve's decode rows have no seqlen)
        return
    if str(record.data.get("benchmark", "")).endswith("_probe"):
        return
    shape = f"{row['batch']}x{row['seqlen']}"
    base = (record.device, _preset(row, record), shape)
    if _impl(row) == "mambakit":
        path = "eager" if "eager" in row["workload"] else "default"
        yield (*base, path), "mambakit"
    else:  # the peer's one eager step stands beside each of mambakit's paths
        for path in ("default", "eager"):
            yield (*base, path), _impl(row)


def decode_rows(row: dict, record: Record) -> Iterator[tuple[tuple, str]]:
    """bench_decode, bench_mamba2 and bench_mamba3: tokens/s of greedy generation."""
    match = re.search(r"decode (\d+\+\d+)", str(row.get("workload", "")))
    if match is None or "tokens_per_s" not in row:
        return
    impl = _impl(row)
    if impl == "mambakit":
        impl = "eager" if "eager" in str(row.get("impl", "")) else "graph"
    yield (record.device, _preset(row, record), match[1], row["batch"]), impl


def prefill_rows(row: dict, record: Record) -> Iterator[tuple[tuple, str]]:
    """bench_decode's `last_logits` prefill; bench_model's and bench_mamba3's full forward."""
    if "prefill_graph_ms" in row or "prefill_eager_ms" in row:
        what, shape = "forward, every logit", row.get("prefill_shape", "1x4096")
    elif "prefill" in str(row.get("workload", "")) and "graph_ms" in row:
        what, shape = "last_logits", str(row["workload"]).split()[-1]
    else:
        return
    yield (record.device, _preset(row, record), shape, what), _impl(row)


def scan_rows(row: dict, record: Record) -> Iterator[tuple[tuple, str]]:
    """bench_scan: the selective scan op alone."""
    s = row.get("shape")
    if not isinstance(s, dict) or "ratio_exp" not in row:
        return
    shape = f"{s['batch']}x{s['seqlen']}x{s['d_inner']}x{s['d_state']}"
    yield (record.device, shape, row["dtype"], row["workload"]), _impl(row)


def layer_rows(row: dict, record: Record) -> Iterator[tuple[tuple, str]]:
    """bench_mamba2 and bench_mamba3: one layer beside upstream's module, the same weights."""
    match = re.fullmatch(r"(Mamba[23]) layer (\S+) (\d+x\d+)", str(row.get("workload", "")))
    if match is None or "impl" not in row or "ms" not in row:
        return
    yield (record.device, match[1], match[3], match[2]), _impl(row)


def kernel_rows(row: dict, record: Record) -> Iterator[tuple[tuple, str]]:
    """kernel_roofline: one training step's kernels by group, against their roofline."""
    if row.get("workload") != "training step by kernel":
        return
    order = [g for g, *_ in KERNEL_GROUPS] + ["the rest", "all"]
    group = row["group"]
    rank = order.index(group) if group in order else len(order)
    yield (record.device, _preset(row, record), f"{row['batch']}x{row['seqlen']}", rank,
           group), "mambakit"  # fmt: skip


def rl_rows(row: dict, record: Record) -> Iterator[tuple[tuple, str]]:
    """bench_rl: the step and the training window of a small float-input backbone, on the
    CPU or the GPU of the record (a row names its own device: one record holds both)."""
    workload = str(row.get("workload", ""))
    if not workload.startswith("RL ") or "mixer" not in row:
        return
    if "median_us" not in row and "median_ms" not in row:
        return
    if row.get("device") == "cpu":
        cpu = record.data.get("context", {}).get("cpu_model")
        device = f"cpu ({cpu})" if cpu else "cpu"
    else:
        device = record.device
    yield (device, row["mixer"], workload, row["batch"]), _impl(row)


@dataclass
class Chosen:
    record: Record
    rows: dict[str, dict]  # implementation -> its row in that record


def choose(records: list[Record], classify: Callable) -> dict[tuple, Chosen]:
    """{workload key: the newest record with a mambakit row for it, and that record's rows}."""
    chosen: dict[tuple, Chosen] = {}
    for record in records:  # oldest first: a newer record replaces an older one
        found: dict[tuple, dict[str, dict]] = {}
        for row in record.data["figures"]:
            for key, impl in classify(row, record):
                found.setdefault(key, {})[impl] = row  # the last row of an impl counts
        for key, rows in found.items():
            if any(impl not in ("mamba_ssm", "transformers", "reference") for impl in rows):
                chosen[key] = Chosen(record, rows)
    return chosen


def _order(key: tuple) -> tuple:
    """Table order: device, then presets by size, then the rest as numbers where numeric."""

    def part(v):
        if v in PRESETS:
            return (0, PRESETS.index(v), "")
        if isinstance(v, int | float):
            return (1, v, "")
        return (2, 0, str(v))

    return tuple(part(v) for v in key)


# --- formatting ---------------------------------------------------------------------------


def num(value, digits: int = 2) -> str:
    """A figure, or the row's own words where it has no number ('n/a (...)'), or a dash."""
    if isinstance(value, bool) or value is None:
        return DASH
    if isinstance(value, int | float):
        return f"{value:,.{digits}f}"
    return str(value)


def ratio(a, b) -> str:
    """a / b as 'N.NNx' when both are numbers."""
    ok = all(isinstance(v, int | float) and not isinstance(v, bool) for v in (a, b))
    return f"{a / b:.2f}x" if ok and b else DASH


def percent(a, b) -> str:
    ok = all(isinstance(v, int | float) and not isinstance(v, bool) for v in (a, b))
    return f"{100 * a / b:.0f}%" if ok and b else DASH


def source(record: Record) -> list[str]:
    """The cells citing a row's record: file, date, commit, device."""
    data = record.data
    commit = str(data.get("commit", "unknown")) + (" (dirty)" if data.get("dirty") else "")
    link = f"[{record.file}](../benchmarks/results/{record.file})"
    return [link, str(data.get("date", ""))[:10], commit, record.device]


SOURCE_COLUMNS = ["record", "date", "commit", "device"]


def markdown_table(columns: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cells) + " |" for cells in rows]
    return lines


# --- the tables: per family, its columns and the cells of one workload ---------------------


def training_cells(key: tuple, c: Chosen) -> list[str]:
    _, preset, shape, path = key
    ours, peer = c.rows.get("mambakit", {}), c.rows.get("mamba_ssm", {})
    ms, peer_ms = ours.get("step_ms"), peer.get("step_ms")
    pruned = " (autotune pruned)" if peer.get("peer_autotune") and peer_ms is not None else ""
    return [preset, shape, ours.get("path") or path, num(ms), num(ours.get("tokens_per_s"), 0),
            percent(ours.get("mfu"), 1), num(ours.get("peak_gib")), num(peer_ms) + pruned,
            num(peer.get("peak_gib")), ratio(peer_ms, ms)]  # fmt: skip


def decode_cells(key: tuple, c: Chosen) -> list[str]:
    _, preset, prompt_new, batch = key
    graph, eager, peer = (c.rows.get(i, {}) for i in ("graph", "eager", "mamba_ssm"))
    tps, us = graph.get("tokens_per_s"), graph.get("us_per_token", graph.get("us_per_step"))
    bound = graph.get("bound_us_per_step", eager.get("bound_us_per_step"))
    return [preset, prompt_new, str(batch), num(tps, 0), num(us, 1),
            num(eager.get("tokens_per_s"), 0), num(peer.get("tokens_per_s"), 0),
            num(peer.get("us_per_token"), 1), ratio(tps, peer.get("tokens_per_s")),
            num(bound, 1), percent(bound, us)]  # fmt: skip


def prefill_cells(key: tuple, c: Chosen) -> list[str]:
    _, preset, shape, what = key
    prefix = "prefill_" if what.startswith("forward") else ""  # bench_model's field names
    ours, peer = c.rows.get("mambakit", {}), c.rows.get("mamba_ssm", {})
    eager, graph = (f"{prefix}{mode}_ms" for mode in ("eager", "graph"))
    return [preset, shape, what, num(ours.get(eager)), num(ours.get(graph)),
            num(peer.get(eager)), num(peer.get(graph)), ratio(peer.get(eager), ours.get(eager)),
            ratio(peer.get(graph), ours.get(graph))]  # fmt: skip


def scan_cells(key: tuple, c: Chosen) -> list[str]:
    _, shape, dtype, what = key
    ours, peer = c.rows.get("mambakit", {}), c.rows.get("mamba_ssm", {})
    ms, bound = ours.get("time_ms"), ours.get("bound_ms")
    return [shape, dtype, what, num(ms, 3), num(peer.get("time_ms"), 3),
            ratio(peer.get("time_ms"), ms), num(bound, 3), percent(bound, ms),
            percent(ours.get("ratio_bytes"), 1), percent(ours.get("ratio_exp"), 1)]  # fmt: skip


def layer_cells(key: tuple, c: Chosen) -> list[str]:
    _, mixer, shape, what = key
    ours, peer = c.rows.get("mambakit", {}), c.rows.get("mamba_ssm", {})
    tune = c.record.data.get("context", {}).get("peer_autotune") if peer else None
    return [mixer, shape, what, num(ours.get("ms")), num(ours.get("peak_extra_mib"), 0),
            num(peer.get("ms")), num(peer.get("peak_extra_mib"), 0),
            ratio(peer.get("ms"), ours.get("ms")), tune or DASH]  # fmt: skip


def _times(row: dict, *keys: str) -> list[str]:
    """Times of a bench_rl row (median, p10, ...) as numbers and their unit: microseconds
    for a step, ms for a window; dashes where the row has none."""
    for unit, digits in (("us", 1), ("ms", 2)):
        if f"median_{unit}" in row:
            return [num(row.get(f"{key}_{unit}"), digits) for key in keys] + [unit]
    return [DASH] * len(keys) + [""]


def kernel_cells(key: tuple, c: Chosen) -> list[str]:
    device, preset, shape, _, group = key
    row = c.rows["mambakit"]
    bound = DASH
    if "bound_ms" in row:
        bound = f"{row['bound_ms']:,.2f} ({row['bound']})"
        if row["group"] == "all":
            bound = f"{row['bound_ms']:,.2f} (every group at its bound)"
    share = f"{100 * row['share']:.1f}%"
    return [preset, shape, group, row.get("what", ""), str(row["calls"]), num(row["ms"]), share,
            bound, percent(row.get("bound_ms"), row["ms"])]  # fmt: skip


def rl_cells(key: tuple, c: Chosen) -> list[str]:
    device, mixer, workload, batch = key
    ours = c.rows.get("mambakit", {})
    if "aten_ops_per_step" in ours:
        ops = f"{ours['aten_ops_per_step']} aten ops"
    elif ours.get("kernels_per_eager_step") is not None:
        ops = f"{ours['kernels_per_eager_step']} kernels (eager)"
    elif ours.get("kernels_per_window") is not None:
        ops = f"{ours['kernels_per_window']} kernels"
    else:
        ops = DASH
    graph = DASH
    if "graph_replays" in ours:
        graph = f"{ours['graph_replays']} of {ours.get('timed_calls', '?')}"
        if ours.get("graph_reason"):
            graph += f" ({ours['graph_reason']})"
    ref = DASH
    if isinstance(ours.get("mamba_rs_us"), int | float):
        us, unit = ours["mamba_rs_us"], "ms" if "median_ms" in ours else "us"
        value = f"{us / 1e3:,.2f} ms" if unit == "ms" else f"{us:,.0f} us"
        ref = f"{value}: {ours.get('mamba_rs_what', '')}, {ours.get('mamba_rs_machine', '')}"
    threads = str(ours["threads"]) if device.startswith("cpu") and "threads" in ours else DASH
    median, p10, p90, unit = _times(ours, "median", "p10", "p90")
    return [device, mixer, workload, str(batch), f"{median} {unit}".strip(),
            f"{p10} – {p90} {unit}".strip(), threads, ops, graph, ref]  # fmt: skip


@dataclass(frozen=True)
class Family:
    title: str
    text: str  # what the table measures, under its title
    program: str  # the benchmark program that writes its records
    classify: Callable  # (row, record) -> (workload key, implementation) pairs
    columns: str  # " | "-separated, before the source columns
    cells: Callable  # (key, Chosen) -> the cells of those columns
    optional: bool = False  # left off the page until a record has a row of it

    def table(self, records: list[Record]) -> list[str]:
        chosen = sorted(choose(records, self.classify).items(), key=lambda kv: _order(kv[0]))
        rows = [self.cells(key, c) + source(c.record) for key, c in chosen]
        return markdown_table(self.columns.split(" | ") + SOURCE_COLUMNS, rows)


FAMILIES = [
    Family("Training step", "One optimizer step (forward, loss, backward, clipping, fused "
           "AdamW; f32 weights under bf16 autocast), timed from the host over several steps. "
           "mambakit's default path replays the step from a CUDA graph; `mamba_ssm` runs its "
           "`MambaLMHeadModel` eagerly (for 130m-mamba2 and 130m-mamba3, with its Mamba2 or "
           "Mamba3 layer). MFU: 6 x parameters x tokens/s over the bf16 matmul rate measured "
           "in the same run.",
           "bench_model.py", training_rows,
           "preset | batch x seqlen | mambakit path | ms / step | tokens/s | MFU | peak GiB | "
           "mamba_ssm ms / step | mamba_ssm peak GiB | speedup", training_cells),
    Family("Training step by kernel", "One eager training step's GPU kernels (the "
           "profiler's table of `bench_model.py --profile`, in `benchmarks/results/profiles/`) "
           "grouped by what they do, against what that work must cost on the H200 "
           "(`benchmarks/kernel_roofline.py`): bytes moved once at the copy rate, the scan's "
           "exponentials at the exp2 rate, GEMM FLOPs at the bf16 matmul rate of the same "
           "run, whichever is largest; \"of bound\" is that over the measured time. The "
           "bytes are the kernels' inputs and outputs as the library lays them out (bf16 "
           "activations, f32 delta, the scan's state saved every 4 steps, or every 32 at "
           "d_inner 4096 and up with a replay rebuilding the rest per layer, dB and dC "
           "partials per backward program's channels, 8 or 16 from d_inner 4096): a "
           "kernel's own design shows in them, so 100% is the "
           "bound of this design, and a design that saves less sets a lower one. Records "
           "from an H100 are held to the H200's rates, so their \"of bound\" reads low.",
           "kernel_roofline.py", kernel_rows,
           "preset | batch x seqlen | group | what | calls | ms | share | bound ms | "
           "of bound", kernel_cells, optional=True),
    Family("Decode", "Greedy generation after a short prompt (bf16, random weights): "
           "mambakit `generate` with and without CUDA graphs, `mamba_ssm` "
           "`generate(cg=True)`; us / step is the time per decode step after the prefill.",
           "bench_decode.py", decode_rows,
           "preset | prompt + new | batch | tokens/s (graph) | us / step (graph) | "
           "tokens/s (eager) | mamba_ssm tokens/s (cg) | mamba_ssm us / step | speedup | "
           "roofline us / step | of roofline", decode_cells),
    Family("Prefill", "One forward over 1 x T prompt tokens (bf16): `last_logits` runs the "
           "final norm and the head on the last position only (as `generate` does; "
           "`mamba_ssm` with `num_last_tokens=1`), \"forward, every logit\" the whole model. "
           "Eager and replayed from a CUDA graph.", "bench_decode.py", prefill_rows,
           "preset | shape | what | eager ms | graph ms | mamba_ssm eager ms | "
           "mamba_ssm graph ms | speedup eager | speedup graph", prefill_cells),
    Family("Selective scan", "The scan op alone (`mamba_ssm`'s `selective_scan_fn` beside "
           "it), median time.", "bench_scan.py", scan_rows,
           "B x T x D x N | dtype | pass | ms | mamba_ssm ms | speedup | roofline ms | "
           "of roofline | of copy bound | of exp2 bound", scan_cells),
    Family("Mamba-2 and Mamba-3 layers", "The 130m-mamba2 and 130m-mamba3 layers (d_model "
           "768, d_state 128, headdim 64, bf16) beside `mamba_ssm.modules.mamba2.Mamba2` and "
           "`mamba_ssm.modules.mamba3.Mamba3` with the same weights, timed in turns. With "
           "upstream's autotune cut to one configuration per kernel (`--prune-peer`) its "
           "figure is a quick check, not its best speed.",
           "bench_mamba2.py, bench_mamba3.py", layer_rows,
           "mixer | B x T | pass | ms | peak extra MiB | mamba_ssm ms | "
           "mamba_ssm peak extra MiB | speedup | mamba_ssm autotune", layer_cells),
    Family("Small recurrent models (RL)", "A float-input backbone as RL and control code "
           "runs it (d_model 128, 3 layers, input 64, f32): `model.step(x, state)` under "
           "no_grad with the state carried in place (on CUDA the library replays it from a "
           "CUDA graph; \"graph replays\" counts the timed calls that did), and a T = 32 "
           "training window (forward from the carried, detached state, an MSE loss of a "
           "linear head, backward, AdamW step, zero_grad). Median and p10 – p90 over rounds; "
           "the CPU with torch's own thread count. The mamba-rs column is that library's "
           "published figure for the same size on another machine (Xeon Gold 5412U, RTX "
           "6000 Ada; its training figures are forward + backward only): context, not a "
           "measurement of the same run.",
           "bench_rl.py", rl_rows,
           "device | mixer | workload | batch | median | p10 – p90 | threads | ops per call | "
           "graph replays | mamba-rs (another machine)", rl_cells, optional=True),
]  # fmt: skip


def records_table(records: list[Record]) -> list[str]:
    cols = [
        "record",
        "benchmark",
        "date",
        "commit",
        "device",
        "torch / Triton / CUDA",
        "peer",
        "command",
    ]
    rows = []
    for r in sorted(records, key=lambda r: r.file):
        d, dev = r.data, r.data.get("device") or {}
        versions = " / ".join(str(dev.get(k) or DASH) for k in ("torch", "triton", "cuda"))
        peer = ", ".join(f"{k} {v}" for k, v in (d.get("peer") or {}).items() if v) or DASH
        command = f"`{d['command']}`" if d.get("command") else DASH
        commit = str(d.get("commit", "unknown")) + (" (dirty)" if d.get("dirty") else "")
        rows.append(
            [
                f"[{r.file}](../benchmarks/results/{r.file})",
                str(d.get("benchmark")),
                str(d.get("date", "")),
                commit,
                r.device,
                versions,
                peer,
                command,
            ]
        )
    return markdown_table(cols, rows)


INTRO = """\
# Performance

Made by `python benchmarks/table.py` from the results records in
[`benchmarks/results/`](../benchmarks/results/), which the benchmark programs write with
`--out` (`benchmarks/common.py` lists the fields); do not edit it by hand. A row is one
workload on one device, from the newest record that measured mambakit on it, and every
figure in the row comes from that record: mambakit and `mamba_ssm` ran in the same process
on the same device. **speedup** is `mamba_ssm`'s time over mambakit's (mambakit's tokens/s
over `mamba_ssm`'s for decode): above 1, mambakit is faster. A dash: the record has no
such figure.

Roofline on the H200 (measured: device-to-device copy 4.27 TB/s, `tl.math.exp2`
4.0e12/s). A decode step must stream every weight once and read and write the recurrent
state: those bytes at the copy rate are its roofline. The selective scan must move its
inputs and outputs once and evaluate one exponential per (token, channel, state), twice
with the backward's recomputation: its roofline is the larger of the two times; "of
roofline" is that bound over the measured time (100% = at the bound).
"""


def render(records: list[Record]) -> str:
    lines = [INTRO]
    for family in FAMILIES:
        body = family.table(records)
        if len(body) == 2 and family.optional:  # the header alone: no section yet
            continue
        lines += [f"## {family.title}", "", textwrap.fill(family.text, 90), ""]
        if len(body) == 2:
            body = [f"No record has this workload yet: `python benchmarks/{family.program} "
                    "--out benchmarks/results/DATE-WHAT.json` on a GPU writes one."]  # fmt: skip
        lines += body + [""]
    lines += ["## Records", "", "Every record in `benchmarks/results/`.", ""]
    lines += records_table(records) + [""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--results", type=Path, default=RESULTS, help="folder of records")
    p.add_argument("--out", type=Path, default=PAGE, help="the page to write")
    p.add_argument("--check", action="store_true", help="only say whether --out is current")
    args = p.parse_args(argv)
    text = render(load_records(args.results))
    if args.check:
        current = args.out.exists() and args.out.read_text() == text
        print(f"{args.out}: {'current' if current else 'out of date: run benchmarks/table.py'}")
        return 0 if current else 1
    args.out.write_text(text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
