"""The benchmarks' results records (benchmarks/common.py) and the page made from them
(benchmarks/table.py -> docs/performance.md), on the CPU."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
FIELDS = {"schema", "benchmark", "date", "commit", "dirty", "device", "peer", "command",
          "context", "figures"}  # fmt: skip


def _load(name: str):
    """A benchmarks/ program as a module (benchmarks/ is not a package)."""
    spec = importlib.util.spec_from_file_location(
        f"benchmarks_{name}", ROOT / "benchmarks" / f"{name}.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


common = _load("common")
table = _load("table")
bench_rl = _load("bench_rl")


def test_a_record_on_the_cpu_describes_itself():
    figures = [{"workload": "w", "impl": "mambakit", "ms": 1.5}]
    rec = common.make_record("bench_x", figures, context={"k": 1}, device="cpu")
    assert set(rec) == FIELDS
    assert rec["schema"] == "mambakit-benchmark/1" and rec["benchmark"] == "bench_x"
    assert rec["figures"] == figures and rec["context"] == {"k": 1}
    datetime.strptime(rec["date"], "%Y-%m-%dT%H:%M:%SZ")  # UTC, ISO 8601
    dev = rec["device"]
    assert dev["name"] == "cpu" and dev["cuda"] is None and dev["torch"] == torch.__version__
    assert rec["peer"] is None or set(rec["peer"]) == {"mamba_ssm", "causal_conv1d"}
    assert rec["command"].startswith("python ")
    assert rec["dirty"] in (True, False, None)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                          capture_output=True, text=True)  # fmt: skip
    if head.returncode == 0:  # a checkout with its .git: the record names its commit
        assert rec["commit"] == head.stdout.strip()
    assert json.loads(json.dumps(rec)) == rec


def test_commit_comes_from_the_environment_without_git(tmp_path, monkeypatch):
    # a copy of the tree without .git (tmp_path), and a machine without git at all
    monkeypatch.setenv("MAMBAKIT_COMMIT", "abc1234")
    monkeypatch.setenv("MAMBAKIT_DIRTY", "1")
    assert common.source_state(tmp_path) == ("abc1234", True)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert common.source_state(ROOT) == ("abc1234", True)
    monkeypatch.delenv("MAMBAKIT_COMMIT")
    monkeypatch.delenv("MAMBAKIT_DIRTY")
    assert common.source_state(ROOT) == ("unknown", None)


def test_write_record(tmp_path):
    path = tmp_path / "r.json"
    common.write_record(str(path), "bench_x", [{"ms": 1.0}], device="cpu")
    assert json.loads(path.read_text())["figures"] == [{"ms": 1.0}]
    common.write_record(None, "bench_x", [])  # no --out: nothing written


def _record(name, date, commit, figures, device="NVIDIA H200", **context):
    return name, {"schema": "mambakit-benchmark/1", "benchmark": "bench_x", "date": date,
                  "commit": commit, "dirty": False, "device": {"name": device},
                  "peer": {"mamba_ssm": "2.3.2"}, "command": "python x.py",
                  "context": context, "figures": figures}  # fmt: skip


def _decode(impl, tps, us, batch=1, **extra):
    return {"workload": "130m decode 16+256", "impl": impl, "preset": "130m", "batch": batch,
            "tokens_per_s": tps, "us_per_token": us, **extra}  # fmt: skip


def _rl(workload, device, batch=1, **figures):
    return {"workload": workload, "impl": "mambakit", "mixer": "mamba1", "device": device,
            "batch": batch, "dtype": "f32", **figures}  # fmt: skip


@pytest.fixture
def results(tmp_path):
    folder = tmp_path / "results"
    folder.mkdir()
    records = [
        _record("old.json", "2026-01-01T00:00:00Z", "aaaaaaa",
                [_decode("mambakit cuda-graph", 1000.0, 900.0),
                 _decode("mamba_ssm cg=True", 500.0, 1900.0)]),
        _record("new.json", "2026-02-01T00:00:00Z", "bbbbbbb",
                [_decode("mambakit eager", 300.0, 3000.0),
                 _decode("mambakit cuda-graph", 4000.0, 240.0, bound_us_per_step=60.0),
                 _decode("mamba_ssm cg=True", 1600.0, 700.0)]),
        _record("cpu.json", "2026-03-01T00:00:00Z", "ccccccc",
                [_decode("mambakit eager", 50.0, 20000.0)], device="cpu"),
        _record("train.json", "2026-01-15T00:00:00Z", "ddddddd",
                [{"workload": "mambakit Trainer (default)", "batch": 8, "seqlen": 2048,
                  "step_ms": 66.0, "tokens_per_s": 248242.4, "peak_gib": 17.5, "mfu": 0.24,
                  "path": "cuda graph"},
                 {"workload": "mamba_ssm eager", "batch": 8, "seqlen": 2048, "step_ms": 99.0,
                  "tokens_per_s": 165494.9, "peak_gib": 18.0, "path": "eager"}],
                preset="130m"),
        _record("scan.json", "2026-01-20T00:00:00Z", "eeeeeee",
                [{"workload": "forward+backward", "impl": "mambakit", "dtype": "bfloat16",
                  "shape": {"batch": 8, "seqlen": 2048, "d_inner": 1536, "d_state": 16},
                  "time_ms": 1.28, "ratio_bytes": 0.1, "ratio_exp": 0.16, "bound_ms": 0.2},
                 {"workload": "forward+backward", "impl": "mamba_ssm", "dtype": "bfloat16",
                  "shape": {"batch": 8, "seqlen": 2048, "d_inner": 1536, "d_state": 16},
                  "time_ms": 2.24, "ratio_bytes": 0.06, "ratio_exp": 0.09, "bound_ms": 0.2}]),
        _record("m3.json", "2026-01-21T00:00:00Z", "fffffff",
                [{"workload": "Mamba3 layer forward+backward 8x2048", "impl": "mambakit",
                  "ms": 5.0, "peak_extra_mib": 1298},
                 {"workload": "Mamba3 layer forward+backward 8x2048", "impl": "mamba_ssm",
                  "ms": 6.0, "peak_extra_mib": 1041}],
                peer_autotune="full"),
        _record("rl.json", "2026-01-22T00:00:00Z", "1111111",
                [_rl("RL step", "cpu", median_us=410.0, p10_us=400.0, p90_us=450.0,
                     threads=16, aten_ops_per_step=98, mamba_rs_us=87.0,
                     mamba_rs_what="CPU inference B=1", mamba_rs_machine="Xeon (mamba-rs)"),
                 _rl("RL step", "cuda", median_us=30.0, p10_us=29.0, p90_us=31.0,
                     kernels_per_eager_step=120, graph_replays=990, timed_calls=1000,
                     graph_reason=None),
                 _rl("RL train window T=32", "cuda", median_ms=4.5, p10_ms=4.25, p90_ms=5.0,
                     kernels_per_window=700)],
                cpu_model="AMD EPYC"),
    ]  # fmt: skip
    for name, data in records:
        (folder / name).write_text(json.dumps(data))
    return folder


def _src(name, date, commit, device="NVIDIA H200"):
    return f"[{name}](../benchmarks/results/{name}) | {date} | {commit} | {device} |"


def test_table_rows_from_a_results_folder(results):
    page = table.render(table.load_records(results)).splitlines()
    # decode: the newest record of the workload, its peer beside it; ratios by hand
    speedup, of_roofline = 4000 / 1600, 100 * 60 / 240
    assert (
        f"| 130m | 16+256 | 1 | 4,000 | 240.0 | 300 | 1,600 | 700.0 | {speedup:.2f}x | "
        f"60.0 | {of_roofline:.0f}% | " + _src("new.json", "2026-02-01", "bbbbbbb")
    ) in page
    assert not any("1,000" in line for line in page)  # the older record's figure
    # the same workload on another device is its own row
    assert ("| 130m | 16+256 | 1 | — | — | 50 | — | — | — | — | — | "
            + _src("cpu.json", "2026-03-01", "ccccccc", "cpu")) in page  # fmt: skip
    speedup = 99.0 / 66.0
    assert (
        f"| 130m | 8x2048 | cuda graph | 66.00 | 248,242 | 24% | 17.50 | 99.00 | 18.00 | "
        f"{speedup:.2f}x | " + _src("train.json", "2026-01-15", "ddddddd")
    ) in page
    speedup = 2.24 / 1.28
    assert (
        f"| 8x2048x1536x16 | bfloat16 | forward+backward | 1.280 | 2.240 | {speedup:.2f}x | "
        f"0.200 | 16% | 10% | 16% | " + _src("scan.json", "2026-01-20", "eeeeeee")
    ) in page
    row = f"| Mamba3 | 8x2048 | forward+backward | 5.00 | 1,298 | 6.00 | 1,041 | {6 / 5:.2f}x | "
    assert row + "full | " + _src("m3.json", "2026-01-21", "fffffff") in page
    # bench_rl: one record, CPU and GPU rows, each on its own device; mamba-rs beside ours
    src = _src("rl.json", "2026-01-22", "1111111")
    assert (
        "| cpu (AMD EPYC) | mamba1 | RL step | 1 | 410.0 us | 400.0 – 450.0 us | 16 | "
        "98 aten ops | — | 87 us: CPU inference B=1, Xeon (mamba-rs) | " + src
    ) in page
    assert (
        "| NVIDIA H200 | mamba1 | RL step | 1 | 30.0 us | 29.0 – 31.0 us | — | "
        "120 kernels (eager) | 990 of 1000 | — | " + src
    ) in page
    assert ("| NVIDIA H200 | mamba1 | RL train window T=32 | 1 | 4.50 ms | 4.25 – 5.00 ms | — | "
            "700 kernels | — | — | " + src) in page  # fmt: skip
    # no other family takes a bench_rl row
    assert sum("rl.json" in line for line in page) == 4  # three rows and the records table


def test_table_is_idempotent_and_checks(results, tmp_path):
    out = tmp_path / "performance.md"
    assert table.main(["--results", str(results), "--out", str(out)]) == 0
    first = out.read_text()
    assert table.main(["--results", str(results), "--out", str(out)]) == 0
    assert out.read_text() == first
    assert table.main(["--results", str(results), "--out", str(out), "--check"]) == 0
    (results / "later.json").write_text(json.dumps(_record("later.json", "2026-04-01", "1234567",
        [_decode("mambakit cuda-graph", 4100.0, 230.0)])[1]))  # fmt: skip
    assert table.main(["--results", str(results), "--out", str(out), "--check"]) == 1


def test_the_rl_section_waits_for_a_record(results):
    records = [r for r in table.load_records(results) if r.file != "rl.json"]
    assert "## Small recurrent models (RL)" not in table.render(records)
    assert "## Small recurrent models (RL)" in table.render(table.load_records(results))


def test_bench_rl_spread_and_reference():
    s = bench_rl.spread([3e-6, 1e-6, 2e-6, 5e-6, 4e-6], "us")
    assert s["median_us"] == pytest.approx(3.0) and s["min_us"] == pytest.approx(1.0)
    assert s["max_us"] == pytest.approx(5.0)
    assert 1.0 < s["p10_us"] < 2.0 and 4.0 < s["p90_us"] < 5.0
    assert bench_rl.spread([2e-3], "ms")["p90_ms"] == pytest.approx(2.0)  # one round
    ref = bench_rl.reference_for(bench_rl.STEP, "mamba3", "cpu", 1)
    assert ref["mamba_rs_us"] == 65.0 and "Xeon" in ref["mamba_rs_machine"]
    assert bench_rl.reference_for(bench_rl.STEP, "mamba2", "cpu", 1) is None
    assert bench_rl.reference_for(bench_rl.STEP, "mamba1", "cpu", 16) is None
    assert bench_rl.reference_for(bench_rl.STEP, "mamba1", "cuda", 64)["mamba_rs_us"] == 115.0
    # mamba-rs's training figures time forward + backward: they stand beside that row
    fb = bench_rl.reference_for(bench_rl.FWD_BWD, "mamba1", "cuda", 1)  # no batch given: B=1
    assert fb["mamba_rs_us"] == 1653.0 and "batch not stated" in fb["mamba_rs_what"]
    assert bench_rl.reference_for(bench_rl.FWD_BWD, "mamba1", "cuda", 16) is None
    assert bench_rl.reference_for(bench_rl.TRAIN, "mamba1", "cuda", 1) is None


def test_bench_rl_writes_a_record_the_table_reads(tmp_path):
    # the smallest run of the program on the CPU: one mixer, batch 1, one round
    folder = tmp_path / "results"
    folder.mkdir()
    out = folder / "rl.json"
    args = ["--dry", "--device", "cpu", "--mixers", "mamba1", "--batches", "1", "--rounds", "1",
            "--out", str(out)]  # fmt: skip
    assert bench_rl.main(args) == 0
    rec = json.loads(out.read_text())
    assert set(rec) == FIELDS and rec["benchmark"] == "bench_rl"
    step, window, fwd_bwd, graphed = rec["figures"]  # (WindowStep runs eagerly on a CPU)
    assert (step["workload"], window["workload"]) == (bench_rl.STEP, bench_rl.TRAIN)
    assert fwd_bwd["workload"] == bench_rl.FWD_BWD and fwd_bwd["median_ms"] > 0
    assert fwd_bwd["mamba_rs_us"] == 14859.0
    assert graphed["workload"] == bench_rl.TRAIN_GRAPHED and graphed["median_ms"] > 0
    assert graphed["graph_reason"] == "not on a CUDA device"
    assert step["median_us"] > 0 and step["aten_ops_per_step"] > 0 and window["median_ms"] > 0
    assert step["threads"] == torch.get_num_threads() and step["mamba_rs_us"] == 87.0
    assert rec["context"]["mamba_rs"]["figures"]
    page = table.render(table.load_records(folder))
    assert "| mamba1 | RL step | 1 |" in page and "| mamba1 | RL train window T=32 | 1 |" in page
    assert "| mamba1 | RL forward+backward T=32 | 1 |" in page


def test_a_file_that_is_not_a_record_is_refused(tmp_path):
    (tmp_path / "x.json").write_text(json.dumps({"meta": {}, "records": []}))
    with pytest.raises(ValueError, match="x.json"):
        table.load_records(tmp_path)


def test_the_committed_page_is_made_from_the_committed_records():
    assert table.main(["--check"]) == 0, "run: python benchmarks/table.py"


def test_kernel_roofline_reads_the_profile_and_bounds_each_group():
    """kernel_roofline on a profiler table in bench_model's format: every row read (the
    header's step total beyond them as "the rest"), the kernels grouped by name (the scan's
    `_bwd_kernel` apart from the other backward kernels), and a group's bound the closed
    form of its bytes at the copy rate (RMSNorm forward: 12 bytes a token and channel)."""
    kr = _load("kernel_roofline")
    text = "\n".join([
        "one eager step: 9 GPU kernels/copies, 2.500 ms of GPU time",
        "-" * 40,
        "Name    Self CPU %      Self CPU   CPU total %     CPU total  CPU time avg     "
        "Self CUDA   Self CUDA %    CUDA total  CUDA time avg    # of Calls",
        "-" * 40,
        "_bwd_kernel  0.00%  0.000us  0.00%  0.000us  0.000us  1.200ms  48.00%  1.200ms  "
        "600.000us  2",
        "_conv_bwd_kernel  0.00%  0.000us  0.00%  0.000us  0.000us  300.000us  12.00%  "
        "300.000us  150.000us  2",
        "_rms_fwd_kernel  0.00%  0.000us  0.00%  0.000us  0.000us  200.000us  8.00%  "
        "200.000us  66.667us  3",
        "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT  0.00%  0.000us  0.00%  0.000us  "
        "0.000us  700.000us  28.00%  700.000us  700.000us  1",
        "-" * 40,
        "Self CPU time total: 1.000ms",
        "Self CUDA time total: 2.400ms",
    ])  # fmt: skip
    rows, total, count = kr.parse_profile(text)
    assert rows == [("_bwd_kernel", pytest.approx(1.2), 2),
                    ("_conv_bwd_kernel", pytest.approx(0.3), 2),
                    ("_rms_fwd_kernel", pytest.approx(0.2), 3),
                    ("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT", pytest.approx(0.7),
                     1)]  # fmt: skip
    assert (total, count) == (2.5, 9)
    cfg = kr.MambaConfig.preset("130m")
    figs = {f["group"]: f for f in kr.kernel_figures(rows, cfg, 2, 64, 700.0, 10**8, "130m",
                                                     total, count)}  # fmt: skip
    assert [g for g in figs] == ["scan backward", "conv backward", "rmsnorm forward", "GEMM",
                                 "the rest", "all"]  # fmt: skip
    rms = figs["rmsnorm forward"]
    want = 3 * 2 * 64 * 12 * cfg.d_model / kr.COPY * 1e3  # three calls
    assert rms["calls"] == 3 and rms["bound_ms"] == pytest.approx(want)
    assert rms["of_bound"] == pytest.approx(want / 0.2)
    assert abs(figs["the rest"]["ms"] - 0.1) < 1e-9 and figs["the rest"]["calls"] == 1
    assert figs["all"]["ms"] == 2.5 and figs["all"]["calls"] == 9
