"""The README's Python snippets run as written, each alone in a fresh interpreter, and its
claims about the CLI's defaults hold."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
RUNNER = README.parent / "scripts" / "readme_snippets.py"
SNIPPETS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_the_readme_has_snippets():
    assert len(SNIPPETS) >= 4


@pytest.mark.parametrize("i", range(len(SNIPPETS)))
@pytest.mark.slow
def test_readme_snippet_runs_alone(i):
    """Each block as a file in a fresh interpreter (scripts/readme_snippets.py, which .ci/run
    also runs in an environment with only the README's install line)."""
    got = subprocess.run(
        [sys.executable, str(RUNNER), "--index", str(i)], capture_output=True, text=True
    )
    assert got.returncode == 0, f"snippet {i}:\n{SNIPPETS[i]}\n{got.stderr[-2000:]}"


def test_readme_states_the_demo_defaults():
    from mambakit.cli import demo

    parser = argparse.ArgumentParser()
    demo.add_parser(parser.add_subparsers())
    (sub,) = parser._subparsers._group_actions[0].choices.values()
    d = sub.parse_args([])
    text = " ".join(README.read_text().split())
    assert f"runs a {d.seqlen}-token parallel forward" in text
    assert f"replays its first {d.steps} tokens with `step()`" in text


def test_cpu_torch_note_comes_before_the_commands_that_install():
    text = README.read_text()
    assert text.index("download.pytorch.org/whl/cpu") < text.index('pip install -e ".[train]"')
