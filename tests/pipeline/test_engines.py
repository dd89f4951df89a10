"""Rollout engines in-process: the sampled tokens' logprobs equal the actor's forward on the
same tokens, EOS ends a sequence, buckets bound the shapes, new weights land in place.

The CUDA-graph engine runs its decode loop eagerly on CPU here; `-m gpu` runs it captured
on a GPU (tests/pipeline/test_engines_gpu.py)."""

from __future__ import annotations

import math

import pytest
import torch

from pipeline.engines.continuous import bucket_batch
from pipeline.engines.cuda_graph import CudaGraphEngine, bucket_length
from pipeline.engines.sampling import sample_tokens
from pipeline.engines.hf import HFEngine
from pipeline.models import load_causal_lm, load_tokenizer
from pipeline.records import GenerationRequest
from pipeline.roles.forward import response_logprobs


@pytest.fixture(scope="module")
def model_and_tokenizer(tiny_model):
    return load_causal_lm(tiny_model), load_tokenizer(tiny_model)


def _request(tokenizer, prompts=4, samples=3, new_tokens=12, temperature=1.0, seed=5):
    ids = [tokenizer(f"what is {i} plus {i * 7}? answer: ")["input_ids"][: 10 + 3 * i] for i in range(prompts)]
    return GenerationRequest(ids, list(range(100, 100 + prompts)), samples, new_tokens, temperature, seed)


def _actor_logprobs(model, rollout, temperature):
    return response_logprobs(model, rollout.input_ids, rollout.attention_mask, rollout.prompt_length,
                             temperature) * rollout.response_mask


