"""The reward role (rule function and reward model) and bounded waits on a missing role."""

from __future__ import annotations

import math

import pytest
import torch

from pipeline.data import PromptStream
from pipeline.models import build_char_tokenizer
from pipeline.records import GenerationRequest, Rollout
from pipeline.rewards import digit_fraction
from pipeline.roles import reward, rollout
from pipeline.roles.reward import RewardRole
from pipeline.fleet.tasks import RoleTimeout, submit, wait_role
from pipeline.trainer import HybridTrainer

PAD, EOS = 0, 1  # the char tokenizer's specials; 'a' is 2, '0' is 28, ' ' is 38


@pytest.fixture(scope="module")
def reward_model(tmp_path_factory) -> str:
    """A tiny randomly initialised Qwen2 reward model saved with the char tokenizer."""
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    tokenizer = build_char_tokenizer()
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
                         num_labels=1, pad_token_id=PAD, eos_token_id=EOS)
    torch.manual_seed(7)
    model = Qwen2ForSequenceClassification(config)
    path = tmp_path_factory.mktemp("reward") / "model"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def direct_scores(model_dir: str, texts: list[str]) -> torch.Tensor:
    """The reward model's output on each text alone: no batch, so no padding involved."""
    from transformers import Qwen2ForSequenceClassification

    tokenizer = build_char_tokenizer()
    model = Qwen2ForSequenceClassification.from_pretrained(model_dir).eval()
    with torch.no_grad():
        return torch.tensor([model(input_ids=torch.tensor([tokenizer.encode(t, add_special_tokens=False)]))
                             .logits[0, 0].item() for t in texts])


def hand_rollout() -> Rollout:
    """Three samples, prompts left-padded to P=4, responses right-padded to R=5:

    row 0: prompt "hi"   response "12a" <eos> <pad>   -> digits 2 of 3
    row 1: prompt "ok: " response "5 5 5" (no EOS: it ran out of tokens) -> 3 of 5
    row 2: prompt "a"    response <eos> at once        -> empty, scores 0
    """
    tokenizer = build_char_tokenizer()
    ids = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    prompts = [[PAD, PAD] + ids("hi"), ids("ok: "), [PAD, PAD, PAD] + ids("a")]
    responses = [ids("12a") + [EOS, PAD], ids("5 5 5"), [EOS, PAD, PAD, PAD, PAD]]
    assert [len(p) for p in prompts] == [4, 4, 4] and [len(r) for r in responses] == [5, 5, 5]
    input_ids = torch.tensor([p + r for p, r in zip(prompts, responses)])
    response_mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], dtype=torch.float32)
    prompt_mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1], [0, 0, 0, 1]])
    return Rollout(input_ids=input_ids, attention_mask=torch.cat([prompt_mask, response_mask.long()], dim=1),
                   response_mask=response_mask, behavior_logprobs=torch.zeros(3, 5),
                   group_ids=torch.tensor([0, 1, 2]), policy_version=0, prompt_length=4)


def test_rule_reward_decodes_prompts_and_responses_without_padding_or_eos(tiny_model):
    role = RewardRole(tiny_model, function=digit_fraction)
    prompts, responses = role.texts(hand_rollout())
    assert prompts == ["hi", "ok: ", "a"]
    assert responses == ["12a", "5 5 5", ""]
    scores = role.score(hand_rollout())
    assert scores.values.shape == (3,) and scores.problems == []
    torch.testing.assert_close(scores.values, torch.tensor([2 / 3, 3 / 5, 0.0]))


def test_rule_reward_sees_the_prompt_too(tiny_model):
    seen = []
    role = RewardRole(tiny_model, function=lambda p, r: seen.append((p, r)) or float(len(p)))
    torch.testing.assert_close(role.score(hand_rollout()).values, torch.tensor([2.0, 4.0, 1.0]))
    assert seen == [("hi", "12a"), ("ok: ", "5 5 5"), ("a", "")]


def test_a_reward_role_needs_exactly_one_of_function_or_model(tiny_model, reward_model):
    with pytest.raises(ValueError, match="exactly one"):
        RewardRole(tiny_model)
    with pytest.raises(ValueError, match="exactly one"):
        RewardRole(tiny_model, function=digit_fraction, model_dir=reward_model)


def test_model_reward_equals_a_direct_forward_of_the_reward_model(tiny_model, reward_model):
    # batch_size 2 over 3 samples: one padded batch of two texts of different lengths, then one.
    role = RewardRole(tiny_model, model_dir=reward_model, batch_size=2)
    scores = role.score(hand_rollout()).values
    expected = direct_scores(reward_model, ["hi12a", "ok: 5 5 5", "a"])
    torch.testing.assert_close(scores, expected, rtol=1e-4, atol=1e-5)
    assert len(set(expected.tolist())) == 3  # the texts really score differently


