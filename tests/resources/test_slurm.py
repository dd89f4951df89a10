"""Role workers as real SLURM jobs on the single-node SLURM of the `slurm` fixture: a job
joins as a tagged worker and runs the role's tasks inside the job; a job the queue refuses,
or one that never starts, ends with one line naming the job and SLURM's reason; a job
cancelled under its worker is reported as lost."""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from resources import load_resource_config
from resources.cluster import RoleCluster, submit
from resources.job_queue import JobRefused, job_state
from resources.plan import plan_workers

pytest.importorskip("dask_jobqueue")


def _config(tmp_path, timeout=120, **section):
    job = {"job_queue": "slurm", "jobs": 1, "memory": "1GB", "walltime": "00:10:00",
           "log_directory": str(tmp_path), **section}
    return load_resource_config({"actor": {"device_type": "cpu"}, "reward": {"device_type": "cpu"},
                                 "rollout": job, "timeout_seconds": timeout})


def _rollout_jobs(config):
    return [w for w in plan_workers(config) if w.role == "rollout"]


def _squeue() -> str:
    return subprocess.run(["squeue", "-h", "-o", "%i %T"], capture_output=True, text=True, timeout=10).stdout


def test_a_job_is_a_tagged_role_worker_and_retiring_it_ends_the_job(slurm, tmp_path, measured):
    config = _config(tmp_path)
    began = time.perf_counter()
    with RoleCluster(_rollout_jobs(config), dashboard_address=":0", timeout=config.timeout_seconds) as cluster:
        joined = time.perf_counter() - began
        (worker,) = cluster.workers_of("rollout")
        job_id = cluster.jobs.job_id("rollout-0")
        assert worker["name"] == "rollout-0" and job_id
        # The task ran inside the job, on a worker that sees no GPU, one thread, no memory limit.
        # (os.getenv: the job imports this project, not the tests' modules.)
        assert submit(cluster.client, "rollout", os.getenv, "SLURM_JOB_ID").result(timeout=60) == job_id
        assert submit(cluster.client, "rollout", os.getenv, "CUDA_VISIBLE_DEVICES").result(timeout=60) == ""
        info = cluster.client.scheduler_info(n_workers=-1)["workers"]
        assert [(w["nthreads"], w["memory_limit"], w["resources"]) for w in info.values()] == [(1, 0, {"rollout": 1})]
        cluster.retire([worker["address"]])
        assert "rollout-0" not in cluster.specs
        # The worker closes and the scheduler lets it go; on a loaded machine that may come
        # a moment after retire_workers returned.
        deadline = time.monotonic() + 30
        while cluster.workers_of("rollout") and time.monotonic() < deadline:
            time.sleep(0.2)
        assert cluster.workers_of("rollout") == []
        deadline = time.monotonic() + 30
        while job_state(job_id)[0] in ("RUNNING", "COMPLETING") and time.monotonic() < deadline:
            time.sleep(0.5)
        assert job_state(job_id)[0] in ("COMPLETED", "CANCELLED", "GONE")
    measured(f"SLURM job start: submit to a joined rollout worker in {joined:.1f} s (1-CPU job, local SLURM)")


def test_a_queue_that_refuses_the_job_says_why(slurm, tmp_path):
    config = _config(tmp_path, queue="nosuchpartition")
    with pytest.raises(JobRefused) as error:
        RoleCluster(_rollout_jobs(config), dashboard_address=":0", timeout=30)
    message = str(error.value)
    assert "SLURM refused the job for worker rollout-0" in message and "invalid partition" in message.lower()
    assert "\n" not in message


def test_a_job_that_never_starts_times_out_naming_the_job_and_the_reason(slurm, tmp_path):
    config = _config(tmp_path, timeout=6, job_extra=["--begin=now+3600"])  # queued for an hour
    with pytest.raises(TimeoutError) as error:
        RoleCluster(_rollout_jobs(config), dashboard_address=":0", timeout=config.timeout_seconds)
    message = str(error.value)
    assert "\n" not in message and "PENDING, reason BeginTime" in message and "within 6s" in message
    job_id = message.split("SLURM job ")[1].split()[0]
    assert job_state(job_id)[0] in ("CANCELLED", "GONE")   # not left in the queue
    assert f"{job_id} PENDING" not in _squeue()


def test_a_cancelled_job_is_a_lost_worker_named_by_its_job(slurm, tmp_path):
    config = _config(tmp_path)
    with RoleCluster(_rollout_jobs(config), dashboard_address=":0", timeout=config.timeout_seconds) as cluster:
        job_id = cluster.jobs.job_id("rollout-0")
        assert cluster.lost_jobs() == []
        subprocess.run(["scancel", job_id], check=True, timeout=10)
        deadline = time.monotonic() + 60
        while cluster.workers_of("rollout") and time.monotonic() < deadline:
            time.sleep(0.5)
        ((role, described),) = cluster.lost_jobs()
        assert role == "rollout" and described.startswith(f"SLURM job {job_id} (worker rollout-0): CANCELLED")
        assert "rollout-0" not in cluster.specs and cluster.lost_jobs() == []
