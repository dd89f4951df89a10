"""What the reward role computes: named, weighted reward functions (and reward models), and
the two calling conventions a function may follow.

- Per sample, dask-rl's own: `f(prompt, response, **fields) -> float | None`.
- Batched, TRL's GRPOTrainer convention: `f(prompts, completions, **columns) -> list[float | None]`,
  recognised by a parameter named `completions`; a function written for TRL works unchanged.

Either gets, as keywords, the dataset row's other fields (`answer=`, `solution=`...) and
`completion_ids` (the response's token ids), but only those its signature accepts (all of
them with `**kwargs`). `None` means "this reward does not apply to this sample": it is left
out of that reward's mean and of the sample's weighted sum.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Any, Callable, Sequence


@dataclass(frozen=True)
class RewardSpec:
    """One reward: a function, or a reward model's directory (exactly one of the two)."""

    name: str
    weight: float = 1.0
    function: Callable | None = None
    model_dir: str | None = None

    @property
    def batched(self) -> bool:
        return self.function is not None and takes_batches(self.function)


def takes_batches(function: Callable) -> bool:
    """True for a TRL-style batched function (it has a parameter named `completions`)."""
    return "completions" in _parameters(function)


def accepted_keywords(function: Callable, offered: dict[str, Any]) -> dict[str, Any]:
    """The keywords of `offered` that `function` accepts (all of them with **kwargs)."""
    parameters = _parameters(function)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return dict(offered)
    return {key: value for key, value in offered.items() if key in parameters}


def _parameters(function: Callable) -> dict[str, inspect.Parameter]:
    try:
        return dict(inspect.signature(function).parameters)
    except (TypeError, ValueError):  # a builtin without a signature: positional only
        return {}


def reward_name(function: Callable) -> str:
    """How a function is named in the figures: its __name__ (TRL's convention), through partials."""
    while isinstance(function, functools.partial):
        function = function.func
    return getattr(function, "__name__", None) or type(function).__name__


def unique_names(names: Sequence[str]) -> list[str]:
    """`names` with repeats numbered (accuracy, accuracy_2) so each figure has its own name."""
    seen: dict[str, int] = {}
    out = []
    for name in names:
        seen[name] = seen.get(name, 0) + 1
        out.append(name if seen[name] == 1 else f"{name}_{seen[name]}")
    return out
