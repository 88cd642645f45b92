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


def test_a_file_that_is_not_a_record_is_refused(tmp_path):
    (tmp_path / "x.json").write_text(json.dumps({"meta": {}, "records": []}))
    with pytest.raises(ValueError, match="x.json"):
        table.load_records(tmp_path)


def test_the_committed_page_is_made_from_the_committed_records():
    assert table.main(["--check"]) == 0, "run: python benchmarks/table.py"
