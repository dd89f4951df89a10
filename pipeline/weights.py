"""Versioned policy weights, published by the actor and loaded by rollout workers.

Weights never go through the scheduler: the actor writes a safetensors snapshot into a
directory that the rollout workers of the same host can read (by default under /dev/shm,
so the copy stays in RAM), and only a small `WeightHandle` travels as a Dask future.
Rollout workers on another host fetch the bytes from the actor's worker instead (see
`fetch_snapshot`). safetensors keeps every dtype, bf16 included, bit for bit.
"""

from __future__ import annotations

import os
import socket
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load, load_file, save_file


@dataclass(frozen=True)
class WeightHandle:
    """Where version `version` of the policy lies."""

    version: int
    path: str       # a safetensors file on `host`
    host: str       # hostname of the worker that wrote it
    nbytes: int


def default_snapshot_dir(run_id: str) -> Path:
    """RAM-backed when the OS has /dev/shm, else the temp directory."""
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    return base / f"dask-rl-{run_id}"


def publish(state: dict[str, torch.Tensor], version: int, directory: str | os.PathLike,
            keep: int = 3) -> WeightHandle:
    """Write `state` as version `version` and delete versions older than the last `keep`.

    Old versions are kept a little while: a rollout worker may still be loading one.
    The write goes to a temporary name first so no reader ever sees half a file.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / f"policy-v{version:06d}.safetensors"
    partial = final.with_suffix(".partial")
    save_file(_unshare(state), str(partial))
    os.replace(partial, final)
    for old in sorted(directory.glob("policy-v*.safetensors"))[:-keep]:
        old.unlink(missing_ok=True)
    return WeightHandle(version=version, path=str(final), host=socket.gethostname(),
                        nbytes=final.stat().st_size)


def _unshare(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors refuses tensors that share memory (tied embeddings): copy the repeats."""
    seen: set[int] = set()
    out = {}
    for name, tensor in state.items():
        tensor = tensor.detach().to("cpu").contiguous()
        key = tensor.untyped_storage().data_ptr()
        out[name] = tensor.clone() if key in seen else tensor
        seen.add(key)
    return out


def is_local(handle: WeightHandle) -> bool:
    return handle.host == socket.gethostname() and Path(handle.path).exists()


def load_snapshot(handle: WeightHandle) -> dict[str, torch.Tensor]:
    """Read a snapshot written on this host."""
    return load_file(handle.path)


def fetch_snapshot(handle: WeightHandle) -> bytes:
    """The raw file bytes; runs as a task on the publishing host for remote readers."""
    return Path(handle.path).read_bytes()


def load_snapshot_bytes(data: bytes) -> dict[str, torch.Tensor]:
    return load(data)
