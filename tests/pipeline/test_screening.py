"""Bad samples are dropped (GRPO: with their group) or refused before an update, by hand.

The batch: 3 prompts x 2 samples, rows grouped by prompt in any order (group ids
[7, 7, 8, 8, 9, 9] and shuffled), 1-token prompts and 2 response tokens; row r's tokens are
r*10 + column so that a message shows which row it talks about.
"""

from __future__ import annotations

import logging
import math

import pytest
import torch
from torch.testing import assert_close

from pipeline.experience import build_experience
from pipeline.records import Rollout, SampleProblem, Scores, join_scores
from pipeline.screening import BadSampleError, SampleScreen, checked_experience, screen_samples

GROUPS = [7, 7, 8, 8, 9, 9]
SCORES = [1.0, 0.0, 2.0, 4.0, 3.0, 5.0]


def _rollout(groups=GROUPS) -> Rollout:
    rows = len(groups)
    ids = torch.tensor([[r * 10 + c for c in range(3)] for r in range(rows)])
    mask = torch.tensor([[1.0, 1.0]] * rows)
    return Rollout(input_ids=ids, attention_mask=torch.ones_like(ids), response_mask=mask,
                   behavior_logprobs=torch.full((rows, 2), -1.0), group_ids=torch.tensor(groups),
                   policy_version=0, prompt_length=1)


def _scores(bad: dict[int, str] | None = None) -> Scores:
    bad = bad or {}
    values = torch.tensor([math.nan if r in bad else s for r, s in enumerate(SCORES)])
    return Scores(values, [SampleProblem(r, "reward", error, f"prompt {r}", f"response {r}") for r, error in bad.items()])


def decode(ids: list[int]) -> str:
    return " ".join(map(str, ids))


def test_nothing_bad_keeps_every_row_unchanged():
    rollout, values = _rollout(), torch.zeros(6, 2)
    kept, scores, per_token, dropped = screen_samples(rollout, _scores(), {"values": values}, SampleScreen())
    assert dropped == 0 and len(kept) == 6
    assert_close(scores.values, torch.tensor(SCORES))
    assert kept.input_ids.equal(rollout.input_ids) and per_token["values"].equal(values)


def test_ppo_drops_only_the_bad_row_and_logs_it_with_its_texts(caplog):
    error = "the reward function raised ZeroDivisionError: division by zero"
    with caplog.at_level(logging.WARNING, logger="dask_rl"):
        kept, scores, per_token, dropped = screen_samples(
            _rollout(), _scores({2: error}), {"values": torch.arange(12.0).view(6, 2)}, SampleScreen())
    assert dropped == 1
    assert kept.group_ids.tolist() == [7, 7, 8, 9, 9]
    assert kept.input_ids[:, 0].tolist() == [0, 10, 30, 40, 50]  # row 2 is gone, the rest in order
    assert_close(scores.values, torch.tensor([1.0, 0.0, 4.0, 3.0, 5.0]))
    assert per_token["values"][:, 0].tolist() == [0, 2, 6, 8, 10]
    assert f"dropped reward: {error}; prompt 'prompt 2', response 'response 2'" in caplog.text
    assert "dropped 1 of 6 samples" in caplog.text


def test_grpo_drops_the_whole_group_of_a_bad_sample_wherever_its_rows_are():
    groups = [9, 7, 8, 7, 9, 8]  # shards need not arrive in prompt order
    kept, scores, _, dropped = screen_samples(_rollout(groups), _scores({3: "nan"}), {},
                                              SampleScreen(by_group=True))
    assert dropped == 2  # row 3 and its group mate, row 1
    assert kept.group_ids.tolist() == [9, 8, 9, 8]
    assert_close(scores.values, torch.tensor([1.0, 2.0, 3.0, 5.0]))


def test_non_finite_values_on_response_tokens_are_bad_and_padding_is_not(caplog):
    rollout = _rollout()
    rollout.response_mask[4, 1] = 0.0            # row 4's second token is padding...
    values = torch.zeros(6, 2)
    values[4, 1] = math.nan                      # ...so a NaN there is masked out of every loss
    values[1, 0] = math.inf                      # row 1's first token is real: bad
    ref = torch.full((6, 2), -1.0)
    ref[5, 1] = -math.inf                        # a reference logprob of -inf: bad
    with caplog.at_level(logging.WARNING, logger="dask_rl"):
        kept, _, _, dropped = screen_samples(rollout, _scores(), {"ref_logprobs": ref, "values": values},
                                             SampleScreen(decode=decode))
    assert dropped == 2 and kept.input_ids[:, 0].tolist() == [0, 20, 30, 40]
    # No texts came with these: the driver decodes the row's prompt and response tokens.
    assert "dropped critic: non-finite values on its response tokens; prompt '10', response '11 12'" in caplog.text
    assert "dropped reference: non-finite ref_logprobs" in caplog.text


