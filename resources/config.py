"""The resource file: which role runs on which devices, validated once and strictly.

The file is the contract between the user and the cluster (DESIGN.md). Every bad file gets
one ResourceConfigError naming the file, the key path, the value and the fix, raised before
anything starts: a typo found after a model has loaded on four GPUs costs minutes.

This module holds the types (RoleSpec, ResourceConfig, AdaptiveBounds, FrozenMap,
ResourceConfigError), the file's constants, the YAML reader and the public load/parse
functions; the validation pass itself (`_Parser`) lives in resources.validate, which imports
these types, so it is imported here inside the functions that use it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from resources.devices import GpuInfo

__all__ = ["ROLES", "STRATEGIES", "AdaptiveBounds", "ResourceConfig", "ResourceConfigError",
           "RoleSpec", "load_resource_config", "parse_resource_config"]

ROLES = ("actor", "critic", "reference", "reward", "rollout")
REQUIRED_ROLES = ("actor", "reward", "rollout")
STRATEGIES = {
    "actor": ("fsdp", "ddp", "none"), "critic": ("fsdp", "ddp", "none"),
    "reference": ("none", "data_parallel"), "reward": ("none", "data_parallel"),
    # cuda_graph: the CUDA-graph decode loop (pipeline/engines/cuda_graph.py), the default on GPUs;
    # hf: transformers' generate, the default on CPUs; vllm: vLLM, where it is installed.
    "rollout": ("cuda_graph", "hf", "vllm"),
}
DEVICE_TYPES = ("cuda", "cpu")
COMM_BACKENDS = ("nccl", "gloo", "auto")
ROLE_KEYS = ("device_type", "device_ids", "workers", "strategy", "vllm_args")
# `train` belongs to the pipeline package, which reads it from the same file.
TOP_KEYS = ROLES + ("comm_backend", "timeout_seconds", "allow_shared_devices",
                    "allow_busy_devices", "adaptive", "train")
_TRAINED_ROLES = ("actor", "critic")  # the roles that form a torch.distributed group


class ResourceConfigError(ValueError):
    """One problem in a resource file: `file: key.path: value: problem. Fix: ...`."""

    def __init__(self, source: str, path: str, value: str | None, problem: str, fix: str):
        self.source, self.path, self.value = source, path, value
        self.problem, self.fix = problem, fix
        head = ": ".join(p for p in (source, path, value) if p)
        super().__init__(f"{head}: {problem}. Fix: {fix}.")

    def __reduce__(self):  # picklable, so it survives a trip through Dask
        return type(self), (self.source, self.path, self.value, self.problem, self.fix)


class FrozenMap(Mapping):
    """A read-only dict that pickles (types.MappingProxyType does not, and configs travel)."""

    __slots__ = ("_data",)

    def __init__(self, data: Mapping | Sequence = ()):
        self._data = dict(data)

    def __getitem__(self, key):
        return self._data[key]

    def __iter__(self) -> Iterator:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __repr__(self) -> str:
        return f"FrozenMap({self._data!r})"


@dataclass(frozen=True)
class RoleSpec:
    role: str
    device_type: str  # "cuda" | "cpu"
    device_ids: tuple[int, ...]  # physical (NVML) GPU ids; () for cpu
    workers: int  # len(device_ids) for cuda: one worker process per GPU
    strategy: str
    vllm_args: tuple[tuple[str, object], ...] = ()  # a tuple so the spec stays immutable
    placed_with: str | None = None  # "actor" when defaulted from the actor, not in the file

    @property
    def vllm_kwargs(self) -> dict[str, object]:
        return dict(self.vllm_args)


@dataclass(frozen=True)
class AdaptiveBounds:
    minimum: int
    maximum: int


@dataclass(frozen=True)
class ResourceConfig:
    roles: Mapping[str, RoleSpec]  # all of ROLES, in ROLES order
    comm_backend: str = "auto"  # as written; see resolved_comm_backend
    timeout_seconds: float = 180.0
    allow_shared_devices: bool = False
    allow_busy_devices: bool = False
    adaptive: Mapping[str, AdaptiveBounds] = field(default_factory=FrozenMap)
    source: str = field(default="<dict>", compare=False)  # names the file on re-validation

    def role(self, name: str) -> RoleSpec:
        if name not in self.roles:
            from resources.validate import _did_you_mean  # validate imports this module
            raise KeyError(f"unknown role {name!r}{_did_you_mean(name, ROLES)}; roles: {ROLES}")
        return self.roles[name]

    @property
    def uses_cuda(self) -> bool:
        return any(spec.device_type == "cuda" for spec in self.roles.values())

    @property
    def gpu_ids(self) -> tuple[int, ...]:
        return tuple(sorted({i for spec in self.roles.values() for i in spec.device_ids}))

    @property
    def resolved_comm_backend(self) -> str:
        """What "auto" means: NCCL when the actor's process group is on GPUs, else gloo."""
        if self.comm_backend != "auto":
            return self.comm_backend
        return "nccl" if self.roles["actor"].device_type == "cuda" else "gloo"

    def to_dict(self) -> dict[str, Any]:
        """A resource-file mapping that parses back to an equal config (defaulted roles left
        out, so that they keep following the actor)."""
        data: dict[str, Any] = {
            role: _role_dict(spec) for role, spec in self.roles.items() if not spec.placed_with}
        data.update(comm_backend=self.comm_backend, timeout_seconds=self.timeout_seconds,
                    allow_shared_devices=self.allow_shared_devices,
                    allow_busy_devices=self.allow_busy_devices)
        if self.adaptive:
            data["adaptive"] = {role: {"min": b.minimum, "max": b.maximum}
                                for role, b in self.adaptive.items()}
        return data

    def with_role(self, spec: RoleSpec, *, gpus: Sequence[GpuInfo] | None = None
                  ) -> ResourceConfig:
        """A copy with one role replaced, validated like a fresh file. GPUs this config
        already uses skip the busy check (our own workers make them busy); replacing the
        actor moves defaulted critic/reference with it."""
        data = self.to_dict()
        data[spec.role] = _role_dict(spec)
        from resources.validate import _Parser  # validate imports this module
        return _Parser(self.source, gpus, owned=set(self.gpu_ids)).parse(data)


