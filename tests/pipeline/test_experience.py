"""build_experience against hand-computed rewards, KL, GAE and GRPO advantages.

The PPO batch: 2 rows, 3 response tokens, row 1 has 2 (its third token is padding).
    ref = -1 everywhere; behaviour = ref + KL, KL (k1) = [[0.5, 0, 0.25], [0, 0.5, pad]]
    scores = [2, -1]; values = [[1, 0.5, 0.5], [0.5, 0.5, 0]]
"""

from __future__ import annotations

import math
import statistics

import pytest
import torch
from torch.testing import assert_close

from pipeline.experience import build_experience
from pipeline.records import Rollout


def t(x):
    return torch.tensor(x, dtype=torch.float32)


MASK = t([[1, 1, 1], [1, 1, 0]])
REF = torch.full((2, 3), -1.0)
# The padded token gets a large "KL" that must not count anywhere.
BEHAVIOR = REF + t([[0.5, 0.0, 0.25], [0.0, 0.5, 7.0]])
SCORES = t([2.0, -1.0])
VALUES = t([[1.0, 0.5, 0.5], [0.5, 0.5, 0.0]])


def _rollout(mask, behavior, group_ids, prompt_length=2) -> Rollout:
    rows, response = mask.shape
    return Rollout(input_ids=torch.arange(rows * (prompt_length + response)).view(rows, -1),
                   attention_mask=torch.ones(rows, prompt_length + response, dtype=torch.long),
                   response_mask=mask, behavior_logprobs=behavior, group_ids=torch.tensor(group_ids),
                   policy_version=3, prompt_length=prompt_length,
                   clipped=mask.sum(-1) == response)  # a row that filled the response had no stop


def _ppo(values=VALUES, *, kl_coef=1.0, gamma=0.5, lam=0.5, whiten=False):
    return build_experience(_rollout(MASK, BEHAVIOR, [0, 1]), SCORES, REF, values, algorithm="ppo",
                            kl_coef=kl_coef, gamma=gamma, lam=lam, group_size=1, whiten=whiten)


# gamma = lam = 0.5 (gamma * lam = 0.25), kl_coef = 1:
#   rewards row 0 = [-0.5, 0, -0.25 + 2] = [-0.5, 0, 1.75]; row 1 = [0, -0.5 - 1, -] = [0, -1.5, -]
#   row 0: t2 delta = 1.75 - 0.5 = 1.25                         A2 = 1.25
#          t1 delta = 0 + 0.5*0.5 - 0.5 = -0.25                 A1 = -0.25 + 0.25*1.25 = 0.0625
#          t0 delta = -0.5 + 0.5*0.5 - 1 = -1.25                A0 = -1.25 + 0.25*0.0625 = -1.234375
#   row 1: t1 delta = -1.5 - 0.5 = -2                           A1 = -2
#          t0 delta = 0 + 0.5*0.5 - 0.5 = -0.25                 A0 = -0.25 + 0.25*(-2) = -0.75
#   returns = A + V
ADVANTAGES = t([[-1.234375, 0.0625, 1.25], [-0.75, -2.0, 0.0]])
RETURNS = t([[-0.234375, 0.5625, 1.75], [-0.25, -1.5, 0.0]])


def test_ppo_advantages_and_returns_by_hand():
    experience, stats = _ppo()
    assert_close(experience.advantages, ADVANTAGES)
    assert_close(experience.returns, RETURNS)
    assert_close(experience.old_values, VALUES)
    assert torch.equal(experience.ref_logprobs, REF)
    assert torch.equal(experience.behavior_logprobs, BEHAVIOR)
    assert experience.prompt_length == 2
    # KL mean over the 5 valid tokens: (0.5 + 0 + 0.25 + 0 + 0.5) / 5; the padded 7.0 is left out.
    # Rewards 2 and -1: mean 0.5, spread (population std) 1.5. Row 0 ran to the limit: clipped.
    assert stats == {"reward_mean": 0.5, "reward_std": 1.5, "kl_mean": pytest.approx(0.25), "response_length": 2.5,
                     "tokens": 5, "clipped_fraction": 0.5}