def test_raise_names_the_role_the_sample_and_the_original_error():
    error = "the reward function returned 'abc' (a str), not a number"
    with pytest.raises(BadSampleError) as info:
        screen_samples(_rollout(), _scores({4: error}), {}, SampleScreen(on_error="raise"))
    assert str(info.value) == (f"reward: {error}; prompt 'prompt 4', response 'response 4'. Fix: make the reward "
                               "return one finite number for every response, or set train.reward_errors: skip "
                               "to drop such samples; nothing was published")


@pytest.mark.parametrize("bad, screen, left", [
    ({r: "nan" for r in range(6)}, SampleScreen(), 0),                     # every sample bad
    ({0: "nan", 2: "nan", 5: "nan"}, SampleScreen(by_group=True), 0),      # a bad sample in every group
    ({0: "nan", 1: "nan", 2: "nan"}, SampleScreen(min_rows=4), 3),         # 3 left, the update needs 4
])
def test_too_little_left_refuses_the_step_naming_a_sample(bad, screen, left):
    with pytest.raises(BadSampleError) as info:
        screen_samples(_rollout(), _scores(bad), {}, screen)
    message = str(info.value)
    assert message.startswith(f"{6 - left} of 6 samples of this step are bad, leaving {left} "
                              f"(the update needs {screen.min_rows}); e.g. reward: nan; prompt 'prompt 0'")
    assert "nothing was published, the last good version stays" in message


def test_scores_of_several_shards_keep_their_problems_rows():
    a = Scores(torch.tensor([1.0, math.nan]), [SampleProblem(1, "reward", "x")])
    b = Scores(torch.tensor([math.nan, 2.0, 3.0]), [SampleProblem(0, "reward", "y")])
    joined = join_scores([a, b])
    assert [(p.row, p.error) for p in joined.problems] == [(1, "x"), (2, "y")]
    assert joined.values[[0, 3, 4]].tolist() == [1.0, 2.0, 3.0]


PPO = dict(algorithm="ppo", kl_coef=0.0, gamma=1.0, lam=1.0, group_size=1, whiten=False)


def test_advantages_that_overflow_drop_their_row_and_the_rest_is_built_without_it():
    rollout, ref = _rollout(), torch.full((6, 2), -1.0)
    scores, values = torch.tensor(SCORES), torch.zeros(6, 2)
    values[3] = -3e38  # finite, but the TD error 3e38 + ... - (-3e38) is inf in float32
    scores[3] = 3e38
    experience, stats = checked_experience(rollout, scores, ref, values, SampleScreen(), **PPO)
    assert stats["dropped_samples"] == 1 and len(experience) == 5
    keep = torch.tensor([0, 1, 2, 4, 5])
    expected, expected_stats = build_experience(rollout.select(keep), scores[keep], ref[keep], values[keep], **PPO)
    assert_close(experience.advantages, expected.advantages)
    assert stats["reward_mean"] == pytest.approx(expected_stats["reward_mean"])
    assert experience.advantages.isfinite().all()


def test_finite_advantages_pass_through_with_nothing_dropped():
    rollout, ref, values = _rollout(), torch.full((6, 2), -1.0), torch.zeros(6, 2)
    experience, stats = checked_experience(rollout, torch.tensor(SCORES), ref, values, SampleScreen(), **PPO)
    expected, _ = build_experience(rollout, torch.tensor(SCORES), ref, values, **PPO)
    assert stats["dropped_samples"] == 0
    assert_close(experience.advantages, expected.advantages)


def test_overflowing_advantages_refuse_the_step_under_raise():
    scores, values = torch.tensor(SCORES), torch.zeros(6, 2)
    scores[0], values[0] = 3e38, -3e38
    with pytest.raises(BadSampleError, match=r"^advantages: its advantages or returns are not finite .*"
                                             r"prompt '0', response '1 2'"):
        checked_experience(_rollout(), scores, torch.full((6, 2), -1.0), values,
                           SampleScreen(on_error="raise", decode=decode), **PPO)
