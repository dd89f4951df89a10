"""Parsing a resource file: `_Parser` turns the mapping read from the file into a
ResourceConfig, or raises the one ResourceConfigError that names the file, the key path, the
value and the fix. The public entry points live here too: load_resource_config (a path or a
mapping), parse_resource_config (a mapping) and with_role (a copy with one role changed).

Imports run one way: this module imports resources.config (the types),
resources.yaml_reader (the defensive file reader), resources.file_values (a value's checks
and how it is shown) and the parsers of the sections with rules of their own
(engine_args_spec, job_queue_spec, hosted_spec); none imports it back.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from resources import devices
from resources.config import (
    _TRAINED_ROLES, COMM_BACKENDS, DEVICE_TYPES, GPU_SHARING, REQUIRED_ROLES, ROLE_KEYS, ROLES, STRATEGIES,
    DEFAULT_TIMEOUT_SECONDS, TOP_KEYS, AdaptiveBounds, FrozenMap, ResourceConfig, ResourceConfigError, RoleSpec,
    did_you_mean, role_dict,
)
from resources.devices import GpuInfo
from resources.engine_args_spec import parse_cuda_graph_args, parse_vllm_args
from resources.file_values import MISSING, is_int, is_positive_number, show
from resources.hosted_spec import parse_hosted_role
from resources.job_queue_spec import parse_job_queue_role
from resources.yaml_reader import read_yaml

__all__ = ["MAX_ROLE_WORKERS", "MAX_TIMEOUT_SECONDS", "load_resource_config", "parse_resource_config",
           "with_changes", "with_role"]

# Upper bounds, each far above any real run and below what the code that uses the number takes:
# - timeout_seconds feeds datetime.timedelta (at most ~8.6e13 s), threading's Event.wait (at
#   most threading.TIMEOUT_MAX, ~9.2e9 s on Linux) and Dask's timeouts: 10**7 s (~116 days).
MAX_TIMEOUT_SECONDS = 10_000_000
# - a CPU role's workers are processes started on this machine, each holding its own model;
#   adaptive bounds count the same workers.
MAX_ROLE_WORKERS = 1024
# - a role's GPU memory cap, far above any GPU made (it becomes a fraction of the device's memory).
MAX_GPU_MEMORY_GIB = 1_000_000


def load_resource_config(source: str | os.PathLike | Mapping, *,
                         gpus: Sequence[GpuInfo] | None = None) -> ResourceConfig:
    """Read and validate a resource file or mapping; `gpus` replaces the NVML probe."""
    if isinstance(source, Mapping):
        return parse_resource_config(source, gpus=gpus)
    name = os.fspath(source)
    return parse_resource_config(read_yaml(Path(name), name), source=name, gpus=gpus)


def parse_resource_config(data: Mapping, *, source: str = "<dict>",
                          gpus: Sequence[GpuInfo] | None = None) -> ResourceConfig:
    return _Parser(source, gpus, owned=set()).parse(data)


def with_changes(config: ResourceConfig, changes: Mapping, *, source: str,
                 gpus: Sequence[GpuInfo] | None = None) -> ResourceConfig:
    """A copy of `config` with top-level keys replaced by `changes`, written as in a resource
    file (e.g. {"reward": {"device_type": "cpu", "workers": 2}}) and checked exactly as one:
    update_resource's, adapt()'s and `dask-rl scale`'s arguments go through this. Errors name
    `source` (e.g. "update_resource") and the key; the copy keeps the config's own source."""
    data = {**config.to_dict(), **changes}
    parsed = _Parser(source, gpus, owned=set(config.gpu_ids)).parse(data)
    return dataclasses.replace(parsed, source=config.source)


def with_role(config: ResourceConfig, spec: RoleSpec, *,
              gpus: Sequence[GpuInfo] | None = None) -> ResourceConfig:
    """A copy of `config` with one role replaced, validated like a fresh file. GPUs the
    config already uses skip the busy check (our own workers make them busy); replacing
    the actor moves defaulted critic/reference with it."""
    data = config.to_dict()
    data[spec.role] = role_dict(spec)
    return _Parser(config.source, gpus, owned=set(config.gpu_ids)).parse(data)


