"""The measurement side of adaptive scaling (resources.adaptive holds the policy and the loop):
how loaded each role was over a window, read on the scheduler.

`RoleLoadPlugin`, a SchedulerPlugin, integrates for every worker the time during which it
had at least one task processing, updated on every transition into or out of `processing`.
Event-driven integration, rather than sampling `ws.processing` every interval, sees short
tasks (a 5 ms reward call) as well as long ones, and counts a task still running (a 30 s
generation) as busy while it runs rather than only when it finishes (as task `startstops`
would). `role_sample` reads it, together with each role's backlog, in one scheduler call.
Backlog = the role's *runnable* tasks: processing (assigned to a worker, executing or queued
there) or no-worker/queued on the scheduler. Tasks still `waiting` for their inputs are
reported apart and are not backlog: a reward task waiting for a rollout says rollout is
slow, not that reward lacks workers. `loads_between` turns two samples into `RoleLoad`s,
the policy's input.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from distributed.diagnostics.plugin import SchedulerPlugin

from resources.config import AdaptiveBounds

__all__ = ["PLUGIN_NAME", "RoleLoad", "RoleLoadPlugin", "loads_between", "role_sample"]


@dataclass(frozen=True)
class RoleLoad:
    """How loaded one role was over the last window."""

    role: str
    workers: int                 # live workers carrying the role
    queued: int                  # runnable tasks of the role: processing on a worker, or no-worker/queued
    busy: float                  # 0..1: share of the window its workers had a task processing
    bounds: AdaptiveBounds
    window: float = 0.0          # seconds `busy` covers
    waiting: int = 0             # tasks of the role waiting for other roles' outputs (not backlog)
    pool: str = ""               # devices move only between roles of one pool ("cuda", "cpu")

    @property
    def per_worker(self) -> float:
        return self.queued / max(self.workers, 1)


PLUGIN_NAME = "dask-rl-role-load"


class RoleLoadPlugin(SchedulerPlugin):
    """Per worker: seconds during which it had at least one task processing (cumulative,
    scheduler clock), updated on every transition into or out of `processing`."""

    name = PLUGIN_NAME

    def __init__(self) -> None:
        self.scheduler: Any = None
        self.busy_total: dict[str, float] = {}
        self.busy_since: dict[str, float | None] = {}
        self.first_seen: dict[str, float] = {}

    async def start(self, scheduler) -> None:
        self.scheduler = scheduler
        self.refresh()

    def refresh(self) -> None:
        if self.scheduler is None:
            return
        now = time.monotonic()
        for address, ws in self.scheduler.workers.items():
            self.first_seen.setdefault(address, now)
            self.busy_total.setdefault(address, 0.0)
            started = self.busy_since.get(address)
            if ws.processing and started is None:
                self.busy_since[address] = now
            elif not ws.processing and started is not None:
                self.busy_total[address] += now - started
                self.busy_since[address] = None

    def transition(self, key, start, finish, *args, **kwargs) -> None:
        if start == "processing" or finish == "processing":
            self.refresh()

    def remove_worker(self, scheduler, worker: str, **kwargs) -> None:
        for table in (self.busy_total, self.busy_since, self.first_seen):
            table.pop(worker, None)

    def busy_seconds(self) -> tuple[float, dict[str, tuple[float, float]]]:
        """(now, {address: (cumulative busy seconds up to now, first seen)})."""
        self.refresh()
        now = time.monotonic()
        out = {}
        for address, total in self.busy_total.items():
            started = self.busy_since.get(address)
            out[address] = (total + (now - started if started is not None else 0.0), self.first_seen[address])
        return now, out


def _install_plugin(dask_scheduler=None) -> bool:
    if PLUGIN_NAME not in dask_scheduler.plugins:
        plugin = RoleLoadPlugin()
        plugin.scheduler = dask_scheduler
        dask_scheduler.add_plugin(plugin, name=PLUGIN_NAME)
        plugin.refresh()
        return True
    return False


def role_sample(roles: Iterable[str], dask_scheduler=None) -> dict:
    """Runs on the scheduler (client.run_on_scheduler): one consistent reading of every
    role's workers, cumulative busy seconds and backlog."""
    roles = tuple(roles)
    plugin = dask_scheduler.plugins[PLUGIN_NAME]
    now, busy = plugin.busy_seconds()
    workers = {}
    for address, ws in dask_scheduler.workers.items():
        mine = [r for r in roles if ws.resources.get(r, 0) > 0]  # a drained worker (role at 0) counts for none
        if mine and address in busy:
            workers[address] = {"name": ws.name, "role": mine[0], "busy": busy[address][0],
                                "since": busy[address][1]}
    queued = dict.fromkeys(roles, 0)
    waiting = dict.fromkeys(roles, 0)
    for ts in dask_scheduler.tasks.values():
        restrictions = ts.resource_restrictions or {}
        table = (queued if ts.state in ("processing", "no-worker", "queued") else
                 waiting if ts.state == "waiting" else None)
        if table is None:
            continue
        for role in roles:
            if role in restrictions:
                table[role] += 1
    return {"time": now, "workers": workers, "queued": queued, "waiting": waiting}


def loads_between(before: dict | None, after: dict, bounds: Mapping[str, AdaptiveBounds],
                  pools: Mapping[str, str] | None = None) -> dict[str, RoleLoad]:
    """RoleLoads over the window between two `role_sample`s (pure). Busy = busy seconds
    gained by the role's workers / worker-seconds they existed in the window; a worker that
    joined inside the window counts from when the scheduler first saw it."""
    pools = pools or {}
    t1 = after["time"]
    t0 = before["time"] if before else t1
    old = before["workers"] if before else {}
    loads = {}
    for role, limits in bounds.items():
        mine = {a: w for a, w in after["workers"].items() if w["role"] == role}
        gained = covered = 0.0
        for address, w in mine.items():
            start = max(t0, w["since"])
            covered += max(t1 - start, 0.0)
            gained += w["busy"] - (old[address]["busy"] if address in old else 0.0)
        busy = min(max(gained / covered, 0.0), 1.0) if covered > 0 else 0.0
        loads[role] = RoleLoad(role, len(mine), after["queued"].get(role, 0), busy, limits, window=t1 - t0,
                               waiting=after["waiting"].get(role, 0), pool=pools.get(role, ""))
    return loads
