"""On the scheduler: the RL figures of the running training, for the dashboard and `/metrics`.

RLMonitor is a SchedulerPlugin that reads the event-log topics of pipeline.events into
bounded in-memory history: the steps of the current run, its latest samples, the last
events, and which devices each role worker holds. Per-role throughput is worked out here,
from the compute seconds the scheduler already sums per task prefix (role tasks' keys
start with their role), so no worker reports anything extra. RLCollector exports the same
figures to Prometheus as `dask_rl_*`: the scheduler's `/metrics` serves everything in
prometheus_client's default registry, so the collector registered there is served next to
`dask_scheduler_*`.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque
from typing import Any

from distributed.diagnostics.plugin import SchedulerPlugin

from pipeline import events
from resources.allocator import DEGRADATION_TOPIC, OUT_OF_MEMORY, Degradation
from resources.config import ROLES

logger = logging.getLogger("dask_rl")

NAME = "dask-rl-monitor"
PAGE = "/individual-rl-training"   # the RL page of the dashboard (pipeline.dashboard)
STEP_HISTORY = 10_000   # steps kept per run (a point each on the plots)
EVENT_HISTORY = 1_000


class RLMonitor(SchedulerPlugin):
    """Collects the dask-rl topics on the scheduler. One per scheduler (idempotent)."""

    name = NAME
    idempotent = True  # registered by every trainer: the first one stays, with its history

    def __init__(self):
        self.scheduler = None
        self.run: str | None = None
        self.run_info: dict[str, Any] = {}
        self.steps: deque[dict] = deque(maxlen=STEP_HISTORY)
        self.samples: list[dict] = []
        self.events: deque[dict] = deque(maxlen=EVENT_HISTORY)
        self.event_counts: Counter[str] = Counter()
        self.steps_total = 0
        self.devices: dict[str, dict] = {}   # worker address -> its announcement
        self.joined: dict[str, dict] = {}    # worker address -> name and role, as it registered
        self._compute: dict[str, float] = {}  # role -> compute seconds at the previous step
        self.changes = 0                      # bumped on every update: readers skip unchanged states

    async def start(self, scheduler) -> None:
        self.scheduler = scheduler
        _bind_collector(self)

    async def close(self) -> None:
        _unbind_collector(self)

    # -- the event log ---------------------------------------------------------------------
    def log_event(self, topic: str, msg: Any) -> None:
        # Runs on the scheduler's event loop for every event of every topic: stay cheap.
        if not isinstance(msg, dict):
            return
        try:
            if topic == events.STEPS:
                self._on_step(msg)
            elif topic == events.EVENTS:
                self._add_event(msg)
            elif topic == DEGRADATION_TOPIC:  # a worker made its work smaller to fit memory
                self._on_degradation(msg)
            elif topic == events.WORKERS:
                self.devices[str(msg.get("address"))] = msg
            elif topic == "all" and msg.get("action") == "remove-worker" and not msg.get("expected"):
                self._on_worker_lost(msg)
            else:
                return
            self.changes += 1
        except Exception:  # a malformed message must not disturb the scheduler
            logger.debug("dask-rl: monitor skipped a %s message", topic, exc_info=True)

    def add_worker(self, scheduler, worker: str) -> None:
        ws = scheduler.workers[worker]
        self.joined[worker] = {"name": str(ws.name), "role": events.role_of(ws.resources)}

    def remove_worker(self, scheduler, worker: str, **kwargs) -> None:
        # After log_event has seen its "remove-worker" message, which names it by address.
        self.devices.pop(worker, None)
        self.joined.pop(worker, None)

    def _on_step(self, msg: dict) -> None:
        if msg.get("run") != self.run:  # a new training on this scheduler: its own plots
            self.run, self.run_info = msg.get("run"), {}
            self.steps.clear()
            self.samples = []
            self._compute = self.role_compute_seconds()
        if msg.get("start"):
            self.run_info = {k: v for k, v in msg.items() if k not in ("run", "start")}
            self._compute = self.role_compute_seconds()
            return
        compute = self.role_compute_seconds()
        busy = {role: compute[role] - self._compute.get(role, 0.0) for role in compute}
        self._compute = compute
        tokens = float(msg.get("tokens") or 0)
        step = {k: v for k, v in msg.items() if k != "samples"}
        # Generated tokens of the step per second of the role's summed task compute time.
        step["role_tokens_per_second"] = {role: tokens / seconds for role, seconds in busy.items() if seconds > 0}
        step["time"] = time.time()
        self.steps.append(step)
        self.steps_total += 1
        if msg.get("samples"):
            self.samples = [{"step": msg.get("step"), **s} for s in msg["samples"]]

    def _add_event(self, msg: dict) -> None:
        event = {"time": time.time(), **msg}
        worker = self.scheduler.workers.get(event.get("worker")) if self.scheduler else None
        if worker is not None:  # a worker's event carries its address: show its name
            event["worker"] = str(worker.name)
        self.events.append(event)
        self.event_counts[str(event.get("kind", "event"))] += 1

    def _on_degradation(self, msg: dict) -> None:
        line = Degradation(**{k: msg.get(k) for k in Degradation.__dataclass_fields__}).line()
        self._add_event({"kind": "oom-backoff" if msg.get("cause") == OUT_OF_MEMORY else "degradation",
                         "role": msg.get("role", ""), "worker": msg.get("worker"), "reason": line})

    def _on_worker_lost(self, msg: dict) -> None:
        address = str(msg.get("worker"))
        known = {**self.joined.get(address, {}), **self.devices.get(address, {})}
        running = len(msg.get("processing-tasks") or ())
        self._add_event({"kind": "fault", "worker": known.get("name", address), "role": known.get("role", ""),
                         "reason": f"worker {known.get('name', address)} left without being retired "
                                   f"({running} running task(s) go to the role's other workers)"})

    # -- what readers use --------------------------------------------------------------------
    def role_compute_seconds(self) -> dict[str, float]:
        """role -> summed compute seconds of every task whose key starts with the role."""
        totals = dict.fromkeys(ROLES, 0.0)
        for name, prefix in self.scheduler.task_prefixes.items():
            role = str(name).split("-", 1)[0]
            if role in totals:
                totals[role] += prefix.all_durations.get("compute", 0.0)
        return totals

    def workers(self) -> list[dict[str, Any]]:
        """Each live role worker: role, name, address, devices, GPU and process memory, tasks."""
        rows = []
        for address, ws in self.scheduler.workers.items():
            # A draining worker's role resource is already 0: its announcement still names it.
            role = events.role_of(ws.resources) or self.devices.get(address, {}).get("role", "")
            if not role:
                continue
            metrics, extra = ws.metrics or {}, ws.extra or {}
            devices = self.devices.get(address, {}).get("devices") or "cpu"
            used = total = None
            if devices != "cpu":  # Dask's NVML figures are of the first visible GPU, which a CPU
                # role worker on a GPU host sees too: not its memory, so it shows none
                gpu = metrics.get("gpu") if isinstance(metrics.get("gpu"), dict) else {}
                used = metrics.get("gpu_memory_used", gpu.get("memory-used"))
                total = metrics.get("gpu-memory-total") or (extra.get("gpu") or {}).get("memory-total")
            rows.append({
                "role": role, "name": str(ws.name), "address": address, "host": ws.host, "devices": devices,
                "gpu_memory_used": used, "gpu_memory_total": total, "memory": ws.memory.process,
                "processing": len(ws.processing), "status": ws.status.name,
            })
        first = lambda row: events.roles_in(row["role"])[0]  # noqa: E731 - "actor+rollout" sorts as the actor
        return sorted(rows, key=lambda r: (ROLES.index(first(r)) if first(r) in ROLES else 99, r["name"]))


def watch(client, run: str, **info: Any) -> None:
    """From the driver: make sure the scheduler runs an RLMonitor, then announce the run.

    A scheduler started with pipeline.dashboard preloaded has one already (registering is
    idempotent, so its history stays); on any other the monitor starts here, and /metrics
    serves its figures, though the RL page needs the preload.
    """
    try:
        client.register_plugin(RLMonitor(), name=NAME)
    except Exception as error:  # e.g. a scheduler that cannot import this package: train anyway
        logger.warning("dask-rl: no RL figures on the dashboard or /metrics: %r", error)
        return
    events.publish(events.STEPS, events.plain({"run": run, "start": True, **info}), client=client)


# -- Prometheus -------------------------------------------------------------------------------
# One collector per process: two registered collectors would export the same names twice.
# It reads the monitor started last that is still open, so tests that start schedulers one
# after another in one process export the live one.
_collector = None
_monitors: list[RLMonitor] = []


def _bind_collector(monitor: RLMonitor) -> None:
    global _collector
    _monitors.append(monitor)
    try:
        import prometheus_client
    except ImportError:  # /metrics then says Prometheus is not available; the page still works
        return
    if _collector is None:
        _collector = RLCollector()
        prometheus_client.REGISTRY.register(_collector)


def _unbind_collector(monitor: RLMonitor) -> None:
    if monitor in _monitors:
        _monitors.remove(monitor)


def current_monitor() -> RLMonitor | None:
    return _monitors[-1] if _monitors else None


PREFIX = "dask_rl_"
LAST_STEP = (("step", "index of the last step"),
             ("policy_version", "policy version after the last step"),
             ("reward_mean", "mean reward of the last step's batch"),
             ("reward_std", "spread (population std) of the last step's rewards"),
             ("kl_mean", "mean per-token KL to the reference model"),
             ("response_length", "mean generated tokens per sample"),
             ("staleness", "mean policy-version lag of the samples the last step consumed"),
             ("staleness_max", "policy-version lag of the oldest sample the last step consumed"),
             ("carried_rows", "unfinished samples the last step's rollout carried to the next (partial rollouts)"),
             ("seconds", "wall seconds of the last step"),
             ("tokens_per_second", "generated tokens per wall second of the last step"))


class RLCollector:
    """`dask_rl_*` gauges and counters of the current run, per-role ones labelled by role
    (a prometheus_client custom collector: `collect()` builds the families at each scrape)."""

    def describe(self):
        return []  # names depend on the run (loss names): nothing to check at registration

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        monitor = current_monitor()
        if monitor is None or monitor.scheduler is None:
            return
        last = monitor.steps[-1] if monitor.steps else None
        if last is not None:
            for key, help_text in LAST_STEP:
                if isinstance(last.get(key), (int, float)):
                    yield GaugeMetricFamily(PREFIX + key, help_text, value=last[key])
            yield _labelled(GaugeMetricFamily(PREFIX + "loss", "losses and update statistics of the last step",
                                              labels=["name"]), last.get("losses"))
            yield _labelled(GaugeMetricFamily(PREFIX + "phase_seconds", "driver wall seconds per phase of the "
                                              "last step", labels=["phase"]), last.get("phases"))
            yield _labelled(GaugeMetricFamily(PREFIX + "role_tokens_per_second", "tokens of the last step per "
                                              "second of the role's task compute time", labels=["role"]),
                            last.get("role_tokens_per_second"))
            for stat in ("mean", "std"):
                yield _labelled(GaugeMetricFamily(PREFIX + f"rewards_{stat}", f"each reward's {stat} over the last "
                                                  "step's samples it applied to", labels=["name"]),
                                {name: stats.get(stat) for name, stats in (last.get("rewards") or {}).items()})
        evaluated = next((step["evaluation"] for step in reversed(monitor.steps) if step.get("evaluation")), None)
        if evaluated:
            yield _labelled(GaugeMetricFamily(PREFIX + "eval", "figures of the last finished held-out evaluation",
                                              labels=["figure"]),
                            {key.removeprefix("eval/"): value for key, value in evaluated.items()})
        yield CounterMetricFamily(PREFIX + "steps", "training steps reported to this scheduler",
                                  value=monitor.steps_total)
        yield _labelled(CounterMetricFamily(PREFIX + "events", "scaling, OOM-backoff and fault events",
                                            labels=["kind"]), monitor.event_counts)
        workers = monitor.workers()
        yield _labelled(GaugeMetricFamily(PREFIX + "role_workers", "live workers per role", labels=["role"]),
                        Counter(role for w in workers for role in events.roles_in(w["role"])))
        gpu = GaugeMetricFamily(PREFIX + "worker_gpu_memory_used_bytes", "GPU memory in use on each role "
                                "worker's device", labels=["role", "worker", "devices"])
        memory = GaugeMetricFamily(PREFIX + "worker_memory_bytes", "process memory of each role worker",
                                   labels=["role", "worker"])
        for w in workers:
            if isinstance(w["gpu_memory_used"], (int, float)):
                gpu.add_metric([w["role"], w["name"], str(w["devices"])], w["gpu_memory_used"])
            memory.add_metric([w["role"], w["name"]], w["memory"])
        yield gpu
        yield memory


def _labelled(family, values: dict | None):
    for label, value in (values or {}).items():
        if isinstance(value, (int, float)):
            family.add_metric([str(label)], value)
    return family
