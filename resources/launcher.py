"""Start role workers for a scheduler this process does not own.

`dask-rl worker` and a RoleCluster connected to a remote scheduler both start workers the
same way SpecCluster does: one Nanny per worker, built from the same options
(dask_worker_spec, which the local RoleCluster's SpecCluster uses too), so a worker joining
from another host is configured exactly like one started by the trainer. GPU workers get
dask-cuda's CPU-affinity plugin when dask-cuda is installed; CPU workers are plain
distributed workers, so the CPU path needs no NVML.

The Nanny keeps a crashed worker restarted; a worker the scheduler retires tells its Nanny
to close instead, so retiring ends the process for good.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import signal
import threading
import time
from typing import Iterable

from distributed import Client, Nanny
from distributed.diagnostics.plugin import WorkerPlugin
from distributed.security import Security

from resources.plan import WorkerSpec

logger = logging.getLogger("dask_rl")


def dask_worker_spec(worker: WorkerSpec, *, host: str | None = None, security: Security | None = None,
                     imports: tuple[str, ...] = ()) -> dict:
    """The SpecCluster entry for one role worker.

    `host`: the interface its Nanny, worker and worker dashboard listen on (None: all, as
    a worker joining from another host needs); `security`: TLS settings (None: plain TCP);
    `imports`: modules the worker starts importing as soon as its process is up
    (BackgroundImports).
    """
    options = {
        "name": worker.name,
        "nthreads": worker.nthreads,
        "resources": worker.resources,
        "env": worker.env_dict,
        # Quiet workers: a training run's console is the progress bar, not Dask's INFO log.
        "silence_logs": logging.WARNING,
        "memory_limit": 0,
    }
    if host is not None:
        options["host"] = host
    if security is not None:
        options["security"] = security
    options["plugins"] = {SignalsToTheDriver(), *(_cuda_worker_plugins(worker.device_id)
                                                   if worker.device_type == "cuda" else ()),
                          *((BackgroundImports(imports),) if imports else ())}
    return {"cls": Nanny, "options": options}


class BackgroundImports(WorkerPlugin):
    """Imports `modules` in a thread from the moment the worker process is up.

    A role worker's first seconds go to importing torch and transformers; started here,
    that overlaps with the other workers starting, the client connecting and the role
    plugins being sent, instead of following them. Code that needs the modules calls
    wait() before importing any of them itself: two threads importing the same package's
    modules at once could each wait for a module the other is loading. A failed import
    is left for that code to raise, with its own context.
    """

    name = "dask-rl-imports"

    def __init__(self, modules: tuple[str, ...]):
        self.modules = tuple(modules)

    def setup(self, worker) -> None:
        self.done = threading.Event()
        self.seconds: float | None = None  # how long the imports took, once done (for reports)
        threading.Thread(target=self._run, name=self.name, daemon=True).start()

    def _run(self) -> None:
        start = time.perf_counter()
        for module in self.modules:
            try:
                importlib.import_module(module)
            except Exception as error:  # noqa: BLE001 - raised again where the module is used
                logger.debug("dask-rl: background import of %s failed: %r", module, error)
        self.seconds = time.perf_counter() - start
        self.done.set()

    def wait(self) -> None:
        done = getattr(self, "done", None)   # set up on the worker only
        if done is not None:
            done.wait()


class SignalsToTheDriver(WorkerPlugin):
    """Worker processes ignore SIGINT and SIGTERM. Ctrl-C in a terminal reaches every process
    of the foreground group, and a batch scheduler's SIGTERM often does too: stopping is the
    driver's (or the `dask-rl worker` Nanny's) job; it finishes the step, writes the
    checkpoint and then closes its workers, which a worker that died first would make
    impossible. A worker still ends with its Nanny, and on SIGKILL."""

    name = "dask-rl-signals"

    def setup(self, worker) -> None:
        if threading.current_thread() is threading.main_thread():  # signal.signal's rule
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _cuda_worker_plugins(device_id: int) -> set:
    """dask-cuda's CPU-affinity plugin for the GPU's NUMA node, when dask-cuda is present."""
    try:
        from dask_cuda.plugins import CPUAffinity
        from dask_cuda.utils import get_cpu_affinity
    except ImportError as error:  # still a working GPU worker, only without NUMA pinning
        logger.warning("dask-rl: dask-cuda unavailable (%s); GPU %d worker runs without CPU affinity", error, device_id)
        return set()
    return {CPUAffinity(get_cpu_affinity(device_id))}


async def start_nannies(scheduler_address: str, workers: Iterable[WorkerSpec], *, host: str | None = None,
                        security: Security | None = None, imports: tuple[str, ...] = ()) -> dict[str, Nanny]:
    """Start one Nanny-managed worker process per spec; returns name -> Nanny once all joined.
    `imports`: modules each worker starts importing as its process comes up (BackgroundImports).

    A Nanny's start returns after its worker registered with the scheduler and ran every
    worker plugin's setup, i.e. after a role worker has loaded its model. If one fails to
    start, the ones already started are closed again and the error is raised.
    """
    nannies = {w.name: Nanny(scheduler_address,
                             **dask_worker_spec(w, host=host, security=security, imports=imports)["options"])
               for w in workers}
    results = await asyncio.gather(*nannies.values(), return_exceptions=True)
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        await close_nannies(nannies.values())
        raise errors[0]
    return nannies


async def close_nannies(nannies: Iterable[Nanny], timeout: float = 10) -> None:
    """Close Nannies and their workers; a Nanny that is already closed is fine."""
    await asyncio.gather(*(n.close(timeout=timeout, reason="dask-rl-close") for n in nannies),
                         return_exceptions=True)


class LocalLauncher:
    """Nannies on this host for a remote scheduler, run on a Client's event loop.

    RoleCluster.connect has no SpecCluster to start workers with, so add_workers goes
    through this: it tracks what it started, so that close() stops exactly those workers
    and never touches the scheduler or anybody else's workers.
    """

    def __init__(self, client: Client, security: Security | None = None, imports: tuple[str, ...] = ()):
        self.client = client
        self.security = security  # the client's TLS settings serve its workers too
        self.imports = tuple(imports)
        self.nannies: dict[str, Nanny] = {}

    @property
    def scheduler_address(self) -> str:
        return self.client.scheduler.address

    def start(self, workers: list[WorkerSpec], timeout: float) -> None:
        started = self.client.sync(start_nannies, self.scheduler_address, workers, security=self.security,
                                   imports=self.imports, callback_timeout=timeout)
        self.nannies.update(started)

    def stop(self, names: Iterable[str]) -> None:
        """Close the Nannies started for `names` (no-op for names started elsewhere)."""
        nannies = [self.nannies.pop(name) for name in names if name in self.nannies]
        if nannies:
            self.client.sync(close_nannies, nannies)

    def close(self) -> None:
        with contextlib.suppress(Exception):  # the loop may already be gone at interpreter exit
            self.stop(list(self.nannies))