def _is_hosted(section: Any) -> bool:
    """A role section that runs the role in another role's workers (`hosted_by`)."""
    return isinstance(section, Mapping) and "hosted_by" in section


def _is_timeout(value: Any) -> bool:
    return is_positive_number(value) and value <= MAX_TIMEOUT_SECONDS


def _is_worker_count(value: Any) -> bool:
    return is_int(value) and 1 <= value <= MAX_ROLE_WORKERS


def _is_fraction(value: Any) -> bool:
    """0 <= value < 1 (a share of GPU memory); YAML `true`, nan and huge ints are not."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value) and 0 <= value < 1
    except OverflowError:
        return False
def _example_ids(ids: Sequence[int]) -> list[int]:
    """The list the user probably meant: their ids once each, padded with the next ones."""
    once = list(dict.fromkeys(ids))
    return once + list(range(max(once) + 1, max(once) + 1 + len(ids) - len(once)))


def _default_strategy(role: str, workers: int, device_type: str = "cpu") -> str:
    if role == "rollout":
        # The CUDA-graph engine on GPUs (10x+ faster than generate there); generate on CPUs,
        # where graphs do not exist. vllm is opt-in: it needs its own install.
        return "cuda_graph" if device_type == "cuda" else "hf"
    if role in _TRAINED_ROLES:
        return "none" if workers == 1 else "ddp"
    return "none" if workers == 1 else "data_parallel"


def _placed_with_actor(actor: RoleSpec, role: str) -> RoleSpec:
    """critic/reference left out of the file share the actor's devices."""
    # The critic has the actor's shape, so the actor's parallelism fits it too.
    strategy = actor.strategy if role == "critic" else _default_strategy(role, actor.workers)
    return RoleSpec(role, actor.device_type, actor.device_ids, actor.workers, strategy,
                    placed_with="actor")


