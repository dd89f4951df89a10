"""Adaptive scaling: move devices (GPU roles) or workers (CPU roles) from an idle role to a
starved one, within the `adaptive:` bounds of the resource file.

Three layers, each usable alone:

1. The policy (pure, here): `decide(loads, ...)` turns the `RoleLoad`s of the last window
   into `Decision`s (move / grow / shrink), each with a reason that carries the numbers.
   `Hysteresis` counts consecutive observations per role, so a role acts only after being
   seen starved or idle `wait_count` times in a row.
2. The measurement (on the scheduler), in resources.load and re-exported here:
   `RoleLoadPlugin` integrates each worker's busy time, `role_sample` reads it together
   with each role's backlog in one scheduler call, and `loads_between` turns two samples
   into `RoleLoad`s (how loaded each role was over the window).
3. The loop (here): `RoleAdaptive`, one coordinating instance over all bounded roles. It
   measures every `interval` seconds, asks the policy, logs every decision with its reason
   (logger "dask_rl"), keeps them in `.decisions` and `.log`, and applies them through
   callbacks the caller supplies (`move`, `resize`), so this package never imports the
   pipeline.

Why not distributed's `Adaptive`/`AdaptiveCore`: their contract is one worker count
(`target`) for one homogeneous pool, scaled up or down by `scale_up(n)`/`scale_down`. A move
takes from one role what it gives another, so the decision is a pair of roles, not a
count; `Adaptive` also runs `adapt()` on the cluster's event loop, where the trainer's
blocking update_resource (it waits for workers to load and drain) would block the very
loop it waits on, and a trainer joined to a remote scheduler has no SpecCluster at all.
What is kept from them is the shape: observe, recommend after `wait_count` consecutive
observations, never two adapt() at once, a log of (time, recommendation).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal

from resources.config import AdaptiveBounds
# The measurement moved to resources.load; these stay importable from here.
from resources.load import (  # noqa: F401
    PLUGIN_NAME, RoleLoad, RoleLoadPlugin, _install_plugin, loads_between, role_sample,
)

__all__ = ["Decision", "Hysteresis", "RoleAdaptive", "RoleLoad", "RoleLoadPlugin", "Thresholds",
           "classify", "decide", "loads_between", "role_sample"]

logger = logging.getLogger("dask_rl")

STARVED, IDLE, OK = "starved", "idle", "ok"


# -- 1. the policy (pure) ----------------------------------------------------------------
@dataclass(frozen=True)
class Thresholds:
    """When a role counts as starved or idle."""

    starved_backlog: float = 1.0   # starved: at least this many runnable tasks per worker ...
    starved_busy: float = 0.9      # ... and its workers busy above this share of the window
    idle_busy: float = 0.3         # idle: busy below this share, and nothing runnable


@dataclass(frozen=True)
class Decision:
    """One adaptive action. move: one device/worker from source_role to target_role;
    grow: target_role gets one more; shrink: source_role gives one up."""

    kind: Literal["move", "grow", "shrink"]
    source_role: str | None
    target_role: str | None
    reason: str
    outcome: str = ""              # filled in by RoleAdaptive: "applied in 8.1s" or "failed: ..."

    def __str__(self) -> str:
        what = {"move": f"move one from {self.source_role} to {self.target_role}",
                "grow": f"grow {self.target_role} by one", "shrink": f"shrink {self.source_role} by one"}
        return f"{what[self.kind]}: {self.reason}" + (f" ({self.outcome})" if self.outcome else "")


def classify(load: RoleLoad, thresholds: Thresholds = Thresholds()) -> str:
    """starved, idle or ok."""
    if load.workers and load.per_worker >= thresholds.starved_backlog and load.busy > thresholds.starved_busy:
        return STARVED
    if load.busy < thresholds.idle_busy and load.queued == 0:
        return IDLE
    return OK


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _over(load: RoleLoad) -> str:
    return f" over {load.window:.0f} s" if load.window else ""


def _starved_reason(load: RoleLoad) -> str:
    return (f"{load.role} starved: {_plural(load.queued, 'task')} queued or running on "
            f"{_plural(load.workers, 'worker')}, busy {load.busy:.0%}{_over(load)}")


def _idle_reason(load: RoleLoad) -> str:
    return f"{load.role} idle: busy {load.busy:.0%}{_over(load)}, nothing queued, {_plural(load.workers, 'worker')}"


class Hysteresis:
    """Consecutive observations of each role in its current state (like AdaptiveCore's
    close_counts): a role acts on `starved`/`idle` only after `wait_count` in a row."""

    def __init__(self) -> None:
        self.state: dict[str, str] = {}
        self.count: dict[str, int] = {}

    def observe(self, states: Mapping[str, str]) -> dict[str, int]:
        for role, state in states.items():
            self.count[role] = self.count.get(role, 0) + 1 if self.state.get(role) == state else 1
            self.state[role] = state
        for role in set(self.state) - set(states):
            del self.state[role], self.count[role]
        return dict(self.count)

    def reset(self) -> None:
        self.state.clear()
        self.count.clear()


def decide(loads: Mapping[str, RoleLoad], *, thresholds: Thresholds = Thresholds(),
           streaks: Mapping[str, int] | None = None, wait_count: int = 1,
           spare: Mapping[str, int] | None = None, queues: Collection[str] = ()) -> list[Decision]:
    """At most one action for these loads; [] when there is nothing to do.

    `streaks[role]`: consecutive observations in the role's current state (default: 1 each,
    i.e. no hysteresis); starved and idle count only once a streak reaches `wait_count`.
    `spare[pool]`: free devices/workers no role holds; a starved role grows from them
    before taking from another role. In order:
      1. a role above its max shrinks (bounds are the file's word: no hysteresis);
      2. a role below its min gets one from the role of its pool with the most above its
         min (idlest first), or grows from a spare;
      3. the most starved role below its max grows from a spare, else takes one from the
         idlest role of its pool above its min;
      4. the idlest role of a pool in `queues` (a job queue: its spare is the queue's) above
         its min shrinks: the job goes back to the queue, no other role needs it.
    Nothing ever goes below a min or above a max.
    """
    streaks = streaks or {}
    spare = spare or {}

    def from_spare(pool: str) -> str:
        return "a job is submitted to the queue" if pool in queues else "a spare device is free"

    states = {role: classify(load, thresholds) for role, load in loads.items()}

    def firm(role: str, state: str) -> bool:
        return states[role] == state and streaks.get(role, 1) >= wait_count

    for load in loads.values():
        if load.workers > load.bounds.maximum:
            return [Decision("shrink", load.role, None, f"{load.role} has {_plural(load.workers, 'worker')}, "
                                                        f"above its max of {load.bounds.maximum}")]
    by_idleness = sorted(loads.values(), key=lambda l: (states[l.role] != IDLE, l.busy, -l.workers, l.role))
    for load in loads.values():
        if load.workers < load.bounds.minimum:
            short = f"{load.role} has {_plural(load.workers, 'worker')}, below its min of {load.bounds.minimum}"
            if spare.get(load.pool, 0) > 0:
                return [Decision("grow", None, load.role, f"{short}; {from_spare(load.pool)}")]
            donors = [d for d in by_idleness if d.role != load.role and d.pool == load.pool
                      and d.workers > d.bounds.minimum]
            if donors:
                donor = donors[0]
                return [Decision("move", donor.role, load.role,
                                 f"{short}; {donor.role} has {_plural(donor.workers, 'worker')}, "
                                 f"above its min of {donor.bounds.minimum}")]
    starved = sorted((l for l in loads.values() if firm(l.role, STARVED) and l.workers < l.bounds.maximum),
                     key=lambda l: (-l.per_worker, -l.busy, l.role))
    for hungry in starved:
        if spare.get(hungry.pool, 0) > 0:
            return [Decision("grow", None, hungry.role, f"{_starved_reason(hungry)}; {from_spare(hungry.pool)}")]
        donors = [d for d in by_idleness if d.role != hungry.role and d.pool == hungry.pool
                  and firm(d.role, IDLE) and d.workers > d.bounds.minimum]
        if donors:
            return [Decision("move", donors[0].role, hungry.role,
                             f"{_starved_reason(hungry)}; {_idle_reason(donors[0])}")]
    for load in by_idleness:
        if load.pool in queues and firm(load.role, IDLE) and load.workers > load.bounds.minimum:
            return [Decision("shrink", load.role, None, f"{_idle_reason(load)}; its job goes back to the queue")]
    return []


# -- 3. the loop -------------------------------------------------------------------------
class RoleAdaptive:
    """Watches the bounded roles and applies the policy's decisions through callbacks.

    Args:
        client: a distributed Client of the cluster (the scheduler runs `role_sample`).
        bounds: role -> AdaptiveBounds (or a (min, max) pair); only these roles move.
        move(source_role, target_role, reason): give one device/worker of source to target.
        resize(role, workers, reason): set the role's worker count (grow/shrink).
        interval: seconds between observations.
        wait_count: consecutive starved/idle observations before acting.
        window: seconds of history the busy fraction covers (default: interval * wait_count,
            at least 5 s).
        pools: role -> pool ("cuda"/"cpu"): devices move only within a pool.
        spare: pool -> free devices no role holds (grow takes from them first).
        queues: pools that are job queues: an idle role there shrinks (its job is cancelled).
        measure: () -> role_sample dict; replaces the scheduler call (tests).
    """

    def __init__(self, client: Any, bounds: Mapping[str, AdaptiveBounds | tuple[int, int]], *,
                 move: Callable[[str, str, str], Any], resize: Callable[[str, int, str], Any],
                 interval: float = 2.0, wait_count: int = 3, window: float | None = None,
                 thresholds: Thresholds = Thresholds(), pools: Mapping[str, str] | None = None,
                 spare: Mapping[str, int] | None = None, measure: Callable[[], dict] | None = None,
                 decisions: list[Decision] | None = None, queues: Collection[str] = ()):
        self.bounds = {role: b if isinstance(b, AdaptiveBounds) else AdaptiveBounds(*b) for role, b in bounds.items()}
        for role, b in self.bounds.items():
            if not 1 <= b.minimum <= b.maximum:
                raise ValueError(f"adaptive bounds for {role}: need 1 <= min <= max, got min={b.minimum} "
                                 f"max={b.maximum}")
        self.wait_count = wait_count
        self.log: deque[tuple[float, dict]] = deque(maxlen=1000)   # (time, {"status", "reason"}) per action
        self._adapting = False
        self.client, self._move, self._resize = client, move, resize
        self.interval = interval
        self.window = window if window is not None else max(interval * wait_count, 5.0)
        self.thresholds, self.pools, self.spare = thresholds, dict(pools or {}), dict(spare or {})
        self.queues = frozenset(queues)
        self._measure = measure or self._sample_scheduler
        self.decisions: list[Decision] = decisions if decisions is not None else []
        self.hysteresis = Hysteresis()
        self.loads: dict[str, RoleLoad] = {}
        self._samples: deque[dict] = deque()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def recommendations(self) -> dict:
        """{"status": "same"}, or the first decision the policy makes on the current loads."""
        streaks = self.hysteresis.observe({role: classify(load, self.thresholds) for role, load in self.loads.items()})
        decisions = decide(self.loads, thresholds=self.thresholds, streaks=streaks, wait_count=self.wait_count,
                           spare=self.spare, queues=self.queues)
        return {"status": decisions[0].kind, "decision": decisions[0]} if decisions else {"status": "same"}

    def observe(self) -> dict[str, RoleLoad]:
        """Take a sample and compute the loads over the last `window` seconds."""
        sample = self._measure()
        self._samples.append(sample)
        while len(self._samples) > 2 and sample["time"] - self._samples[1]["time"] >= self.window:
            self._samples.popleft()
        before = self._samples[0] if len(self._samples) > 1 else None
        self.loads = loads_between(before, sample, self.bounds, self.pools)
        return self.loads

    def adapt(self) -> None:
        """Observe, recommend, act (one call at a time)."""
        if self._adapting:
            return
        self._adapting = True
        try:
            self.observe()
            if self._samples[0] is self._samples[-1]:
                return  # the first sample: no window yet
            recommendation = self.recommendations()
            if recommendation["status"] == "same":
                return
            if self._stop.is_set():  # stopped while observing: start no change now
                return
            self.log.append((time.time(), {"status": recommendation["status"],
                                           "reason": recommendation["decision"].reason}))
            self.apply(recommendation["decision"])
        finally:
            self._adapting = False

    def apply(self, decision: Decision) -> Decision:
        logger.warning("dask-rl: adaptive: %s", decision)
        start = time.perf_counter()
        try:
            if decision.kind == "move":
                self._move(decision.source_role, decision.target_role, decision.reason)
            else:
                role = decision.target_role or decision.source_role
                step = 1 if decision.kind == "grow" else -1
                self._resize(role, self.loads[role].workers + step, decision.reason)
            outcome = f"applied in {time.perf_counter() - start:.1f}s"
        except Exception as error:  # reported, recorded, and the loop goes on
            outcome = f"failed: {error!r}"
            logger.warning("dask-rl: adaptive: %s failed: %r", decision.kind, error)
        decision = replace(decision, outcome=outcome)
        self.decisions.append(decision)
        # Fresh evidence after a change: a new window, and wait_count observations again.
        self._samples.clear()
        self.hysteresis.reset()
        return decision

    def _sample_scheduler(self) -> dict:
        return self.client.run_on_scheduler(role_sample, tuple(self.bounds))

    # -- running in the background --------------------------------------------------------
    def start(self) -> RoleAdaptive:
        """Install the scheduler plugin and adapt every `interval` seconds in a daemon thread."""
        if self._thread is not None:
            return self
        if self._measure == self._sample_scheduler:
            self.client.run_on_scheduler(_install_plugin)
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="dask-rl-adaptive", daemon=True)
        self._thread.start()
        bounds = ", ".join(f"{r} {b.minimum}..{b.maximum}" for r, b in self.bounds.items())
        logger.info("dask-rl: adaptive scaling started (%s; every %.1fs, wait_count %d)", bounds, self.interval,
                    self.wait_count)
        return self

    def _run(self, max_errors: int = 3) -> None:
        errors = 0
        while not self._stop.wait(self.interval):
            try:
                self.adapt()
                errors = 0
            except Exception as error:  # one bad reading is skipped; the cluster gone away stops it
                if self._stop.is_set():
                    return
                self.error, errors = error, errors + 1
                if errors >= max_errors:
                    logger.warning("dask-rl: adaptive scaling stopped after %d errors in a row: %r", errors, error)
                    return
                logger.warning("dask-rl: adaptive: observation failed (%r); trying again", error)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self, timeout: float | None = None) -> None:
        """Stop observing; a change in progress finishes first (waits up to `timeout`)."""
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
        if thread is None or not thread.is_alive():
            self._thread = None

    def __del__(self) -> None:  # like Adaptive.__del__: a dropped instance stops observing
        stop = getattr(self, "_stop", None)
        if stop is not None:
            stop.set()
