"""The vLLM rollout engine against the HF actor's forward pass.

Marked `vllm`: the default run deselects it; it runs where vllm is installed (.ci/run does so):
    bash scripts/vllm_venv.sh            # once: builds /tmp/vllm-venv
    PYTHONPATH=$PWD /tmp/vllm-venv/bin/python -m pytest -q -m vllm -p no:cacheprovider
"""

from __future__ import annotations

import pytest
import torch

from pipeline import weights
from pipeline.engines.vllm import vllm_installed
from pipeline.models import create_tiny_model, load_causal_lm, load_tokenizer
from pipeline.records import GenerationRequest
from pipeline.roles.forward import response_logprobs
from pipeline.roles.rollout import RolloutRole

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(not vllm_installed(), reason="vllm is not installed here")]

PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [3]] * 4  # 16 prompts of lengths 1..4
SAMPLES = 4


def request(temperature: float = 1.0, seed: int = 3, max_new_tokens: int = 32, **controls) -> GenerationRequest:
    return GenerationRequest(prompt_ids=PROMPTS, group_ids=[100 + i for i in range(len(PROMPTS))],
                             samples_per_prompt=SAMPLES, max_new_tokens=max_new_tokens,
                             temperature=temperature, seed=seed, **controls)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # hidden 128 with 2 heads: head_dim 64 (the CPU attention kernel refuses head_dim 16).
    return create_tiny_model(tmp_path_factory.mktemp("tiny-vllm"), hidden_size=128, heads=2)


@pytest.fixture(scope="module")
def role(model_dir):
    # One engine for the module: vLLM takes seconds to start, and tests below restore the
    # weights they change. Built through RolloutRole, as a rollout worker builds it.
    return RolloutRole(str(model_dir), device="cpu", engine="vllm", dtype="float32",
                       engine_args={"max_model_len": 128})


def hf_logprobs(model, rollout, temperature: float) -> torch.Tensor:
    with torch.no_grad():
        lp = response_logprobs(model.float(), rollout.input_ids, rollout.attention_mask,
                               rollout.prompt_length, temperature)
    return lp * rollout.response_mask


def perturbed(model_dir, seed: int = 1, scale: float = 0.05):
    """An HF model with noise added to every weight (in place, so tied weights stay tied)."""
    model = load_causal_lm(model_dir)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=generator))
    return model