def _role_dict(spec: RoleSpec) -> dict[str, Any]:
    data: dict[str, Any] = {"device_type": spec.device_type,
                            "device_ids": list(spec.device_ids), "strategy": spec.strategy}
    if spec.device_type == "cpu":
        data["workers"] = spec.workers
    if spec.vllm_args:
        data["vllm_args"] = spec.vllm_kwargs
    return data


def load_resource_config(source: str | os.PathLike | Mapping, *,
                         gpus: Sequence[GpuInfo] | None = None) -> ResourceConfig:
    """Read and validate a resource file or mapping; `gpus` replaces the NVML probe."""
    if isinstance(source, Mapping):
        return parse_resource_config(source, gpus=gpus)
    name = os.fspath(source)
    return parse_resource_config(_read_yaml(Path(name), name), source=name, gpus=gpus)


def parse_resource_config(data: Mapping, *, source: str = "<dict>",
                          gpus: Sequence[GpuInfo] | None = None) -> ResourceConfig:
    from resources.validate import _Parser  # validate imports this module
    return _Parser(source, gpus, owned=set()).parse(data)


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate keys; plain YAML silently keeps the last one."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<: *base` may be overridden by later keys on purpose
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, (str, int, float)):
                continue  # an unhashable key: SafeLoader reports it itself
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


def _read_yaml(path: Path, name: str) -> Any:
    if not path.is_file():
        problem = "is a directory" if path.is_dir() else "file not found"
        raise ResourceConfigError(name, "", None, problem, f"check the path ({path.resolve()})")
    try:
        return yaml.load(path.read_text(encoding="utf-8"), Loader=_StrictLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        fix = ("write each key once" if problem.startswith("duplicate key") else
               "correct the YAML there (indentation, a missing ':' or an unclosed bracket)")
        problem = f"invalid YAML ({problem})"
        raise ResourceConfigError(name, where, None, problem, fix) from None