def test_trainer_with_a_reward_model_scores_with_that_model(shared_cluster, shared_config, tiny_model,
                                                            reward_model, prompts):
    # Near-greedy sampling, so the first batch is the same whatever sampling seed the trainer
    # picks: it depends only on the prompts drawn, which the prompt stream fixes by seed.
    temperature = 1e-4
    trainer = HybridTrainer(tiny_model, reward_model, shared_config, algorithm="grpo", prompts=prompts,
                            cluster=shared_cluster, steps=1, samples_per_prompt=2, prompts_per_step=4,
                            max_new_tokens=6, temperature=temperature, show_progress=False)
    client = shared_cluster.client
    first_prompts, draws = PromptStream(trainer.prompts.token_ids, seed=trainer.prompts.seed).next_batch(4)
    request = GenerationRequest(prompt_ids=first_prompts, group_ids=draws, samples_per_prompt=2,
                                max_new_tokens=6, temperature=temperature, seed=12345)
    generated = submit(client, "rollout", rollout.generate, request, None, tag="check")
    on_worker = submit(client, "reward", reward.score, generated, tag="check").result().values
    samples = generated.result()
    prompt_texts, response_texts = RewardRole(tiny_model, function=digit_fraction).texts(samples)
    expected = direct_scores(reward_model, [p + r for p, r in zip(prompt_texts, response_texts)])
    # The reward worker runs the model the trainer was given, on the decoded texts.
    torch.testing.assert_close(on_worker, expected, rtol=1e-4, atol=1e-5)

    [record] = trainer.train()
    assert record.policy_version == 1 and trainer.version == 1
    assert math.isfinite(record.reward_mean)
    assert record.reward_mean == pytest.approx(expected.mean().item(), rel=1e-4, abs=1e-5)


def _raise_on_ok(prompt: str, response: str) -> float:
    if prompt.startswith("ok"):
        raise ArithmeticError("no score for ok")
    return 1.0


# What a reward function returns for the prompt "ok: " (row 1), and how the role reports it.
BAD_REWARDS = {
    "raises": (_raise_on_ok, "the reward function raised ArithmeticError: no score for ok"),
    "string": (lambda p, r: "0.5" if p.startswith("ok") else 1.0,
               "the reward function returned '0.5' (a str), not a number"),
    # None is "does not apply" (TRL's convention): with no other reward, none applies.
    "None": (lambda p, r: None if p.startswith("ok") else 1.0,
             "every reward returned None (none applies to this sample)"),
    "tensor of two": (lambda p, r: torch.ones(2) if p.startswith("ok") else torch.tensor(1.0),
                      "the reward function returned a tensor of shape (2,), not one number"),
    "nan": (lambda p, r: math.nan if p.startswith("ok") else 1, "the reward function returned nan, not a finite"),
    "-inf": (lambda p, r: -math.inf if p.startswith("ok") else True, "the reward function returned -inf"),
    "huge int": (lambda p, r: 10**400 if p.startswith("ok") else 1.0, "an integer too large for a float"),
}


@pytest.mark.parametrize("function, error", BAD_REWARDS.values(), ids=BAD_REWARDS.keys())
def test_a_bad_reward_marks_its_sample_with_the_texts_and_the_error(tiny_model, function, error):
    scores = RewardRole(tiny_model, function=function).score(hand_rollout())
    assert scores.values[[0, 2]].tolist() == [1.0, 1.0]  # one good number per other row (True is 1)
    assert math.isnan(scores.values[1])
    [problem] = scores.problems
    assert (problem.row, problem.role, problem.prompt, problem.response) == (1, "reward", "ok: ", "5 5 5")
    assert error in problem.error


def test_every_rows_token_ids_in_one_pass_are_each_rows():
    rollout = hand_rollout()
    prompts, responses = rollout.all_token_ids()
    assert list(zip(prompts, responses)) == [rollout.token_ids(row) for row in range(len(rollout))]
    assert [len(p) for p in prompts] == [2, 4, 1] and [len(r) for r in responses] == [4, 5, 1]


def test_prompt_and_response_in_a_problem_are_cut_short(tiny_model):
    rollout = hand_rollout()
    role = RewardRole(tiny_model, function=lambda p, r: None)
    role._decode = lambda *_: (["p" * 5000] * 3, ["r" * 5000] * 3)  # as if the model wrote 5000 characters
    problem = role.score(rollout).problems[0]
    assert problem.prompt == "p" * 197 + "..." and problem.response == "r" * 197 + "..."


def test_a_reward_model_scoring_nan_marks_its_samples(tiny_model, reward_model, tmp_path):
    from transformers import Qwen2ForSequenceClassification

    broken = Qwen2ForSequenceClassification.from_pretrained(reward_model)
    with torch.no_grad():
        broken.score.weight.fill_(math.nan)  # a reward model whose head went NaN in its own training
    broken.save_pretrained(tmp_path / "broken")
    build_char_tokenizer().save_pretrained(tmp_path / "broken")
    scores = RewardRole(tiny_model, model_dir=str(tmp_path / "broken")).score(hand_rollout())
    assert scores.values.isnan().all()
    assert [(p.row, p.error) for p in scores.problems] == [(r, "the reward model scored nan") for r in range(3)]


def test_waiting_on_a_role_nobody_has_times_out_naming_the_role_and_the_fix(shared_cluster):
    client = shared_cluster.client
    future = submit(client, "judge", sum, [1, 2], tag="orphan")
    try:
        with pytest.raises(RoleTimeout) as error:
            wait_role(client, [future], "judge", "verdicts", timeout=2)
    finally:
        future.cancel()
    message = str(error.value)
    assert message.startswith("judge: waited 2s")
    assert "verdicts" in message
    assert "there is no live judge worker" in message
    assert "Fix:" in message and "add a judge worker" in message
    assert future.key in message
