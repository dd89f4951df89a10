"""Learning-rate schedules (pure): the factor the base learning rate is multiplied by at a
policy update.

The schedule counts policy updates (train steps), as verl's actor and critic step their
scheduler once per update: every optimizer step of update k (its mini-batches and epochs)
uses the learning rate of k. Update k is the one that produces policy version k + 1, so the
position is the policy version before the update: a checkpoint holds it, and a resumed run
continues the schedule exactly where it stopped.
"""

from __future__ import annotations

import math
from typing import Callable


def _constant(progress: float) -> float:
    return 1.0


def _linear(progress: float) -> float:
    return 1.0 - progress


def _cosine(progress: float) -> float:
    return 0.5 * (1.0 + math.cos(math.pi * progress))


# train.lr_schedule -> decay shape over progress 0..1 after the warmup (1 at the start, 0 at the end).
DECAYS: dict[str, Callable[[float], float]] = {"constant": _constant, "linear": _linear, "cosine": _cosine}


def lr_factor(update: int, total_updates: int, warmup: int = 0, schedule: str = "constant",
              min_ratio: float = 0.0) -> float:
    """Multiplier of the base learning rate at `update` (0-based) of `total_updates`.

    warmup (update < warmup):  (update + 1) / warmup    (linear, reaching 1 at update warmup - 1)
    after:  min_ratio + (1 - min_ratio) * decay(p),  p = (update - warmup) / (total - warmup)
    decay: constant 1; linear 1 - p; cosine (1 + cos(pi p)) / 2. Past the end, p stays 1.
    verl's warmup starts from 0 at update 0 (lr 0 makes the first update a no-op); here the
    first update already moves, with 1/warmup of the rate. verl's cosine floor is
    min_lr_ratio too; its linear decay has none (min_ratio 0 here gives the same).
    """
    if update < warmup:
        return (update + 1) / warmup
    span = max(total_updates - warmup, 1)
    progress = min(max(update - warmup, 0) / span, 1.0)
    return min_ratio + (1.0 - min_ratio) * DECAYS[schedule](progress)
