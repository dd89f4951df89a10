"""Checkpoints on disk: one directory per saved step, written atomically, checked when read.

    <root>/step-000010/
        actor.pt  critic.pt   full model + optimizer state of the trainable roles
        rng.pt                the driver's random number generator states
        trainer.json          step, policy version, prompt stream position, next batch index
        manifest.json         size and sha256 of every file above; written last

A checkpoint is assembled in a hidden directory beside the others; every file and the
directory are fsynced, and only then is it renamed into place. A crash mid-save leaves that
hidden directory (the next save removes it) and the previous checkpoints untouched. Reading
checks the manifest: a missing, truncated or altered file is refused with CheckpointError
naming the file, and `latest` falls back to the newest checkpoint that passes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import shutil
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger("dask_rl")

MANIFEST = "manifest.json"
STATE = "trainer.json"
RNG = "rng.pt"
PREFIX = "step-"
STAGING = ".partial-"


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message names the file and the reason."""


def step_name(step: int) -> str:
    return f"{PREFIX}{step:06d}"


def staging_dir(root: str | os.PathLike, step: int) -> Path:
    """A fresh hidden directory to assemble the checkpoint of `step` in; leftovers of an
    interrupted save are removed first."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(f"{STAGING}*"):
        shutil.rmtree(stale, ignore_errors=True)
    path = root / f"{STAGING}{step_name(step)}-{os.getpid()}"
    path.mkdir()
    return path


def commit(staging: Path, trainer_state: dict[str, Any]) -> Path:
    """Finish the checkpoint assembled in `staging` (the role states already lie there):
    add the RNG states, the trainer state and the manifest, fsync, rename into place."""
    torch.save({"torch": torch.get_rng_state(), "python": random.getstate()}, staging / RNG)
    (staging / STATE).write_text(json.dumps(trainer_state, indent=1))
    files = sorted(p.name for p in staging.iterdir() if p.is_file())
    manifest = {name: {"bytes": (staging / name).stat().st_size, "sha256": _sha256(staging / name)}
                for name in files}
    (staging / MANIFEST).write_text(json.dumps(manifest, indent=1))
    for name in files + [MANIFEST]:
        _fsync(staging / name)
    _fsync(staging)
    final = staging.parent / step_name(trainer_state["step"])
    if final.exists():  # the same step saved again (a stop right after a periodic save)
        shutil.rmtree(final)
    os.rename(staging, final)
    _fsync(final.parent)
    return final


def verify(path: str | os.PathLike) -> dict[str, Any]:
    """The trainer state of the checkpoint at `path`, once every file matches the manifest."""
    path = Path(path)
    fix = "Fix: resume from an older checkpoint (pass the checkpoints directory to use the newest valid one)."
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path}: no {MANIFEST}; the save did not finish. {fix}") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise CheckpointError(f"checkpoint {path}: {MANIFEST} is corrupt. {fix}") from None
    for name, expected in manifest.items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"checkpoint {path}: {name} is missing. {fix}")
        size = file.stat().st_size
        if size != expected["bytes"]:
            raise CheckpointError(f"checkpoint {path}: {name} holds {size} bytes, the manifest says "
                                  f"{expected['bytes']} (truncated?). {fix}")
        if _sha256(file) != expected["sha256"]:
            raise CheckpointError(f"checkpoint {path}: {name} does not match its checksum (corrupt). {fix}")
    if STATE not in manifest:
        raise CheckpointError(f"checkpoint {path}: no {STATE} in the manifest. {fix}")
    return json.loads((path / STATE).read_text())


def find(target: str | os.PathLike) -> tuple[Path, dict[str, Any]]:
    """The checkpoint to resume from: `target` itself when it is one (refused if invalid),
    else the newest valid checkpoint under `target` or `target`/checkpoints."""
    target = Path(target)
    if (target / MANIFEST).exists() or target.name.startswith(PREFIX):
        return target, verify(target)
    root = target / "checkpoints" if (target / "checkpoints").is_dir() else target
    refused = []
    for path in sorted(root.glob(f"{PREFIX}*"), reverse=True):
        try:
            state = verify(path)
        except CheckpointError as error:
            logger.warning("dask-rl: %s; trying the one before", error)
            refused.append(path.name)
            continue
        return path, state
    found = f" ({', '.join(refused)} refused as incomplete or corrupt)" if refused else ""
    raise CheckpointError(f"no usable checkpoint under {root}{found}. Fix: point resume at an output directory "
                          f"or checkpoints directory of a run with train.checkpoint.every_n_steps set.")


def restore_rng(path: Path) -> None:
    states = torch.load(path / RNG, weights_only=False)
    torch.set_rng_state(states["torch"])
    random.setstate(states["python"])


def prune(root: str | os.PathLike, keep_last: int) -> None:
    """Delete all but the newest `keep_last` checkpoints."""
    for old in sorted(Path(root).glob(f"{PREFIX}*"))[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
