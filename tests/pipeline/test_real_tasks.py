"""Real tasks: rows with fields, chat templates, rewards that read the answer column, several
weighted rewards, and the held-out evaluation's figures (by hand, then through the trainer)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from pipeline.chat import ChatTemplateError, render_prompts
from pipeline.data import PromptColumnError, PromptRow, read_rows
from pipeline.evaluation import eval_figures
from pipeline.metrics import reward_figures
from pipeline.models import QWEN_CHAT_TEMPLATE, build_char_tokenizer, create_tiny_model, load_tokenizer
from pipeline.config import make_train_config
from pipeline.records import RewardInputs, Rollout, Scores
from pipeline.reward_specs import RewardSpec, takes_batches
from pipeline.roles.reward import RewardRole
from tests.conftest import published_snapshots

CHAT = [{"role": "user", "content": "what is 2 plus 3?"}]


@pytest.fixture(scope="session")
def chat_model(tmp_path_factory) -> str:
    return str(create_tiny_model(tmp_path_factory.mktemp("chat") / "model", chat=True))


# -- rows --------------------------------------------------------------------------------------
def test_a_jsonl_row_keeps_its_messages_and_every_other_field(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"prompt": CHAT, "answer": "5", "level": 1}) + "\n" +
                    json.dumps({"prompt": "plain text", "answer": "7"}) + "\n")
    rows = read_rows(path)
    assert rows == [PromptRow(CHAT, {"answer": "5", "level": 1}), PromptRow("plain text", {"answer": "7"})]
    assert rows[0].is_chat and not rows[1].is_chat


def test_columns_rename_fields_and_a_missing_one_names_the_file_the_row_and_the_fix(tmp_path):
    rows = [{"question": "q1", "solution": "#### 4"}, {"question": "q2", "solution": "#### 5"}]
    assert read_rows(rows, "question", {"answer": "solution"})[1] == PromptRow("q2", {"answer": "#### 5"})
    path = tmp_path / "gsm.jsonl"
    path.write_text(json.dumps(rows[0]) + "\n" + json.dumps({"question": "q2", "final": "5"}) + "\n")
    with pytest.raises(PromptColumnError) as error:
        read_rows(path, "question", {"answer": "solution"})
    assert str(error.value) == (f"{path} line 2: no 'solution' field (its fields are ['question', 'final']), which "
                                f"train.columns reads 'answer' from. Fix: name an existing field in train.columns.")


def test_a_parquet_file_without_a_mapped_column_is_refused_at_load(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"question": ["q"], "answer": ["1"]}), path)
    assert read_rows(path, "question") == [PromptRow("q", {"answer": "1"})]
    with pytest.raises(PromptColumnError, match=r"has no column 'solution' .*train.columns reads 'answer' from"):
        read_rows(path, "question", {"answer": "solution"})


@pytest.mark.parametrize("prompt, expected", [
    ([{"role": "user"}], "is a list, but its item 0 is no chat message"),
    ([], "is an empty list of messages"),
    ({"role": "user", "content": "x"}, "is .*, neither text nor a list of chat messages"),
])
def test_a_malformed_chat_prompt_names_the_row(prompt, expected):
    with pytest.raises(ValueError, match=f"^prompt 1: 'prompt' {expected}.*Fix: "):
        read_rows([{"prompt": "fine"}, {"prompt": prompt}])


# -- chat templates ----------------------------------------------------------------------------
def test_chat_rows_are_rendered_token_for_token_as_apply_chat_template_does(chat_model):
    tokenizer = load_tokenizer(chat_model)  # the saved template comes back with the tokenizer
    assert tokenizer.chat_template == QWEN_CHAT_TEMPLATE
    rows = [PromptRow(CHAT), PromptRow("plain")]
    chat_ids, text_ids = render_prompts(tokenizer, rows)
    assert chat_ids == list(tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True,
                                                          return_dict=False))
    # Qwen's format, by hand: the markers are one token each, then the text character by character.
    start, end = tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    assert chat_ids == [start, *encode("user\nwhat is 2 plus 3?"), end, *encode("\n"), start, *encode("assistant\n")]
    assert text_ids == encode("plain")  # text stays text by default
    wrapped, = render_prompts(tokenizer, [PromptRow("plain")], chat_template=True, system_prompt="be brief")
    assert wrapped == [start, *encode("system\nbe brief"), end, *encode("\n"), start, *encode("user\nplain"), end,
                       *encode("\n"), start, *encode("assistant\n")]


def test_chat_prompts_without_a_template_are_refused_with_the_fix():
    plain = build_char_tokenizer()
    with pytest.raises(ChatTemplateError, match="has no chat template.*Fix: use an instruct model's tokenizer"):
        render_prompts(plain, [PromptRow(CHAT)])
    with pytest.raises(ChatTemplateError, match="has no chat template"):
        render_prompts(plain, [PromptRow("text")], chat_template=True)
    chat = build_char_tokenizer(chat=True)
    with pytest.raises(ChatTemplateError, match="train.chat_template is false. Fix: set chat_template: true"):
        render_prompts(chat, [PromptRow("text"), PromptRow(CHAT)], chat_template=False)


# -- rewards that read the row -----------------------------------------------------------------
def _rollout(tokenizer, groups: list[int], responses: list[str]) -> Rollout:
    """One-token prompts; responses right-padded, every response token real."""
    encoded = [tokenizer(r, add_special_tokens=False)["input_ids"] for r in responses]
    width = max(len(e) for e in encoded)
    ids = torch.zeros(len(groups), 1 + width, dtype=torch.long)
    mask = torch.zeros(len(groups), width)
    ids[:, 0] = tokenizer.convert_tokens_to_ids("q")
    for row, e in enumerate(encoded):
        ids[row, 1:1 + len(e)] = torch.tensor(e)
        mask[row, :len(e)] = 1
    return Rollout(ids, torch.cat([torch.ones(len(groups), 1, dtype=torch.long), mask.long()], 1), mask,
                   torch.zeros_like(mask), torch.tensor(groups), 0, 1)


def trl_accuracy(prompts, completions, answer, **kwargs):
    """Written for TRL's GRPOTrainer: batched, columns as keyword lists."""
    trl_accuracy.seen = (prompts, completions, answer, kwargs["completion_ids"])
    texts = [c if isinstance(c, str) else c[0]["content"] for c in completions]
    return [1.0 if text.strip() == a else 0.0 for text, a in zip(texts, answer)]


