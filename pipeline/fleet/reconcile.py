"""What a placement change is: the request, its validation against the current placement,
and the report of what it changed. The Fleet applies it (fleet.py)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Sequence

from pipeline.roles import actor, critic
from resources.config import ResourceConfig, RoleSpec, engine_args_dict
from resources.validate import with_changes, with_role

# The roles whose state lives in a process group: a resize exports it first (these tasks).
TRAINABLE_EXPORTS = {"actor": actor.export_state, "critic": critic.export_state}


@dataclass(frozen=True)
class ResourceRequest:
    """One update_resource call: give `component` these devices or this many workers."""

    component: str
    device_ids: Sequence[int] | None = None
    strategy: str | None = None
    workers: int | None = None
    device_type: str | None = None
    jobs: int | None = None      # a job-queue role's job count (one worker each)


@dataclass(frozen=True)
class ResourceChange:
    """What one update_resource call changed for one role."""

    role: str
    added: tuple[str, ...]       # worker names started
    removed: tuple[str, ...]     # worker names drained and retired
    workers: tuple[str, ...]     # the role's workers afterwards
    devices: tuple[int, ...]     # its GPUs afterwards (empty on CPU)
    strategy: str
    seconds: float               # the whole change: start, load, drain, retire
    ready_seconds: float = 0.0   # from the call to the new workers' first task done (0 if none added)
    # Of `workers`, those this trainer started and manages: what workers=N and device_ids count.
    # The others joined from elsewhere (`dask-rl worker`) and are stopped from their own host.
    managed: tuple[str, ...] = ()

    def __str__(self) -> str:
        where = f"GPUs {list(self.devices)}" if self.devices else f"{len(self.managed)} CPU workers"
        joined = len(self.workers) - len(self.managed)
        if joined:
            where += (f" managed by this trainer, {len(self.workers)} in all ({joined} joined from elsewhere, "
                      f"not counted by workers=N)")
        return (f"{self.role}: +{list(self.added)} -{list(self.removed)} -> {where}, strategy "
                f"{self.strategy} ({self.seconds:.1f}s)")


def requested_config(config: ResourceConfig, request: ResourceRequest) -> ResourceConfig:
    """The whole placement after `request`, validated like a fresh file: the arguments are
    written as the role's section of a resource file and go through the file's checks (types,
    ranges, limits), so a wrong one is one error naming the key, the value and the fix."""
    role = request.component if isinstance(request.component, str) and request.component in config.roles else None
    if role is not None and config.role(role).job_queue is not None:  # a job count: the queue gives devices
        return with_role(config, _requested_jobs(config.role(role), request))
    return with_changes(config, {request.component: requested_settings(config, request)}, source="update_resource")


def requested_settings(config: ResourceConfig, request: ResourceRequest) -> dict[str, Any]:
    """The role's section of a resource file that `request` asks for. Only what the file's
    checks cannot say is checked here: which arguments go together."""
    component, device_ids, workers, device_type = (request.component, request.device_ids, request.workers,
                                                   request.device_type)
    if not isinstance(component, str) or component not in config.roles:
        raise ValueError(f"update_resource: unknown component {component!r}. Fix: use one of {sorted(config.roles)}.")
    current = config.role(component)
    if current.hosted_by is not None:
        raise ValueError(f"update_resource: {component} runs in the {current.hosted_by}'s workers ({component}."
                         f"hosted_by: {current.hosted_by}), so it grows and shrinks with them. Fix: change the "
                         f"{current.hosted_by}'s devices, or start the run with a {component} section of its own "
                         f"devices to scale it apart.")
    if request.jobs is not None:
        raise ValueError(f"update_resource: jobs= is for a role on a job queue; {component} runs on local "
                         f"{'GPUs: give device_ids' if current.device_type == 'cuda' else 'CPU workers: give workers'}")
    kind = current.device_type if device_type is None else device_type
    if not isinstance(kind, str) or kind not in ("cuda", "cpu"):
        raise ValueError(f"update_resource: device_type={device_type!r}. Fix: use 'cuda' or 'cpu'.")
    if kind == "cuda":
        if workers is not None and device_ids is None:
            raise ValueError(f"update_resource: {component} runs on GPUs; give device_ids=[...] rather than "
                             f"workers=, or device_type='cpu' to move it to CPU workers")
        if device_ids is None and current.device_type != "cuda":
            raise ValueError(f"update_resource: moving {component} to GPUs needs device_ids=[...]")
        ids = current.device_ids if device_ids is None else device_ids
        settings: dict[str, Any] = {"device_type": "cuda",
                                    "device_ids": list(ids) if isinstance(ids, (list, tuple)) else ids}
        if workers is not None:
            settings["workers"] = workers
        emptied = isinstance(ids, (list, tuple)) and not ids
    else:
        if device_ids is not None and device_ids != [] and device_ids != ():
            raise ValueError(f"update_resource: {component} runs on CPU workers; give workers=N, not device_ids "
                             f"(or device_type='cuda' to move it to GPUs)")
        count = workers if workers is not None else (current.workers if current.device_type == "cpu" else 1)
        settings = {"device_type": "cpu", "workers": count}
        emptied = type(count) is int and count < 1
    if emptied:
        raise ValueError(f"update_resource: that would remove the last {component} worker. Fix: keep at least one "
                         f"device or worker for {component}; move it elsewhere by giving the new one in the same call.")
    settings["strategy"] = current.strategy if request.strategy is None else request.strategy
    if settings["strategy"] == current.strategy:   # an engine's options go with its engine
        settings.update(engine_args_dict(current))
    return settings


def _requested_jobs(current: RoleSpec, request: ResourceRequest) -> RoleSpec:
    """A job-queue role changes its number of jobs (jobs=, or workers= which means the same)."""
    component = request.component
    if request.device_ids or request.device_type:
        raise ValueError(f"update_resource: {component} runs as batch jobs, whose devices the queue gives. Fix: "
                         f"give jobs=N (one worker per job), or change its section of the resource file")
    if request.jobs is not None and request.workers is not None and request.jobs != request.workers:
        raise ValueError(f"update_resource: jobs={request.jobs} and workers={request.workers} disagree for "
                         f"{component} (one worker per job). Fix: give only jobs=N")
    count = next((n for n in (request.jobs, request.workers) if n is not None), current.workers)
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"update_resource: jobs={count!r} for {component}. Fix: give jobs=1 or more: removing the "
                         f"last {component} worker would stop the training")
    return replace(current, workers=count, strategy=request.strategy or current.strategy)
