"""Bounded staleness (`max_staleness`) on real workers: how old the trained-on rollouts are,
and that the importance weight of decoupled PPO is active exactly when they are stale."""

from __future__ import annotations

import pytest

from pipeline.rewards import digit_fraction
from pipeline.trainer import HybridTrainer

SMALL = dict(prompts_per_step=8, max_new_tokens=8, actor_lr=1e-3, critic_lr=1e-3, micro_batch_size=8,
             show_progress=False)

# Measured (tiny model, these sizes, 2 actor ranks, 2026-12-02): on-policy steps give
# is_weight_mean = 1 to within 5e-9 (the rollout's and the actor's log-probs of the same
# weights differ by float rounding only); steps trained on rollouts 1 or 2 versions old gave
# |is_weight_mean - 1| between 1.2e-3 and 4.5e-2. The mean weight stays near 1 even when the
# weights are active (E[w] = 1 under the behaviour policy), so one stale step could land near
# 1 by chance: each stale step must only leave float rounding behind (> ON_POLICY_TOL), and
# the stale steps together must move it by more than STALE_MIN_DEVIATION.
ON_POLICY_TOL = 1e-5
STALE_MIN_DEVIATION = 1e-3


def _train(model, config, cluster, prompts, **train):
    trainer = HybridTrainer(model, digit_fraction, config, algorithm="ppo", prompts=prompts,
                            cluster=cluster, **SMALL, **train)
    try:
        return trainer.train()
    finally:
        trainer.close()   # drops the batches still generating; the shared cluster stays up


@pytest.fixture(scope="module")
def stale_records(shared_cluster, shared_config, tiny_model, prompts):
    return _train(tiny_model, shared_config, shared_cluster, prompts, steps=6, max_staleness=2)


def test_staleness_is_bounded_and_fills_up(stale_records):
    staleness = [r.staleness for r in stale_records]
    # Batch 0 is generated with the initial weights and trained first; batches 1 and 2 were
    # submitted at the same time (version 0) and are trained on after 1 and 2 updates; from
    # then on each batch is generated 2 versions before the one it is trained with.
    assert staleness == [0.0, 1.0, 2.0, 2.0, 2.0, 2.0]
    assert all(s <= 2 for s in staleness)


def test_policy_versions_are_consecutive(stale_records):
    assert [r.policy_version for r in stale_records] == [1, 2, 3, 4, 5, 6]


def test_importance_weights_act_only_on_stale_batches(stale_records):
    deviation = {r.step: abs(r.losses["is_weight_mean"] - 1.0) for r in stale_records}
    stale = [r.step for r in stale_records if r.staleness > 0]
    assert deviation[0] < ON_POLICY_TOL, stale_records[0].losses          # step 0 is on-policy
    assert stale_records[-1].staleness == 2 and deviation[stale_records[-1].step] > ON_POLICY_TOL
    assert all(deviation[step] > ON_POLICY_TOL for step in stale), deviation
    assert max(deviation[step] for step in stale) > STALE_MIN_DEVIATION, deviation


def test_on_policy_is_the_default_and_never_stale(shared_cluster, shared_config, tiny_model, prompts):
    records = _train(tiny_model, shared_config, shared_cluster, prompts, steps=3)
    assert [r.staleness for r in records] == [0.0, 0.0, 0.0]
    assert [r.policy_version for r in records] == [1, 2, 3]
    for record in records:
        assert abs(record.losses["is_weight_mean"] - 1.0) < ON_POLICY_TOL, record.losses
