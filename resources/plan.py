"""A validated ResourceConfig -> one WorkerSpec per worker process (pure: no Dask, no NVML).

One worker per GPU: each spec pins its process to one physical GPU through the
environment, or hides every GPU for a CPU role, and carries exactly one role resource, so
that a task tagged with one role can only land on that role's workers. The exception is a
hosted role (`rollout: {hosted_by: actor}`): it has no workers of its own, and each of its
host's workers carries its resource too. cluster.py turns the
specs into Nanny processes; keeping this step pure lets tests check placement without a
cluster or a GPU.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, replace

from resources.config import ROLES, JobQueueSpec, ResourceConfig, RoleSpec
from resources.devices import pin_to_device

__all__ = ["WorkerSpec", "device_roles", "plan_role", "plan_workers"]


@dataclass(frozen=True)
class WorkerSpec:
    name: str  # "{role}-{k}", k counting up per role: a stable Dask worker name
    role: str
    device_type: str  # "cuda" | "cpu"
    device_id: int | None  # physical (NVML) GPU id; None for cpu
    env: tuple[tuple[str, str], ...]  # from devices.pin_to_device; a tuple keeps it frozen
    nthreads: int = 1  # one task at a time: a model on a GPU is not shared between threads
    job_queue: JobQueueSpec | None = None  # a batch job (resources.job_queue), not a local process
    hosts: tuple[str, ...] = ()  # roles this process runs too (their `hosted_by` is `role`)

    @property
    def env_dict(self) -> dict[str, str]:
        return dict(self.env)

    @property
    def resources(self) -> dict[str, float]:
        """The Dask worker resources: one unit of its role (and of each role it hosts)."""
        return {self.role: 1, **{hosted: 1 for hosted in self.hosts}}


# torch's allocator for a GPU process that hosts another role: memory grown by mapping more
# into one segment instead of cudaMalloc'ing new ones, so the blocks that generation and the
# update free and take in turn are not stranded in segments of the wrong size (apart, on the
# long-tail run, the actor reserved 8.5 instead of 10.2-12.3 GiB for the same tensors). Not
# for processes whose weights travel by CUDA IPC (a separate rollout): sharing such memory
# needs the pidfd_getfd system call, which some containers forbid. A value set in the
# environment that starts dask-rl is inherited instead.
HOSTING_ALLOCATOR = ("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")


def _worker_env(device_id: int | None, hosts: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    env = tuple(pin_to_device(device_id).items())
    if hosts and device_id is not None and HOSTING_ALLOCATOR[0] not in os.environ:
        env += (HOSTING_ALLOCATOR,)
    return env


def plan_role(spec: RoleSpec, first_index: int = 0, hosts: tuple[str, ...] = ()) -> list[WorkerSpec]:
    """Workers for one role, numbered from `first_index` (scaling up adds after the last);
    `hosts`: the roles its workers run too. A hosted role has none of its own."""
    if spec.hosted_by is not None:
        return []
    cuda = spec.device_type == "cuda" and spec.job_queue is None
    devices: list[int | None] = list(spec.device_ids) if cuda else [None] * spec.workers
    # A CPU worker hides every GPU; a GPU job's one GPU is the one SLURM gives it (--gres).
    job_gpu = spec.job_queue is not None and spec.device_type == "cuda"
    return [
        WorkerSpec(
            name=f"{spec.role}-{first_index + k}",
            role=spec.role,
            device_type=spec.device_type,
            device_id=device_id,
            env=() if job_gpu else _worker_env(device_id, hosts),
            job_queue=spec.job_queue,
            hosts=hosts,
        )
        for k, device_id in enumerate(devices)
    ]


def plan_workers(config: ResourceConfig) -> list[WorkerSpec]:
    """Every worker of every role, in ROLES order.

    Defaulted critic/reference get their own workers on the actor's GPUs: one role resource
    per worker keeps the tagging simple, and the config only allows such sharing for roles
    placed with the actor or when the file opts in with allow_shared_devices.
    """
    return [worker for role in ROLES for worker in plan_role(config.role(role), hosts=config.hosted_roles(role))]


def device_roles(workers: Iterable[WorkerSpec]) -> dict[int, list[str]]:
    """GPU id -> the roles with a worker on it, for placement reports; CPU workers are skipped."""
    roles: dict[int, list[str]] = {}
    for worker in workers:
        if worker.device_id is None:
            continue
        on_device = roles.setdefault(worker.device_id, [])
        if worker.role not in on_device:
            on_device.append(worker.role)
    return dict(sorted(roles.items()))


def plan_change(current: Iterable[WorkerSpec], spec: RoleSpec, next_index: int, hosts: tuple[str, ...] = ()
                ) -> tuple[list[WorkerSpec], list[WorkerSpec]]:
    """Workers to start and workers to retire so that a role matches `spec`.

    GPU roles keep the workers whose device is still listed and start one per new device;
    CPU roles keep their oldest workers up to the new count. New names continue from
    `next_index`, so a name is never reused for a different worker.
    """
    if spec.hosted_by is not None:   # its host's workers carry it: they change with the host
        return [], []
    current = [w for w in current if w.role == spec.role]
    if spec.device_type == "cuda" and spec.job_queue is None:
        wanted = list(spec.device_ids)
        keep = [w for w in current if w.device_type == "cuda" and w.device_id in wanted]
        kept_ids = {w.device_id for w in keep}
        new_ids = [i for i in wanted if i not in kept_ids]
        start = [replace(w, name=f"{spec.role}-{next_index + k}")
                 for k, w in enumerate(plan_role(replace(spec, device_ids=tuple(new_ids), workers=len(new_ids)),
                                                 hosts=hosts))]
    else:  # CPU workers or jobs: a count
        keep = [w for w in current if w.device_type == spec.device_type and w.job_queue == spec.job_queue
                ][:spec.workers]
        start = (plan_role(replace(spec, workers=spec.workers - len(keep)), next_index, hosts)
                 if spec.workers > len(keep) else [])
    retire = [w for w in current if w not in keep]
    return start, retire
