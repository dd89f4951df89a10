"""A killed worker comes back however long its Nanny takes to restart it.

Dask's SpecCluster closes the Nanny of a worker that has not registered again 15 s after
the scheduler lost it (distributed.deploy.lost-worker-timeout), even while that Nanny is
restarting it. On a busy machine a role worker's replacement took longer, the Nanny was
closed under it, and the role never got its worker back (a training run then ended with
RoleTimeout). The drill here makes the restart slow for certain: the replacement process is
stopped (SIGSTOP) before it can register, and let go only after Dask's 15 s.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from resources.cluster import RoleCluster, live_workers
from resources.plan import WorkerSpec

DASK_DEFAULT_LOST_WORKER_SECONDS = 15


def _wait_for(condition, seconds: float, what: str):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.01)
    raise AssertionError(f"no {what} within {seconds:.0f}s")


def _registered_names(cluster: RoleCluster) -> set[str]:
    return {str(w["name"]) for w in live_workers(cluster.client).values()}


@pytest.mark.slow  # waits out Dask's 15 s on purpose
def test_a_worker_whose_restart_outlasts_dasks_lost_worker_timeout_still_comes_back():
    worker = WorkerSpec(name="actor-0", role="actor", device_type="cpu", device_id=None, env=())
    with RoleCluster([worker], dashboard_address=":0") as cluster:
        nanny = cluster.cluster.workers["actor-0"]
        killed = nanny.pid
        os.kill(killed, signal.SIGKILL)
        # The Nanny starts a replacement: hold it before it registers, as a loaded machine would.
        replacement = _wait_for(lambda: nanny.pid not in (None, killed) and nanny.pid, 60, "replacement process")
        os.kill(replacement, signal.SIGSTOP)
        try:
            _wait_for(lambda: "actor-0" not in _registered_names(cluster), 30, "removal of the killed worker")
            time.sleep(DASK_DEFAULT_LOST_WORKER_SECONDS + 2)
        finally:
            os.kill(replacement, signal.SIGCONT)
        _wait_for(lambda: "actor-0" in _registered_names(cluster), 60, "registration of the replacement")
        time.sleep(2)  # a Nanny closed under its worker would take the worker away again now
        assert "actor-0" in _registered_names(cluster)
        assert cluster.cluster.workers.get("actor-0") is nanny and nanny.pid == replacement
        assert cluster.nanny_states("actor") == {"actor-0": f"Nanny running, worker pid {replacement}"}
