"""Placeholder: calls in this thread (replaced by the isolated, time-bounded version)."""

from __future__ import annotations

import logging
from typing import Any, Callable

from resources.config import shorten

logger = logging.getLogger("dask_rl")


class BoundedCalls:
    def __init__(self, timeout: float | None):
        self.timeout = timeout

    def run(self, function: Callable, calls: list[tuple[tuple, dict]]) -> list[tuple[Any, str | None]]:
        out = []
        for args, kwargs in calls:
            try:
                out.append((function(*args, **kwargs), None))
            except Exception as error:  # the user's function: any failure is this call's problem
                out.append((None, shorten(f"raised {type(error).__name__}: {error}", 300)))
        return out

    def close(self) -> None:
        pass
