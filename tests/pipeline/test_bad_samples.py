"""Bad rewards on the real loop (the shared CPU cluster): dropped and counted, or the run
stops naming the reward role and a sample, and a NaN never reaches the published policy."""

from __future__ import annotations

import math

import pytest

from pipeline import weights
from pipeline.screening import BadSampleError
from pipeline.trainer import HybridTrainer

SMALL = dict(prompts_per_step=8, samples_per_prompt=2, max_new_tokens=6, actor_lr=1e-3, micro_batch_size=16,
             show_progress=False, kl_coef=0.0)


def test_grpo_drops_the_groups_of_bad_rewards_counts_them_and_publishes_finite_weights(
        shared_cluster, shared_config, tiny_model, prompts):
    def reward(prompt: str, response: str):  # nested: it travels to the reward worker by value
        if "plus 3" in prompt:
            raise ArithmeticError("no score for 3")
        return math.nan if prompt.startswith("what is 7") else len(response) / 10

    trainer = HybridTrainer(tiny_model, reward, shared_config, algorithm="grpo", prompts=prompts,
                            cluster=shared_cluster, steps=2, **SMALL)
    records = trainer.train()
    assert [r.policy_version for r in records] == [1, 2]
    # 11 of the 32 prompts are bad ("plus 3" or "what is 7"): a step of 8 draws some, and
    # every dropped sample takes its group of 2 along.
    bad = [p for p in prompts if "plus 3" in p or p.startswith("what is 7")]
    assert len(bad) == 11
    dropped = [r.dropped_samples for r in records]
    assert sum(dropped) > 0 and all(d % 2 == 0 for d in dropped), dropped
    assert all(r.tokens > 0 and math.isfinite(r.reward_mean) for r in records)
    state = weights.receive(trainer.weights)
    assert all(tensor.isfinite().all() for tensor in state.values())


def test_a_batch_of_only_bad_rewards_stops_the_run_and_publishes_nothing(shared_cluster, shared_config,
                                                                         tiny_model, prompts):
    trainer = HybridTrainer(tiny_model, lambda p, r: "high", shared_config, algorithm="grpo", prompts=prompts,
                            cluster=shared_cluster, steps=2, **SMALL)
    with pytest.raises(BadSampleError) as info:
        trainer.train()
    message = str(info.value)
    assert message.startswith("16 of 16 samples of this step are bad, leaving 0")
    assert "e.g. reward: the reward function returned 'high' (a str), not a number; prompt 'what is" in message
    assert trainer.version == 0 and trainer.weights is None  # the initial policy is still the one published
    assert trainer.history == []


def test_reward_errors_raise_stops_at_the_first_bad_sample_naming_it(shared_cluster, shared_config, tiny_model,
                                                                     prompts):
    def reward(prompt: str, response: str) -> float:
        return 1 / 0 if "plus 2" in prompt else 0.5

    trainer = HybridTrainer(tiny_model, reward, shared_config, algorithm="ppo", prompts=prompts,
                            cluster=shared_cluster, steps=3, reward_errors="raise", **SMALL)
    with pytest.raises(BadSampleError) as info:
        trainer.train()
    message = str(info.value)
    assert message.startswith("reward: the reward function raised ZeroDivisionError: division by zero; "
                              "prompt 'what is ") and "plus 2? answer: '" in message
    assert "Fix: make the reward return one finite number for every response, or set train.reward_errors: skip" \
        in message
    assert trainer.weights is None or all(t.isfinite().all() for t in weights.receive(trainer.weights).values())