class _Parser:
    """One validation pass. Raises at the first problem: one clear error beats ten."""

    def __init__(self, source: str, gpus: Sequence[GpuInfo] | None, owned: set[int]):
        self.source, self.gpus, self.owned = source, gpus, owned

    def error(self, path: str, value: Any, problem: str, fix: str) -> ResourceConfigError:
        shown = None if value is MISSING else show(value)
        return ResourceConfigError(self.source, path, shown, problem, fix)

    def parse(self, data: Any) -> ResourceConfig:
        if not isinstance(data, Mapping):
            raise self.error("", data, "the file must map roles to settings",
                             "start from examples/resource_config.yaml (actor: ..., reward: ...)")
        self.check_keys(data, TOP_KEYS, prefix="")
        config = ResourceConfig(
            roles=FrozenMap(self.roles(data)),
            comm_backend=self.scalar(data, "comm_backend", "auto", COMM_BACKENDS.__contains__,
                                     "not a backend", "use nccl, gloo or auto"),
            timeout_seconds=float(self.scalar(
                data, "timeout_seconds", DEFAULT_TIMEOUT_SECONDS, _is_timeout,
                f"expected a number of seconds > 0 and at most {MAX_TIMEOUT_SECONDS} (about 116 days; the waits "
                "it bounds overflow far above), not inf or nan", "use e.g. timeout_seconds: 180")),
            allow_shared_devices=self.flag(data, "allow_shared_devices"),
            gpu_sharing=self.scalar(data, "gpu_sharing", "time_slice", GPU_SHARING.__contains__,
                                    "not a way to share a GPU", "use time_slice (the default) or mps"),
            allow_busy_devices=self.flag(data, "allow_busy_devices"),
            busy_memory_fraction=float(self.scalar(
                data, "busy_memory_fraction", devices.BUSY_MEMORY_FRACTION, _is_fraction,
                "expected a share of GPU memory from 0 to 1 (0.05 = 5%)",
                "use e.g. busy_memory_fraction: 0.05, or allow_busy_devices: true to share busy GPUs")),
            adaptive=FrozenMap(self.adaptive(data.get("adaptive"), data)),
            source=self.source)
        self.check_backend(config)
        self.check_overlap(config)
        self.check_devices(config)
        return config

    def check_keys(self, data: Mapping, allowed: Sequence[str], prefix: str) -> None:
        for key in data:
            if key not in allowed:
                hint = did_you_mean(key, allowed)
                raise self.error(f"{prefix}{key}", MISSING, f"unknown key{hint}",
                                 f"use one of {', '.join(allowed)}")

    def scalar(self, data: Mapping, key: str, default: Any, valid: Callable[[Any], bool],
               problem: str, fix: str) -> Any:
        value = data.get(key, default)
        if not valid(value):
            raise self.error(key, value, problem, fix)
        return value

    def flag(self, data: Mapping, key: str) -> bool:
        return self.scalar(data, key, False, lambda v: isinstance(v, bool),
                           "expected true or false", f"write {key}: true or {key}: false")

    def roles(self, data: Mapping) -> dict[str, RoleSpec]:
        for role in REQUIRED_ROLES:
            if role not in data:
                raise self.error(role, MISSING, "missing: actor, reward and rollout are required",
                                 f"add e.g. {role}: {{device_type: cpu, workers: 1}}")
        hosted = {role for role in ROLES if _is_hosted(data.get(role))}
        parsed = {role: self.role(role, data[role]) for role in ROLES if role in data and role not in hosted}
        for role in sorted(hosted):   # after the roles that host them: they take their devices
            parsed[role] = parse_hosted_role(self, role, data[role], parsed, lambda workers, device_type, role=role:
                                             self.strategy(role, data[role].get("strategy", MISSING), workers,
                                                           device_type))
        for role in ("critic", "reference"):
            parsed.setdefault(role, _placed_with_actor(parsed["actor"], role))
        return {role: parsed[role] for role in ROLES}

    def role(self, role: str, raw: Any) -> RoleSpec:
        if not isinstance(raw, Mapping):
            raise self.error(role, raw, "a role must be a mapping of settings",
                             f"write e.g. {role}: {{device_type: cuda, device_ids: [0]}}")
        if "job_queue" in raw:  # workers are batch jobs: resources/job_queue_spec.py
            return parse_job_queue_role(self, role, raw, lambda workers, device_type: self.strategy(
                role, raw.get("strategy", MISSING), workers, device_type))
        self.check_keys(raw, ROLE_KEYS, prefix=f"{role}.")
        device_type = self.device_type(role, raw.get("device_type", MISSING))
        if device_type == "cuda":
            ids = self.cuda_ids(role, raw.get("device_ids", MISSING))
            workers = raw.get("workers", len(ids))
            if not is_int(workers) or workers != len(ids):  # one worker process per GPU
                raise self.error(f"{role}.workers", workers,
                                 f"a cuda role runs one worker per GPU, so workers is {len(ids)}",
                                 "remove workers, or list one GPU per worker in device_ids")
        else:
            ids, workers = self.cpu_workers(role, raw)
        strategy = self.strategy(role, raw.get("strategy", MISSING), workers, device_type)
        vllm_args = self.vllm_args(role, raw.get("vllm_args", MISSING), strategy)
        cuda_graph_args = self.cuda_graph_args(role, raw.get("cuda_graph_args", MISSING), strategy)
        return RoleSpec(role, device_type, ids, workers, strategy, vllm_args, cuda_graph_args=cuda_graph_args,
                        max_gpu_memory_gib=self.gpu_memory_cap(role, raw.get("max_gpu_memory_gib"), device_type))

    def gpu_memory_cap(self, role: str, value: Any, device_type: str) -> float | None:
        path = f"{role}.max_gpu_memory_gib"
        if value is None:
            return None
        if device_type != "cuda":
            raise self.error(path, value, "a cap on GPU memory for a role on CPU workers",
                             "remove it, or use device_type: cuda")
        if not (is_positive_number(value) and value <= MAX_GPU_MEMORY_GIB):
            raise self.error(path, value, f"expected a number of GiB > 0 and at most {MAX_GPU_MEMORY_GIB}",
                             "use e.g. max_gpu_memory_gib: 20, or remove it to let the role use its whole GPU")
        return float(value)

    def device_type(self, role: str, value: Any) -> str:
        if value in DEVICE_TYPES:
            return value
        fix = "use cuda" if str(value).lower() in ("gpu", "cuda", "nvidia") else "use cuda or cpu"
        problem = "missing" if value is MISSING else "not a device type"
        raise self.error(f"{role}.device_type", value, problem, fix)

    def cuda_ids(self, role: str, ids: Any) -> tuple[int, ...]:
        path = f"{role}.device_ids"
        if ids is MISSING or ids is None:
            raise self.error(path, MISSING, "missing: a cuda role needs the GPUs it runs on",
                             "add e.g. device_ids: [0] (one worker per GPU), or use cpu")
        if not isinstance(ids, (list, tuple)):
            raise self.error(path, ids, "not a list of GPU ids",
                             f"write a list, e.g. [{show(ids)}]")
        if not ids:
            raise self.error(path, ids, "no GPUs listed", "list at least one GPU, e.g. [0], "
                             "or use device_type: cpu with workers: N")
        for i in ids:
            if not is_int(i) or i < 0:
                raise self.error(path, ids, f"{show(i)} is not a GPU id (an integer >= 0)",
                                 "use NVML indexes as nvidia-smi shows them, e.g. [0, 1]")
            if ids.count(i) > 1:
                raise self.error(path, ids, f"GPU {i} is listed twice",
                                 f"list each GPU once, e.g. {show(_example_ids(ids))}")
        return tuple(ids)

    def cpu_workers(self, role: str, raw: Mapping) -> tuple[tuple[int, ...], int]:
        ids = raw.get("device_ids", [])
        if ids not in ([], None):
            raise self.error(f"{role}.device_ids", ids, "a cpu role takes no GPU ids",
                             "write device_ids: [] (or remove it), or use device_type: cuda")
        workers = raw.get("workers", 1)
        if not _is_worker_count(workers):
            raise self.error(f"{role}.workers", workers, f"not an integer from 1 to {MAX_ROLE_WORKERS} (one "
                             "process each)", f"set workers: 1 or more, at most {MAX_ROLE_WORKERS}")
        return (), workers

    def strategy(self, role: str, value: Any, workers: int, device_type: str = "cpu") -> str:
        path, options = f"{role}.strategy", STRATEGIES[role]
        if value is MISSING:
            return _default_strategy(role, workers, device_type)
        if value not in options:
            raise self.error(path, value, f"not a {role} strategy{did_you_mean(value, options)}",
                             f"use one of {', '.join(options)}")
        if value == "none" and workers > 1:
            better = "ddp or fsdp" if role in _TRAINED_ROLES else "data_parallel"
            raise self.error(path, value, f"'none' runs one {role} worker but {workers} are set",
                             f"use strategy: {better} to use all {workers}, or give the role "
                             "one device")
        return value

    def vllm_args(self, role: str, args: Any, strategy: str) -> tuple[tuple[str, object], ...]:
        return parse_vllm_args(self, role, args, strategy)

    def cuda_graph_args(self, role: str, args: Any, strategy: str) -> tuple[tuple[str, object], ...]:
        return parse_cuda_graph_args(self, role, args, strategy)

    def adaptive(self, raw: Any, data: Mapping) -> dict[str, AdaptiveBounds]:
        if not isinstance(raw, (Mapping, type(None))):
            raise self.error("adaptive", raw, "expected a mapping of roles to bounds",
                             "write e.g. adaptive: {rollout: {min: 1, max: 3}}")
        return {role: self.bounds(role, b, data) for role, b in (raw or {}).items()}

    def bounds(self, role: Any, raw: Any, data: Mapping) -> AdaptiveBounds:
        path, example = f"adaptive.{role}", f"write e.g. {role}: {{min: 1, max: 3}}"
        if role not in ROLES:
            raise self.error(path, MISSING, f"not a role{did_you_mean(role, ROLES)}",
                             f"use one of {', '.join(ROLES)}")
        if role not in data:  # a defaulted role lives on the actor's devices: it can't move alone
            raise self.error(path, raw, f"{role} is not in the file (it is placed with the actor)",
                             f"add a {role} section with its own devices, or remove {path}")
        if _is_hosted(data[role]):
            raise self.error(path, raw, f"{role} runs in the {data[role]['hosted_by']}'s workers (hosted_by), "
                             f"so it grows and shrinks with them", f"remove {path}, or give the {role} devices "
                             f"of its own")
        if not isinstance(raw, Mapping) or set(raw) != {"min", "max"}:
            raise self.error(path, raw, "bounds need exactly min and max", example)
        low, high = raw["min"], raw["max"]
        if not (_is_worker_count(low) and _is_worker_count(high) and low <= high):
            raise self.error(path, raw, f"need integers with 1 <= min <= max <= {MAX_ROLE_WORKERS}", example)
        return AdaptiveBounds(low, high)

    def check_backend(self, config: ResourceConfig) -> None:
        if config.comm_backend != "nccl":
            return
        for role in _TRAINED_ROLES:  # the process groups that comm_backend is for
            if config.roles[role].device_type != "cuda":
                raise self.error("comm_backend", "nccl", f"NCCL needs GPUs but {role} runs on cpu",
                                 "use comm_backend: gloo, or auto (gloo for a cpu actor)")

    def check_overlap(self, config: ResourceConfig) -> None:
        if config.allow_shared_devices:
            return
        owner: dict[int, RoleSpec] = {}
        for spec in config.roles.values():
            for i in spec.device_ids:
                other = owner.setdefault(i, spec)
                # Defaulted critic/reference sit on the actor's GPUs: that is the default.
                if (other.moves_with or other.role) != (spec.moves_with or spec.role):
                    raise self.error(f"{spec.role}.device_ids", spec.device_ids,
                                     f"GPU {i} is also used by {other.role}",
                                     "give each role its own GPUs, or set allow_shared_devices: "
                                     "true to co-locate them on purpose (one-GPU machines)")

    def check_mps(self, config: ResourceConfig) -> None:
        """gpu_sharing: mps needs a control daemon listening where this host's workers will
        look: without one they would silently take turns on the GPU."""
        pipe = devices.mps_control_pipe()
        if config.gpu_sharing != "mps" or pipe.exists():
            return
        raise self.error("gpu_sharing", "mps", f"no NVIDIA MPS control daemon listens at {pipe}",
                         "start one with `nvidia-cuda-mps-control -d` (CUDA_MPS_PIPE_DIRECTORY for a daemon "
                         "of your own, exported before dask-rl starts), or remove gpu_sharing")

    def check_devices(self, config: ResourceConfig) -> None:
        # A job-queue role's GPUs are on its jobs' nodes, not this host's.
        cuda = [spec for spec in config.roles.values() if spec.device_type == "cuda" and spec.job_queue is None]
        if not cuda:
            return  # a CPU-only file must load without NVML
        gpus = list(self.gpus) if self.gpus is not None else devices.get_gpu_usage()
        if not gpus:
            ok, reason = devices.nvml_status() if self.gpus is None else (False, "none given")
            raise self.error(f"{cuda[0].role}.device_type", "cuda", "this machine has no usable "
                             f"NVIDIA GPU ({reason if not ok else 'NVML reports 0 GPUs'})",
                             f"use device_type: cpu with workers: {cuda[0].workers}")
        self.check_mps(config)
        have = sorted(g.index for g in gpus)
        busy = {} if config.allow_busy_devices else devices.busy_gpus(gpus, config.busy_memory_fraction)
        sizes = {g.index: g.total_bytes for g in gpus}
        for spec in cuda:
            path = f"{spec.role}.device_ids"
            for i in spec.device_ids:
                if i not in have:
                    raise self.error(path, spec.device_ids, f"GPU {i} does not exist; this "
                                     f"machine has GPUs {show(have)}",
                                     "use ids from that list (NVML order, as nvidia-smi shows)")
                cap = spec.max_gpu_memory_gib
                if cap is not None and sizes[i] and cap * 2**30 > sizes[i]:
                    raise self.error(f"{spec.role}.max_gpu_memory_gib", cap, f"GPU {i} has "
                                     f"{sizes[i] / 2**30:.1f} GiB", f"use at most {sizes[i] / 2**30:.1f}, or remove "
                                     f"it to let the role use its whole GPU")
                if i in busy and i not in self.owned:
                    raise self.error(path, spec.device_ids, f"GPU {i} is busy ({busy[i]})",
                                     "pick a free GPU, stop what runs there, or set "
                                     "allow_busy_devices: true to share it anyway")
