"""Run the README's Python code blocks, each as a file in a fresh interpreter and an empty
folder, as a reader who copies one would. Standard library only, so it runs in an
environment with nothing but the README's install line (`.ci/run` does that).

    python scripts/readme_snippets.py            # every block
    python scripts/readme_snippets.py --index 2  # one block

One change is made to what the README says: the training block's `steps=100` runs 2 steps
(both show that it trains; 100 take minutes on a CPU). Exit status 1 names the blocks that
failed, with the end of their stderr.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"
SHORTER = {"steps=100,": "steps=2,"}


def snippets(readme: Path = README) -> list[str]:
    return re.findall(r"```python\n(.*?)```", readme.read_text(), flags=re.S)


def run(code: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """One block as `snippet.py` in a fresh temporary folder, one CPU thread."""
    for old, new in SHORTER.items():
        code = code.replace(old, new)
    env = {**os.environ, "MAMBAKIT_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "snippet.py"
        path.write_text(code)
        return subprocess.run(
            [sys.executable, str(path)],
            cwd=tmp,
            capture_output=True,
            text=True,
            env=env,
            timeout=timeout,
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--index", type=int, default=None, help="run this block only (from 0)")
    args = parser.parse_args()
    blocks = snippets()
    chosen = range(len(blocks)) if args.index is None else [args.index]
    failed = []
    for i in chosen:
        got = run(blocks[i])
        print(f"README python block {i}: {'ok' if got.returncode == 0 else 'FAILED'}")
        if got.returncode != 0:
            failed.append(i)
            print(blocks[i] + "\n" + got.stderr[-3000:], file=sys.stderr)
    if failed:
        print(f"failed: blocks {failed} of {len(blocks)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
