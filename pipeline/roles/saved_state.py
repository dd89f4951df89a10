"""The saved states a trainable role's process group rebuilds from, written and chosen here.

A state is one file: the full model and optimizer state plus the version it belongs to (the
number of the last update applied) and that update's result, so that an update redone after
a fault returns the result of the one already applied instead of applying it twice.

Three kinds exist. A resize *export* is written at a step boundary, just before the group
changes: every rank of the new group starts from exactly it. The *recovery state* is written
by rank 0 after each update (every `train.recovery_every_n_steps`): a group that lost a rank
rebuilds from it. Without one that is current, the actor falls back to the last *published
weights* (exact weights, optimizer moments start afresh) and the critic to its recovery state
however old, or its initial weights; each fallback is logged.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from pipeline.weights import load_tied_file

logger = logging.getLogger("dask_rl")


@dataclass(frozen=True)
class Recovery:
    """Where a group that lost a rank looks for its last good state."""

    state_path: str                       # the role's recovery state (may not exist yet)
    published_path: str | None = None     # the actor's last published weights (safetensors)
    published_version: int = 0


def recovery_path(snapshot_dir: str, role: str) -> str:
    return f"{snapshot_dir}/{role}-recovery.pt"


def save_state(path: str, model_state: dict, optim_state: dict | None, version: int, result: Any) -> None:
    """Write atomically: a reader (or a crash mid-write) never sees half a file."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    partial = f"{path}.partial"
    torch.save({"model": model_state, "optim": optim_state, "version": version, "result": result}, partial)
    os.replace(partial, path)


def load_state(path: str) -> dict:
    if path.endswith(".safetensors"):
        return {"model": load_tied_file(path), "optim": None, "version": None, "result": None}
    state = torch.load(path, weights_only=False)
    state.setdefault("version", None)
    state.setdefault("result", None)
    return state


def recover(recovery: Recovery, role_name: str, initial_state: Callable[[], dict]) -> dict:
    """The newest good state for a group that lost a rank (see the module docstring)."""
    saved = load_state(recovery.state_path) if os.path.exists(recovery.state_path) else None
    if saved is not None and (saved["version"] or 0) >= recovery.published_version:
        logger.warning("dask-rl: %s rebuilds from its recovery state (v%d)", role_name, saved["version"] or 0)
        return saved
    if recovery.published_path and os.path.exists(recovery.published_path):
        logger.warning("dask-rl: %s rebuilds from the published weights v%d; its optimizer state starts afresh "
                       "(no recovery state that recent: see train.recovery_every_n_steps)", role_name,
                       recovery.published_version)
        state = load_state(recovery.published_path)
        state["version"] = recovery.published_version
        return state
    if saved is not None:
        logger.warning("dask-rl: %s rebuilds from its recovery state v%d; the updates since are lost",
                       role_name, saved["version"] or 0)
        return saved
    if recovery.published_version == 0:  # nothing applied yet: the initial weights are the state
        logger.warning("dask-rl: %s rebuilds from its initial weights (no update applied yet)", role_name)
    else:
        logger.warning("dask-rl: %s lost a rank and has no saved state: it starts again from its initial weights",
                       role_name)
    return {"model": initial_state(), "optim": None, "version": None, "result": None}
