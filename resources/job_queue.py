"""Role workers as SLURM batch jobs, through dask-jobqueue (the `slurm` extra).

One job = one `dask worker` process joined to the trainer's scheduler, with the role
resource (`--resources rollout=1`), one thread, no memory limit, the driver's Python and
PYTHONPATH, and the Dask settings the local workers get: the same worker as
launcher.dask_worker_spec starts locally, only obtained from the queue. The jobs are
dask-jobqueue's `SLURMCluster.job_cls` (SLURMJob) built with SLURMCluster's own keyword
arguments (`slurm_options`): a SLURMCluster would start a second scheduler, and the role
workers must join the one the trainer drives. `job_script(spec, role)` is what
`SLURMCluster(**slurm_options(...)).job_script()` prints.

Which jobs run is decided by the fleet (update_resource, adaptive scaling); JobLauncher only
submits, cancels and reports: the job id and SLURM's state and reason for each worker.
"""

from __future__ import annotations

import logging
import os
import shlex
import subprocess
import sys
from collections.abc import Iterable, Mapping

from resources.config import JobQueueSpec
from resources.plan import WorkerSpec

__all__ = ["JobLauncher", "JobRefused", "job_script", "job_state", "slurm_options"]

logger = logging.getLogger("dask_rl")
INSTALL = "pip install 'dask-rl[slurm]' (dask-jobqueue)"
# Job states in which the job's worker is gone for good (squeue/scontrol JobState).
ENDED = {"BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "NODE_FAIL", "OUT_OF_MEMORY",
         "PREEMPTED", "TIMEOUT", "GONE"}


class JobRefused(RuntimeError):
    """The queue refused a job (sbatch failed), or a job ended before its worker joined."""


def _slurm_cluster_class():
    try:
        from dask_jobqueue import SLURMCluster
    except ImportError as error:
        raise ImportError(f"a job-queue role needs dask-jobqueue ({error}). Fix: {INSTALL}") from None
    return SLURMCluster


def _export(name: str, value: str) -> str:
    return f"export {name}={shlex.quote(value)}"


def dask_env(settings: Mapping[str, object]) -> dict[str, str]:
    """Dask config as the DASK_* variables a fresh worker process reads (a job's worker gets no
    config from a Nanny of ours): "a.b-c" -> DASK_A__B_C, the value as Python literal text."""
    return {"DASK_" + key.upper().replace(".", "__").replace("-", "_"): value if isinstance(value, str) else repr(value)
            for key, value in settings.items()}


def slurm_options(spec: JobQueueSpec, role: str, *, env: Mapping[str, str] = (),
                  python: str | None = None) -> dict:
    """SLURMCluster (and SLURMJob) keyword arguments for one job of `role`.

    `env`: variables the job exports before starting the worker (CUDA_VISIBLE_DEVICES="" for
    a CPU job, the Dask settings); PYTHONPATH is carried from this process, so the job
    imports the same code; `python`: the job's interpreter (this one by default)."""
    variables = dict(env)
    if os.environ.get("PYTHONPATH"):
        variables["PYTHONPATH"] = os.environ["PYTHONPATH"]
    gres = [f"--gres=gpu:{spec.gpus_per_job}"] if spec.gpus_per_job else []
    return dict(
        cores=spec.cores, memory=spec.memory, processes=1, queue=spec.queue, account=spec.account,
        walltime=spec.walltime, job_name=f"dask-rl-{role}", log_directory=spec.log_directory,
        job_extra_directives=[*gres, *spec.job_extra],
        job_script_prologue=[*(_export(k, v) for k, v in sorted(variables.items())), *spec.prologue],
        # One role resource, one task at a time, no memory limit: as for a local role worker
        # (the later --nthreads/--memory-limit win over the ones dask-jobqueue derives).
        worker_extra_args=["--resources", f"{role}=1", "--nthreads", "1", "--memory-limit", "0"],
        python=python or sys.executable,
    )


PLACEHOLDER = "tcp://<insert-scheduler-address-here>:8786"


def job_script(spec: JobQueueSpec, role: str, *, scheduler: str = PLACEHOLDER, name: str = "dummy-name",
               **kwargs) -> str:
    """The batch script of one job of `role`: what `SLURMCluster(**slurm_options(spec, role)).
    job_script()` prints (it builds the same job with the same placeholders), without
    starting the scheduler a SLURMCluster would."""
    job_cls = _slurm_cluster_class().job_cls
    return job_cls(scheduler, name=name, **slurm_options(spec, role, **kwargs)).job_script()


