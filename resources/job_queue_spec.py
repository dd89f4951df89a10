"""A role whose workers are batch jobs: parsing its section of the resource file.

    rollout: {job_queue: slurm, gpus_per_job: 1, jobs: 2, queue: gpu, walltime: "04:00:00",
              job_extra: ["--constraint=a100"]}

becomes a RoleSpec with `job_queue` set and `workers` = jobs; each job runs one worker
process (on its one GPU when gpus_per_job is 1). Pure: no Dask and no SLURM here;
resources.job_queue submits the jobs. resources.validate calls `parse_job_queue_role` for
a role section that has a `job_queue` key, with its own parser for the errors.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

from dask.utils import parse_bytes

from resources.config import JobQueueSpec, RoleSpec

__all__ = ["JOB_QUEUE_KEYS", "JOB_QUEUE_ROLES", "parse_job_queue_role"]

JOB_QUEUE_KEYS = ("job_queue", "jobs", "gpus_per_job", "cores", "memory", "queue", "account", "walltime",
                  "job_extra", "prologue", "log_directory", "strategy", "cuda_graph_args")
# Roles that grow and shrink by worker count alone. The actor and critic form a process group
# that is rebuilt at step boundaries from local workers; they stay on devices or `dask-rl worker`.
JOB_QUEUE_ROLES = ("rollout", "reward", "reference")
SCHEDULERS = ("slurm",)
_WALLTIME = re.compile(r"(\d+-)?\d{1,3}:\d{2}:\d{2}")
_DEVICE_KEYS = ("device_type", "device_ids", "workers", "vllm_args")


def parse_job_queue_role(parser: Any, role: str, raw: Mapping,
                         strategy: Callable[[int, str], str]) -> RoleSpec:
    """The RoleSpec of a job-queue role section; `parser` is resources.validate's _Parser
    (its .error makes the one ResourceConfigError naming the key, the value and the fix),
    `strategy(workers, device_type)` parses the role's strategy as for any role."""
    def fail(key: str, value: Any, problem: str, fix: str):
        return parser.error(f"{role}.{key}", value, problem, fix)

    if role not in JOB_QUEUE_ROLES:
        raise fail("job_queue", raw["job_queue"], f"{role} cannot run as batch jobs: its process group is "
                   "rebuilt from local workers", f"give {role} device_ids or workers here, and put "
                   f"{', '.join(JOB_QUEUE_ROLES)} on the job queue")
    for key in _DEVICE_KEYS:
        if key in raw:
            raise fail(key, raw[key], "a job-queue role gets its devices from its jobs",
                       f"remove {key}; set jobs: N for the number of workers and gpus_per_job: 1 for GPU jobs")
    parser.check_keys(raw, JOB_QUEUE_KEYS, prefix=f"{role}.")
    if raw["job_queue"] not in SCHEDULERS:
        raise fail("job_queue", raw["job_queue"], "not a job queue dask-rl submits to", "use job_queue: slurm")
    jobs = _count(raw, "jobs", 1, 1, fail, "set jobs: 1 or more (one worker each)")
    gpus = _count(raw, "gpus_per_job", 0, 0, fail, "use gpus_per_job: 1 for GPU jobs, 0 for CPU jobs")
    if gpus > 1:
        raise fail("gpus_per_job", gpus, "each job runs one worker process on one GPU",
                   f"use gpus_per_job: 1 and jobs: {jobs * gpus}; SLURM packs several one-GPU jobs onto a node")
    spec = JobQueueSpec(
        scheduler=raw["job_queue"], gpus_per_job=gpus,
        cores=_count(raw, "cores", 1, 1, fail, "set cores: 1 or more (CPUs per job)"),
        memory=_memory(raw.get("memory", JobQueueSpec.memory), fail),
        queue=_name(raw, "queue", fail, "the partition, e.g. queue: gpu"),
        account=_name(raw, "account", fail, "e.g. account: my-project"),
        walltime=_walltime(raw.get("walltime", JobQueueSpec.walltime), fail),
        job_extra=_lines(raw, "job_extra", fail, 'write sbatch options, e.g. job_extra: ["--constraint=a100"]'),
        prologue=_lines(raw, "prologue", fail, 'write shell lines, e.g. prologue: ["module load cuda"]'),
        log_directory=_name(raw, "log_directory", fail, "a directory the jobs can write, e.g. log_directory: logs"))
    for line in spec.job_extra:
        if not line.startswith("-"):
            raise fail("job_extra", line, "not an sbatch option", f"write the option alone, e.g. "
                       f"{line.replace('#SBATCH', '').strip() or '--constraint=a100'!r}")
    device_type = "cuda" if gpus else "cpu"
    chosen = strategy(jobs, device_type)
    engine_args = parser.cuda_graph_args(role, raw["cuda_graph_args"], chosen) if "cuda_graph_args" in raw else ()
    return RoleSpec(role, device_type, (), jobs, chosen, job_queue=spec, cuda_graph_args=engine_args)


def _count(raw: Mapping, key: str, default: int, low: int, fail, fix: str) -> int:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise fail(key, value, f"not an integer >= {low}", fix)
    return value


def _memory(value: Any, fail) -> str:
    try:
        size = parse_bytes(value) if isinstance(value, str) else 0
    except (ValueError, TypeError):
        size = 0
    if size <= 0:
        raise fail("memory", value, "not an amount of memory", 'write it with a unit, e.g. memory: "16GB"')
    return value


def _walltime(value: Any, fail) -> str:
    if not isinstance(value, str) or not _WALLTIME.fullmatch(value):
        raise fail("walltime", value, "not a SLURM time limit", 'write [days-]hours:minutes:seconds, '
                   'e.g. walltime: "04:00:00" (quoted: YAML reads 04:00 as a number)')
    return value


def _name(raw: Mapping, key: str, fail, fix: str) -> str | None:
    value = raw.get(key)
    if value is not None and (not isinstance(value, str) or not value.strip()):
        raise fail(key, value, "expected a non-empty name", fix)
    return value


def _lines(raw: Mapping, key: str, fail, fix: str) -> tuple[str, ...]:
    value = raw.get(key, [])
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) and v.strip() for v in value):
        raise fail(key, value, "expected a list of strings", fix)
    return tuple(value)