def test_ppo_returns_are_taken_before_whitening():
    experience, _ = _ppo(whiten=True)
    # The critic's targets stay in reward units, whatever whitening does to the advantages.
    assert_close(experience.returns, RETURNS)
    valid = [-1.234375, 0.0625, 1.25, -0.75, -2.0]
    mean, var = statistics.fmean(valid), statistics.pvariance(valid)   # mean = -0.534375
    whitened = [[(a - mean) / math.sqrt(var + 1e-8) for a in row] for row in ([-1.234375, 0.0625, 1.25],
                                                                               [-0.75, -2.0, mean])]
    assert_close(experience.advantages, t(whitened) * MASK)
    assert_close(experience.advantages[MASK.bool()].mean(), torch.tensor(0.0))


def test_ppo_kl_penalty_is_a_per_token_reward():
    # V = 0 and gamma = lam = 1: returns = advantages = reward-to-go.
    # kl_coef = 2: rewards row 0 = [-1, 0, -0.5 + 2] = [-1, 0, 1.5]; row 1 = [0, -1 - 1, -] = [0, -2, -]
    experience, _ = _ppo(torch.zeros(2, 3), kl_coef=2.0, gamma=1.0, lam=1.0)
    assert_close(experience.returns, t([[0.5, 1.5, 1.5], [-2.0, -2.0, 0.0]]))
    assert_close(experience.advantages, t([[0.5, 1.5, 1.5], [-2.0, -2.0, 0.0]]))
    # kl_coef = 0: only the score, on each row's last valid token
    experience, _ = _ppo(torch.zeros(2, 3), kl_coef=0.0, gamma=1.0, lam=1.0)
    assert_close(experience.returns, t([[2.0, 2.0, 2.0], [-1.0, -1.0, 0.0]]))


# GRPO: two groups of 3. Group 5 scores [0, 3, 6]: mean 3, unbiased std sqrt((9 + 0 + 9) / 2) = 3
#   -> [-1, 0, 1]. Group 9 scores [1, 1, 4]: mean 2, std sqrt((1 + 1 + 4) / 2) = sqrt(3)
#   -> [-1, -1, 2] / sqrt(3). (eps = 1e-6 in the denominator is below the tolerance.)
GROUPS = [5, 5, 5, 9, 9, 9]
GRPO_SCORES = [0.0, 3.0, 6.0, 1.0, 1.0, 4.0]
GRPO_ADVANTAGES = [-1.0, 0.0, 1.0, -1 / math.sqrt(3), -1 / math.sqrt(3), 2 / math.sqrt(3)]
GRPO_MASK = t([[1, 1], [1, 0], [1, 1], [1, 1], [0, 0], [1, 0]])


def _grpo(order: list[int], kl_coef: float = 0.1):
    rows = torch.tensor(order)
    ref = torch.full((6, 2), -2.0)
    return build_experience(_rollout(GRPO_MASK[rows], ref[rows] + 0.5, [GROUPS[i] for i in order]),
                            t(GRPO_SCORES)[rows], ref[rows], None, algorithm="grpo", kl_coef=kl_coef, gamma=1.0,
                            lam=1.0, group_size=3, whiten=False)


def test_grpo_advantages_by_hand():
    experience, stats = _grpo(list(range(6)))
    assert_close(experience.advantages, t(GRPO_ADVANTAGES)[:, None] * GRPO_MASK)
    assert torch.equal(experience.returns, torch.zeros(6, 2))
    assert torch.equal(experience.old_values, torch.zeros(6, 2))
    # GRPO puts KL in the loss: the advantages do not depend on kl_coef, the KL stat does not either
    assert torch.equal(_grpo(list(range(6)), kl_coef=5.0)[0].advantages, experience.advantages)
    assert stats["kl_mean"] == pytest.approx(0.5)


def test_grpo_groups_by_group_ids_not_by_row_order():
    order = [3, 0, 4, 1, 5, 2]   # groups interleaved: 9, 5, 9, 5, 9, 5
    experience, _ = _grpo(order)
    rows = torch.tensor(order)
    assert_close(experience.advantages, (t(GRPO_ADVANTAGES)[:, None] * GRPO_MASK)[rows])
    assert_close(experience.advantages, _grpo(list(range(6)))[0].advantages[rows])


def test_grpo_rejects_a_group_with_rows_missing():
    experience = _rollout(GRPO_MASK[:5], torch.zeros(5, 2), GROUPS[:5])
    with pytest.raises(ValueError, match=r"samples_per_prompt=3.*\{9: 2\}"):
        build_experience(experience, t(GRPO_SCORES[:5]), torch.zeros(5, 2), None, algorithm="grpo",
                         kl_coef=0.0, gamma=1.0, lam=1.0, group_size=3, whiten=False)