@pytest.mark.parametrize("engine_cls", [HFEngine, CudaGraphEngine])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_equal_the_actor_forward(engine_cls, temperature, model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    engine = engine_cls(model, pad_id=tokenizer.pad_token_id, eos_id=tokenizer.eos_token_id, device="cpu")
    request = _request(tokenizer, temperature=temperature)
    rollout = engine.generate(request, policy_version=3)

    assert len(rollout) == 12 and rollout.policy_version == 3
    assert rollout.group_ids.tolist() == [g for g in range(100, 104) for _ in range(3)]
    # Every row holds its own prompt, right-aligned at P, followed by the response.
    for row, prompt in enumerate(p for p in request.prompt_ids for _ in range(3)):
        assert rollout.input_ids[row, rollout.prompt_length - len(prompt):rollout.prompt_length].tolist() == prompt
        assert rollout.attention_mask[row, :rollout.prompt_length].sum() == len(prompt)
    expected = _actor_logprobs(model, rollout, temperature)
    assert (rollout.behavior_logprobs <= 0).all()
    torch.testing.assert_close(rollout.behavior_logprobs, expected, atol=2e-5, rtol=0)


def test_cuda_graph_engine_stops_each_sequence_at_eos(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    eos = tokenizer.eos_token_id
    engine = CudaGraphEngine(model, pad_id=tokenizer.pad_token_id, eos_id=eos, device="cpu")
    # Make EOS likely (its logit raised by 3): rows end at different steps, and the loop
    # exits before max_new_tokens once all have.
    def raise_eos(module, args, logits):
        logits[..., eos] += 3.0
        return logits

    hook = model.lm_head.register_forward_hook(raise_eos)
    try:
        rollout = engine.generate(_request(tokenizer, new_tokens=64, samples=4), policy_version=0)
    finally:
        hook.remove()
    responses, mask = rollout.responses, rollout.response_mask
    ended = (responses == eos).any(-1)
    assert ended.all(), "every row should have sampled EOS with its logit raised"
    assert responses.shape[1] < 64, "the loop should exit once every sequence has ended"
    for row in range(len(rollout)):
        first = int((responses[row] == eos).nonzero()[0])
        assert mask[row, :first + 1].tolist() == [1.0] * (first + 1)
        assert mask[row, first + 1:].sum() == 0
        assert (responses[row, first + 1:] == tokenizer.pad_token_id).all()
        assert (rollout.behavior_logprobs[row, first + 1:] == 0).all()


def test_cuda_graph_engine_splits_large_batches_and_loads_weights_in_place(tiny_model, model_and_tokenizer):
    _, tokenizer = model_and_tokenizer
    model = load_causal_lm(tiny_model)
    engine = CudaGraphEngine(model, pad_id=tokenizer.pad_token_id, eos_id=tokenizer.eos_token_id, device="cpu",
                             max_batch_size=8)
    request = _request(tokenizer, prompts=5, samples=4)   # 20 rows: chunks of 8, 8 and 4 (padded to 8)
    before = engine.generate(request, policy_version=0)
    assert len(before) == 20
    torch.testing.assert_close(before.behavior_logprobs, _actor_logprobs(model, before, 1.0), atol=2e-5, rtol=0)

    pointers = {name: p.data_ptr() for name, p in model.named_parameters()}
    other = load_causal_lm(tiny_model)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.05 * torch.randn_like(p))
    engine.load_state_dict(other.state_dict())
    assert {name: p.data_ptr() for name, p in model.named_parameters()} == pointers, "weights must stay in place"
    for name, p in model.named_parameters():
        assert torch.equal(p, other.get_parameter(name))
    after = engine.generate(request, policy_version=1)
    torch.testing.assert_close(after.behavior_logprobs, _actor_logprobs(other, after, 1.0), atol=2e-5, rtol=0)

    with pytest.raises(KeyError, match="publish the full state"):
        engine.load_state_dict({"model.norm.weight": model.model.norm.weight.clone()})


def test_sampling_matches_the_distribution_and_filters():
    torch.manual_seed(0)
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).expand(20000, -1)
    tokens, logprobs = sample_tokens(logits, temperature=1.0)
    frequency = torch.bincount(tokens, minlength=4).float() / len(tokens)
    torch.testing.assert_close(frequency, torch.tensor([0.5, 0.3, 0.15, 0.05]), atol=0.015, rtol=0)
    torch.testing.assert_close(logprobs, torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))[tokens])

    # Temperature 0.5 squares the probabilities before renormalising: 0.25/0.34 etc.
    _, lp = sample_tokens(logits[:1], temperature=0.5)
    probs = torch.tensor([0.25, 0.09, 0.0225, 0.0025]) / 0.365
    assert math.isclose(float(lp.exp()), float(probs[_[0]]), rel_tol=1e-5)

    # The filters choose what can be sampled; the logprob stays the unfiltered one (what the
    # actor's loss evaluates). top_k=2 keeps 0.5 and 0.3, sampled as 0.625 and 0.375.
    tokens, logprobs = sample_tokens(logits, 1.0, top_k=2)
    frequency = torch.bincount(tokens, minlength=4).float() / len(tokens)
    torch.testing.assert_close(frequency, torch.tensor([0.625, 0.375, 0.0, 0.0]), atol=0.015, rtol=0)
    torch.testing.assert_close(logprobs.exp(), torch.tensor([0.5, 0.3])[tokens])
    # top_p=0.7: 0.5 alone holds less than 0.7, 0.5 + 0.3 reaches it: keep those two.
    tokens, logprobs = sample_tokens(logits, 1.0, top_p=0.7)
    assert set(tokens.tolist()) == {0, 1}
    torch.testing.assert_close(logprobs.exp(), torch.tensor([0.5, 0.3])[tokens])
    # top_p=0.4: the most likely token alone, with its unfiltered probability 0.5.
    tokens, logprobs = sample_tokens(logits[:100], 1.0, top_p=0.4)
    assert tokens.tolist() == [0] * 100 and torch.allclose(logprobs, torch.full((100,), math.log(0.5)))


def _logits_on_four_tokens(width: int, device: str = "cpu", dtype=torch.float32):
    """One row of logits whose mass lies on four tokens in different stretches of the
    vocabulary (0.4, 0.3, 0.2, 0.1), every other at -1e4 (mass 0) -> (row, their places,
    their probabilities)."""
    spots = torch.tensor([0, width // 3, width // 2 + 1, width - 1], device=device)
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1], device=device)
    row = torch.full((width,), -1e4, device=device, dtype=dtype)
    row[spots] = probs.log().to(dtype)
    return row, spots, probs


