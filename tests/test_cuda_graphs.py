"""`graph_capture`'s recovery from a failed capture, on the CPU with `torch.cuda.graph` and
the stream functions replaced by stand-ins: where the capture's exit raises, the caller's
stream is put back and the default generator reset once, whichever stream it captured on
(the serving engine captures its prefill graphs on the stream that is current); where the
body raises and the exit does not, nothing is reset."""

import pytest
import torch

import mambakit.cuda_graphs as cuda_graphs


class Stream(str):
    device = torch.device("cuda", 0)


class Capture:
    """`torch.cuda.graph` that switches to its stream on enter; its exit, when told to fail,
    raises before switching back (as `capture_end` does for an invalidated capture)."""

    fail_exit = False

    def __init__(self, graph, pool=None, stream=None):
        self.stream = stream if stream is not None else Stream("default capture")

    def __enter__(self):
        self.before = current[0]
        current[0] = self.stream

    def __exit__(self, *exc):
        if Capture.fail_exit:
            raise RuntimeError("capture_end failed")
        current[0] = self.before


current = [Stream("caller")]


@pytest.fixture
def resets(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "graph", Capture)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: current[0])
    monkeypatch.setattr(torch.cuda, "set_stream", lambda s: current.__setitem__(0, s))
    monkeypatch.setattr(cuda_graphs, "_reset_generator", calls.append)
    current[0] = Stream("caller")
    yield calls
    Capture.fail_exit = False


@pytest.mark.parametrize("on", ["own", "caller's", "default"])
def test_a_failed_exit_puts_the_stream_back_and_resets_the_generator(resets, on):
    stream = {"own": Stream("capture"), "caller's": current[0], "default": None}[on]
    Capture.fail_exit = True
    with pytest.raises(RuntimeError, match="capture_end failed"):
        with cuda_graphs.graph_capture(object(), stream=stream):
            raise ValueError("a host sync inside the capture")
    assert current[0] == "caller" and resets == [Stream.device]
    resets.clear()
    with pytest.raises(RuntimeError, match="capture_end failed"):  # the body ran, the end failed
        with cuda_graphs.graph_capture(object(), stream=stream):
            pass
    assert current[0] == "caller" and resets == [Stream.device]


def test_a_body_error_with_a_clean_exit_resets_nothing(resets):
    with pytest.raises(ValueError, match="not a CUDA error"):
        with cuda_graphs.graph_capture(object(), stream=Stream("capture")):
            raise ValueError("not a CUDA error")
    assert current[0] == "caller" and resets == []
    with cuda_graphs.graph_capture(object(), stream=Stream("capture")):
        assert current[0] == "capture"
    assert current[0] == "caller" and resets == []
