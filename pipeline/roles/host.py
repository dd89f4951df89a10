"""Keep a role's model alive on its workers across tasks.

One `RoleHost` WorkerPlugin is registered per role. Dask hands every plugin to every
worker, including workers that join later, so a worker added to a role loads the model
by itself. Each worker builds the state only for the role resource it carries; tasks then
find it with `role_state(role)`. Plugins, unlike Dask actors, survive retirement logic,
leave tasks visible on the dashboard and let a lost task be recomputed elsewhere.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import threading
import time
from typing import Any, Callable

import cloudpickle
from distributed import get_worker
from distributed.diagnostics.plugin import WorkerPlugin

from pipeline import events
from resources.allocator import limit_gpu_memory
from resources.launcher import BackgroundImports

logger = logging.getLogger("dask_rl")

# What building any role imports first (seconds on a GPU host): a worker starts on these as
# soon as its process is up (RoleCluster's worker_imports), and RoleHost waits for them.
WORKER_IMPORTS = ("torch", "transformers.modeling_utils", "transformers.models.auto.modeling_auto",
                  "transformers.models.auto.tokenization_auto")


def plugin_name(role: str) -> str:
    return f"dask-rl-{role}"


class RoleHost(WorkerPlugin):
    """Builds `build()` once on each worker that carries the `role` resource."""

    def __init__(self, role: str, build: Callable[[], Any] | None, torch_threads: int | None = None,
                 gpu_memory_gib: float | None = None):
        self.role = role
        self.build = build
        self._recipe: bytes | None = None    # `build` as it travelled, until _build unpickles it
        self.torch_threads = torch_threads
        self.gpu_memory_gib = gpu_memory_gib   # the role's max_gpu_memory_gib, set before it allocates
        self.state: Any = None
        self.error: BaseException | None = None
        self.ready = threading.Event()
        self.load_started: float | None = None   # when setup began (wall clock), how long the
        self.load_seconds: float | None = None   # build took, imports included, and how much of
        self.imports_wait: float = 0.0           # it went to waiting for the imports: for reports

    def __getstate__(self):
        # Events and loaded models stay on their worker; only the recipe travels, pickled on
        # its own: the worker unpickles it in _build, after its background imports. Unpickled
        # with the plugin, it imported the role's module (torch, transformers) on the worker's
        # event loop while the BackgroundImports thread imported the same packages, and the two
        # raced ("cannot import name 'fsdp' from 'torch.distributed'" on a SLURM job's worker).
        return {"role": self.role, "recipe": cloudpickle.dumps(self.build), "torch_threads": self.torch_threads,
                "gpu_memory_gib": self.gpu_memory_gib}

    def __setstate__(self, state):
        self.__init__(state["role"], None, torch_threads=state["torch_threads"],
                      gpu_memory_gib=state["gpu_memory_gib"])
        self._recipe = state["recipe"]

    async def setup(self, worker) -> None:
        if self.role not in worker.state.total_resources:
            return
        # Load off the event loop so heartbeats keep flowing while a large model loads;
        # the worker takes no task before every plugin's setup has returned.
        self.load_started, start = time.time(), time.perf_counter()
        try:
            self.state = await asyncio.to_thread(self._build, worker.plugins.get(BackgroundImports.name))
            bind = getattr(self.state, "bind_worker", None)   # a role that reaches another on its worker
            if callable(bind):
                bind(worker)
            settle_heap()
        except BaseException as error:  # reported by the first task rather than killing the worker
            logger.exception("dask-rl: %s worker %s failed to load its model", self.role, worker.name)
            self.error = error
        finally:
            self.load_seconds = time.perf_counter() - start
            self.ready.set()
        events.announce_worker(worker, self.role)  # the RL page's worker table: role and devices

    def _build(self, imports: BackgroundImports | None):
        if imports is not None:  # the worker's own imports of torch and transformers first
            start = time.perf_counter()
            imports.wait()
            self.imports_wait = time.perf_counter() - start
        import torch

        if self.torch_threads:
            torch.set_num_threads(self.torch_threads)
        if self.gpu_memory_gib is not None:
            fraction = limit_gpu_memory(self.gpu_memory_gib)
            logger.info("dask-rl: %s worker capped at %.1f GiB of GPU memory (%s of the device)", self.role,
                        self.gpu_memory_gib, "no GPU here" if fraction is None else f"{fraction:.1%}")
        if self.build is None:
            self.build, self._recipe = cloudpickle.loads(self._recipe), None
        return self.build()

    def teardown(self, worker) -> None:
        close = getattr(self.state, "close", None)
        if callable(close):
            close()
        self.state = None
        gc.unfreeze()   # what the role held (frozen at its build) is collectable again


def settle_heap(thaw: bool = True) -> None:
    """Collect what is garbage now, then keep every object still alive out of later full
    garbage collections (gc.freeze). A full collection walks every tracked object: with
    torch, transformers and a 0.5B model loaded that is 0.24 s on a CPU host, and the actor
    of a 12-step GRPO run on an H100 paused five times for 2.0 s in all (the longest 0.57 s),
    the rollout three times for 1.0 s. Frozen objects are never collected, even once they
    are unreachable cycles (a compiled module and its compiled call are one), so with `thaw`
    the objects frozen before are thawed and collected first: after a role replaces its
    model, the old one is freed, not kept. Without it only what is new since the last call
    is collected and frozen (a new compiled graph, nothing replaced), and the frozen heap is
    not walked again. Garbage made between calls is collected as usual."""
    if thaw:
        gc.unfreeze()
    gc.collect()
    gc.freeze()


def load_times(dask_worker=None) -> dict[str, tuple[float, float, float]]:
    """For `client.run`: role -> (wall-clock time its setup began, seconds it took to build:
    imports, model, engine; of which seconds waiting for the background imports) on this worker."""
    return {plugin.role: (plugin.load_started, plugin.load_seconds, plugin.imports_wait)
            for plugin in dask_worker.plugins.values() if isinstance(plugin, RoleHost) and plugin.load_seconds is not None}


def resolve_device(device: str = "auto") -> str:
    """"auto" -> the device for models on this worker: its GPU when it was given one, else the CPU.

    Resolved on the worker, not in the driver: a role moved between CPU and GPU workers
    keeps one recipe, and each worker loads onto what it actually has.
    """
    import torch

    if device != "auto":
        return device
    return "cuda" if os.environ.get("CUDA_VISIBLE_DEVICES") and torch.cuda.is_available() else "cpu"


def role_state(role: str, worker: Any = None) -> Any:
    """The role object that lives on `worker` (default: the worker running the current task;
    a function run by `client.run` has none and passes the `dask_worker` it is given)."""
    worker = get_worker() if worker is None else worker
    plugin = worker.plugins.get(plugin_name(role))
    if plugin is None or role not in worker.state.total_resources:
        raise RuntimeError(
            f"a {role} task ran on worker {worker.name} ({worker.address}), which does not hold the "
            f"{role} model; every {role} task must request resources={{'{role}': 1}}"
        )
    plugin.ready.wait()
    if plugin.error is not None:
        raise RuntimeError(f"{role} worker {worker.name} could not load its model: {plugin.error!r}") from plugin.error
    return plugin.state


def role_ready(role: str, restore_path: str | None = None) -> dict[str, Any]:
    """Task: returns once this worker has loaded the `role` model (and, for a trainable role
    joining mid-run, the exported current weights); says where it runs."""
    state = role_state(role)
    if restore_path is not None:
        state.trainer.load_model_state(restore_path)
    return worker_identity()


def worker_identity() -> dict[str, Any]:
    """Where the current task runs: for reports and for tests that check placement."""
    worker = get_worker()
    return {
        "name": worker.name, "address": worker.address, "pid": os.getpid(),
        "resources": dict(worker.state.total_resources),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
    }
