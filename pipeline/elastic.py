"""Moving devices between roles while training runs.

A change is reconciliation: the new resource config is validated like a fresh file, each
role's wanted workers are compared with its live ones, new workers are started (they load
the role's model before taking any task, and rollout workers receive the current
weights), and removed workers are drained (no new task, running ones finish) and only then
retired. The trainable roles (actor, critic) change at a step boundary: their full model
and optimizer state is exported first and every rank of the new group starts from it.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Sequence

from pipeline.roles import actor, critic, rollout
from pipeline.roles.host import role_ready
from pipeline.tasks import submit, wait_role
from resources.adaptive import RoleAdaptive
from resources.config import ResourceConfig, RoleSpec
from resources.plan import plan_change

if TYPE_CHECKING:
    from pipeline.trainer import HybridTrainer

logger = logging.getLogger("dask_rl")
TRAINABLE = {"actor": actor.export_state, "critic": critic.export_state}


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

    def __str__(self) -> str:
        where = f"GPUs {list(self.devices)}" if self.devices else f"{len(self.workers)} CPU workers"
        return (f"{self.role}: +{list(self.added)} -{list(self.removed)} -> {where}, strategy "
                f"{self.strategy} ({self.seconds:.1f}s)")


@dataclass
class BoundaryRequest:
    """An update_resource call waiting for the training thread to apply it between steps."""

    component: str
    device_ids: Sequence[int] | None
    strategy: str | None
    workers: int | None
    device_type: str | None = None

    def __post_init__(self):
        self._done = threading.Event()
        self._result: list[ResourceChange] | None = None
        self._error: BaseException | None = None

    def finish(self, result: list[ResourceChange]) -> None:
        self._result = result
        self._done.set()

    def fail(self, error: BaseException) -> None:
        self._error = error
        self._done.set()

    def wait(self, timeout: float) -> list[ResourceChange]:
        if not self._done.wait(timeout):
            raise TimeoutError(f"update_resource({self.component!r}): no step boundary within {timeout:.0f}s")
        if self._error is not None:
            raise self._error
        return self._result


def requested_spec(config: ResourceConfig, component: str, device_ids: Sequence[int] | None,
                   strategy: str | None, workers: int | None, device_type: str | None = None) -> RoleSpec:
    """The role spec an update_resource call asks for; errors name the argument and the fix."""
    if component not in config.roles:
        raise ValueError(f"update_resource: unknown component {component!r}. Fix: use one of {sorted(config.roles)}.")
    current = config.role(component)
    kind = device_type or current.device_type
    if kind not in ("cuda", "cpu"):
        raise ValueError(f"update_resource: device_type={device_type!r}. Fix: use 'cuda' or 'cpu'.")
    if kind == "cuda":
        if workers is not None and device_ids is None:
            raise ValueError(f"update_resource: {component} runs on GPUs; give device_ids=[...] rather than "
                             f"workers=, or device_type='cpu' to move it to CPU workers")
        if device_ids is None and current.device_type != "cuda":
            raise ValueError(f"update_resource: moving {component} to GPUs needs device_ids=[...]")
        ids = tuple(current.device_ids if device_ids is None else device_ids)
        spec = replace(current, device_type="cuda", device_ids=ids, workers=len(ids), placed_with=None)
    else:
        if device_ids:
            raise ValueError(f"update_resource: {component} runs on CPU workers; give workers=N, not device_ids "
                             f"(or device_type='cuda' to move it to GPUs)")
        count = workers if workers is not None else (current.workers if current.device_type == "cpu" else 1)
        spec = replace(current, device_type="cpu", device_ids=(), workers=count, placed_with=None)
    if spec.workers < 1:
        raise ValueError(f"update_resource: that would remove the last {component} worker. Fix: keep at least one "
                         f"device or worker for {component}; move it elsewhere by giving the new one in the same call.")
    return replace(spec, strategy=strategy or spec.strategy)


def apply_config(trainer: HybridTrainer, new_config: ResourceConfig) -> list[ResourceChange]:
    """Reconcile the live workers of every role the trainer uses with `new_config`."""
    cluster, timeout = trainer.cluster, new_config.timeout_seconds
    changes = []
    for role in trainer.roles:
        start_time = time.perf_counter()
        live = {w["name"]: w["address"] for w in cluster.workers_of(role)}
        current = [spec for name, spec in cluster.specs.items() if name in live]
        start, retire = plan_change(current, new_config.role(role), cluster.next_index(role))
        restrategy = role in TRAINABLE and trainer.groups.strategy(role) not in (None, new_config.role(role).strategy)
        if not start and not retire and not restrategy:
            continue
        if role in TRAINABLE:  # every rank of the new group starts from exactly this state
            trainer.groups.restore_paths[role] = _export(trainer, role, list(live.values()))
        added = cluster.add_workers(start, timeout) if start else {}
        _wait_ready(trainer, role, list(added.values()))
        ready = time.perf_counter() - start_time if added else 0.0
        removed = [live[w.name] for w in retire]
        if removed:
            cluster.drain(removed, role, timeout)
            cluster.retire(removed)
        spec = new_config.role(role)
        change = ResourceChange(role, tuple(sorted(added)), tuple(w.name for w in retire),
                                tuple(w["name"] for w in cluster.workers_of(role)), spec.device_ids,
                                spec.strategy, time.perf_counter() - start_time, ready)
        logger.warning("dask-rl: %s", change)
        changes.append(change)
    trainer.resources = new_config
    return changes


def _export(trainer: HybridTrainer, role: str, members: list[str]) -> str:
    path = f"{trainer.snapshot_dir}/{role}-state-v{trainer.version:06d}.pt"
    futures = [submit(trainer.client, role, TRAINABLE[role], path, tag=f"resize-r{rank}", workers=[address])
               for rank, address in enumerate(trainer.group_members(role) or members)]
    wait_role(trainer.client, futures, role, "exporting its state before a resize", trainer.resources.timeout_seconds)
    return path


def _wait_ready(trainer: HybridTrainer, role: str, addresses: list[str]) -> None:
    """Block until each new worker has loaded its model (rollout: and the current weights)."""
    if role == "rollout":
        futures = [submit(trainer.client, role, rollout.sync_weights, trainer.weights, tag="join", workers=[a])
                   for a in addresses]
    else:  # a new critic serves values before its first update: give it the current weights now
        restore = trainer.groups.restore_paths.get(role)
        futures = [submit(trainer.client, role, role_ready, role, restore, tag="join", workers=[a])
                   for a in addresses]
    wait_role(trainer.client, futures, role, "new workers to load their model", trainer.resources.timeout_seconds)


# -- adaptive scaling: resources.adaptive decides, these moves apply it ---------------------

def start_adaptive(trainer: HybridTrainer, bounds, *, interval: float, wait_count: int, **policy) -> RoleAdaptive:
    bounds = trainer.resources.adaptive if bounds is None else bounds
    if not bounds:
        raise ValueError("adapt: no bounds. Fix: pass bounds={'rollout': (1, 3), ...} or add an "
                         "`adaptive:` section to the resource file")
    scalable = [r for r in trainer.roles if not trainer.resources.role(r).placed_with]
    for role in bounds:
        if role not in scalable:
            raise ValueError(f"adapt: {role!r} cannot be scaled on its own here. Fix: bound one of {scalable}")
    return RoleAdaptive(
        trainer.client, bounds, move=lambda source, target, reason: move_one(trainer, source, target),
        resize=lambda role, workers, reason: resize_role(trainer, role, workers), interval=interval,
        wait_count=wait_count, pools={role: trainer.resources.role(role).device_type for role in bounds},
        decisions=trainer.adaptive_decisions, **policy).start()


def stop_adaptive(trainer: HybridTrainer, adaptive: RoleAdaptive) -> None:
    adaptive.stop(timeout=0)
    deadline = time.monotonic() + trainer.resources.timeout_seconds
    while adaptive.running and time.monotonic() < deadline:
        if not trainer._training:  # an actor/critic move waits for a step boundary: give it one
            trainer._apply_boundary_changes()
        adaptive.stop(timeout=0.2)


def move_one(trainer: HybridTrainer, source: str, target: str) -> None:
    """One worker (CPU roles) or device (GPU roles) from `source` to `target`."""
    take, give = trainer.resources.role(source), trainer.resources.role(target)
    if take.device_type == "cpu":  # shrink first: the freed core goes to the new worker
        first = (source, {"workers": take.workers - 1}, {"workers": take.workers})
        second = (target, {"workers": give.workers + 1})
    else:
        device = take.device_ids[-1]
        remove = (source, {"device_ids": [i for i in take.device_ids if i != device]},
                  {"device_ids": list(take.device_ids)})
        add = (target, {"device_ids": [*give.device_ids, device]}, {"device_ids": list(give.device_ids)})
        # Shared devices may briefly hold both roles: the target gets it before the source lets go.
        first, second = (add, remove) if trainer.resources.allow_shared_devices else (remove, add)
    trainer.update_resource(first[0], **first[1])
    try:
        trainer.update_resource(second[0], **second[1])
    except Exception:
        trainer.update_resource(first[0], **first[2])  # undo: the device goes back where it was
        raise


def resize_role(trainer: HybridTrainer, role: str, workers: int) -> None:
    spec = trainer.resources.role(role)
    if spec.device_type == "cpu":
        trainer.update_resource(role, workers=workers)
    elif workers <= len(spec.device_ids):
        trainer.update_resource(role, device_ids=list(spec.device_ids[:workers]))
    else:
        raise ValueError(f"adapt: {role} cannot grow to {workers} GPUs: no spare GPU is known; it can only "
                         f"take one from another role")


# -- requests from outside the driver (`dask-rl scale`) -------------------------------------

REQUESTS = "dask-rl-resource-requests"   # a distributed.Queue on the training's scheduler


def poll_remote_requests(trainer: HybridTrainer) -> None:
    """At a step boundary: apply the update_resource requests that `dask-rl scale` queued on
    the scheduler, and answer each on its reply queue (the changes, or the error)."""
    from distributed import Queue

    requests = Queue(REQUESTS, client=trainer.client)
    while requests.qsize():
        request = requests.get(timeout=5)
        reply = Queue(request.pop("reply_to"), client=trainer.client)
        try:
            reply.put({"changes": [str(c) for c in trainer.update_resource(**request)]})
        except Exception as error:  # the requester prints it; training goes on unchanged
            reply.put({"error": f"{type(error).__name__}: {error}"})


def send_remote_request(client, request: dict, timeout: float) -> dict:
    """Queue one update_resource request for the trainer driving this scheduler; wait for its answer."""
    import uuid

    from distributed import Queue

    reply_to = f"dask-rl-reply-{uuid.uuid4().hex[:8]}"
    Queue(REQUESTS, client=client).put({**request, "reply_to": reply_to})
    try:
        return Queue(reply_to, client=client).get(timeout=timeout)
    except TimeoutError:
        return {"error": f"no trainer answered within {timeout:.0f}s: the request is taken at a step boundary "
                         f"of a running train(); is one running on this scheduler?"}
