"""Stopping and sampling controls: the model's EOS ids, stop ids and stop strings in the hf
and cuda_graph engines (run eagerly on CPU), the one mask/clipped helper, top-k/top-p/min-p,
and one run through HybridTrainer that honours a stop string and reports clipped_fraction."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pipeline.engines.cuda_graph import CudaGraphEngine
from pipeline.engines.hf import HFEngine, assemble_rollout, response_mask_until_stop, stop_string_ends
from pipeline.engines.sampling import filter_logits, sample_tokens, stop_string_end
from pipeline.models import create_tiny_model, load_causal_lm, load_tokenizer, stop_token_ids
from pipeline.records import GenerationRequest
from pipeline.rewards import digit_fraction
from pipeline.roles.forward import response_logprobs
from pipeline.trainer import HybridTrainer

ENGINES = [HFEngine, CudaGraphEngine]


@pytest.fixture(scope="module")
def model_and_tokenizer(tiny_model):
    return load_causal_lm(tiny_model), load_tokenizer(tiny_model)


def _prompts(tokenizer, count=4):
    return [tokenizer(f"what is {i} plus {i * 7}? answer: ")["input_ids"][: 10 + 3 * i] for i in range(count)]


def _actor_logprobs(model, rollout, temperature):
    return response_logprobs(model, rollout.input_ids, rollout.attention_mask, rollout.prompt_length,
                             temperature) * rollout.response_mask


class Bias:
    """Raises some tokens' logits in the model's output (while active), so that the stops
    under test come up often; the actor's forward sees the same bias."""

    def __init__(self, model, bias: dict[int, float]):
        self.model, self.bias = model, bias

    def __enter__(self):
        def hook(module, args, logits):
            for token, value in self.bias.items():
                logits[..., token] += value
            return logits
        self.handle = self.model.lm_head.register_forward_hook(hook)

    def __exit__(self, *exc):
        self.handle.remove()


# -- the model's stop ids ---------------------------------------------------------------------

def test_stop_token_ids_are_the_generation_configs_eos_ids_and_the_tokenizers(tmp_path):
    directory = create_tiny_model(tmp_path / "model")
    tokenizer = load_tokenizer(directory)
    config_file = directory / "generation_config.json"
    config = json.loads(config_file.read_text())
    config["eos_token_id"] = [5, 1]  # a list, as instruct models write it; 1 is the tokenizer's EOS too
    config_file.write_text(json.dumps(config))
    assert stop_token_ids(directory, tokenizer) == (5, 1)
    config["eos_token_id"] = 7       # an int
    config_file.write_text(json.dumps(config))
    assert stop_token_ids(directory, tokenizer) == (7, 1)
    config_file.unlink()             # no generation config at all
    assert stop_token_ids(directory, tokenizer) == (1,)


# -- the one helper every engine ends rows with ------------------------------------------------

def test_the_mask_and_clipped_by_hand():
    responses = torch.tensor([[5, 1, 7, 7],    # stop id 1 at 1
                              [5, 6, 7, 8],    # no stop: clipped
                              [9, 5, 2, 1],    # stop id 2 at 2, before the string's end at 3
                              [5, 6, 7, 8]])   # a stop string completed by the token at 1
    mask, clipped = response_mask_until_stop(responses, (1, 2), torch.tensor([-1, -1, 3, 1]))
    assert mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 0, 0]]
    assert clipped.tolist() == [False, True, False, False]

    rollout = assemble_rollout(torch.tensor([[3, 4]] * 4), torch.ones(4, 2, dtype=torch.long), responses,
                               -torch.ones(4, 4), [0, 0, 1, 1], (1, 2), 0, pad_id=0,
                               engine_string_ends=torch.tensor([-1, -1, 3, 1]))
    assert rollout.responses.tolist() == [[5, 1, 0, 0], [5, 6, 7, 8], [9, 5, 2, 0], [5, 6, 0, 0]]
    assert rollout.behavior_logprobs.tolist() == (-mask).tolist()
    assert rollout.clipped.tolist() == [False, True, False, False]
    assert rollout.select(torch.tensor([1, 3])).clipped.tolist() == [True, False]


