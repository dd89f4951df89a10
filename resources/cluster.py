"""Start a Dask cluster from a worker plan: one Nanny-managed process per role worker.

Every worker carries exactly one role resource (`{"rollout": 1}`), one thread and its own
CUDA_VISIBLE_DEVICES; launcher.dask_worker_spec holds the worker options. This module
imports the launcher, never the other way round.
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from typing import Any, Callable, Iterable

import dask
from distributed import Client, Future, Scheduler, SpecCluster
from distributed.security import Security

from resources.config import DEFAULT_TIMEOUT_SECONDS, ResourceConfig
from resources.job_queue import JobLauncher, JobRefused, dask_env, job_script
from resources.launcher import LocalLauncher, close_nannies, dask_worker_spec
from resources.plan import WorkerSpec, plan_role

logger = logging.getLogger("dask_rl")

# Why each setting (see notes on Dask's behaviour in the project docs):
DASK_SETTINGS = {
    # Rollout engines and DataLoaders spawn processes; daemonic workers cannot.
    "distributed.worker.daemon": False,
    # A worker loading a large model in its plugin sends no heartbeat until setup ends;
    # the default 5 minutes would have the scheduler restart it in a loop.
    "distributed.scheduler.worker-ttl": "15 minutes",
    # A SpecCluster closes the Nanny of a worker that has not registered again this long
    # after the scheduler lost it (Dask's default: 15 s), even while that Nanny is still
    # restarting it; the role then loses the worker for good. On a busy machine a killed
    # worker's replacement can take longer to start, and one removal's timer can fire while
    # a later restart (a stuck rank freed after a lost peer) is under way. The Nanny owns
    # the restart here: give it as long as a model load.
    "distributed.deploy.lost-worker-timeout": "15 minutes",
    # Models are the workers' memory, not Dask data: no spilling, pausing or killing.
    "distributed.worker.memory.target": False,
    "distributed.worker.memory.spill": False,
    "distributed.worker.memory.pause": False,
    "distributed.worker.memory.terminate": False,
    # Tensors compress badly and cost CPU.
    "distributed.comm.compression": None,
}


def configure_dask() -> None:
    """Apply DASK_SETTINGS in this process; Nannies pass the config on to their workers."""
    dask.config.set(DASK_SETTINGS)
    logging.getLogger("distributed").setLevel(logging.WARNING)


def role_job_script(config: ResourceConfig, role: str) -> str:
    """The batch script each job of a job-queue `role` runs (SLURMCluster.job_script(), with
    the worker's environment and Dask settings as the trainer submits it)."""
    spec = config.role(role)
    if spec.job_queue is None:
        raise ValueError(f"{role} is not on a job queue. Fix: give it a job_queue section, e.g. "
                         f"{role}: {{job_queue: slurm, jobs: 2}}")
    worker = plan_role(spec)[0]
    return job_script(spec.job_queue, role, env={**worker.env_dict, **dask_env(DASK_SETTINGS)})


def tls_security(ca_file: str, cert: str, key: str | None = None) -> Security:
    """Mutual TLS on every connection: this process shows `cert` (with `key`, or a PEM file
    holding both) as scheduler, worker and client, and trusts peers signed by `ca_file`."""
    return Security(tls_ca_file=ca_file, require_encryption=True,
                    **{f"tls_{role}_{part}": path for role in ("scheduler", "worker", "client")
                       for part, path in (("cert", cert), ("key", key)) if path})


def listen_address(dashboard_address: str, host: str) -> str:
    """":8787" -> "HOST:8787": a dashboard address without a host follows the scheduler's,
    where Dask would read it as every interface."""
    return f"{host}{dashboard_address}" if dashboard_address.startswith(":") else dashboard_address


def live_workers(client: Client) -> dict[str, dict]:
    """address -> {name, host, resources} of every worker, read on the scheduler itself.

    Not `client.scheduler_info()`: the client refreshes that cache in the background with
    a view limited to 5 workers, so another thread can read a list missing workers.
    """
    return client.run_on_scheduler(_worker_table)


def _worker_table(dask_scheduler=None) -> dict[str, dict]:
    return {addr: {"name": ws.name, "host": ws.host, "resources": dict(ws.resources)}
            for addr, ws in dask_scheduler.workers.items()}


def role_workers(client: Client, role: str) -> list[dict]:
    """Live workers carrying `role` (a resource above 0): address, name, host; sorted by name."""
    return sorted(({"address": addr, "name": w["name"], "host": w["host"]}
                   for addr, w in live_workers(client).items() if w["resources"].get(role)),
                  key=lambda w: str(w["name"]))


def role_addresses(client: Client, role: str) -> list[str]:
    return [w["address"] for w in role_workers(client, role)]


def task_key(role: str, fn: Callable, tag: str = "") -> str:
    """`role-fn-tag-xxxxxxxx`: the dashboard groups keys by the words before the first that
    is not a name (here `role-fn`), so its task views group and colour by role and function."""
    return f"{role}-{fn.__name__.replace('_', '-')}-{tag}-{uuid.uuid4().hex[:8]}"


def submit(client: Client, role: str, fn: Callable, *args: Any, tag: str = "",
           workers: list[str] | None = None, **kwargs: Any) -> Future:
    """Run `fn(*args)` on a worker carrying `role`, keyed by task_key."""
    key = task_key(role, fn, tag)
    return client.submit(fn, *args, key=key, resources={role: 1}, pure=False, workers=workers,
                         allow_other_workers=False, **kwargs)


async def _set_role_resource(role: str, quantity: float, dask_worker=None) -> None:
    await dask_worker.set_resources(**{role: quantity})


def _executing_count(dask_worker=None) -> int:
    return len(dask_worker.state.executing)


class RoleSpecCluster(SpecCluster):
    """SpecCluster whose new workers are named role workers rather than copies of one template.

    Scaling goes through SpecCluster's own contract: `scale(n)` asks `new_worker_spec()` for
    each worker it adds, and `scale_down(names)` removes named ones; SpecCluster then starts
    and stops processes to match its spec. `add` queues the specs `new_worker_spec` hands out.
    """

    def __init__(self, *args, **kwargs):
        self._joining: list[tuple[str, dict]] = []
        super().__init__(*args, **kwargs)

    def new_worker_spec(self) -> dict:
        if not self._joining:
            raise RuntimeError("RoleSpecCluster grows only through add(); scale(n) alone has no role to give")
        name, spec = self._joining.pop(0)
        return {name: spec}

    def add(self, specs: dict[str, dict]) -> None:
        self._joining.extend(specs.items())
        self.scale(len(self.worker_spec) + len(specs))

    def remove(self, names: list[str]) -> None:
        # Closed by scale_down alone, a Nanny gives its worker 4 s to exit and then 1 s to be
        # reaped after SIGKILL; on a busy machine a process holding torch takes longer, and the
        # TimeoutError failed the whole resize. Closed first with more time, as in
        # RoleCluster.close, they are gone when scale_down looks.
        self.sync(close_nannies, [self.workers[name] for name in names if name in self.workers], 30)
        self.sync(self.scale_down, names)


class RoleCluster:
    """A local Dask cluster with role-tagged workers, and the client the trainer uses.

    `RoleCluster(workers)` starts its own scheduler and workers; `RoleCluster.connect(address)`
    joins a running scheduler (`dask-rl scheduler`) whose workers other hosts started with
    `dask-rl worker`. Both offer the same methods to the trainer.
    """

    launcher = None  # connected mode: the LocalLauncher of workers add_workers started here
    jobs: JobLauncher | None = None  # the batch jobs of job-queue role workers (resources.job_queue)
    worker_imports: tuple[str, ...] = ()

    def __init__(self, workers: Iterable[WorkerSpec], *, dashboard_address: str = ":8787", host: str = "127.0.0.1",
                 security: Security | None = None, preload: Iterable[str] = (),
                 worker_imports: Iterable[str] = (), silence_logs: int = logging.WARNING,
                 timeout: float = DEFAULT_TIMEOUT_SECONDS):
        """`host`: the interface the scheduler, its dashboard and the workers listen on
        (localhost unless asked; "0.0.0.0" is every interface, as batch jobs on other nodes
        need); `security`: TLS for every connection (tls_security); `preload`: modules the
        scheduler imports as it starts; `worker_imports`: modules each worker starts importing
        as its process comes up (launcher.BackgroundImports); `timeout`: how long job-queue
        workers may take to join (their jobs are submitted once the scheduler runs)."""
        configure_dask()
        workers = list(workers)
        self.specs: dict[str, WorkerSpec] = {w.name: w for w in workers if w.job_queue is None}
        self.host, self.security = host, security
        self.worker_imports = tuple(worker_imports)
        options = {"dashboard_address": listen_address(dashboard_address, host), "host": host,
                   "preload": list(preload)}
        if security is not None:  # every connection then goes over tls://, the workers' too
            options.update(security=security, protocol="tls")
        self.cluster = RoleSpecCluster(
            workers={name: self._worker_spec(w) for name, w in self.specs.items()},
            scheduler={"cls": Scheduler, "options": options}, silence_logs=silence_logs, name="dask-rl",
            security=security,
        )
        self.client = Client(self.cluster, direct_to_workers=True, security=security)
        queued = [w for w in workers if w.job_queue is not None]
        try:
            if queued:
                self.add_workers(queued, timeout)
        except BaseException:
            self.close()
            raise

    def _worker_spec(self, worker: WorkerSpec) -> dict:
        return dask_worker_spec(worker, host=self.host, security=self.security, imports=self.worker_imports)

    @classmethod
    def connect(cls, address: str, roles: Iterable[str] = (), *, timeout: float,
                security: Security | None = None, worker_imports: Iterable[str] = ()) -> RoleCluster:
        """Join the scheduler at `address` and wait until every role in `roles` has a worker.

        No scheduler and no worker is started: the workers are `dask-rl worker` processes
        (or `dask cuda worker --resources ROLE=1`) on any host. add_workers still works and
        starts workers on this host; close() stops those and leaves the scheduler and the
        remote workers running. `specs` holds only the workers this object started, so
        update_resource never retires a worker some other host owns. A `tls://` scheduler
        needs `security` (tls_security), which the workers started here use too, as they
        use `worker_imports`.
        """
        configure_dask()
        self = cls.__new__(cls)  # no SpecCluster: __init__ would start one
        self.specs, self.cluster, self.host, self.security = {}, None, None, security
        try:
            self.client = Client(address, timeout=timeout, direct_to_workers=True, security=security)
        except OSError as error:
            raise ConnectionError(f"could not reach a Dask scheduler at {address} within {timeout:.0f}s ({error}). "
                                  f"Fix: start one with `dask-rl scheduler` and check the host and port") from error
        self.worker_imports = tuple(worker_imports)
        self.launcher = LocalLauncher(self.client, security, self.worker_imports)
        try:
            self._wait_for_roles(tuple(roles), timeout)
        except BaseException:
            self.client.close()
            raise
        return self

    @property
    def scheduler_address(self) -> str:
        return self.client.scheduler.address

    def _wait_for_roles(self, roles: tuple[str, ...], timeout: float) -> None:
        deadline, announced = time.monotonic() + timeout, False
        while True:
            resources = [w["resources"] for w in live_workers(self.client).values()]
            missing = [role for role in roles if not any(r.get(role) for r in resources)]
            if not missing:
                return
            if time.monotonic() > deadline:
                commands = "; ".join(f"`dask-rl worker {self.scheduler_address} --role {role}`" for role in missing)
                raise TimeoutError(
                    f"no live worker for role(s) {missing} on the scheduler at {self.scheduler_address} after "
                    f"{timeout:.0f}s (timeout_seconds). Fix: start one per role on a host with the devices: "
                    f"{commands}, adding --device-ids N for a GPU worker")
            if not announced:
                logger.warning("dask-rl: waiting up to %.0fs for workers of role(s) %s to join %s",
                               timeout, missing, self.scheduler_address)
                announced = True
            time.sleep(0.25)

    @property
    def dashboard_link(self) -> str:
        return self.client.dashboard_link

    def workers_of(self, role: str) -> list[dict]:
        """Scheduler's view of the live workers carrying `role`: address, name, host."""
        return role_workers(self.client, role)

    def next_index(self, role: str) -> int:
        """The first unused k for a new "{role}-{k}" worker name (names are never reused).

        Live workers count too: on a shared scheduler another host may have taken "reward-3".
        """
        pattern = re.compile(rf"{re.escape(role)}-(\d+)")
        names = [*(name for name, spec in self.specs.items() if spec.role == role),
                 *(str(w["name"]) for w in self.workers_of(role))]
        taken = [int(m.group(1)) for m in map(pattern.fullmatch, names) if m]
        return max(taken, default=-1) + 1

    def add_workers(self, workers: Iterable[WorkerSpec], timeout: float) -> dict[str, str]:
        """Start `workers` and wait until each has registered; returns name -> address.

        A joining worker runs every role plugin's setup (loading its model) before it
        executes any task, so it takes work only once its model is loaded.
        """
        workers = list(workers)
        queued = [w for w in workers if w.job_queue is not None]  # batch jobs: resources.job_queue
        local = [w for w in workers if w.job_queue is None]
        if queued:
            self.jobs = self.jobs or JobLauncher(self.client, dask_env(DASK_SETTINGS))
            self.jobs.start(queued)
        self.specs.update((w.name, w) for w in workers)
        if local and self.launcher is not None:  # connected: Nannies on this host, pointed at the remote scheduler
            self.launcher.start(local, timeout)
        elif local:
            self.cluster.add({w.name: self._worker_spec(w) for w in local})
        try:
            return self._wait_for_names({w.name for w in workers}, timeout)
        except (TimeoutError, JobRefused):
            self.forget([w.name for w in queued])  # a job that never joined is cancelled, not left queued
            raise

    def _wait_for_names(self, names: set[str], timeout: float) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        queued = {name for name in names if self.jobs and self.jobs.job_id(name)}
        checked = time.monotonic()
        while True:
            live = {w["name"]: addr for addr, w in live_workers(self.client).items()}
            if names <= set(live):
                if self.jobs:
                    self.jobs.joined.update(queued)
                return {name: live[name] for name in names}
            waiting = sorted(names - set(live))
            if queued and time.monotonic() - checked > 2:  # a job that ended will never join: say so now
                checked = time.monotonic()
                ended = self.jobs.ended_before_joining(set(waiting) & queued)
                if ended:
                    raise JobRefused(f"{'; '.join(ended)}: the job ended before its worker joined. Fix: read the "
                                     f"job's output file (log_directory) for the worker's error")
            if time.monotonic() > deadline:
                jobs = [self.jobs.describe(name) for name in waiting if name in queued]
                if jobs:
                    raise TimeoutError(f"{'; '.join(jobs)}: its worker did not join within {timeout:.0f}s "
                                       f"(timeout_seconds); the job was cancelled. Fix: free or change the "
                                       f"queue (squeue shows why it waits), or raise timeout_seconds")
                raise TimeoutError(f"workers {waiting} did not join the scheduler within "
                                   f"{timeout:.0f}s (timeout_seconds); check their logs and the devices")
            time.sleep(0.2)

    def nanny_states(self, role: str) -> dict[str, str]:
        """name -> what the Nanny this object started for a `role` worker holds now (its status
        and worker pid, or none): said in the error when a role's workers do not come back,
        telling a restart still under way from a Nanny left without a process."""
        nannies = self.launcher.nannies if self.launcher is not None else self.cluster.workers
        states = {}
        for name, spec in self.specs.items():
            nanny = nannies.get(name)
            if spec.role == role and nanny is not None:
                pid = getattr(nanny, "pid", None)
                states[name] = f"Nanny {getattr(nanny.status, 'name', nanny.status)}, " + (
                    f"worker pid {pid}" if pid else "no worker process")
        return states

    def forget(self, names: list[str]) -> None:
        """Drop the specs of `names` and cancel their jobs (a worker already gone, or never come)."""
        for name in names:
            self.specs.pop(name, None)
        if self.jobs is not None:
            self.jobs.stop(names)

    def lost_jobs(self) -> list[tuple[str, str]]:
        """Job-queue workers that joined and are gone (the queue killed or preempted their
        job): (role, "SLURM job 12 (worker rollout-1): CANCELLED, reason None") each. They
        are forgotten, so a reconciliation of the role starts replacements."""
        if self.jobs is None or not self.jobs.joined:
            return []
        lost = self.jobs.lost(str(w["name"]) for w in live_workers(self.client).values())
        return [(self.specs.pop(name).role, described) for name, described in lost.items()]

    def drain(self, addresses: list[str], role: str, timeout: float) -> None:
        """Stop routing `role` tasks to `addresses` and wait for their running tasks to end.

        The role resource goes to 0 on each worker, so the scheduler sends it nothing new
        and the worker starts nothing it had queued; what it queued moves to the role's
        other workers when it is retired.
        """
        self.client.run(_set_role_resource, role, 0, workers=addresses)
        deadline = time.monotonic() + timeout
        while any(self.client.run(_executing_count, workers=addresses).values()):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{role}: workers {addresses} still ran a task after {timeout:.0f}s of draining "
                                   f"(timeout_seconds); they were not retired")
            time.sleep(0.1)

    def unblock(self, addresses: list[str], grace: float, timeout: float) -> list[str]:
        """Workers still running a task `grace` seconds from now are restarted by their
        Nanny (the process ends; the Nanny starts a fresh one, which loads its role anew):
        a rank blocked in a collective with a dead peer holds its thread until the group's
        timeout, and nothing else unblocks it. Returns the addresses restarted."""
        deadline = time.monotonic() + grace
        busy = [a for a, n in self.client.run(_executing_count, workers=addresses, on_error="ignore").items()
                if n]
        while busy and time.monotonic() < deadline:
            time.sleep(0.2)
            busy = [a for a, n in self.client.run(_executing_count, workers=busy, on_error="ignore").items()
                    if n]
        busy = [a for a in busy if a in live_workers(self.client)]
        if busy:
            # The scheduler gives each Nanny its own 5 s to stop the process (4 s, then SIGKILL
            # and 1 s to reap it), whatever `timeout` says; on a busy machine that can run out
            # although the process is gone. The Nanny still starts the replacement when it
            # sees the exit, and the caller waits for it (Fleet.await_replacements): reported
            # here, not raised.
            outcome = self.client.restart_workers(busy, timeout=timeout, raise_for_error=False)
            late = {address: state for address, state in outcome.items() if state != "OK"}
            if late:
                logger.warning("dask-rl: restarting %s did not finish in time (%s); waiting for the Nannies",
                               sorted(late), late)
        return busy

    def retire(self, addresses: list[str]) -> None:
        """Retire drained workers (Dask moves any results they hold) and forget their specs.

        Any worker can be retired, wherever it runs: with close_workers=True the worker
        tells its Nanny to close rather than restart it, so the process ends (and a
        `dask-rl worker` process exits once all of its workers are gone).
        """
        info = live_workers(self.client)
        names = [info[addr]["name"] for addr in addresses if addr in info]
        self.client.retire_workers(workers=addresses, close_workers=True)
        queued = [name for name in names if self.specs.get(name) and self.specs[name].job_queue]
        self.forget(queued)  # the worker has closed, so its job ends; scancel makes sure
        names = [name for name in names if name not in queued]
        for name in names:
            self.specs.pop(name, None)
        if self.launcher is not None:
            self.launcher.stop(names)
        elif names:
            self.cluster.remove(names)

    def close(self) -> None:
        """Stop what this object started; a connected one leaves the scheduler running."""
        if self.jobs is not None:
            self.jobs.close()  # first: the jobs are cancelled while the client's loop still runs
        if self.launcher is not None:
            self.launcher.close()  # first: its Nannies run on the client's event loop
            self.client.close()
            return
        self.client.close()
        try:
            # A Nanny's own close gives its worker process 4 s to exit, then kills it with a
            # warning; with torch and transformers loaded, interpreter shutdown alone can take
            # longer on a busy machine. Closed first with more time, they exit by themselves.
            self.cluster.sync(close_nannies, list(self.cluster.workers.values()), 30)
            self.cluster.close()
        except (TimeoutError, OSError) as error:  # the work is done and saved: closing never fails it
            logger.warning("dask-rl: closing the cluster did not finish cleanly (%r)", error)

    def __enter__(self) -> RoleCluster:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