def test_rollout_shapes_masks_and_logprobs_match_actor(role, model_dir):
    rollout = role.engine.generate(request(), policy_version=7)
    B, P = len(PROMPTS) * SAMPLES, max(len(p) for p in PROMPTS)
    assert rollout.input_ids.shape[0] == B and rollout.prompt_length == P
    R = rollout.response_mask.shape[1]
    assert 1 <= R <= 32 and rollout.input_ids.shape == (B, P + R)
    assert rollout.policy_version == 7
    assert rollout.group_ids.tolist() == [100 + i for i in range(len(PROMPTS)) for _ in range(SAMPLES)]
    # prompts left-padded, every row's prompt exactly as given
    for row in range(B):
        prompt = PROMPTS[row // SAMPLES]
        assert rollout.input_ids[row, P - len(prompt):P].tolist() == prompt
        assert rollout.attention_mask[row, :P].sum() == len(prompt)
    # response mask: 1 up to and including the first EOS, then pad only
    responses, mask = rollout.responses, rollout.response_mask
    for row in range(B):
        n = int(mask[row].sum())
        assert mask[row, :n].eq(1).all() and mask[row, n:].eq(0).all()
        assert responses[row, n:].eq(0).all()
        assert (responses[row, :n - 1] != 1).all()                   # no EOS before the end
        assert responses[row, n - 1] == 1 or n == 32                  # ends at EOS or at the limit
    assert torch.equal(rollout.attention_mask[:, P:].float(), mask)
    # every sample has its own random stream: within a prompt, across repeats of a prompt
    # (rows 0.. and 16.. both answer [5, 6, 7]) and across neighbouring request seeds
    assert len({tuple(r) for r in responses[:SAMPLES].tolist()}) > 1
    assert responses[:SAMPLES].tolist() != responses[4 * SAMPLES:5 * SAMPLES].tolist()
    shifted = role.engine.generate(request(seed=4), policy_version=7).responses
    assert not any(row in responses.tolist() for row in shifted.tolist() if 1 not in row[:8])  # long rows
    # behaviour logprobs = the actor's log_softmax(logits / T) on the same ids
    actor = hf_logprobs(load_causal_lm(model_dir), rollout, 1.0)
    assert (rollout.behavior_logprobs - actor).abs().max() < 1e-3
    assert rollout.behavior_logprobs[mask == 0].eq(0).all()
    # the same seed gives the same rollout
    assert torch.equal(role.engine.generate(request(), policy_version=7).input_ids, rollout.input_ids)


def test_temperature_scales_logprobs(role, model_dir):
    rollout = role.engine.generate(request(temperature=0.7, seed=11, max_new_tokens=16), policy_version=0)
    actor = hf_logprobs(load_causal_lm(model_dir), rollout, 0.7)
    assert (rollout.behavior_logprobs - actor).abs().max() < 1e-3


def test_load_state_dict_changes_generation_and_matches_hf(role, model_dir):
    cold = request(temperature=0.01, max_new_tokens=16)  # the coldest vLLM allows: near greedy
    before = role.engine.generate(cold, policy_version=0)
    model = perturbed(model_dir)
    role.engine.load_state_dict(model.state_dict())
    try:
        after = role.engine.generate(cold, policy_version=1)
        assert not torch.equal(after.input_ids, before.input_ids)
        # the tokens' logprobs are the perturbed HF model's, even this cold (errors x 100)
        assert (after.behavior_logprobs - hf_logprobs(model, after, 0.01)).abs().max() < 1e-3
        # and at T=1
        sampled = role.engine.generate(request(), policy_version=1)
        assert (sampled.behavior_logprobs - hf_logprobs(model, sampled, 1.0)).abs().max() < 1e-3
    finally:
        role.engine.load_state_dict(load_causal_lm(model_dir).state_dict())
    # back on the original weights, the same seed gives the same tokens as before
    assert torch.equal(role.engine.generate(cold, policy_version=0).input_ids, before.input_ids)


def test_a_very_cold_temperature_samples_and_scores_at_that_temperature(role, model_dir):
    # vLLM's own sampler raises temperatures below 0.01 to 0.01; here the temperature lives in
    # the logits layer, so 1e-3 is what is sampled and scored.
    rollout = role.engine.generate(request(temperature=1e-3, max_new_tokens=12), policy_version=0)
    assert (rollout.behavior_logprobs - hf_logprobs(load_causal_lm(model_dir), rollout, 1e-3)).abs().max() < 1e-3
    with pytest.raises(ValueError, match="temperature > 0"):
        role.engine.generate(request(temperature=0.0), policy_version=0)


def test_stop_ids_and_stop_strings_end_responses_as_in_every_engine(role, model_dir):
    tokenizer = load_tokenizer(model_dir)
    x, z = tokenizer.convert_tokens_to_ids(["x", "z"])
    stops = ("l", "b2")
    rollout = role.engine.generate(request(seed=8, stop_token_ids=(x, z), stop_strings=stops), policy_version=0)
    endings = []
    for row in range(len(rollout)):
        n = int(rollout.response_mask[row].sum())
        kept = rollout.responses[row, :n].tolist()
        assert rollout.responses[row, n:].eq(0).all() and rollout.behavior_logprobs[row, n:].eq(0).all()
        assert not set(kept[:-1]) & {x, z, 1}, "no stop id before the end"
        assert not any(s in tokenizer.decode(kept[:-1]) for s in stops), "no stop string before the end"
        text = tokenizer.decode(kept)
        ending = ("id" if kept[-1] in (x, z, 1) else "string" if any(text.endswith(s) for s in stops) else "clipped")
        assert bool(rollout.clipped[row]) == (ending == "clipped") and (ending != "clipped" or n == 32)
        endings.append(ending)
    assert {"id", "string"} <= set(endings), endings
    actor = hf_logprobs(load_causal_lm(model_dir), rollout, 1.0)
    assert (rollout.behavior_logprobs - actor).abs().max() < 1e-3


def test_filters_choose_the_tokens_and_logprobs_stay_unfiltered(role, model_dir):
    model = load_causal_lm(model_dir)
    # top_k=1: every sample of a prompt is the argmax continuation, the same for all four.
    greedy = role.engine.generate(request(temperature=0.7, max_new_tokens=8, top_k=1), policy_version=0)
    for prompt in range(len(PROMPTS)):
        rows = greedy.responses[prompt * SAMPLES:(prompt + 1) * SAMPLES]
        assert (rows == rows[:1]).all()
    ids, row = list(PROMPTS[0]), greedy.token_ids(0)[1]
    with torch.no_grad():
        for token in row:
            assert token == int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
            ids.append(token)
    actor = hf_logprobs(model, greedy, 0.7)
    assert (greedy.behavior_logprobs - actor).abs().max() < 1e-3
    assert (greedy.behavior_logprobs[greedy.response_mask.bool()] < -1e-2).any(), "unfiltered: below log 1"
    # top_p and min_p: the logprobs are still the unfiltered ones at the temperature.
    filtered = role.engine.generate(request(temperature=0.8, max_new_tokens=16, top_p=0.5, min_p=0.1),
                                    policy_version=0)
    assert (filtered.behavior_logprobs - hf_logprobs(model, filtered, 0.8)).abs().max() < 1e-3


def test_rollout_role_syncs_published_weights(role, model_dir, tmp_path):
    model = perturbed(model_dir, seed=2)
    handle = weights.publish(model.state_dict(), version=1, directory=tmp_path)
    role.sync(handle)
    try:
        assert role.version == 1
        rollout = role.engine.generate(request(max_new_tokens=16), role.version)
        assert rollout.policy_version == 1
        assert (rollout.behavior_logprobs - hf_logprobs(model, rollout, 1.0)).abs().max() < 1e-3
    finally:
        role.engine.load_state_dict(load_causal_lm(model_dir).state_dict())
        role.version = 0