def test_stop_strings_end_at_the_token_that_completes_them():
    pieces = {0: "he", 1: "ll", 2: "o ", 3: "wor", 4: "ld", 9: "<end>"}
    decode = lambda ids: "".join(pieces[i] for i in ids)  # noqa: E731
    tokens = [0, 1, 2, 3, 4]
    assert stop_string_end(tokens, decode, ["lo w"]) == 3   # spans "ll", "o ", "wor"
    assert stop_string_end(tokens, decode, ["xyz", "hel"]) == 1
    assert stop_string_end(tokens, decode, ["he"]) == 0
    assert stop_string_end(tokens, decode, ["xyz"]) == -1
    # Only the text before a row's first stop id counts.
    ends = stop_string_ends(torch.tensor([[0, 1, 9, 3], [0, 1, 2, 3]]), (9,), decode, ("wor",))
    assert ends.tolist() == [-1, 3]
    with pytest.raises(ValueError, match="Fix: build the engine with decode=tokenizer.decode"):
        stop_string_ends(torch.tensor([[0]]), (9,), None, ("wor",))


# -- engines -------------------------------------------------------------------------------------

@pytest.mark.parametrize("engine_cls", ENGINES)
def test_a_response_ends_at_either_stop_id_and_at_a_stop_string(engine_cls, model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    x, z, a, b = tokenizer.convert_tokens_to_ids(["x", "z", "a", "b"])
    eos, limit = tokenizer.eos_token_id, 24
    engine = engine_cls(model, pad_id=tokenizer.pad_token_id, eos_id=eos, device="cpu", decode=tokenizer.decode)
    request = GenerationRequest(_prompts(tokenizer), [0, 1, 2, 3], 6, limit, 1.0, seed=5,
                                stop_token_ids=(x, z), stop_strings=("ab",))
    with Bias(model, {x: 1.0, z: 1.0, a: 2.5, b: 2.5}):
        rollout = engine.generate(request, policy_version=0)
        expected = _actor_logprobs(model, rollout, 1.0)
    torch.testing.assert_close(rollout.behavior_logprobs, expected, atol=2e-5, rtol=0)

    endings = []
    for row in range(len(rollout)):
        n = int(rollout.response_mask[row].sum())
        assert rollout.response_mask[row, :n].eq(1).all() and rollout.response_mask[row, n:].eq(0).all()
        kept = rollout.responses[row, :n].tolist()
        assert rollout.responses[row, n:].eq(tokenizer.pad_token_id).all()
        assert not set(kept[:-1]) & {x, z, eos}, "no stop id before the end"
        assert "ab" not in tokenizer.decode(kept[:-1]), "no stop string before the end"
        if kept[-1] in (x, z, eos):
            endings.append(tokenizer.convert_ids_to_tokens(kept[-1]))
        elif tokenizer.decode(kept).endswith("ab"):
            endings.append("ab")
        else:
            endings.append("clipped")
            assert n == limit
        assert bool(rollout.clipped[row]) == (endings[-1] == "clipped")
    # Every kind of end came up (the bias makes them likely; the seed fixes the draw).
    assert {"x", "z", "ab"} <= set(endings), endings


@pytest.mark.parametrize("engine_cls", ENGINES)
def test_top_k_1_is_argmax_decoding_and_logprobs_stay_unfiltered(engine_cls, model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    eos, limit = tokenizer.eos_token_id, 10
    engine = engine_cls(model, pad_id=tokenizer.pad_token_id, eos_id=eos, device="cpu")
    prompts = _prompts(tokenizer, 3)
    rollout = engine.generate(GenerationRequest(prompts, [0, 1, 2], 2, limit, 0.7, seed=1, top_k=1), 0)
    for row in range(len(rollout)):
        ids, greedy = list(prompts[row // 2]), []
        with torch.no_grad():
            while len(greedy) < limit and (not greedy or greedy[-1] != eos):
                greedy.append(int(model(input_ids=torch.tensor([ids + greedy])).logits[0, -1].argmax()))
        assert rollout.token_ids(row)[1] == greedy
    # The sampled (most likely) token's probability under the unfiltered distribution: below 1.
    expected = _actor_logprobs(model, rollout, 0.7)
    torch.testing.assert_close(rollout.behavior_logprobs, expected, atol=2e-5, rtol=0)
    assert (rollout.behavior_logprobs[rollout.response_mask.bool()] < -1e-3).any()


def test_min_p_and_top_p_filter_what_they_should_by_hand():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    kept = lambda **f: (~filter_logits(logits, **f).isneginf()).nonzero()[:, 1].tolist()  # noqa: E731
    assert kept(min_p=0.2) == [0, 1, 2]        # p >= 0.2 x 0.5 = 0.1
    assert kept(min_p=0.5) == [0, 1]           # p >= 0.25
    assert kept(top_p=0.9) == [0, 1, 2]        # mass above token 3 is 0.95 > 0.9
    assert kept(top_p=0.4) == [0]
    assert kept(top_k=3) == [0, 1, 2]
    # min-p first, then top-p on what is left, renormalised: 0.5/0.95 = 0.53 < 0.6, so the
    # second token stays; the third is above 0.6 once the first two are counted.
    assert kept(min_p=0.2, top_p=0.6) == [0, 1]
    # Sampling follows the filtered, renormalised distribution; the logprob is the unfiltered one.
    torch.manual_seed(0)
    tokens, logprobs = sample_tokens(logits.expand(20000, -1), 1.0, min_p=0.5)
    frequency = torch.bincount(tokens, minlength=4).float() / len(tokens)
    torch.testing.assert_close(frequency, torch.tensor([0.625, 0.375, 0.0, 0.0]), atol=0.015, rtol=0)
    torch.testing.assert_close(logprobs, probs[0].log()[tokens])


# -- through the trainer -------------------------------------------------------------------------

# The tiny model writes characters nearly uniformly at first: one frequent enough to end about
# half the responses within 8 tokens, and a two-character one.
STOPS = ["l", "z0"]


def test_a_run_honours_a_stop_string_and_reports_clipped_fraction(shared_cluster, shared_config, tiny_model,
                                                                  prompts, tmp_path):
    limit = 8
    ends_at_stop = lambda text: any(text.endswith(s) for s in STOPS)  # noqa: E731
    with HybridTrainer(tiny_model, digit_fraction, shared_config, algorithm="grpo", prompts=prompts,
                       cluster=shared_cluster, steps=2, samples_per_prompt=2, prompts_per_step=8,
                       max_new_tokens=limit, kl_coef=0.0, micro_batch_size=8, stop=STOPS, top_p=0.95,
                       log_samples=16, output_dir=str(tmp_path), show_progress=False) as trainer:
        records = trainer.train()
    rows = [sample for record in records for sample in record.samples]
    assert len(rows) == 2 * 16
    for sample in rows:  # the response is cut right after a stop string, or has none
        assert not any(s in sample["response"][:-1] for s in STOPS), sample
    assert any(ends_at_stop(sample["response"]) for sample in rows), "a stop string should come up"
    # Clipped: no stop. A response of all max_new_tokens characters (one token each) that does
    # not end at a stop string surely is; one that ends at a stop string surely is not; a
    # shorter one ended at EOS or holds a sampled special token (neither is shown in the text).
    for record in records:
        texts, share = [s["response"] for s in record.samples], record.clipped_fraction * len(record.samples)
        assert sum(len(t) == limit and not ends_at_stop(t) for t in texts) <= share
        assert share <= sum(not ends_at_stop(t) for t in texts)
    lines = [json.loads(line) for line in (Path(tmp_path) / "metrics.jsonl").read_text().splitlines()]
    assert [line["clipped_fraction"] for line in lines] == [r.clipped_fraction for r in records]
    assert 0 < sum(r.clipped_fraction for r in records) < len(records), "some rows clipped, some not"
