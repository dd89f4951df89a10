"""A role on a job queue without a queue: the file's section, its errors, the job script
dask-jobqueue writes from it, the plan of a resize and the adaptive policy's queue rules.
The jobs themselves run in tests/resources/test_slurm.py."""

from __future__ import annotations

import shlex
import sys
from dataclasses import replace

import pytest

from pipeline.fleet.reconcile import ResourceRequest, requested_config
from resources import ResourceConfigError, load_resource_config
from resources.adaptive import RoleLoad, decide
from resources.config import AdaptiveBounds
from resources.plan import plan_change, plan_role
from resources.validate import with_role

BASE = {"actor": {"device_type": "cpu"}, "reward": {"device_type": "cpu"}}
GPU_JOBS = {"job_queue": "slurm", "gpus_per_job": 1, "jobs": 2, "queue": "gpu", "walltime": "04:00:00",
            "job_extra": ["--constraint=a100"], "memory": "32GB", "cores": 8}


def test_the_issue_section_parses_and_round_trips():
    config = load_resource_config({**BASE, "rollout": GPU_JOBS, "adaptive": {"rollout": {"min": 1, "max": 4}}})
    spec = config.role("rollout")
    assert (spec.device_type, spec.device_ids, spec.workers, spec.strategy) == ("cuda", (), 2, "cuda_graph")
    jobs = spec.job_queue
    assert (jobs.gpus_per_job, jobs.cores, jobs.memory, jobs.queue, jobs.walltime, jobs.job_extra) == (
        1, 8, "32GB", "gpu", "04:00:00", ("--constraint=a100",))
    # No NVML was needed (the GPUs are the jobs' nodes'), and a copy re-validates to the same config.
    assert with_role(config, spec) == config
    assert config.to_dict()["rollout"]["jobs"] == 2
    # The engine's options ride along with the jobs.
    tuned = load_resource_config({**BASE, "rollout": {**GPU_JOBS, "cuda_graph_args": {"decode_attention": "sdpa"}}})
    assert tuned.role("rollout").engine_kwargs == {"decode_attention": "sdpa"}
    assert with_role(tuned, tuned.role("rollout")) == tuned


@pytest.mark.parametrize("section, path, fragment", [
    ({"job_queue": "pbs"}, "rollout.job_queue: 'pbs'", "use job_queue: slurm"),
    ({"job_queue": "slurm", "gpus_per_job": 4, "jobs": 2}, "rollout.gpus_per_job: 4", "gpus_per_job: 1 and jobs: 8"),
    ({"job_queue": "slurm", "device_ids": [0]}, "rollout.device_ids", "set jobs: N"),
    ({"job_queue": "slurm", "jobs": 0}, "rollout.jobs: 0", "jobs: 1 or more"),
    ({"job_queue": "slurm", "walltime": 14400}, "rollout.walltime: 14400", '"04:00:00"'),
    ({"job_queue": "slurm", "memory": "lots"}, "rollout.memory: 'lots'", '"16GB"'),
    ({"job_queue": "slurm", "job_extra": ["#SBATCH --qos=low"]}, "rollout.job_extra", "'--qos=low'"),
    ({"job_queue": "slurm", "jobz": 2}, "rollout.jobz", "did you mean 'jobs'"),
    ({"job_queue": "slurm", "strategy": "hf", "cuda_graph_args": {}}, "rollout.cuda_graph_args", "strategy: cuda_graph"),
])
def test_a_bad_section_names_the_key_and_the_fix(section, path, fragment):
    with pytest.raises(ResourceConfigError) as error:
        load_resource_config({**BASE, "rollout": section})
    assert path in str(error.value) and fragment in str(error.value)


def test_the_actor_stays_off_the_queue():
    with pytest.raises(ResourceConfigError, match="actor.job_queue.*put rollout, reward, reference on the job"):
        load_resource_config({"actor": {"job_queue": "slurm"}, "reward": {"device_type": "cpu"},
                              "rollout": {"device_type": "cpu"}})


