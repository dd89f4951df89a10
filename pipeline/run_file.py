"""A whole run file: the resource contract at the top (validated by `resources.validate`),
the `train:` section below (pipeline/config.py) and the run's inputs (models, reward, prompts)
that may sit in it."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from pipeline.config import INPUT_KEYS, TrainConfig, TrainConfigError, make_train_config, shown
from resources.config import ResourceConfig
from resources.validate import parse_resource_config
from resources.yaml_reader import read_yaml


@dataclass(frozen=True)
class RunFile:
    """A whole run file: the resource contract, the training section and the run inputs."""

    resources: ResourceConfig
    train: TrainConfig
    inputs: Mapping[str, Any]   # actor_model, reward_function, prompts, ... (paths made absolute)


def load_run_file(path: str | os.PathLike) -> RunFile:
    """Read a run file such as examples/quickstart.yaml (resources at the top, `train:` below)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"run file {path} does not exist. Fix: check the path (examples/quickstart.yaml "
                                f"is one to start from)")
    # The resource parser's strict reader: a key written twice is an error, not "last wins".
    data = read_yaml(path, str(path)) or {}
    resources = parse_resource_config(data, source=str(path))
    section = data.get("train") or {}
    if not isinstance(section, Mapping):
        raise TrainConfigError(f"{path}: train: {shown(section)} is not a mapping. "
                               f"Fix: write the training keys under it, e.g. train: {{steps: 20}}.")
    section = dict(section)
    inputs = {key: section.pop(key) for key in INPUT_KEYS if key in section}
    for key in ("prompts", "eval_prompts", "output_dir", "actor_model", "reward_model", "critic_model", "reference_model"):
        value = inputs.get(key)
        # Relative paths in a run file are relative to the file, like any include.
        if isinstance(value, str) and value not in ("tiny", "tiny-chat") and _exists(path.parent / value):
            inputs[key] = str((path.parent / value).resolve())
    return RunFile(resources, make_train_config(section, source=f"{path}: train"), inputs)


def _exists(path: Path) -> bool:
    try:
        return path.exists()
    except (OSError, ValueError):  # a name too long for the OS, or with a NUL byte: not a file
        return False
