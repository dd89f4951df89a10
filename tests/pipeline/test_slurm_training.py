"""Training with the rollout role on SLURM jobs (the local single-node SLURM of the `slurm`
fixture): grown by a job submitted while training runs, a job cancelled mid-step (scancel)
costs no step and is reported by its job id, shrunk by draining and cancelling a job; and
adaptive scaling grows the role by submission and gives an idle job back.

Each test starts its own trainer cluster: the jobs join that scheduler."""

from __future__ import annotations

import subprocess
import threading
import time

import pytest

from pipeline import events
from pipeline.rewards import digit_fraction
from pipeline.trainer import HybridTrainer
from resources import load_resource_config
from resources.adaptive import Thresholds
from resources.job_queue import job_state

pytest.importorskip("dask_jobqueue")

GRPO = dict(algorithm="grpo", samples_per_prompt=2, prompts_per_step=8, max_new_tokens=24, actor_lr=1e-3,
            micro_batch_size=16, show_progress=False)


def _layout(log_directory, **extra):
    return {"actor": {"device_type": "cpu", "workers": 1}, "reference": {"device_type": "cpu", "workers": 1},
            "reward": {"device_type": "cpu", "workers": 1},
            "rollout": {"job_queue": "slurm", "jobs": 1, "memory": "1GB", "walltime": "00:20:00",
                        "log_directory": str(log_directory)},
            "timeout_seconds": 120, **extra}


def _after_step(trainer, count, seconds=240):
    deadline = time.monotonic() + seconds
    while len(trainer.history) < count and time.monotonic() < deadline:
        time.sleep(0.05)


def _fault_events(client) -> list[str]:
    return [msg["reason"] for _, msg in client.get_events(events.EVENTS) if msg.get("kind") == "fault"]


def _running_on(client, address) -> bool:
    return bool(client.processing(workers=[address]).get(address))


@pytest.mark.slow  # about 4 minutes on two shared cores: CI runs it in the slow suite
def test_rollout_jobs_grow_lose_one_to_scancel_and_shrink_while_training(slurm, tiny_model, prompts, tmp_path,
                                                                          measured):
    trainer = HybridTrainer(tiny_model, digit_fraction, load_resource_config(_layout(tmp_path)), prompts=prompts,
                            steps=60, dashboard_address=":0", **GRPO)
    fleet = trainer.fleet
    first_job = fleet.cluster.jobs.job_id("rollout-0")
    done: dict = {}

    def operate():
        _after_step(trainer, 1)
        began = time.perf_counter()
        (done["grown"],) = trainer.update_resource("rollout", jobs=2)
        done["grow_seconds"] = time.perf_counter() - began
        # Mid-step: the queue takes the first job away while its worker generates.
        (first,) = [w["address"] for w in fleet.cluster.workers_of("rollout") if w["name"] == "rollout-0"]
        deadline = time.monotonic() + 120
        while not _running_on(fleet.client, first) and time.monotonic() < deadline:
            time.sleep(0.01)
        subprocess.run(["scancel", first_job], check=True, timeout=10)
        done["cancelled_at_step"] = len(trainer.history)
        deadline = time.monotonic() + 120   # the fleet's watch submits a replacement job
        while "rollout-2" not in [w["name"] for w in fleet.cluster.workers_of("rollout")] and \
                time.monotonic() < deadline:
            time.sleep(0.2)
        began = time.perf_counter()
        (done["shrunk"],) = trainer.update_resource("rollout", jobs=1)
        done["shrink_seconds"] = time.perf_counter() - began
        trainer.request_stop()

    operator = threading.Thread(target=operate, daemon=True)
    operator.start()
    try:
        # Training goes on while the operator works (slowed a little, so that it outlasts it).
        records = trainer.train(on_step=lambda record: time.sleep(0.3))
        operator.join(timeout=240)
        # No step lost, none repeated, although a rollout worker died under a running step.
        assert [r.policy_version for r in records] == list(range(1, len(records) + 1))
        assert "shrunk" in done and done["cancelled_at_step"] < len(records)
        assert done["grown"].added == ("rollout-1",) and done["grown"].workers == ("rollout-0", "rollout-1")
        faults = [reason for reason in _fault_events(fleet.client) if first_job in reason]
        assert faults == [f"rollout lost SLURM job {first_job} (worker rollout-0): CANCELLED, reason None; "
                          "submitting a replacement job"]
        assert job_state(first_job)[0] in ("CANCELLED", "GONE")
        shrunk = done["shrunk"]
        assert len(shrunk.removed) == 1 and len(shrunk.workers) == 1
        assert len(fleet.cluster.workers_of("rollout")) == 1 and len(fleet.cluster.jobs.jobs) == 1
    finally:
        trainer.close()
    measured(f"SLURM rollout under training: grow 1->2 jobs {done['grow_seconds']:.1f} s (submit, join, load, "
             f"weights), shrink 2->1 {done['shrink_seconds']:.1f} s (drain, retire, cancel); scancel during "
             f"step {done['cancelled_at_step'] + 1} of {len(records)} cost no step")


@pytest.mark.slow  # a long drill: CI runs it in the slow suite
def test_adaptive_grows_by_submission_and_gives_an_idle_job_back(slurm, tiny_model, prompts, tmp_path):
    layout = _layout(tmp_path, adaptive={"rollout": {"min": 1, "max": 2}})
    # Long generations, one step ahead: the rollout job is the bottleneck (starved from 75% busy
    # on two shared cores, as in test_adaptive_cpu).
    trainer = HybridTrainer(tiny_model, digit_fraction, load_resource_config(layout), prompts=prompts, steps=12,
                            dashboard_address=":0", **{**GRPO, "prompts_per_step": 16, "max_new_tokens": 128,
                                                      "max_staleness": 1})
    try:
        # Idle only below 10% while training: one rollout job starves, two are not idle.
        trainer.adapt(interval=1.0, wait_count=2, thresholds=Thresholds(starved_busy=0.75, idle_busy=0.1))
        trainer.train()
        grown = [d for d in trainer.adaptive_decisions if d.kind == "grow"]
        assert grown and grown[0].reason.endswith("a job is submitted to the queue")
        assert grown[0].outcome.startswith("applied")
        if len(trainer.fleet.cluster.workers_of("rollout")) == 1:   # given back already: ask for two by hand
            trainer.update_resource("rollout", jobs=2)
        # No training: the rollout jobs are idle, and one goes back to the queue.
        before = len(trainer.adaptive_decisions)
        trainer.adapt(interval=1.0, wait_count=2)
        deadline = time.monotonic() + 120
        while not any(d.kind == "shrink" for d in trainer.adaptive_decisions[before:]) and \
                time.monotonic() < deadline:
            time.sleep(0.5)
        trainer.fleet.stop_adapting()
        (shrink,) = trainer.adaptive_decisions[before:]
        assert shrink.kind == "shrink" and shrink.reason.endswith("its job goes back to the queue")
        assert shrink.outcome.startswith("applied")
        assert len(trainer.fleet.cluster.workers_of("rollout")) == 1 and len(trainer.fleet.cluster.jobs.jobs) == 1
    finally:
        trainer.close()
