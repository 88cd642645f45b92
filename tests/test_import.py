"""The package on a machine without Triton (a CPU torch wheel brings none, and the `[train]`
extra adds none): it imports, trains, steps and generates every mixer on the reference path,
and its command line works. Triton is hidden from a fresh interpreter by a meta-path finder
that refuses it (tests/conftest.py), as if it were not installed."""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest


@pytest.fixture
def run_without_triton(hide_triton):
    def run(code: str, timeout: float = 300) -> subprocess.CompletedProcess:
        program = hide_triton + textwrap.dedent(code)
        return subprocess.run(
            [sys.executable, "-c", program], capture_output=True, text=True, timeout=timeout
        )

    return run


def test_the_blocker_hides_triton(run_without_triton):
    got = run_without_triton("import triton")
    assert got.returncode != 0 and "No module named 'triton'" in got.stderr


@pytest.mark.parametrize("preset", ["tiny", "tiny-mamba3"])
def test_every_model_path_runs_without_triton(preset, run_without_triton):
    got = run_without_triton(
        f"""
        import torch
        import mambakit
        from mambakit import MambaBackbone, MambaConfig, MambaLM
        from mambakit.ops import resolve_backend

        assert resolve_backend("auto", torch.zeros(1)) == "reference"
        torch.manual_seed(0)
        cfg = MambaConfig.preset({preset!r}, d_model=64, n_layers=2)
        model = MambaLM(cfg)
        ids = torch.randint(0, cfg.vocab_size, (2, 24))
        out = model(ids, labels=ids)
        out.loss.backward()
        assert all(p.grad is not None for p in model.parameters())
        with torch.no_grad():
            logits, state = model.last_logits(ids)
            step_logits, state = model.step(ids[:, -1], state)
            new = model.generate(ids[:, :4], max_new_tokens=5, temperature=0)
        assert new.shape == (2, 9)
        bb = MambaBackbone(MambaConfig.preset({preset!r}, d_model=64, n_layers=1, input_dim=5))
        hidden, state = bb(torch.randn(3, 7, 5))
        hidden_t, state = bb.step(torch.randn(3, 5), state)
        assert "triton" not in sys.modules
        print("ok")
        """
    )
    assert got.returncode == 0 and got.stdout.strip() == "ok", got.stderr[-3000:]


def test_the_command_line_starts_without_triton_and_without_torch_for_help(run_without_triton):
    got = run_without_triton(
        """
        from mambakit.cli import main
        assert main(["--help"]) == 0
        assert "torch" not in sys.modules, "mambakit --help imported torch"
        import mambakit
        assert "torch" not in sys.modules, "import mambakit imported torch"
        """
    )
    assert got.returncode == 0, got.stderr[-3000:]
    assert "demo" in got.stdout and "train" in got.stdout


def test_public_names_resolve_lazily():
    import mambakit

    assert sorted(mambakit._WHERE) == sorted(mambakit.__all__)
    for name in mambakit.__all__:
        assert getattr(mambakit, name).__name__ == name
    assert set(mambakit.__all__) <= set(dir(mambakit))
    with pytest.raises(AttributeError, match="no attribute 'Mamba4'"):
        mambakit.Mamba4  # noqa: B018


PEERS = ("mamba_ssm", "causal_conv1d")


def test_tests_load_the_peers_only_through_a_skip():
    """A test that needs mamba_ssm skips, with the reason, where it is not installed: a test
    function loads a peer through `pytest.importorskip`, never with a bare import (helpers
    that import one are called after a test's importorskip)."""
    bare = []
    for path in sorted(Path(__file__).parent.rglob("test_*.py")):
        for fn in ast.walk(ast.parse(path.read_text(), str(path))):
            if not (isinstance(fn, ast.FunctionDef) and fn.name.startswith("test_")):
                continue
            for node in ast.walk(fn):
                names = []
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module:
                    names = [node.module]
                if any(n.split(".")[0] in PEERS for n in names):
                    bare.append(f"{path.name}:{node.lineno} {fn.name}")
    assert not bare, "peer imported without importorskip: " + ", ".join(bare)
