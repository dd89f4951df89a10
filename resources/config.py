"""The resource file's types: which role runs on which devices.

The file is the contract between the user and the cluster. Every bad file gets one
ResourceConfigError naming the file, the key path, the value and the fix, raised before
anything starts: a typo found after a model has loaded on four GPUs costs minutes.

This module holds only the types (RoleSpec, ResourceConfig, AdaptiveBounds, FrozenMap,
ResourceConfigError) and the file's constants. Imports run one way: resources.yaml_reader
reads the file, resources.validate parses it into these types (load_resource_config,
parse_resource_config, with_role); neither is imported here.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["CUDA_GRAPH_ARGS", "CUDA_GRAPH_MAX_BATCH", "HOSTS", "ROLES", "STRATEGIES", "AdaptiveBounds", "JobQueueSpec",
           "ResourceConfig", "ResourceConfigError", "RoleSpec", "shorten"]

ROLES = ("actor", "critic", "reference", "reward", "rollout")
REQUIRED_ROLES = ("actor", "reward", "rollout")
STRATEGIES = {
    "actor": ("fsdp", "ddp", "none"), "critic": ("fsdp", "ddp", "none"),
    "reference": ("none", "data_parallel"), "reward": ("none", "data_parallel"),
    # cuda_graph: the CUDA-graph decode loop (pipeline/engines/cuda_graph.py), the default on GPUs;
    # hf: transformers' generate, the default on CPUs; vllm: vLLM, where it is installed.
    "rollout": ("cuda_graph", "hf", "vllm"),
}
# The cuda_graph engine's options (a rollout role's `cuda_graph_args`) and the values each takes,
# the default first: its decode attention (the Triton kernel, or SDPA), whether it fuses each
# layer's projections into fewer matrix products, and whether prefill passes run compiled.
CUDA_GRAPH_ARGS = {"decode_attention": ("kernel", "sdpa"), "fuse_projections": (True, False),
                   "compile_prefill": (False, True)}
# Its one number: decode slots at most (rounded up to a power of two; free memory may hold
# fewer). Fewer slots keep a smaller KV cache, for one that shares a process or a cap.
CUDA_GRAPH_MAX_BATCH = ("max_batch_size", 256, 4096)   # key, default, largest
DEVICE_TYPES = ("cuda", "cpu")
COMM_BACKENDS = ("nccl", "gloo", "auto")
# How roles placed on one GPU share it: the NVIDIA driver's time slices (one process's kernels at a
# time) or NVIDIA MPS, whose daemon runs the kernels of several processes at once.
GPU_SHARING = ("time_slice", "mps")
ROLE_KEYS = ("device_type", "device_ids", "workers", "strategy", "vllm_args", "cuda_graph_args",
             "max_gpu_memory_gib")
# A rollout may run inside the actor's worker processes instead of its own (`rollout: {hosted_by:
# actor}`): its engine reads the actor's parameters in place, so the GPU holds one copy of the
# weights, one CUDA context and no published copy, and generation and updates take turns.
HOSTED_ROLE_KEYS = ("hosted_by", "strategy", "cuda_graph_args")
HOSTS = {"rollout": "actor"}   # role -> the role whose workers may host it
HOSTED_STRATEGIES = ("cuda_graph", "hf")   # engines that can read a module's own tensors
# `train` belongs to the pipeline package, which reads it from the same file.
TOP_KEYS = ROLES + ("comm_backend", "timeout_seconds", "allow_shared_devices", "gpu_sharing",
                    "allow_busy_devices", "busy_memory_fraction", "adaptive", "train")
_TRAINED_ROLES = ("actor", "critic")  # the roles that form a torch.distributed group
# How much of a user's value an error message echoes: a 1 MiB string or a whole file
# pasted as a key must not flood the terminal or a log line.
ECHO_LIMIT = 100


def shorten(text: str, limit: int = ECHO_LIMIT) -> str:
    """`text` on one line, cut to `limit` characters with "..." when longer."""
    text = text.replace("\r", "\\r").replace("\n", "\\n")
    return text if len(text) <= limit else text[:limit - 3] + "..."


def did_you_mean(word: object, options: Sequence[str]) -> str:
    close = difflib.get_close_matches(shorten(str(word)), options, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


class ResourceConfigError(ValueError):
    """One problem in a resource file: `file: key.path: value: problem. Fix: ...`."""

    def __init__(self, source: str, path: str, value: str | None, problem: str, fix: str):
        # path and value come from the file (a key, a value): bounded, so one line stays short.
        path, value = shorten(path), None if value is None else shorten(value)
        problem = shorten(problem, 3 * ECHO_LIMIT)
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
class JobQueueSpec:
    """How one job of a job-queue role is asked for (resources.job_queue_spec parses it;
    resources.job_queue submits it). The number of jobs is the role's `workers`: each job
    runs one worker process, on one GPU when gpus_per_job is 1."""

    scheduler: str = "slurm"
    gpus_per_job: int = 0
    cores: int = 1                 # CPUs per job (the worker still runs one task at a time)
    memory: str = "4GB"            # per job, as SLURM's --mem
    queue: str | None = None       # the partition (-p)
    account: str | None = None     # -A
    walltime: str = "01:00:00"     # -t
    job_extra: tuple[str, ...] = ()     # more #SBATCH directives, e.g. "--constraint=a100"
    prologue: tuple[str, ...] = ()      # shell lines run before the worker, e.g. "module load cuda"
    log_directory: str | None = None    # where the jobs' output goes (None: sbatch's working directory)

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"job_queue": self.scheduler, "gpus_per_job": self.gpus_per_job,
                                "cores": self.cores, "memory": self.memory, "walltime": self.walltime}
        optional = {"queue": self.queue, "account": self.account, "job_extra": list(self.job_extra),
                    "prologue": list(self.prologue), "log_directory": self.log_directory}
        data.update((key, value) for key, value in optional.items() if value)
        return data


@dataclass(frozen=True)
class RoleSpec:
    role: str
    device_type: str  # "cuda" | "cpu"
    device_ids: tuple[int, ...]  # physical (NVML) GPU ids; () for cpu
    workers: int  # len(device_ids) for cuda: one worker process per GPU
    strategy: str
    vllm_args: tuple[tuple[str, object], ...] = ()  # a tuple so the spec stays immutable
    placed_with: str | None = None  # "actor" when defaulted from the actor, not in the file
    job_queue: JobQueueSpec | None = None  # workers are batch jobs (`workers` of them), not local devices
    cuda_graph_args: tuple[tuple[str, object], ...] = ()  # the cuda_graph engine's options (CUDA_GRAPH_ARGS)
    hosted_by: str | None = None  # "actor": runs in the actor's workers, on its devices (HOSTS)
    # The most GPU memory each worker process of the role allocates through torch (GiB; its
    # CUDA context comes on top); None: all of its GPU. A hosted role shares its host's.
    max_gpu_memory_gib: float | None = None

    @property
    def moves_with(self) -> str | None:
        """The role whose devices this one follows (defaulted beside it, or hosted by it);
        such a role is not scaled on its own."""
        return self.placed_with or self.hosted_by

    @property
    def vllm_kwargs(self) -> dict[str, object]:
        return dict(self.vllm_args)

    @property
    def engine_kwargs(self) -> dict[str, object]:
        """The rollout engine's arguments from the file: its strategy's `<strategy>_args`."""
        return dict(self.vllm_args or self.cuda_graph_args)


@dataclass(frozen=True)
class AdaptiveBounds:
    minimum: int
    maximum: int


# The one bound on every wait of a run (a role's tasks, a worker's start, a drain, a
# rendezvous), unless the resource file says otherwise.
DEFAULT_TIMEOUT_SECONDS = 180.0


@dataclass(frozen=True)
class ResourceConfig:
    roles: Mapping[str, RoleSpec]  # all of ROLES, in ROLES order
    comm_backend: str = "auto"  # as written; see resolved_comm_backend
    timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS
    allow_shared_devices: bool = False
    gpu_sharing: str = "time_slice"   # one of GPU_SHARING
    allow_busy_devices: bool = False
    # A declared GPU on which other processes use more than this share of the memory is
    # refused at start (naming them) unless allow_busy_devices (devices.busy_gpus).
    busy_memory_fraction: float = 0.05
    adaptive: Mapping[str, AdaptiveBounds] = field(default_factory=FrozenMap)
    source: str = field(default="<dict>", compare=False)  # names the file on re-validation

    def role(self, name: str) -> RoleSpec:
        if name not in self.roles:
            shown = shorten(repr(name))
            raise KeyError(f"unknown role {shown}{did_you_mean(name, ROLES)}; roles: {ROLES}")
        return self.roles[name]

    def hosted_roles(self, host: str) -> tuple[str, ...]:
        """The roles that run inside `host`'s worker processes (their `hosted_by`)."""
        return tuple(name for name, spec in self.roles.items() if spec.hosted_by == host)

    @property
    def uses_cuda(self) -> bool:
        return any(spec.device_type == "cuda" for spec in self.roles.values())

    @property
    def gpu_ids(self) -> tuple[int, ...]:
        return tuple(sorted({i for spec in self.roles.values() for i in spec.device_ids}))

    def share_gpus(self, first: str, second: str) -> bool:
        """Whether a worker of role `first` and one of `second` are placed on the same GPU."""
        a, b = self.role(first), self.role(second)
        return a.device_type == b.device_type == "cuda" and bool(set(a.device_ids) & set(b.device_ids))

    def take_turns(self, first: str, second: str) -> bool:
        """Whether the two roles' GPU work runs one after the other: on a GPU they share,
        unless MPS runs both processes' kernels at once."""
        if first in self.hosted_roles(second) or second in self.hosted_roles(first):
            return True   # one process, one task at a time
        return self.share_gpus(first, second) and self.gpu_sharing != "mps"

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
            role: role_dict(spec) for role, spec in self.roles.items() if not spec.placed_with}
        data.update(comm_backend=self.comm_backend, timeout_seconds=self.timeout_seconds,
                    allow_shared_devices=self.allow_shared_devices, gpu_sharing=self.gpu_sharing,
                    allow_busy_devices=self.allow_busy_devices,
                    busy_memory_fraction=self.busy_memory_fraction)
        if self.adaptive:
            data["adaptive"] = {role: {"min": b.minimum, "max": b.maximum}
                                for role, b in self.adaptive.items()}
        return data


def role_dict(spec: RoleSpec) -> dict[str, Any]:
    if spec.hosted_by is not None:
        return {"hosted_by": spec.hosted_by, "strategy": spec.strategy, **engine_args_dict(spec)}
    if spec.job_queue is not None:
        return {**spec.job_queue.to_dict(), "jobs": spec.workers, "strategy": spec.strategy,
                **engine_args_dict(spec)}
    data: dict[str, Any] = {"device_type": spec.device_type,
                            "device_ids": list(spec.device_ids), "strategy": spec.strategy}
    if spec.device_type == "cpu":
        data["workers"] = spec.workers
    if spec.max_gpu_memory_gib is not None:
        data["max_gpu_memory_gib"] = spec.max_gpu_memory_gib
    return {**data, **engine_args_dict(spec)}


def engine_args_dict(spec: RoleSpec) -> dict[str, dict[str, object]]:
    """The role's engine options as the file writes them (`vllm_args`, `cuda_graph_args`), those it has."""
    sections = {"vllm_args": spec.vllm_args, "cuda_graph_args": spec.cuda_graph_args}
    return {key: dict(args) for key, args in sections.items() if args}
