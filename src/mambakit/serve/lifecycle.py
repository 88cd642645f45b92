"""The serving engine's life (`Engine`'s methods, as a base class): the loop's thread,
started by `start`, and the end of service: `begin_drain` takes no new requests, `shutdown`
lets the running ones finish for a while, ends the rest and stops the loop. The state these
read and write is `Engine.__init__`'s."""

from __future__ import annotations

import threading
import time
import traceback
from typing import TypeVar

import torch

_E = TypeVar("_E", bound="Lifecycle")


class Lifecycle:
    """The engine's loop thread, its drain and its stop (module docstring)."""

    def start(self: _E) -> _E:
        """Run the loop on a thread of its own."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="mambakit-engine", daemon=True)
            self._thread.start()
        return self

    def begin_drain(self) -> None:
        """Take no new requests (`submit` raises EngineStopped); the running ones go on."""
        with self._lock:
            self._draining = True

    def shutdown(self, timeout: float = 30.0) -> bool:
        """Take no new requests, let the running ones finish for up to `timeout` seconds,
        end the rest ("abort") and stop the loop. True when everything finished in time."""
        with self._shutting:  # SIGTERM's drain thread and the app's own shutdown: one at a time
            return self._shutdown(timeout)

    def _shutdown(self, timeout: float) -> bool:
        self.begin_drain()
        deadline = time.monotonic() + timeout
        while not self.idle and time.monotonic() < deadline:
            if self._thread is None:
                self.step()
            else:
                time.sleep(0.01)
        drained = self.idle
        with self._lock:
            self._abort = True
            self._stop = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout=10)
        else:
            self.step()
        return drained

    @property
    def draining(self) -> bool:
        return self._draining

    @property
    def idle(self) -> bool:
        return not (self.rows or self.prefilling or self._n_waiting)

    def _run(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        while True:
            with self._lock:
                if self._stop and not self._abort:
                    break
                if not (self._inbox or self._cancels or self.rows or self.prefilling
                        or self.waiting or self._abort or self._pending
                        or self._to_cache):  # fmt: skip
                    self._wake.wait(timeout=0.5)
                    continue
            try:
                self.step()
            except Exception:  # step() ends the requests it cannot serve; the loop goes on
                traceback.print_exc()
            with self._lock:
                if self._stop and self.idle:
                    break