def per_sample_length(prompt, response, *, level):
    return None if level == 0 else float(len(response))  # "does not apply" to level-0 rows


def test_a_trl_reward_gets_each_samples_answer_and_a_per_sample_one_its_fields(chat_model):
    role = RewardRole(chat_model, rewards=[RewardSpec("trl_accuracy", 1.0, function=trl_accuracy),
                                           RewardSpec("per_sample_length", 0.5, function=per_sample_length)])
    assert takes_batches(trl_accuracy) and not takes_batches(per_sample_length)
    # Shards need not be in prompt order: rows of groups 11, 10, 11, 10.
    rollout = _rollout(role.tokenizer, [11, 10, 11, 10], ["5", "7", "6", "77"])
    inputs = RewardInputs({10: CHAT, 11: "say six"}, {10: {"answer": "7", "level": 0}, 11: {"answer": "6", "level": 2}})
    scores = role.score(rollout, inputs)
    prompts, completions, answers, completion_ids = trl_accuracy.seen
    assert prompts == ["say six", CHAT, "say six", CHAT] and answers == ["6", "7", "6", "7"]
    # Conversational prompts get message completions, as TRL gives them; text prompts text.
    assert completions == ["5", [{"role": "assistant", "content": "7"}], "6", [{"role": "assistant", "content": "77"}]]
    assert completion_ids[3] == role.tokenizer("77", add_special_tokens=False)["input_ids"]
    torch.testing.assert_close(scores.components["trl_accuracy"], torch.tensor([0.0, 1.0, 1.0, 0.0]))
    assert scores.components["per_sample_length"][[0, 2]].tolist() == [1.0, 1.0]
    assert scores.components["per_sample_length"][[1, 3]].isnan().all()  # None: level 0
    # Weighted sum over the rewards that apply: 1 x accuracy + 0.5 x length.
    torch.testing.assert_close(scores.values, torch.tensor([0.5, 1.0, 1.5, 0.0]))
    assert scores.problems == []
    assert reward_figures(scores.components) == {"trl_accuracy": {"mean": 0.5, "std": 0.5},
                                                 "per_sample_length": {"mean": 1.0, "std": 0.0}}


def test_a_batched_reward_with_a_wrong_count_or_an_error_costs_its_samples(chat_model):
    rollout = _rollout(build_char_tokenizer(chat=True), [0, 0], ["1", "2"])
    short = RewardRole(chat_model, function=lambda prompts, completions, **_: [1.0]).score(rollout)
    assert [p.error for p in short.problems] == ["the reward function returned [1.0], not a list of 2 values "
                                                 "(one per completion)"] * 2
    failing = RewardRole(chat_model, function=lambda prompts, completions, **_: 1 / 0).score(rollout)
    assert failing.values.isnan().all() and "ZeroDivisionError: division by zero" in failing.problems[0].error


