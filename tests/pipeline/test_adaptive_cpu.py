"""Adaptive scaling on real worker processes: rollout is the bottleneck, reward has a
worker to spare, and the policy moves it while training runs.

These tests add and retire workers, so they get their own small cluster."""

from __future__ import annotations

import logging
import time

import pytest
from conftest import role_cluster

from pipeline.rewards import digit_fraction
from pipeline.trainer import HybridTrainer
from resources.adaptive import Thresholds
from resources import load_resource_config
from resources.config import AdaptiveBounds

BOUNDS = {"rollout": {"min": 1, "max": 2}, "reward": {"min": 1, "max": 2}}
LAYOUT = {
    "actor": {"device_type": "cpu", "workers": 1},
    "reference": {"device_type": "cpu", "workers": 1},
    "reward": {"device_type": "cpu", "workers": 2, "strategy": "data_parallel"},
    "rollout": {"device_type": "cpu", "workers": 1},
    "timeout_seconds": 120,
    "adaptive": BOUNDS,
}
# Long generations and a one-step-ahead rollout (max_staleness=1) keep the rollout worker
# busy nearly all the time; digit_fraction makes reward almost free. On two shared cores the
# update can take about as long as a generation, so rollout counts as starved from 75% busy.
ROLLOUT_BOUND = dict(algorithm="grpo", samples_per_prompt=2, prompts_per_step=16, max_new_tokens=128,
                     micro_batch_size=32, actor_lr=1e-3, max_staleness=1, show_progress=False)


@pytest.fixture(scope="module")
def adaptive_cluster():  # these tests add, retire or kill workers: a cluster of their own
    with role_cluster(load_resource_config(LAYOUT)) as cluster:
        yield cluster


def _count(cluster, role):
    return len(cluster.workers_of(role))


@pytest.mark.slow  # over 20 s on 2 cores: the slow suite (CI runs it) keeps the default one short
def test_train_starts_and_stops_adaptation_from_the_file(adaptive_cluster, tiny_model, prompts):
    trainer = HybridTrainer(tiny_model, digit_fraction, load_resource_config(LAYOUT), prompts=prompts,
                            cluster=adaptive_cluster, steps=1, **{**ROLLOUT_BOUND, "max_new_tokens": 4})
    seen = []
    trainer.train(on_step=lambda record: seen.append(trainer.fleet._adaptive))
    (adaptive,) = seen
    assert adaptive is not None and adaptive.bounds == {"rollout": AdaptiveBounds(1, 2), "reward": AdaptiveBounds(1, 2)}
    assert not trainer.fleet.adapting and not adaptive.running  # stopped when train() ended
    with pytest.raises(ValueError, match=r"adaptive.critic: .*critic is not in the file \(it is placed with the actor\)"):
        trainer.adapt({"critic": (1, 2)})


@pytest.mark.slow  # a long end-to-end drill: CI runs it in the slow suite
def test_idle_reward_worker_moves_to_starved_rollout(adaptive_cluster, tiny_model, prompts, caplog):
    trainer = HybridTrainer(tiny_model, digit_fraction, load_resource_config(LAYOUT), prompts=prompts,
                            cluster=adaptive_cluster, **ROLLOUT_BOUND)
    assert (_count(adaptive_cluster, "rollout"), _count(adaptive_cluster, "reward")) == (1, 2)
    adaptive = trainer.adapt(interval=1.0, wait_count=2, thresholds=Thresholds(starved_busy=0.75))
    seen = []  # per step: decisions taken so far, rollout workers the trainer then used

    def watch(record):
        seen.append((len(adaptive.log), trainer.resources.role("rollout").workers))
        # Three steps on two rollout workers show the move landed while training ran; how many
        # steps it takes to get there depends on the machine's load, so the run waits for it.
        if len(seen) >= 3 and all(workers == 2 for _, workers in seen[-3:]):
            trainer.request_stop()

    start = time.perf_counter()
    with caplog.at_level(logging.WARNING, logger="dask_rl"):
        records = trainer.train(steps=200, on_step=watch)   # a bound: it stops once the move has landed
    seconds = time.perf_counter() - start
    # Training never lost or repeated a step while a worker moved.
    assert [r.policy_version for r in records] == list(range(1, len(records) + 1))
    (decision,) = trainer.adaptive_decisions
    assert (decision.kind, decision.source_role, decision.target_role) == ("move", "reward", "rollout")
    assert decision.outcome.startswith("applied"), decision.outcome
    assert "rollout starved" in decision.reason and "reward idle" in decision.reason
    assert any("adaptive: move one from reward to rollout: rollout starved" in m for m in caplog.messages)
    assert (_count(adaptive_cluster, "rollout"), _count(adaptive_cluster, "reward")) == (2, 1)
    assert trainer.resources.role("rollout").workers == 2 and trainer.resources.role("reward").workers == 1
    # The move landed while training ran: later steps generated on two rollout workers.
    assert seen[-1] == (1, 2), seen
    decided = next(step for step, (decisions, _) in enumerate(seen) if decisions)
    applied = next(step for step, (_, workers) in enumerate(seen) if workers == 2)
    print(f"\n{decision}\ndecided by step {decided}, applied by step {applied}; {len(records)} steps in "
          f"{seconds:.1f}s")
