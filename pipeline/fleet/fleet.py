"""The Fleet: the driver's one view of who runs where.

It owns the cluster and the placement (the validated resource config), the role plugins,
the trainable roles' process groups, the weight routes and the newest published weights,
the step-boundary queue of resource changes and their reconciliation, adaptive scaling, and
the one timeout (`timeout_seconds` of the resource file). The trainer asks it to run and
wait for role tasks, to publish, and to change the placement; it never reaches past it.

A change is reconciliation: each role's wanted workers (from the new config) are compared
with its live ones, new workers are started (they load the role's model before taking any
task; rollout workers also receive the current weights), and removed workers are drained
(no new task, running ones finish) and only then retired. The trainable roles (actor,
critic) change at a step boundary: their full model and optimizer state is exported first
and every rank of the new group starts from it.

Which workers an update runs on, and what a lost rank costs, is its base class RankKeeper
(ranks.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterator

from pipeline import events, weights
from pipeline.fleet import boundary
from pipeline.fleet.groups import ProcessGroups
from pipeline.fleet.ranks import RankKeeper
from pipeline.fleet.reconcile import TRAINABLE_EXPORTS, ResourceChange, ResourceRequest, requested_config
from pipeline.fleet.routes import WeightRoutes
from pipeline.fleet.scaling import start_adaptive
from pipeline.fleet.tasks import (
    SchedulerLost, scheduler_lost, scheduler_lost_after, submit, task_key, wait_role,
)
from pipeline.roles import rollout
from pipeline.roles.host import WORKER_IMPORTS, RoleHost, plugin_name, role_ready
from resources.adaptive import Decision, RoleAdaptive
from resources.cluster import RoleCluster
from resources.allocator import DEGRADATION_TOPIC, Degradation, report
from resources.config import ResourceConfig
from resources.plan import plan_change, plan_workers

logger = logging.getLogger("dask_rl")


class Fleet(RankKeeper):
    """Role workers for `roles`, placed as `config` says.

    Args:
        config: the validated resource config.
        roles: the roles this run uses (a subset of the config's: GRPO has no critic...).
        snapshot_dir: where the actor publishes weight snapshots and resize exports.
        weight_sync: the train setting "auto" | "shm" | "cuda_ipc" | "broadcast" | "dask".
        cluster: run on this RoleCluster (left running at close); else one is started, or
            `scheduler_address` is joined.
    """

    def __init__(self, config: ResourceConfig, roles: tuple[str, ...], *, snapshot_dir: str,
                 weight_sync: str = "auto", cluster: RoleCluster | None = None,
                 scheduler_address: str | None = None, dashboard_address: str = ":8787",
                 host: str = "127.0.0.1", security: Any = None):
        self.config = config
        self.roles = roles
        self.snapshot_dir = snapshot_dir
        self._owns_cluster = cluster is None   # a cluster passed in is the caller's to close
        hosted = config.role("rollout").hosted_by
        if hosted and scheduler_address is not None:
            raise ValueError(f"rollout.hosted_by: {hosted}: a run that joins a scheduler uses the workers other hosts "
                             f"started, none of which hosts the rollout. Fix: give the rollout workers of its own "
                             f"(`dask-rl worker --role rollout`), or run without scheduler_address")
        if hosted and weight_sync != "auto":
            raise ValueError(f"train.weight_sync: {weight_sync}: the rollout is hosted by the {hosted} and reads its "
                             f"parameters in place, so no weights are sent. Fix: remove weight_sync (or set auto)")
        planned = [w for w in plan_workers(config) if w.role in roles]
        queued = [w for w in planned if w.job_queue is not None]   # batch jobs (resources.job_queue)
        if cluster is None and scheduler_address is not None:  # joined: this fleet submits the jobs
            cluster = RoleCluster.connect(scheduler_address, [r for r in roles if not config.role(r).job_queue],
                                          timeout=config.timeout_seconds, security=security,
                                          worker_imports=WORKER_IMPORTS)
            self._start_jobs(cluster, queued)
        self.cluster = cluster or RoleCluster(planned, dashboard_address=dashboard_address, host=host,
                                              security=security, timeout=config.timeout_seconds,
                                              preload=["pipeline.dashboard"],  # the RL page and its monitor
                                              worker_imports=WORKER_IMPORTS)
        self.client = self.cluster.client
        if hosted and cluster is not None:
            hosts = self.cluster.workers_of(hosted)
            apart = [w["name"] for w in self.cluster.workers_of("rollout") if w not in hosts]
            if apart:
                raise ValueError(f"rollout.hosted_by: {hosted}: the cluster given has rollout workers of their own "
                                 f"({', '.join(map(str, apart))}). Fix: pass a cluster started from this placement "
                                 f"(RoleCluster(plan_workers(config))), or none")
        # Jobs the queue takes away (scancel, preemption, walltime) are replaced as they go.
        self._job_watch = _Every(2.0, self.replace_lost_jobs, "dask-rl-jobs") if self.cluster.jobs else None
        self.groups = ProcessGroups(self.client)
        self.routes = WeightRoutes(self.cluster, weight_sync, hosted=hosted is not None)
        self.weights: weights.WeightHandle | None = None   # None: the initial weights (version 0)
        self._queue = boundary.BoundaryQueue()
        self._lock = threading.Lock()             # one reconciliation at a time
        self._train_thread: threading.Thread | None = None
        self._adaptive: RoleAdaptive | None = None
        self.adaptive_decisions: list[Decision] = []
        self._pinned: dict[str, tuple[str, ...]] = {}   # key -> the workers a pending task is pinned to
        # Degradation events are read from here on: an earlier run's on a shared cluster are not ours.
        self._degradations_read = max((stamp for stamp, _ in self.client.get_events(DEGRADATION_TOPIC)), default=0.0)

    def _start_jobs(self, cluster: RoleCluster, queued: list) -> None:
        """Submit the job-queue roles' jobs to a joined scheduler and wait for their workers;
        a job that cannot start leaves the scheduler as it was."""
        try:
            if queued:
                cluster.add_workers(queued, self.timeout)
        except BaseException:
            cluster.close()
            raise

    def replace_lost_jobs(self) -> list[str]:
        """Job-queue workers whose job ended under them (scancel, preemption, walltime) are
        worker losses: Dask reruns their tasks on the role's other workers, each loss is a
        fault event naming the job, and the role gets a new job to keep its placement's count."""
        with self._lock:
            lost = self.cluster.lost_jobs()
            for role, job in lost:
                logger.warning("dask-rl: %s lost %s; submitting a replacement", role, job)
                events.emit("fault", f"{role} lost {job}; submitting a replacement job", client=self.client,
                            role=role)
            for role in sorted({role for role, _ in lost}):
                self._reconcile(self.config, role)
        return [job for _, job in lost]

    @property
    def timeout(self) -> float:
        """The one bound on every wait: the resource file's timeout_seconds."""
        return self.config.timeout_seconds

    @property
    def version(self) -> int:
        return 0 if self.weights is None else self.weights.version

    # -- roles and their tasks -------------------------------------------------------------
    def register(self, recipes: dict[str, Callable[[], Any]], torch_threads: int | None) -> None:
        """One RoleHost plugin per role: every worker carrying the role loads its model once.
        Registering returns once every worker ran its setup; one thread per role lets the
        roles load their models side by side."""
        # A role's GPU memory cap is its process's: a hosted role allocates under its host's.
        caps = {role: self.config.role(role).max_gpu_memory_gib for role in recipes}
        with ThreadPoolExecutor(len(recipes)) as pool:
            list(pool.map(lambda role: self.client.register_plugin(
                RoleHost(role, recipes[role], torch_threads=torch_threads, gpu_memory_gib=caps[role]),
                name=plugin_name(role)), recipes))

    def addresses(self, role: str) -> list[str]:
        return [w["address"] for w in self.cluster.workers_of(role)]

    def submit(self, role: str, fn: Callable, *args: Any, tag: str = "", workers: list[str] | None = None,
               priority: int = 0):
        future = submit(self.client, role, fn, *args, tag=tag, workers=workers, priority=priority)
        if workers:
            self._pinned[future.key] = tuple(workers)
        return future

    def place(self, role: str, fn: Callable, data: list, address: str, tag: str = "") -> list:
        """Futures of `data`'s items, held on the worker at `address` for the task `fn` of
        `role` pinned there. Scattered, they pass the scheduler as opaque bytes it forwards to
        that worker; inside the task they were part of its graph, which the scheduler
        unpickles (a batch of long responses is tens of MiB a step: 20 MiB took 0.20 s to
        reach a local worker that way, 0.03 s scattered, on a 2-core host,
        benchmarks/task_inputs.py). Their keys fall in the task's own group (`role-fn`): the
        dashboard's task-group graph fails on a dependency group that is forgotten before its
        dependents. Lost with that worker, as the task is: Dask cancels the task, and the
        wait reports the worker lost."""
        keys = [f"{task_key(role, fn, tag)}-input{i}" for i in range(len(data))]
        with self._losing(role, [address], (OSError,), "the update's rows were sent to it"):   # a closed comm
            placed = self.client.scatter(dict(zip(keys, data)), workers=[address])
        return [placed[key] for key in keys]

    def wait(self, role: str, futures: list, what: str) -> list:
        """Results, or RoleTimeout after the timeout, or WorkerLost as soon as a worker a task
        is pinned to is gone (a rank of a process group: it cannot run elsewhere)."""
        futures = list(futures)
        try:
            return wait_role(self.client, futures, role, what, self.timeout,
                             pinned={f.key: self._pinned[f.key] for f in futures if f.key in self._pinned})
        finally:
            for future in futures:
                self._pinned.pop(future.key, None)

    def degraded(self, role: str, what: str, before: int, after: int, unit: str, cause: str, detail: str) -> None:
        """Report work of `role` that the driver made smaller (logged; counted by degradations())."""
        report(what, before, after, unit, cause, detail, role=role, client=self.client)

    def degradations(self) -> list[Degradation]:
        """What the workers made smaller to fit GPU memory since the last call (halved
        micro-batches and chunks, smaller generation batches), oldest first. Read from the
        scheduler's event log: a worker sends its event before its task's result, so a
        step's own degradations are there once its results are."""
        logged = self.client.get_events(DEGRADATION_TOPIC)
        new = [msg for stamp, msg in logged if stamp > self._degradations_read]
        self._degradations_read = max((stamp for stamp, _ in logged), default=self._degradations_read)
        names = {f.name for f in dataclasses.fields(Degradation)}
        return [Degradation(**{key: msg[key] for key in names}) for msg in new]

    # -- weights ---------------------------------------------------------------------------
    def publish_transport(self) -> str:
        return self.routes.publish_transport()

    def published(self, handle: weights.WeightHandle, actor_address: str) -> None:
        """A new version is out: remember it, and broadcast it to readers that can't read it
        where it lies."""
        self.weights = handle
        self.routes.after_publish(handle, actor_address, self.timeout)

    # -- placement changes -----------------------------------------------------------------
    def scheduler_lost(self, doing: str = "training") -> SchedulerLost | None:
        """The error to raise if the client lost its scheduler, else None."""
        return scheduler_lost(self.client, doing)

    @contextlib.contextmanager
    def training(self) -> Iterator[None]:
        """Marks the calling thread as the training loop: trainable-role changes asked for
        from other threads wait for its next step boundary, and leaving settles the ones
        that raced the last step. Whatever a lost scheduler makes fail, inside (a wait, a
        fetch, a publish) or in that last settling, ends as one SchedulerLost naming it."""
        self._train_thread = threading.current_thread()
        try:
            yield
        except Exception as error:
            self._train_thread = None
            lost = scheduler_lost_after(self.client, error, f"training ({type(error).__name__} in the step)")
            if lost is None:
                self._settle_after_failure(error)
            if lost is None or isinstance(error, SchedulerLost):
                raise
            raise lost from error
        finally:
            self._train_thread = None
        self._settle_after_last_step()   # reached only when the loop returned

    def _settle_after_failure(self, error: Exception) -> None:
        """at_boundary as a failed train() leaves: its own failure is logged, not raised, so
        the step's error is the one the caller sees."""
        try:
            self.at_boundary()
        except Exception as late:
            logger.warning("dask-rl: leaving train() after %s, the queued resource changes could not be "
                           "settled: %s: %s", type(error).__name__, type(late).__name__, late)

    def _settle_after_last_step(self) -> None:
        """at_boundary as train() returns; a scheduler lost by then, or found lost on the way,
        is SchedulerLost."""
        doing = "answering resource changes after the last step"
        lost = self.scheduler_lost(doing)
        if lost is not None:   # settling would wait timeout_seconds for the client to reconnect
            raise lost
        try:
            self.at_boundary()
        except Exception as error:
            lost = scheduler_lost_after(self.client, error, doing)
            if lost is None:
                raise
            raise lost from error

    def update_resource(self, request: ResourceRequest) -> list[ResourceChange]:
        """Validate `request` against the current placement (a bad one raises, nothing
        changes), then apply it now, or at the next step boundary when it touches the
        actor or critic while another thread trains."""
        base = self.config
        config = requested_config(base, request)
        trainer = self._train_thread
        if request.component in TRAINABLE_EXPORTS and trainer not in (None, threading.current_thread()):
            return self._queue.put(request, base, config).wait(lambda: self._train_thread is trainer)
        return self._apply(request, base, config)

    def at_boundary(self) -> None:
        """Between two steps: apply queued changes, and those `dask-rl scale` sent."""
        for pending in self._queue.drain():
            pending.settle(lambda: self._apply(pending.request, pending.base, pending.config))
        boundary.answer_remote(self.client, lambda kwargs: [str(c) for c in self.update_resource(
            ResourceRequest(**kwargs))])

    def _apply(self, request: ResourceRequest, base: ResourceConfig, config: ResourceConfig
               ) -> list[ResourceChange]:
        with self._lock:
            if base is not self.config:  # another change landed since it was validated: re-derive
                config = requested_config(self.config, request)
            return self._reconcile(config, request.component)

    def _reconcile(self, new_config: ResourceConfig, component: str) -> list[ResourceChange]:
        """Bring the live workers of `component` (and of any role whose placement the change
        touched) to what `new_config` says; other roles are left as they run (in connected
        mode their workers were started by other hosts, not by this fleet)."""
        changes = []
        for role in self.roles:
            if role != component and new_config.role(role) == self.config.role(role):
                continue
            start_time = time.perf_counter()
            live = {w["name"]: w["address"] for w in self.cluster.workers_of(role)}
            current = [spec for name, spec in self.cluster.specs.items() if name in live]
            start, retire = plan_change(current, new_config.role(role), self.cluster.next_index(role),
                                        hosts=new_config.hosted_roles(role))
            regroup = role in TRAINABLE_EXPORTS and self.groups.strategy(role) not in (
                None, new_config.role(role).strategy)
            if not start and not retire and not regroup:
                continue
            if role in TRAINABLE_EXPORTS:  # every rank of the new group starts from exactly this state
                self.groups.restore_paths[role] = self._export(role, list(live.values()))
            added = self.cluster.add_workers(start, self.timeout) if start else {}
            self._wait_ready(role, list(added.values()))
            ready = time.perf_counter() - start_time if added else 0.0
            removed = [live[w.name] for w in retire]
            if removed:
                self.cluster.drain(removed, role, self.timeout)
                self.cluster.retire(removed)
            spec = new_config.role(role)
            names = tuple(w["name"] for w in self.cluster.workers_of(role))
            change = ResourceChange(role, tuple(sorted(added)), tuple(w.name for w in retire), names, spec.device_ids,
                                    spec.strategy, time.perf_counter() - start_time, ready,
                                    managed=tuple(name for name in names if name in self.cluster.specs))
            logger.warning("dask-rl: %s", change)
            events.emit("scale", str(change), client=self.client, role=role, added=list(change.added),
                        removed=list(change.removed))
            changes.append(change)
        self.config = new_config
        return changes

    def _export(self, role: str, members: list[str]) -> str:
        path = f"{self.snapshot_dir}/{role}-state-v{self.version:06d}.pt"
        futures = [self.submit(role, TRAINABLE_EXPORTS[role], path, tag=f"resize-r{rank}", workers=[address])
                   for rank, address in enumerate(self.groups.members(role) or members)]
        self.wait(role, futures, "exporting its state before a resize")
        return path

    def _wait_ready(self, role: str, addresses: list[str]) -> None:
        """Block until each new worker has loaded its model (rollout: and the current weights;
        a new critic serves values before its first update: it loads the exported state)."""
        if role == "rollout":
            futures = [self.submit(role, rollout.sync_weights, self.weights, tag="join", workers=[a])
                       for a in addresses]
        else:
            restore = self.groups.restore_paths.get(role)
            futures = [self.submit(role, role_ready, role, restore, tag="join", workers=[a]) for a in addresses]
        self.wait(role, futures, "new workers to load their model")

    # -- adaptive scaling: resources.adaptive decides, update_resource applies ----------------
    def adapt(self, bounds: dict | None, **policy: Any) -> RoleAdaptive:
        self.stop_adapting()
        self._adaptive = start_adaptive(self, bounds, **policy)
        return self._adaptive

    @property
    def adapting(self) -> bool:
        return self._adaptive is not None

    def stop_adapting(self) -> None:
        """Stop adaptive scaling; a move in progress finishes first (an actor/critic move
        waits for a step boundary: outside training, this gives it one)."""
        adaptive, self._adaptive = self._adaptive, None
        if adaptive is None:
            return
        adaptive.stop(timeout=0)
        deadline = time.monotonic() + self.timeout
        while adaptive.running and time.monotonic() < deadline:
            if self._train_thread is None and self.scheduler_lost() is None:
                self.at_boundary()
            adaptive.stop(timeout=0.2)

    def close(self) -> None:
        """Stop adapting, delete the weight snapshots and close the cluster this fleet
        started (a cluster passed in stays up; a joined scheduler too, less the workers this
        fleet started). Never raises: a scheduler already gone only shortens the work."""
        try:
            if self._job_watch is not None:
                self._job_watch.stop()
            self.stop_adapting()
            for address in [] if self.scheduler_lost() else self.addresses("actor"):  # the actor's host's snapshots
                self.client.run(shutil.rmtree, self.snapshot_dir, True, workers=[address])
        except Exception as error:  # noqa: BLE001 - closing after a fault must not replace it
            logger.warning("dask-rl: the cluster did not answer while closing (%s); cleaning up locally", error)
        shutil.rmtree(self.snapshot_dir, ignore_errors=True)
        if self._owns_cluster:
            try:
                self.cluster.close()
            except Exception as error:  # noqa: BLE001
                logger.warning("dask-rl: closing the cluster: %s", error)


class _Every:
    """Calls `fn` every `interval` seconds in a daemon thread until stopped; an error is
    logged and the next call goes on (a scheduler briefly busy must not end the watch)."""

    def __init__(self, interval: float, fn: Callable[[], Any], name: str):
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(interval, fn), name=name, daemon=True)
        self._thread.start()

    def _run(self, interval: float, fn: Callable[[], Any]) -> None:
        while not self._stop.wait(interval):
            try:
                fn()
            except Exception as error:  # noqa: BLE001 - logged; the watch goes on
                if not self._stop.is_set():
                    logger.warning("dask-rl: %s: %r", self._thread.name, error)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join()
