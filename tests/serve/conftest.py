"""A tiny random model saved to a folder, and a real server over it: uvicorn on
127.0.0.1, on a free port, in a thread of the test process."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import pytest
import torch

from mambakit import MambaConfig, MambaLM

SMALL = dict(d_model=64, n_layers=2)  # a tiny preset cut down: fast on one CPU thread


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory):
    """preset -> a checkpoint folder of a randomly initialised model (byte vocabulary)."""
    out = {}
    for preset in ("tiny", "tiny-mamba2", "tiny-mamba3"):
        torch.manual_seed(0)
        model = MambaLM(MambaConfig.preset(preset, **SMALL))
        path = tmp_path_factory.mktemp(preset)
        model.save_pretrained(path)
        out[preset] = path
    return out


def _load(path) -> MambaLM:
    return MambaLM.from_pretrained(path).eval()


@pytest.fixture(scope="session")
def load():
    """Read a checkpoint folder into a fresh model (the server's, or the oracle's copy)."""
    return _load


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def free_port():
    """() -> a TCP port free on 127.0.0.1 now."""
    return _free_port


@pytest.fixture(scope="session")
def running():
    """A context manager: serve an app with uvicorn in a thread, yielding its base URL."""
    return _running


@contextlib.contextmanager
def _running(app):
    """Serve `app` with uvicorn on 127.0.0.1 in a thread; yields the base URL."""
    import uvicorn

    port = _free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        assert not thread.is_alive(), "the server did not stop"
