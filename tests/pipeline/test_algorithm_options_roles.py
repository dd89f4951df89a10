"""The algorithm options through the real roles: the actor's update on a real tiny model (in
process, and on two ranks of the shared cluster), the experience builder, the config keys."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from torch.testing import assert_close

from pipeline import weights
from pipeline.algorithms import entropy_from_logits
from pipeline.config import TrainConfig, TrainConfigError, make_train_config
from pipeline.experience import build_experience
from pipeline.models import position_ids
from pipeline.records import Rollout, rank_shards
from pipeline.roles import actor
from pipeline.roles.critic import CriticRole, CriticStep
from pipeline.roles.training import GroupInfo
from tests.pipeline.test_data_parallel import _assert_same_update, _experience, _two_ranks

ONE_RANK = GroupInfo(rank=0, world_size=1, init_method="", backend="gloo", generation=0, timeout_seconds=60)
# Every option away from its default at once: each must keep splitting exact.
OPTIONS = dict(clip_ratio_high=0.28, clip_ratio_c=3.0, policy_loss="gspo", loss_agg_mode="seq-mean-token-sum-norm",
               horizon=6.0, entropy_coef=0.01, lr=5e-3)


def _step(experience, mini_batches: int, snapshot_dir: str, micro_batch_size: int = 2, **options) -> actor.PolicyStep:
    blocks = torch.arange(len(experience)).tensor_split(mini_batches)
    mask = experience.response_mask
    return actor.PolicyStep(clip_ratio=0.2, kl_coef_in_loss=0.1, temperature=1.0, micro_batch_size=micro_batch_size,
                            epochs=2, is_cap=2.0, normalizers=tuple(float(mask[b].sum()) for b in blocks),
                            sequence_counts=tuple(float((mask[b].sum(-1) > 0).sum()) for b in blocks),
                            next_version=1, snapshot_dir=snapshot_dir, **options)


def _update_in_process(tiny_model, experience, step) -> tuple[dict, dict, actor.ActorRole]:
    role = actor.ActorRole(tiny_model, device="cpu", lr=1e-2, strategy="none")
    rows = rank_shards(len(experience), 1, len(step.normalizers))[0]
    stats, handle = role.update([experience.select(r) for r in rows], ONE_RANK, step)
    return stats, weights.load_snapshot(handle), role


@pytest.mark.parametrize("mode", ["token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_micro_batches_leave_the_actor_update_unchanged_with_every_option(mode, tiny_model, tmp_path):
    experience = _experience(tiny_model)
    options = {**OPTIONS, "loss_agg_mode": mode}
    whole, whole_weights, _ = _update_in_process(tiny_model, experience,
                                                 _step(experience, 2, str(tmp_path / "a"), 8, **options))
    split, split_weights, _ = _update_in_process(tiny_model, experience,
                                                 _step(experience, 2, str(tmp_path / "b"), 1, **options))
    _assert_same_update(split_weights, whole_weights, tiny_model, atol=1e-4)
    assert split["entropy_sum"] == pytest.approx(whole["entropy_sum"], rel=1e-5)


def test_the_actor_measures_the_entropy_and_takes_the_rate_it_is_given(tiny_model, tmp_path):
    experience = _experience(tiny_model)
    stats, _, role = _update_in_process(tiny_model, experience, _step(experience, 1, str(tmp_path), 8, lr=3e-3))
    assert [group["lr"] for group in role.trainer.optimizer.param_groups] == [3e-3]
    # The entropy summed over the response tokens of both epochs, from the model before the update.
    model = actor.ActorRole(tiny_model, device="cpu", lr=1e-2, strategy="none").trainer.model.eval()
    with torch.no_grad():
        logits = model(input_ids=experience.input_ids, attention_mask=experience.attention_mask,
                       position_ids=position_ids(experience.attention_mask)).logits
    entropy = entropy_from_logits(logits[:, experience.prompt_length - 1:-1])
    first_epoch = float((entropy * experience.response_mask).sum())
    assert stats["entropy_sum"] > first_epoch and stats["entropy_sum"] == pytest.approx(2 * first_epoch, rel=0.05)
    assert stats["tokens"] == 2 * float(experience.response_mask.sum())


def test_entropy_coef_changes_the_update_and_zero_keeps_it(tiny_model, tmp_path):
    experience = _experience(tiny_model)
    _, plain, _ = _update_in_process(tiny_model, experience, _step(experience, 1, str(tmp_path / "a")))
    _, zero, _ = _update_in_process(tiny_model, experience, _step(experience, 1, str(tmp_path / "b"), entropy_coef=0.0))
    _, bonus, _ = _update_in_process(tiny_model, experience,
                                     _step(experience, 1, str(tmp_path / "c"), entropy_coef=0.5))
    assert all(torch.equal(zero[name], plain[name]) for name in plain)
    assert any(not torch.equal(bonus[name], plain[name]) for name in plain)


@pytest.mark.slow  # over 20 s on 2 cores: the slow suite (CI runs it) keeps the default one short
def test_two_ranks_equal_one_with_every_option(shared_cluster, tiny_model, tmp_path):
    """The real ddp group of the shared cluster: rank shards and global counts."""
    experience, mini_batches = _experience(tiny_model), 2
    step = _step(experience, mini_batches, str(tmp_path / "one"), **OPTIONS)
    _, one, _ = _update_in_process(tiny_model, experience, step)
    recipe = functools.partial(actor.ActorRole, tiny_model, device="cpu", lr=1e-2, strategy="ddp")
    step_two = dataclasses.replace(step, snapshot_dir=str(tmp_path / "two"))
    two, _ = _two_ranks(shared_cluster, recipe, experience, mini_batches, "ddp", str(tmp_path / "two"),
                        step=step_two)
    _assert_same_update(two, one, tiny_model, atol=1e-4)


def test_the_critic_takes_its_rate_and_weight_decay(tiny_model):
    role = CriticRole(tiny_model, device="cpu", lr=1e-3, strategy="none", weight_decay=0.1)
    experience = _experience(tiny_model)
    tokens = float(experience.response_mask.sum())
    step = CriticStep(clip_range=0.2, micro_batch_size=8, epochs=1, normalizers=(tokens,), next_version=1, lr=2e-4)
    role.update([experience], ONE_RANK, step)
    assert [(g["lr"], g["weight_decay"]) for g in role.trainer.optimizer.param_groups] == [(2e-4, 0.1)]


# ------------------------------------------------------------------ experience: the estimator chosen by name

def _rollout(rows: int = 4) -> Rollout:
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 0, 0]], dtype=torch.float32)[:rows]
    ids = torch.ones(rows, 5, dtype=torch.long)
    return Rollout(input_ids=ids, attention_mask=torch.ones_like(ids),
                   response_mask=mask, behavior_logprobs=torch.zeros(rows, 3), group_ids=torch.tensor([0, 0, 1, 1]),
                   policy_version=0, prompt_length=2)


def test_build_experience_uses_the_named_estimator():
    rollout = _rollout()
    scores = torch.tensor([1.0, 0.0, 2.0, 2.0])
    build = dict(algorithm="grpo", kl_coef=0.0, gamma=1.0, lam=1.0, group_size=2, whiten=False)
    default, _ = build_experience(rollout, scores, torch.zeros(4, 3), None, **build)
    grpo, _ = build_experience(rollout, scores, torch.zeros(4, 3), None, advantage="grpo", **build)
    assert torch.equal(default.advantages, grpo.advantages)
    rloo, _ = build_experience(rollout, scores, torch.zeros(4, 3), None, advantage="rloo", **build)
    # group 0: 1 - 0 = 1, 0 - 1 = -1; group 1: equal rewards, 0
    assert_close(rloo.advantages, torch.tensor([[1.0, 1, 0], [-1, 0, 0], [0, 0, 0], [0, 0, 0]]))


# ------------------------------------------------------------------ config: keys, defaults, refusals

def test_the_defaults_are_the_plain_losses():
    config = TrainConfig()
    assert (config.loss_agg_mode, config.clip_ratio_low, config.clip_ratio_high, config.clip_ratio_c,
            config.policy_loss, config.entropy_coef, config.lr_warmup_steps, config.lr_schedule,
            config.weight_decay) == ("token-mean", None, None, None, "ppo", 0.0, 0, "constant", 0.0)
    assert (config.estimator, TrainConfig(algorithm="grpo", samples_per_prompt=2).estimator) == ("gae", "grpo")


def test_a_recipe_is_accepted():
    config = make_train_config({"algorithm": "grpo", "samples_per_prompt": 4, "advantage": "grpo_no_std",
                                "loss_agg_mode": "seq-mean-token-sum-norm", "clip_ratio_low": 0.2,
                                "clip_ratio_high": 0.28, "clip_ratio_c": 3, "entropy_coef": 0.001,
                                "lr_warmup_steps": 2, "lr_schedule": "cosine", "lr_min_ratio": 0.1,
                                "weight_decay": 0.01, "policy_loss": "gspo"})
    assert config.clip_ratio_c == 3.0 and isinstance(config.clip_ratio_c, float)


@pytest.mark.parametrize("values, expected", [
    ({"loss_agg_mode": "mean"}, "train.loss_agg_mode: 'mean' is not allowed. Fix: use token-mean, token-sum, "),
    ({"clip_ratio_low": 1.0}, "train.clip_ratio_low: 1.0 is not allowed. Fix: use a ratio between 0 and 1"),
    ({"clip_ratio_high": 0}, "train.clip_ratio_high: 0.0 is not allowed. Fix: use a ratio > 0"),
    ({"clip_ratio_c": 1.0}, "train.clip_ratio_c: 1.0 is not allowed. Fix: use a bound > 1"),
    ({"clip_ratio_c": float("nan")}, "train.clip_ratio_c: nan is not allowed"),
    ({"clip_ratio_c": "3"}, "train.clip_ratio_c: '3' should be a float"),
    ({"advantage": "rloo"}, "train.advantage: 'rloo' is not allowed. Fix: with algorithm ppo use auto or gae"),
    ({"algorithm": "grpo", "samples_per_prompt": 2, "advantage": "gae"},
     "train.advantage: 'gae' is not allowed. Fix: with algorithm grpo use auto or one of grpo, "),
    ({"algorithm": "grpo", "samples_per_prompt": 2, "advantage": "ppo"}, "train.advantage: 'ppo' is not allowed"),
    ({"policy_loss": "vanilla"}, "train.policy_loss: 'vanilla' is not allowed. Fix: use ppo or gspo"),
    ({"entropy_coef": -0.1}, "train.entropy_coef: -0.1 is not allowed. Fix: use 0"),
    ({"steps": 5, "lr_warmup_steps": 6}, "train.lr_warmup_steps: 6 is not allowed. Fix: use 0 (no warmup) to 5"),
    ({"lr_schedule": "step"}, "train.lr_schedule: 'step' is not allowed. Fix: use constant, linear, cosine"),
    ({"lr_min_ratio": 1.5}, "train.lr_min_ratio: 1.5 is not allowed. Fix: use a fraction from 0 to 1"),
    ({"weight_decay": -1}, "train.weight_decay: -1.0 is not allowed. Fix: use 0 (none)"),
])
def test_out_of_range_options_are_refused_in_one_line_naming_key_value_and_fix(values, expected):
    with pytest.raises(TrainConfigError) as error:
        make_train_config(values, source="run.yaml: train")
    message = str(error.value)
    assert expected in message and "\n" not in message and "Fix:" in message
