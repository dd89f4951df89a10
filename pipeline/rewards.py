"""Rule-based rewards. Any function (prompt: str, response: str) -> float can be a reward."""

from __future__ import annotations

import importlib
from typing import Callable


def digit_fraction(prompt: str, response: str) -> float:
    """The quickstart's task, "answer with digits": the share of the response's characters
    that are digits (0.0 to 1.0). An empty response scores 0."""
    if not response:
        return 0.0
    return sum(ch.isdigit() for ch in response) / len(response)


def resolve_reward_function(spec: str | Callable) -> Callable[[str, str], float]:
    """A callable as is, or a "module:function" path (the one string reference allowed in a
    run file, since YAML cannot hold a function)."""
    if callable(spec):
        return spec
    module_name, _, attr = str(spec).partition(":")
    if not attr:
        raise ValueError(f"reward_function: {spec!r} should look like 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(f"reward_function: {spec!r}: cannot import {module_name} ({error}). "
                         f"Fix: check the module path, or install the package that provides it.") from None
    function = getattr(module, attr, None)
    if not callable(function):
        raise ValueError(f"reward_function: {spec!r}: {module_name} has no function {attr!r}")
    return function
