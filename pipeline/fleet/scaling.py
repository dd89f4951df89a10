"""Adaptive scaling's moves: resources.adaptive decides from the roles' queues, these apply
a decision as update_resource requests on the fleet."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pipeline import events
from pipeline.fleet.reconcile import ResourceRequest
from resources.adaptive import RoleAdaptive
from resources.config import AdaptiveBounds
from resources.validate import MAX_TIMEOUT_SECONDS, with_changes

# `fleet` below is the Fleet (fleet.py imports this module, so it is not imported here).


def start_adaptive(fleet, bounds, *, interval: float, wait_count: int, **policy: Any) -> RoleAdaptive:
    """Adapt the bounded roles (None: the resource file's `adaptive:` section)."""
    config = fleet.config
    bounds = config.adaptive if bounds is None else checked_bounds(config, bounds)
    if not bounds:
        raise ValueError("adapt: no bounds. Fix: pass bounds={'rollout': (1, 3), ...} or add an "
                         "`adaptive:` section to the resource file")
    _check_period(interval, wait_count)
    scalable = [r for r in fleet.roles if not config.role(r).moves_with]
    for role in bounds:
        if role not in scalable:
            raise ValueError(f"adapt: {role!r} cannot be scaled on its own here. Fix: bound one of {scalable}")
    # A role on a job queue is a pool of its own whose spare is the queue: it grows by
    # submitting a job (up to its max) and shrinks by giving an idle one back.
    queues = {role: f"{role} job queue" for role in bounds if config.role(role).job_queue}
    pools = {role: queues.get(role, config.role(role).device_type) for role in bounds}
    spare = {**{pool: 1 for pool in queues.values()}, **policy.pop("spare", {})}
    return RoleAdaptive(
        fleet.client, bounds, interval=interval,
        move=lambda source, target, reason: _decided(fleet, f"move {source} -> {target}", reason, move_one, fleet,
                                                     source, target),
        resize=lambda role, workers, reason: _decided(fleet, f"resize {role} to {workers}", reason, resize_role,
                                                      fleet, role, workers),
        wait_count=wait_count, pools=pools, spare=spare, queues=set(queues.values()),
        decisions=fleet.adaptive_decisions, **policy).start()


def checked_bounds(config, bounds: Any) -> dict:
    """adapt()'s bounds, checked by the resource file's `adaptive:` rules (types, order, limit)."""
    if not isinstance(bounds, Mapping):
        raise ValueError(f"adapt: bounds={bounds!r}. Fix: pass a mapping of role to (min, max), e.g. "
                         "bounds={'rollout': (1, 3)}")
    written = {role: {"min": b.minimum, "max": b.maximum} if isinstance(b, AdaptiveBounds) else
               dict(zip(("min", "max"), b)) if isinstance(b, (tuple, list)) and len(b) == 2 else b
               for role, b in bounds.items()}
    return dict(with_changes(config, {"adaptive": written}, source="adapt(bounds=...)").adaptive)


def _check_period(interval: Any, wait_count: Any) -> None:
    """interval feeds Event.wait: a positive, finite number of seconds within the timeout's limit."""
    if isinstance(interval, bool) or not isinstance(interval, (int, float)) or not 0 < interval <= MAX_TIMEOUT_SECONDS:
        raise ValueError(f"adapt: interval={interval!r}. Fix: use a number of seconds > 0 and at most "
                         f"{MAX_TIMEOUT_SECONDS}, e.g. interval=2.0")
    if isinstance(wait_count, bool) or not isinstance(wait_count, int) or not 1 <= wait_count <= 1000:
        raise ValueError(f"adapt: wait_count={wait_count!r}. Fix: use an integer from 1 to 1000, e.g. wait_count=3")


def _decided(fleet, action: str, reason: str, apply, *args) -> None:
    """Apply one adaptive decision; the RL page's event log gets it with its reason, and its failure."""
    events.emit("adaptive", f"{action}: {reason}", client=fleet.client)
    try:
        apply(*args)
    except Exception as error:
        events.emit("adaptive-failed", f"{action}: {error!r}", client=fleet.client)
        raise


def move_one(fleet, source: str, target: str) -> None:
    """One worker (CPU roles) or device (GPU roles) from `source` to `target`."""
    take, give = fleet.config.role(source), fleet.config.role(target)
    if take.device_type == "cpu":  # shrink first: the freed core goes to the new worker
        first = (ResourceRequest(source, workers=take.workers - 1), ResourceRequest(source, workers=take.workers))
        second = ResourceRequest(target, workers=give.workers + 1)
    else:
        device = take.device_ids[-1]
        remove = (ResourceRequest(source, device_ids=[i for i in take.device_ids if i != device]),
                  ResourceRequest(source, device_ids=list(take.device_ids)))
        add = (ResourceRequest(target, device_ids=[*give.device_ids, device]),
               ResourceRequest(target, device_ids=list(give.device_ids)))
        # Shared devices may briefly hold both roles: the target gets it before the source lets go.
        (first, second) = (add, remove[0]) if fleet.config.allow_shared_devices else (remove, add[0])
    fleet.update_resource(first[0])
    try:
        fleet.update_resource(second)
    except Exception:
        fleet.update_resource(first[1])  # undo: the device goes back where it was
        raise


def resize_role(fleet, role: str, workers: int) -> None:
    spec = fleet.config.role(role)
    if spec.job_queue is not None:  # submit a job, or drain one worker and cancel its job
        fleet.update_resource(ResourceRequest(role, jobs=workers))
    elif spec.device_type == "cpu":
        fleet.update_resource(ResourceRequest(role, workers=workers))
    elif workers <= len(spec.device_ids):
        fleet.update_resource(ResourceRequest(role, device_ids=list(spec.device_ids[:workers])))
    else:
        raise ValueError(f"adapt: {role} cannot grow to {workers} GPUs: no spare GPU is known; it can only "
                         f"take one from another role")