def test_the_job_script_is_slurmclusters_with_the_role_worker(monkeypatch):
    """slurm_options are SLURMCluster's own arguments: a real SLURMCluster (its scheduler
    started here, no job submitted) writes the very script the launcher submits."""
    SLURMCluster = pytest.importorskip("dask_jobqueue").SLURMCluster
    from resources.cluster import role_job_script
    from resources.job_queue import job_script, slurm_options

    monkeypatch.setenv("PYTHONPATH", "/opt/project")
    config = load_resource_config({**BASE, "rollout": GPU_JOBS})
    spec = config.role("rollout").job_queue
    with SLURMCluster(**slurm_options(spec, "rollout"), scheduler_options={"dashboard_address": ":0",
                                                                             "host": "127.0.0.1"}) as cluster:
        address = cluster.scheduler_address
        assert cluster.job_script() == job_script(spec, "rollout", scheduler=address)
    script = role_job_script(config, "rollout")
    for line in ("#SBATCH -p gpu", "#SBATCH --cpus-per-task=8", "#SBATCH -t 04:00:00", "#SBATCH --gres=gpu:1",
                 "#SBATCH --constraint=a100", "export PYTHONPATH=/opt/project",
                 "export DASK_DISTRIBUTED__WORKER__DAEMON=False"):
        assert line in script.splitlines()
    command = shlex.split(script.splitlines()[-1])
    assert command[:3] == [sys.executable, "-m", "distributed.cli.dask_worker"]
    # The last of a repeated option wins: one thread, no memory limit, one role resource.
    assert command[-6:] == ["--resources", "rollout=1", "--nthreads", "1", "--memory-limit", "0"]
    assert "CUDA_VISIBLE_DEVICES" not in script   # the job's GPU is the one SLURM gives it
    cpu = role_job_script(load_resource_config({**BASE, "rollout": {"job_queue": "slurm"}}), "rollout")
    assert "export CUDA_VISIBLE_DEVICES=''" in cpu.splitlines() and "--gres" not in cpu


def test_a_resize_keeps_the_oldest_jobs_and_names_new_ones_after_the_last():
    spec = load_resource_config({**BASE, "rollout": {"job_queue": "slurm", "jobs": 3}}).role("rollout")
    running = plan_role(spec)
    assert [w.name for w in running] == ["rollout-0", "rollout-1", "rollout-2"] and all(w.job_queue for w in running)
    start, retire = plan_change(running, replace(spec, workers=1), next_index=3)
    assert start == [] and [w.name for w in retire] == ["rollout-1", "rollout-2"]
    start, retire = plan_change(running[:1], spec, next_index=3)
    assert [w.name for w in start] == ["rollout-3", "rollout-4"] and retire == []


def test_update_resource_takes_jobs_for_a_queued_role():
    config = load_resource_config({**BASE, "rollout": {"job_queue": "slurm", "jobs": 1}})
    assert requested_config(config, ResourceRequest("rollout", jobs=3)).role("rollout").workers == 3
    assert requested_config(config, ResourceRequest("rollout", workers=2)).role("rollout").workers == 2
    with pytest.raises(ValueError, match="jobs=0 for rollout. Fix: give jobs=1 or more"):
        requested_config(config, ResourceRequest("rollout", jobs=0))
    with pytest.raises(ValueError, match="runs as batch jobs.*Fix: give jobs=N"):
        requested_config(config, ResourceRequest("rollout", device_ids=[0]))
    with pytest.raises(ValueError, match="jobs= is for a role on a job queue; reward runs on local CPU workers"):
        requested_config(config, ResourceRequest("reward", jobs=2))


def _load(role, workers, queued, busy, pool, low=1, high=4):
    return RoleLoad(role, workers, queued, busy, AdaptiveBounds(low, high), window=10.0, pool=pool)


def test_a_queued_role_grows_from_the_queue_and_gives_idle_jobs_back():
    queue = "rollout job queue"
    # Starved: 6 tasks on 2 workers (3 each >= 1), busy 95% > 90%: a job is submitted.
    (grow,) = decide({"rollout": _load("rollout", 2, 6, 0.95, queue)}, spare={queue: 1}, queues={queue})
    assert (grow.kind, grow.target_role) == ("grow", "rollout")
    assert grow.reason == ("rollout starved: 6 tasks queued or running on 2 workers, busy 95% over 10 s; "
                           "a job is submitted to the queue")
    # Idle: busy 10% < 30% and nothing queued, above its min of 1: one job goes back.
    (shrink,) = decide({"rollout": _load("rollout", 2, 0, 0.10, queue)}, spare={queue: 1}, queues={queue})
    assert (shrink.kind, shrink.source_role) == ("shrink", "rollout")
    assert shrink.reason == "rollout idle: busy 10% over 10 s, nothing queued, 2 workers; its job goes back to the queue"
    # At its min, or at its max, nothing changes; an idle local role is not shrunk by this rule.
    assert decide({"rollout": _load("rollout", 1, 0, 0.0, queue)}, spare={queue: 1}, queues={queue}) == []
    assert decide({"rollout": _load("rollout", 4, 9, 1.0, queue)}, spare={queue: 1}, queues={queue}) == []
    assert decide({"reward": _load("reward", 2, 0, 0.0, "cpu")}, queues={queue}) == []
