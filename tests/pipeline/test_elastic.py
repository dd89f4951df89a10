"""Elastic roles on real worker processes: add, drain and retire while training runs,
resize the actor at a step boundary, and lose a worker to kill -9.

These tests add, retire and kill workers, so they get their own cluster."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from distributed import get_task_stream
from conftest import role_cluster
import torch

from pipeline import weights
from pipeline.rewards import digit_fraction
from pipeline.roles.host import role_ready, worker_identity
from pipeline.fleet.tasks import submit
from pipeline.trainer import HybridTrainer
from resources import ResourceConfigError, load_resource_config

LAYOUT = {
    "actor": {"device_type": "cpu", "workers": 2, "strategy": "ddp"},
    "reference": {"device_type": "cpu", "workers": 1},
    "reward": {"device_type": "cpu", "workers": 1},
    "rollout": {"device_type": "cpu", "workers": 1},
    "timeout_seconds": 120,
}
GRPO = dict(algorithm="grpo", samples_per_prompt=2, prompts_per_step=8, max_new_tokens=8, actor_lr=1e-3,
            micro_batch_size=8, show_progress=False)


@pytest.fixture(scope="module")
def elastic_cluster():  # these tests add, retire or kill workers: a cluster of their own
    with role_cluster(load_resource_config(LAYOUT)) as cluster:
        yield cluster


def _names(cluster, role):
    return [w["name"] for w in cluster.workers_of(role)]


@pytest.mark.slow  # over 20 s on 2 cores: the slow suite (CI runs it) keeps the default one short
def test_bad_requests_change_nothing(elastic_cluster, tiny_model, prompts):
    trainer = HybridTrainer(tiny_model, digit_fraction, load_resource_config(LAYOUT), prompts=prompts,
                            cluster=elastic_cluster, steps=1, **GRPO)
    before = {role: _names(elastic_cluster, role) for role in trainer.roles}
    with pytest.raises(ValueError, match="unknown component 'judge'"):
        trainer.update_resource("judge", workers=2)
    with pytest.raises(ValueError, match="last rollout worker"):
        trainer.update_resource("rollout", workers=0)
    with pytest.raises(ValueError, match="give workers=N"):
        trainer.update_resource("reward", device_ids=[3])
    with pytest.raises(ResourceConfigError, match="reward.strategy"):
        trainer.update_resource("reward", workers=2, strategy="vllm")
    # A wrong type is the resource file's error naming the argument and the fix, not a TypeError.
    with pytest.raises(ResourceConfigError, match=r"update_resource: reward.workers: '2': not an integer from 1 to "
                                                  r"1024 \(one process each\)\. Fix: set workers: 1 or more"):
        trainer.update_resource(component="reward", workers="2")
    assert {role: _names(elastic_cluster, role) for role in trainer.roles} == before


# Over 20 s on 2 cores, and with the kill test below the only default test on a cluster of
# its own. The slow suite moves a worker while training runs in test_adaptive_cpu.py (a
# rollout worker added, a reward worker drained and retired, versions consecutive).
@pytest.mark.slow
def test_rollout_grows_and_shrinks_while_training_runs(elastic_cluster, tiny_model, prompts):
    trainer = HybridTrainer(tiny_model, digit_fraction, load_resource_config(LAYOUT), prompts=prompts,
                            cluster=elastic_cluster, steps=8, **GRPO)
    reports = []

    def after_step(count):  # a deadline, so a failed training cannot leave this thread spinning
        deadline = time.monotonic() + 120
        while len(trainer.history) < count and time.monotonic() < deadline:
            time.sleep(0.05)

    def move_devices():
        after_step(2)
        reports.extend(trainer.update_resource("rollout", workers=2))
        after_step(5)
        reports.extend(trainer.update_resource("rollout", workers=1))

    mover = threading.Thread(target=move_devices, daemon=True)
    mover.start()
    records = trainer.train()
    mover.join()
    # No step lost, none repeated: one update per step, versions consecutive.
    assert [r.policy_version for r in records] == list(range(1, 9))
    grown, shrunk = reports
    assert grown.role == "rollout" and grown.added == ("rollout-1",) and grown.workers == ("rollout-0", "rollout-1")
    assert shrunk.removed == ("rollout-1",) and shrunk.workers == ("rollout-0",)
    assert _names(elastic_cluster, "rollout") == ["rollout-0"]
    assert trainer.resources.role("rollout").workers == 1


@pytest.mark.slow  # over 20 s on 2 cores: the slow suite (CI runs it) keeps the default one short
def test_actor_resize_keeps_the_update_it_would_have_made(elastic_cluster, tiny_model, prompts, tmp_path):
    """2 ranks -> step -> resize to 1 -> step must equal 1 rank for both steps: the model and
    the optimizer state cross the resize intact (data-parallel updates are world-size free)."""
    config = load_resource_config(LAYOUT)
    resized = HybridTrainer(tiny_model, digit_fraction, config, prompts=prompts, cluster=elastic_cluster, **GRPO)
    resized.step()
    assert len(resized.fleet.groups.members("actor")) == 2
    (change,) = resized.update_resource("actor", workers=1)
    assert change.removed == ("actor-1",) and change.workers == ("actor-0",)
    resized.step()
    assert resized.fleet.groups.members("actor") == tuple(w["address"] for w in elastic_cluster.workers_of("actor"))

    steady = HybridTrainer(tiny_model, digit_fraction, resized.resources, prompts=prompts,
                           cluster=elastic_cluster, **GRPO)
    steady.step()
    steady.step()
    one, two = weights.load_snapshot(resized.weights), weights.load_snapshot(steady.weights)
    for name in one:
        torch.testing.assert_close(one[name], two[name], rtol=1e-4, atol=1e-5, msg=name)
    # And it grows back: a new actor worker joins the group from the exported state.
    (change,) = resized.update_resource("actor", workers=2)
    assert change.added and len(change.workers) == 2
    record = resized.step()
    assert record.policy_version == 3 and len(resized.fleet.groups.members("actor")) == 2
    # A strategy change alone regroups the same workers from the exported state.
    (change,) = resized.update_resource("actor", strategy="fsdp")
    assert change.strategy == "fsdp" and not change.added and not change.removed
    assert resized.step().policy_version == 4
    strategies = [submit(elastic_cluster.client, "actor", _actor_strategy, workers=[address]).result()
                  for address in resized.fleet.groups.members("actor")]
    assert strategies == ["fsdp", "fsdp"]


def _actor_strategy() -> str:
    from pipeline.roles.host import role_state

    return role_state("actor").trainer.strategy


# Over 20 s on 2 cores; the slow suite's random-moment drill (test_faults.py) kills the
# rollout worker of a running 10-step run the same way.
@pytest.mark.slow
def test_killed_rollout_worker_costs_no_batch(elastic_cluster, tiny_model, prompts):
    trainer = HybridTrainer(tiny_model, digit_fraction, load_resource_config(LAYOUT), prompts=prompts,
                            cluster=elastic_cluster, steps=4, **{**GRPO, "max_new_tokens": 48,
                                                                  "prompts_per_step": 32})
    trainer.step()
    pid = submit(elastic_cluster.client, "rollout", worker_identity).result()["pid"]
    killer = threading.Timer(0.3, os.kill, (pid, signal.SIGKILL))  # during the next generation
    killer.start()
    records = trainer.train(steps=3)
    killer.join()
    # The Nanny restarted the worker process; the step that lost it still completed.
    assert [r.policy_version for r in records] == [2, 3, 4]
    assert submit(elastic_cluster.client, "rollout", worker_identity).result()["pid"] != pid


@pytest.mark.slow  # a long end-to-end drill: CI runs it in the slow suite
def test_reward_reference_and_critic_change_too(elastic_cluster, tiny_model, prompts):
    """PPO on the same cluster (its critic is placed with the actor: two CPU workers)."""
    trainer = HybridTrainer(tiny_model, digit_fraction, load_resource_config(LAYOUT), prompts=prompts,
                            cluster=elastic_cluster, algorithm="ppo", prompts_per_step=8, max_new_tokens=8,
                            actor_lr=1e-3, critic_lr=1e-3, micro_batch_size=8, show_progress=False)
    trainer.step()
    assert len(trainer.fleet.groups.members("critic")) == 2
    (reward_up,) = trainer.update_resource("reward", workers=2, strategy="data_parallel")
    (reference_up,) = trainer.update_resource("reference", workers=2, strategy="data_parallel")
    (critic_down,) = trainer.update_resource("critic", workers=1)
    assert len(reward_up.workers) == 2 and len(reference_up.workers) == 2 and len(critic_down.workers) == 1
    record = trainer.step()
    assert record.policy_version == 2 and "critic_grad_norm" in record.losses
    assert len(trainer.fleet.groups.members("critic")) == 1
    # With two rollout shards per step the scoring is split in two tasks, and both reward
    # workers may take them (which one does is Dask's choice, so it is not asserted).
    trainer.update_resource("rollout", workers=2)
    reward_workers = set(trainer.fleet.addresses("reward"))
    assert len(reward_workers) == 2
    with get_task_stream(client=elastic_cluster.client) as stream:
        trainer.step()
    scoring = [t for t in stream.data if str(t["key"]).startswith("reward-score")]
    assert len(scoring) == 2 and {t["worker"] for t in scoring} <= reward_workers
    for address in reward_workers:  # each one loaded the reward model and serves reward tasks
        assert submit(elastic_cluster.client, "reward", role_ready, "reward", tag="eligible",
                      workers=[address]).result(60)["address"] == address
    (reward_down,) = trainer.update_resource("reward", workers=1, strategy="none")
    (reference_down,) = trainer.update_resource("reference", workers=1, strategy="none")
    assert len(reward_down.removed) == 1 and len(reference_down.removed) == 1
    assert trainer.step().policy_version == 4


@pytest.mark.slow  # a long end-to-end drill: CI runs it in the slow suite
def test_dask_rl_scale_changes_a_role_of_a_running_training_from_a_shell(elastic_cluster, tiny_model, prompts):
    trainer = HybridTrainer(tiny_model, digit_fraction, load_resource_config(LAYOUT), prompts=prompts,
                            cluster=elastic_cluster, steps=30, **GRPO)
    trainer.update_resource("rollout", workers=1)  # whatever the tests before left
    address = elastic_cluster.client.scheduler.address
    shell = {}

    def scale(*args):
        return subprocess.run([sys.executable, "-m", "pipeline.cli", "scale", address, *args],
                              capture_output=True, text=True, timeout=300)

    def from_a_shell():
        deadline = time.monotonic() + 120
        while not trainer.history and time.monotonic() < deadline:
            time.sleep(0.05)
        shell["bad"] = scale("--role", "rollout", "--workers", "0")
        shell["grow"] = scale("--role", "rollout", "--workers", "2")

    thread = threading.Thread(target=from_a_shell, daemon=True)
    thread.start()
    records = trainer.train(on_step=lambda record: time.sleep(0.3) if "grow" not in shell else None)
    thread.join(timeout=60)
    assert [r.policy_version for r in records] == list(range(1, 31))
    assert shell["bad"].returncode == 2 and "last rollout worker" in shell["bad"].stderr
    assert shell["grow"].returncode == 0 and "rollout: +['rollout-" in shell["grow"].stdout
    assert len(elastic_cluster.workers_of("rollout")) == 2
    trainer.update_resource("rollout", workers=1)


@pytest.mark.slow  # a worker restart on a busy machine: a minute or more
@pytest.mark.parametrize("lost_rank", [1, 0])
def test_saving_after_a_lost_actor_rank_uses_only_the_live_members(elastic_cluster, tiny_model, prompts, tmp_path,
                                                                   caplog, lost_rank):
    """A run that ends with a rank of its group gone (as after a fault it could not recover
    from) saves from the group's live members, never through a task pinned to the dead worker:
    rank 0 alive writes the model; rank 0 gone leaves it unsaved, saying so."""
    trainer = HybridTrainer(tiny_model, digit_fraction, load_resource_config(LAYOUT), prompts=prompts,
                            cluster=elastic_cluster, **GRPO)
    trainer.step()
    members = trainer.fleet.groups.members("actor")
    assert len(members) == 2
    gone = members[lost_rank]
    pid = submit(elastic_cluster.client, "actor", worker_identity, workers=[gone]).result(60)["pid"]
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while gone in trainer.fleet.addresses("actor") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert gone not in trainer.fleet.addresses("actor")  # its Nanny's replacement gets a new address
    with caplog.at_level(logging.WARNING, logger="dask_rl"):
        saved = trainer.save(str(tmp_path / "saved"))
    assert f"actor: its group lost ['{gone}']" in caplog.text
    if lost_rank == 1:
        assert saved["actor"] == tmp_path / "saved" / "actor"
        assert (tmp_path / "saved" / "actor" / "config.json").is_file()
    else:
        assert "actor" not in saved and not (tmp_path / "saved" / "actor").exists()
        assert "actor: rank 0 of its group is gone, so its model is not saved" in caplog.text
    trainer.fleet.await_replacements("actor")  # the next test finds both actor workers
    trainer.close()
