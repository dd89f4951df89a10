"""A background thread that samples a reading at a fixed interval while a `with` block runs
(the benchmarks' peak-memory watchers)."""

from __future__ import annotations

import threading


class Sampler:
    """Calls `sample()` every `interval` seconds from `with` to its end; subclasses keep
    the peaks they want."""

    def __init__(self, interval: float):
        self.interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self) -> None:
        raise NotImplementedError

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