@pytest.mark.parametrize("width", [5, 29, 224, 203])   # fewer tokens than stretches; 32 of 7; 29 of 7, 3 of padding
def test_the_sampler_follows_the_distribution_across_stretches(width):
    """One uniform number a row picks a stretch of the vocabulary by their masses, then a
    token within it: the frequencies are the probabilities wherever the mass lies, filtered
    tokens never come out, and the logprob is log_softmax's."""
    torch.manual_seed(0)
    row, spots, probs = _logits_on_four_tokens(width)
    logits = row.expand(40000, -1)
    tokens, logprobs = sample_tokens(logits, temperature=1.0)
    frequency = torch.bincount(tokens, minlength=width).float() / len(tokens)
    torch.testing.assert_close(frequency[spots], probs, atol=0.01, rtol=0)
    assert frequency.sum() == 1 and set(tokens.unique().tolist()) <= set(spots.tolist())
    torch.testing.assert_close(logprobs, torch.log_softmax(logits[:1], -1)[0, tokens])
    # Temperature 2 flattens them: square roots, renormalised; top_k=2 keeps the two likeliest.
    tokens, _ = sample_tokens(logits, temperature=2.0, top_k=2)
    kept = probs[:2].sqrt() / probs[:2].sqrt().sum()
    frequency = torch.bincount(tokens, minlength=width).float() / len(tokens)
    torch.testing.assert_close(frequency[spots[:2]], kept, atol=0.01, rtol=0)
    assert frequency[spots[:2]].sum() == 1


def test_the_sampler_follows_a_smooth_distribution():
    """Mass spread over every token: the frequency of each stretch of the vocabulary and of
    the likeliest tokens within them match softmax's probabilities."""
    from pipeline.engines.sampling import VOCAB_STRETCHES
    torch.manual_seed(1)
    width, draws = 2016, 20000   # 32 stretches of 63
    logits = torch.randn(width) * 2
    tokens, _ = sample_tokens(logits.expand(draws, -1), temperature=1.0)
    probs = torch.softmax(logits, -1)
    frequency = torch.bincount(tokens, minlength=width).float() / draws
    per_stretch = lambda values: values.view(VOCAB_STRETCHES, -1).sum(-1)   # noqa: E731
    torch.testing.assert_close(per_stretch(frequency), per_stretch(probs), atol=0.012, rtol=0)
    likeliest = probs.topk(10).indices
    torch.testing.assert_close(frequency[likeliest], probs[likeliest], atol=0.006, rtol=0)


@pytest.mark.parametrize("device", [
    pytest.param("cpu", marks=pytest.mark.slow),   # an Inductor compile of its own: tens of seconds
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                    reason="needs an NVIDIA GPU")]),
])
def test_the_compiled_sampler_follows_the_distribution(device):
    """The sampler as the cuda_graph engine's decode step runs it, through torch.compile, over
    a Qwen2-sized vocabulary (32 stretches of 4748): the mass on four tokens far apart comes
    out in their proportions, with and without top-k, and nothing else comes out."""
    width, rows, draws = 151936, 1024, 64   # 65 536 samples: 0.01 is over 5 standard deviations
    torch.manual_seed(0)
    row, spots, probs = _logits_on_four_tokens(width, device, torch.bfloat16)
    logits = row.expand(rows, -1).contiguous()
    sample = torch.compile(sample_tokens)
    for top_k, expected in ((0, probs), (2, probs[:2] / probs[:2].sum())):
        tokens = torch.cat([sample(logits, 1.0, top_k)[0] for _ in range(draws)])
        frequency = (tokens[:, None] == spots[None, :]).float().mean(0)
        assert frequency.sum() == 1, "a token without mass came out"
        torch.testing.assert_close(frequency[:len(expected)], expected, atol=0.01, rtol=0)


def test_the_sampler_never_picks_a_token_without_mass():
    """Where the uniform lands on a running sum's rounding, the pick falls back to the last
    token with mass, never a filtered-out or padded one."""
    from pipeline.engines.sampling import _first_above
    masses = torch.tensor([[0.5, 0.0, 0.5, 0.0], [0.0, 1.0, 0.0, 0.0], [0.2, 0.3, 0.5, 0.0]])
    running = masses.cumsum(-1)
    targets = torch.tensor([0.7, 1.0, 0.1])     # inside the third; at the total (rounding); inside the first
    assert _first_above(running, targets, masses).tolist() == [2, 1, 0]


def test_buckets_bound_the_shapes():
    assert [bucket_batch(n) for n in (1, 8, 9, 64, 65, 256)] == [8, 8, 16, 64, 128, 256]
    assert [bucket_length(n, 64) for n in (1, 64, 65, 130)] == [64, 64, 128, 192]