def job_state(job_id: str, env: Mapping[str, str] | None = None) -> tuple[str, str]:
    """(state, reason) of a job as SLURM reports it, e.g. ("PENDING", "BeginTime");
    ("GONE", ...) once SLURM has forgotten it."""
    try:
        out = subprocess.run(["scontrol", "show", "job", "-o", str(job_id)], capture_output=True, text=True,
                             timeout=10, env=env)
    except (OSError, subprocess.TimeoutExpired) as error:
        return "UNKNOWN", f"scontrol failed: {error}"
    fields = dict(item.split("=", 1) for item in out.stdout.split() if "=" in item)
    if "JobState" not in fields:
        return "GONE", (out.stderr.strip() or "no longer known to SLURM")
    return fields["JobState"], fields.get("Reason", "None")


def _one_line(error: BaseException) -> str:
    """sbatch's own complaint out of dask-jobqueue's multi-line RuntimeError."""
    text = str(error)
    stderr = text.split("stderr:", 1)[-1].strip()
    return " ".join(stderr.split()) or " ".join(text.split())


class JobLauncher:
    """Submits and cancels the jobs of job-queue role workers for one scheduler, on a Client's
    event loop (dask-jobqueue's jobs are awaited there)."""

    def __init__(self, client, env: Mapping[str, str] = ()):
        self.client = client
        self.env = dict(env)   # exported in every job, besides the worker's own (WorkerSpec.env)
        self.jobs: dict[str, object] = {}    # worker name -> SLURMJob
        self.joined: set[str] = set()        # names whose worker registered at least once

    def job_id(self, name: str) -> str | None:
        job = self.jobs.get(name)
        return None if job is None else job.job_id

    def start(self, workers: Iterable[WorkerSpec]) -> dict[str, str]:
        """Submit one job per worker; returns name -> job id. A refused job raises JobRefused
        (its siblings submitted here are cancelled again)."""
        job_cls = _slurm_cluster_class().job_cls
        workers = list(workers)
        jobs = {w.name: job_cls(self.client.scheduler.address, name=w.name, **slurm_options(
            w.job_queue, w.role, env={**w.env_dict, **self.env})) for w in workers}
        try:
            self.client.sync(self._submit, jobs)
        except JobRefused:
            self.stop(list(jobs))
            raise
        return {name: job.job_id for name, job in jobs.items()}

    async def _submit(self, jobs: dict) -> None:
        for name, job in jobs.items():
            try:
                await job.start()
            except RuntimeError as error:
                raise JobRefused(f"SLURM refused the job for worker {name}: {_one_line(error)}. Fix: check the "
                                 f"role's job_queue settings (queue, cores, memory, walltime, job_extra) "
                                 f"against `sinfo`") from None
            self.jobs[name] = job
            logger.warning("dask-rl: submitted SLURM job %s for worker %s", job.job_id, name)

    def describe(self, name: str) -> str:
        """"SLURM job 12 (worker rollout-2): PENDING, reason BeginTime"."""
        job_id = self.job_id(name)
        if job_id is None:
            return f"worker {name} (no job)"
        state, reason = job_state(job_id)
        return f"SLURM job {job_id} (worker {name}): {state}, reason {reason}"

    def ended_before_joining(self, names: Iterable[str]) -> list[str]:
        """Descriptions of the jobs among `names` that ended without their worker ever joining."""
        ended = []
        for name in names:
            if name in self.jobs and name not in self.joined:
                state, reason = job_state(self.jobs[name].job_id)
                if state in ENDED:
                    ended.append(f"SLURM job {self.jobs[name].job_id} (worker {name}): {state}, reason {reason}")
        return ended

    def lost(self, live_names: Iterable[str]) -> dict[str, str]:
        """Workers that joined, are gone, and whose job has ended: name -> "SLURM job 12
        (worker rollout-1): CANCELLED, reason None". They are forgotten here. A worker gone
        while its job still runs is left alone: its Nanny is restarting it."""
        live = set(live_names)
        lost = {}
        for name in [n for n in self.joined if n in self.jobs and n not in live]:
            state, reason = job_state(self.jobs[name].job_id)
            if state in ENDED:
                lost[name] = f"SLURM job {self.jobs[name].job_id} (worker {name}): {state}, reason {reason}"
        self.stop(lost)
        return lost

    def stop(self, names: Iterable[str]) -> None:
        """Cancel the jobs of `names` (scancel; a job already ended is fine) and forget them."""
        names = list(names)
        jobs = [self.jobs.pop(name) for name in names if name in self.jobs]
        self.joined.difference_update(names)
        if jobs:
            self.client.sync(_close_jobs, jobs)

    def close(self) -> None:
        try:
            self.stop(list(self.jobs))
        except Exception as error:  # noqa: BLE001 - closing never fails a finished run
            logger.warning("dask-rl: cancelling SLURM jobs %s failed: %r",
                           [job.job_id for job in self.jobs.values()], error)


async def _close_jobs(jobs: list) -> None:
    for job in jobs:
        await job.close()
