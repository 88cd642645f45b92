"""`mambakit serve` as a user runs it: a process on a checkpoint folder, SIGTERM while a
stream runs (the stream finishes, the process exits 0), and its flag errors."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest


@pytest.mark.parametrize(
    "flags, max_tokens, want",
    [([], 300, "length"), (["--drain-timeout", "1", "--max-tokens", "1000000"], 10**6, "abort")],
    ids=["finishes", "aborted-at-the-drain-timeout"],
)
def test_sigterm_drains_the_running_stream_and_exits_0(model_dirs, free_port, flags,
                                                       max_tokens, want):  # fmt: skip
    """SIGTERM while a stream runs: it runs to its end within the drain timeout; past it,
    it ends with finish_reason "abort" and [DONE] (not cut off); the process exits 0."""
    port = free_port()
    env = {**os.environ, "MAMBAKIT_API_KEY": "k"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "mambakit", "serve", "--model", str(model_dirs["tiny"]),
         "--port", str(port), "--device", "cpu", "--max-batch", "4", *flags],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None, proc.communicate()[1]
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.1)
        assert httpx.get(f"{url}/v1/models").status_code == 401  # the key from the environment
        body = {"prompt": "def ", "max_tokens": max_tokens, "temperature": 0, "stream": True,
                "return_token_ids": True}  # fmt: skip
        headers = {"Authorization": "Bearer k"}
        n, reason, done, sent = 0, None, False, False
        with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=headers,
                          timeout=60) as r:  # fmt: skip
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                c = json.loads(line[6:])["choices"][0]
                n += len(c["token_ids"])
                reason = c["finish_reason"] or reason
                if n >= 5 and not sent:
                    proc.send_signal(signal.SIGTERM)
                    sent = True
        assert done and reason == want
        assert (n == max_tokens) == (want == "length")  # ran to its end, or was cut short
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "4 slots" in proc.stderr.read()


def test_flag_errors_are_one_line(model_dirs):
    for args, msg in [
        (["--max-batch", "0"], "--max-batch must be at least 1"),
        (["--cache-gib", "-1"], "--cache-gib must be a finite number >= 0"),
        (["--cache-gib", "inf"], "--cache-gib must be a finite number >= 0"),
        (["--drain-timeout", "nan"], "--drain-timeout must be a finite number >= 0"),
        (["--drain-timeout", "-1"], "--drain-timeout must be a finite number >= 0"),
        (["--eos-token-id", "256"], "--eos-token-id must lie in [0, 256)"),
        (["--eos-token-id", "-7"], "--eos-token-id must lie in [0, 256)"),
        (["--prefill-hold", "soon"], "--prefill-hold must be auto, none or TOKENS,MS"),
        (["--prefill-hold", "100,-1"], "--prefill-hold must be auto, none or TOKENS,MS"),
        (["--prefill-hold=-1,5"], "--prefill-hold must be auto, none or TOKENS,MS"),
    ]:
        got = subprocess.run(
            [sys.executable, "-m", "mambakit", "serve", "--model", str(model_dirs["tiny"]), *args],
            capture_output=True, text=True,
        )  # fmt: skip
        assert got.returncode == 2 and msg in got.stderr, got.stderr
    got = subprocess.run(
        [sys.executable, "-m", "mambakit", "serve", "--model", str(model_dirs["tiny-mamba2"]),
         "--packed-prefill", "on"], capture_output=True, text=True,
    )  # fmt: skip
    assert got.returncode == 2 and "--packed-prefill on: packed prefill needs a Mamba-1" in (
        got.stderr
    ), got.stderr


def test_prefill_hold_flag_reads_as_the_engine_takes_it():
    from mambakit.cli._common import UsageError
    from mambakit.cli.serve import prefill_hold

    assert prefill_hold("auto") == "auto"
    assert prefill_hold("none") is None
    assert prefill_hold("8192,30") == (8192, 0.03)
    assert prefill_hold(" None ") is None
    for bad in ("8192", ",30", "nan", "100,inf", "100,nan", "1e3,5", "8192,30,4"):
        with pytest.raises(UsageError, match="--prefill-hold must be"):
            prefill_hold(bad)


def test_serve_stops_at_every_end_id_of_the_checkpoint():
    """A checkpoint whose eos_token_id is a list (end of text, end of turn): serve's engine
    and `mambakit generate` get every one inside the vocabulary; --eos-token-id overrides
    it, -1 for none."""
    import argparse

    from mambakit import MambaConfig, MambaLM
    from mambakit.cli.generate import end_tokens

    model = MambaLM(MambaConfig(d_model=16, n_layers=1, vocab_size=32, d_state=4,
                                extra={"eos_token_id": [3, 999, 5, True]}))  # fmt: skip
    args = argparse.Namespace(eos_token_id=None)
    assert end_tokens(args, model) == [3, 5]
    assert end_tokens(argparse.Namespace(eos_token_id=7), model) == [7]
    assert end_tokens(argparse.Namespace(eos_token_id=-1), model) == []
    model.config.extra["eos_token_id"] = 4
    assert end_tokens(args, model) == [4]
