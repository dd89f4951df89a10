"""One value of a resource file: the sentinel for a key the file leaves out, the number
checks several keys share, and how a value is shown in an error, as the user wrote it in YAML.
Pure: resources.validate and the section parsers beside it (engine_args_spec) import it."""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from typing import Any

from resources.config import ECHO_LIMIT, shorten

__all__ = ["MISSING", "is_int", "is_positive_number", "show"]

MISSING: Any = object()   # a key the file leaves out (an error then shows no value)

SHOW_ITEMS, SHOW_DEPTH = 8, 3  # beyond these a value is "...": the message stays one line


def show(value: Any, depth: int = 0) -> str:
    """A value as the user wrote it in YAML, so the message matches the file; a huge or
    deeply nested value is cut short, and costs no more to show than a small one."""
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    if depth > SHOW_DEPTH:
        return "..."
    if isinstance(value, Mapping):
        pairs = itertools.islice(value.items(), SHOW_ITEMS)
        shown = [f"{shorten(str(k))}: {show(v, depth + 1)}" for k, v in pairs]
        return shorten("{" + ", ".join(shown + ["..."] * (len(value) > SHOW_ITEMS)) + "}")
    if isinstance(value, (list, tuple)):
        shown = [show(v, depth + 1) for v in value[:SHOW_ITEMS]]
        return shorten("[" + ", ".join(shown + ["..."] * (len(value) > SHOW_ITEMS)) + "]")
    if isinstance(value, str):
        return shorten(repr(value[:ECHO_LIMIT]))  # the repr of a prefix, not of 1 MiB
    try:
        return shorten(str(value))
    except ValueError:  # an int past Python's 4300-digit str() limit
        return f"<an integer of {value.bit_length()} bits>"


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # YAML `true` is no GPU id


def is_positive_number(value: Any) -> bool:
    # inf is refused too (a timeout of inf is a silent hang), and nan (every comparison
    # with it is false, so a nan timeout never fires either).
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value) and value > 0
    except OverflowError:  # an int too large for a float: no sensible number of seconds
        return False