def test_eval_figures_count_correct_samples_per_prompt():
    # Two prompts (groups 4 and 3) x 3 samples; a sample is correct at reward >= 1.
    values = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, math.nan])
    groups = torch.tensor([4, 3, 4, 3, 4, 3])
    scores = Scores(values, [], {"accuracy": torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, math.nan])})
    tc = make_train_config({"eval_samples_per_prompt": 3})
    figures = eval_figures(scores, groups, tc)
    # Group 4: rows 0, 2, 4 -> 2 of 3 correct; group 3: rows 1, 3, 5 -> none (NaN is not correct).
    assert figures["eval/accuracy"] == pytest.approx(2 / 6)
    assert figures["eval/pass@1"] == pytest.approx((2 / 3 + 0) / 2)
    assert figures["eval/pass@3"] == pytest.approx(0.5)
    assert figures["eval/reward"] == pytest.approx(3 / 5)  # the NaN left out
    assert figures["eval/rewards/accuracy/mean"] == pytest.approx(2 / 5)


# -- through the trainer -----------------------------------------------------------------------
def first_digit_is_answer(prompt, response, *, answer, **_):
    digits = [ch for ch in response if ch.isdigit()]
    return 1.0 if digits and digits[0] == answer else 0.0


def test_chat_rows_train_with_answers_and_evaluation_runs_while_async_training_goes_on(
        shared_cluster, shared_config, chat_model, tmp_path):
    rows = [{"prompt": [{"role": "user", "content": f"repeat {d}"}], "answer": str(d), "tag": f"t{d}"}
            for d in range(8)]

    def answers_seen(prompts, completions, answer, tag, **_):  # TRL's convention, on the reward worker
        # 0.1 where the sample got its own row's answer and tag with the conversation it answers.
        return [0.1 if p[0]["content"] == f"repeat {a}" and t == f"t{a}" else -5.0
                for p, a, t in zip(prompts, answer, tag)]

    from pipeline.trainer import HybridTrainer

    out = tmp_path / "run"
    with HybridTrainer(chat_model, [first_digit_is_answer, answers_seen], shared_config, algorithm="grpo",
                       prompts=rows, eval_prompts=rows[:4], cluster=shared_cluster, steps=4, samples_per_prompt=2,
                       prompts_per_step=4, max_new_tokens=4, kl_coef=0.0, max_staleness=1, eval_before_train=True,
                       eval_every_n_steps=2, eval_samples_per_prompt=2, eval_temperature=1.0,
                       reward_weights=[1.0, 2.0], output_dir=str(out), show_progress=False) as trainer:
        history = trainer.train()
        # The batch generating ahead loads the version before the newest; an evaluation may
        # still load the newest while the next is published: three kept ("shm": a file each).
        assert trainer.batches.published_versions == 3
        assert len(published_snapshots(trainer.fleet.snapshot_dir)) == 3
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [line for line in lines if "reward" in line]
    assert len(steps) == 4 == len(history)
    for line, record in zip(steps, history):
        # Every sample saw its own row (0.1); the step's reward is 1 x first_digit_is_answer + 2 x 0.1.
        assert line["rewards/answers_seen/mean"] == pytest.approx(0.1)
        assert line["reward"] == pytest.approx(line["rewards/first_digit_is_answer/mean"] + 0.2, abs=1e-6)
        assert record.rewards["first_digit_is_answer"]["mean"] == line["rewards/first_digit_is_answer/mean"]
    evaluations = [line for line in lines if "eval/accuracy" in line]
    # Before training (step 0), after 2 steps, and the final weights (4); training did not wait for them.
    assert sorted(int(line["eval/step"]) for line in evaluations) == [0, 2, 4]
    for line in evaluations:
        assert line["eval/samples"] == 8 and 0 <= line["eval/pass@1"] <= line["eval/pass@2"] <= 1
        assert line["eval/rewards/answers_seen/mean"] == pytest.approx(0.1)
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert samples and all(s["fields"]["tag"] == f"t{s['fields']['answer']}" and set(s["rewards"]) ==
                           {"first_digit_is_answer", "answers_seen"} for s in samples)


def test_a_reward_model_among_reward_functions_is_one_weighted_reward(chat_model, tmp_path):
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    tokenizer = build_char_tokenizer(chat=True)
    torch.manual_seed(3)
    scorer = Qwen2ForSequenceClassification(Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, num_labels=1, pad_token_id=0))
    scorer.save_pretrained(tmp_path / "rm")
    tokenizer.save_pretrained(tmp_path / "rm")
    role = RewardRole(chat_model, rewards=[RewardSpec("first_digit_is_answer", 1.0, function=first_digit_is_answer),
                                           RewardSpec("reward_model", 0.5, model_dir=str(tmp_path / "rm"))])
    rollout = _rollout(role.tokenizer, [0, 0], ["7", "3"])
    scores = role.score(rollout, RewardInputs({0: "x"}, {0: {"answer": "7"}}))
    model_scores = scores.components["reward_model"]
    assert model_scores.isfinite().all()
    torch.testing.assert_close(scores.values, torch.tensor([1.0, 0.0]) + 0.5 * model_scores)
