"""Start a Dask cluster from a worker plan: one Nanny-managed process per role worker.

Every worker carries exactly one role resource (`{"rollout": 1}`), one thread and its own
CUDA_VISIBLE_DEVICES. GPU workers get dask-cuda's CPU-affinity plugin when dask-cuda is
installed; CPU workers are plain distributed workers, so the CPU path needs no NVML.
"""

from __future__ import annotations

import logging
from typing import Iterable

import dask
from distributed import Client, Nanny, Scheduler, SpecCluster

from resources.plan import WorkerSpec

logger = logging.getLogger("dask_rl")

# Why each setting (see notes on Dask's behaviour in the project docs):
DASK_SETTINGS = {
    # Rollout engines and DataLoaders spawn processes; daemonic workers cannot.
    "distributed.worker.daemon": False,
    # A worker loading a large model in its plugin sends no heartbeat until setup ends;
    # the default 5 minutes would have the scheduler restart it in a loop.
    "distributed.scheduler.worker-ttl": "15 minutes",
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


def dask_worker_spec(worker: WorkerSpec) -> dict:
    """The SpecCluster entry for one role worker."""
    options = {
        "name": worker.name,
        "nthreads": worker.nthreads,
        "resources": worker.resources,
        "env": worker.env_dict,
        # Quiet workers: a training run's console is the progress bar, not Dask's INFO log.
        "silence_logs": logging.WARNING,
        "memory_limit": 0,
    }
    if worker.device_type == "cuda":
        options["plugins"] = _cuda_worker_plugins(worker.device_id)
    return {"cls": Nanny, "options": options}


def _cuda_worker_plugins(device_id: int) -> set:
    """dask-cuda's CPU-affinity plugin for the GPU's NUMA node, when dask-cuda is present."""
    try:
        from dask_cuda.plugins import CPUAffinity
        from dask_cuda.utils import get_cpu_affinity
    except ImportError as error:  # still a working GPU worker, only without NUMA pinning
        logger.warning("dask-rl: dask-cuda unavailable (%s); GPU %d worker runs without CPU affinity", error, device_id)
        return set()
    return {CPUAffinity(get_cpu_affinity(device_id))}


class RoleCluster:
    """A local Dask cluster with role-tagged workers, and the client the trainer uses."""

    def __init__(self, workers: Iterable[WorkerSpec], *, dashboard_address: str = ":8787",
                 scheduler_address: str = "127.0.0.1", silence_logs: int = logging.WARNING):
        configure_dask()
        self.specs: dict[str, WorkerSpec] = {w.name: w for w in workers}
        scheduler = {"cls": Scheduler, "options": {"dashboard_address": dashboard_address,
                                                   "host": scheduler_address}}
        self.cluster = SpecCluster(
            workers={name: dask_worker_spec(w) for name, w in self.specs.items()},
            scheduler=scheduler, silence_logs=silence_logs, name="dask-rl",
        )
        self.client = Client(self.cluster, direct_to_workers=True)

    @property
    def dashboard_link(self) -> str:
        return self.client.dashboard_link

    def workers_of(self, role: str) -> list[dict]:
        """Scheduler's view of the live workers carrying `role`: address, name, host."""
        info = self.client.scheduler_info(n_workers=-1)["workers"]
        return sorted(
            ({"address": addr, "name": w["name"], "host": w["host"]}
             for addr, w in info.items() if w.get("resources", {}).get(role)),
            key=lambda w: str(w["name"]),
        )

    def close(self) -> None:
        self.client.close()
        self.cluster.close()

    def __enter__(self) -> RoleCluster:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
