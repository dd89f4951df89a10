"""Packed forwards and token-budget micro-batches: first-fit-decreasing by hand, the packed
layout and the transformers mask it relies on, packed == padded (actor logprobs, entropy,
gradients of the actor loss, critic values, reference logprobs), the planned compute on
long-tailed lengths, the token budget's maths, and `micro_batch_size: auto`."""

from __future__ import annotations

import types

import pytest
import torch

from benchmarks.shapes import geometric_lengths, padded_rows, share_prompts
from pipeline.config import TrainConfig, TrainConfigError, make_train_config
from pipeline.models import ValueModel, load_causal_lm
from pipeline.packing import (
    SHARED_PROMPTS, computed_tokens, first_fit_decreasing, micro_batch_count, pack_capacity, pack_rows, plan_packing, response_slots, token_chunks,
)
from pipeline.records import Experience
from pipeline.roles.actor import ActorRole, PolicyStep
from pipeline.roles.forward import (
    in_row_chunks, response_logprobs, response_logprobs_and_entropy, response_values,
)
from pipeline.roles.training import Trainable
from resources.allocator import AUTO_MAX_TOKENS, AUTO_ROWS, MicroBatchAllocator, token_budget


# -- plans, by hand ---------------------------------------------------------------------------
def test_first_fit_decreasing_by_hand():
    # Longest first: 8 -> bin 0 (room 2), 5 -> bin 1 (room 5), 4 -> bin 1 (room 1), 3 -> bin 2,
    # 2 -> bin 0 (the first with room).
    assert first_fit_decreasing([5, 3, 8, 2, 4], 10) == [[2, 3], [0, 4], [1]]
    assert first_fit_decreasing([3, 3, 3], 6) == [[0, 1], [2]]   # ties: the lower index first
    assert first_fit_decreasing([6, 6], 6) == [[0], [1]]
    with pytest.raises(ValueError, match="does not fit"):
        first_fit_decreasing([7], 6)


def test_capacity_and_width():
    assert pack_capacity(1000) == 1008           # the longest, rounded up to 16
    assert pack_capacity(1008) == 1008
    plan = plan_packing([10, 20, 25])              # capacity 32: 25 alone, then 20 + 10
    assert plan.bins == ((2,), (1, 0)) and plan.width == 32 and plan.computed_tokens == 64
    assert plan.real_tokens == 55
    assert plan_packing([100, 100, 100], capacity=120).width == 112   # the fullest row, rounded up to 16
    assert plan_packing([100, 100, 100], capacity=104).width == 104   # never wider than the capacity


def test_pack_rows_layout_and_the_mask_transformers_reads_from_it():
    from transformers.masking_utils import find_packed_sequence_indices

    ids = torch.tensor([[0, 0, 5, 6, 7, 8], [0, 9, 10, 11, 0, 0]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [0, 1, 1, 1, 0, 0]])
    packed = pack_rows(ids, mask, capacity=8)
    assert packed.input_ids.tolist() == [[5, 6, 7, 8, 9, 10, 11, 0]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2, 0]]   # the filler is a sequence of its own
    assert packed.starts.tolist() == [0, 4]
    # Sequence boundaries from the positions alone: the model's mask keeps them apart.
    assert find_packed_sequence_indices(packed.position_ids).tolist() == [[0, 0, 0, 0, 1, 1, 1, 2]]
    # Long filler restarts below the longest sequence's length (4 here): 0 1 2 3, then 0 1 ...
    wide = pack_rows(ids, mask, capacity=13)
    assert wide.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2, 0, 1, 2, 3, 0, 1]]
    # Prompt width 3: row 0 has 1 prompt token and responses 6, 7, 8 (predicted at packed
    # 0, 1, 2); row 1 has 2 prompt tokens and response 11 (predicted by 10, packed 5).
    predictors, outputs = response_slots(packed, mask, prompt_length=3)
    assert predictors.tolist() == [0, 1, 2, 5] and outputs.tolist() == [0, 1, 2, 3]


def test_token_budget_packing_computes_at_most_a_tenth_more_than_the_real_tokens():
    prompt, cap = 128, 1024
    lengths = [prompt + n for n in geometric_lengths(256, 215.0, cap)]
    budget = AUTO_ROWS * (prompt + cap)          # the first budget: 16 padded rows' worth
    parts = token_chunks(lengths, micro_batch_count(lengths, budget))
    plans = [plan_packing(lengths[part]) for part in parts]
    real = sum(plan.real_tokens for plan in plans)
    computed = sum(plan.computed_tokens for plan in plans)
    padded = len(lengths) * (prompt + cap)
    print(f"real {real}, packed {computed} ({computed / real:.3f}x), padded {padded} ({padded / real:.2f}x), "
          f"{len(parts)} micro-batches")
    assert real == sum(lengths) and all(sum(lengths[p]) <= budget for p in parts)
    assert computed / real <= 1.1


# -- micro-batches by tokens -----------------------------------------------------------------
def test_micro_batch_count_and_token_chunks_by_hand():
    assert micro_batch_count([5, 5, 5, 5], 10) == 2
    assert micro_batch_count([12, 1], 10) == 2          # a row longer than the budget runs alone
    assert token_chunks([5, 5, 5, 5], 2) == [slice(0, 2), slice(2, 4)]
    assert token_chunks([9, 1, 1, 1], 2) == [slice(0, 1), slice(1, 4)]   # the largest sum as small as can be
    assert token_chunks([1] * 6, 3) == [slice(0, 2), slice(2, 4), slice(4, 6)]
    # A rank needing fewer micro-batches than the group runs spreads its rows over them.
    assert token_chunks([4, 4], 1) == [slice(0, 2)]
    assert token_chunks([4, 4, 4, 4], 3) == [slice(0, 1), slice(1, 2), slice(2, 4)]
    assert token_chunks([3, 3], 4) == [slice(0, 1), slice(1, 2), slice(2, 2), slice(2, 2)]


def test_token_budget_maths():
    assert token_budget(10**9, 2e5, 0.8) == 4000                # 0.8 x 1e9 / 2e5
    assert token_budget(1000, 1e6, 0.8) == 1                    # never below one token
    allocator = MicroBatchAllocator(headroom=0.5)
    assert allocator.tokens(18432, 10**9) == 18432              # no measurement yet: the first budget
    allocator.observe(peak_bytes=5 * 10**8, tokens=10_000)      # 50 kB a token
    assert allocator.tokens(18432, 10**9) == 10_000             # 0.5 x 1e9 / 5e4: grows past the first
    assert allocator.tokens(18432, None) == 18432               # no reading (CPU)
    assert allocator.tokens(18432, 10**12) == AUTO_MAX_TOKENS   # 0.5 x 1e12 / 5e4 = 1e7: capped
    assert allocator.tokens(10**6, None) == AUTO_MAX_TOKENS
    allocator.max_tokens = 8192                                 # a lower cap (benchmarks sweep it)
    assert allocator.tokens(18432, 10**12) == 8192 and allocator.tokens(4096, None) == 4096


# -- packed == padded on a real model ---------------------------------------------------------
PROMPT, RESPONSE = 6, 9


def _rows(vocab: int, prompt_lengths=(6, 3, 1, 4, 5), response_lengths=(9, 2, 5, 0, 7), seed: int = 0):
    """Left-padded prompts and right-padded responses of the given real lengths."""
    return padded_rows(list(prompt_lengths), list(response_lengths), vocab, prompt_width=PROMPT,
                       response_width=RESPONSE, seed=seed)


def _experience(vocab: int, samples: int = 1, **lengths) -> Experience:
    """Rows of _rows, every `samples` consecutive ones sharing a prompt."""
    ids, mask = share_prompts(*_rows(vocab, **lengths), PROMPT, samples)
    response = mask[:, PROMPT:].float()
    generator = torch.Generator().manual_seed(1)
    noise = lambda: torch.randn(response.shape, generator=generator) * response  # noqa: E731
    return Experience(input_ids=ids, attention_mask=mask, response_mask=response,
                      behavior_logprobs=noise() * 0.1 - 2.0, ref_logprobs=noise() * 0.1 - 2.0, advantages=noise(),
                      returns=noise(), old_values=noise(), prompt_length=PROMPT)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_packed_logprobs_and_entropy_equal_padded(policy, attention):
    policy.set_attn_implementation(attention)   # both read the packed sequences from the positions
    ids, mask = _rows(policy.config.vocab_size)
    response = mask[:, PROMPT:].bool()
    padded = response_logprobs_and_entropy(policy, ids, mask, PROMPT, 0.7, entropy_grad=True)
    packed = response_logprobs_and_entropy(policy, ids, mask, PROMPT, 0.7, entropy_grad=True, pack=True)
    for name, want, got in zip(("logprobs", "entropy"), padded, packed):
        torch.testing.assert_close(got[response], want[response], rtol=0, atol=1e-5, msg=name)
        assert (got[~response] == 0).all(), name


def test_actor_loss_gradients_equal_padded(policy):
    """Packed rows, and a shared prompt computed once (train.share_prompts; pairs of rows
    share one here), give the padded rows' gradients."""
    experience = _experience(policy.config.vocab_size, samples=2)
    grads = {}
    for pack in (False, True, SHARED_PROMPTS):
        step = PolicyStep(clip_ratio=0.2, kl_coef_in_loss=0.05, temperature=0.7, micro_batch_size=16, epochs=1,
                          is_cap=2.0, normalizers=(float(experience.response_mask.sum()),), next_version=1,
                          snapshot_dir="", entropy_coef=0.01)
        policy.zero_grad()
        role = types.SimpleNamespace(device="cpu")
        loss, _ = ActorRole._loss(role, policy, (experience, None), step, step.normalizers[0], None, pack)
        loss.backward()
        grads[pack] = {name: p.grad.clone() for name, p in policy.named_parameters()}
    for pack in (True, SHARED_PROMPTS):
        for name, grad in grads[False].items():
            torch.testing.assert_close(grads[pack][name], grad, rtol=1e-4, atol=1e-5, msg=f"{pack}: {name}")


def test_packed_critic_values_equal_padded(tiny_model):
    critic = ValueModel(tiny_model).eval()
    torch.nn.init.normal_(critic.head.weight)    # the initial head is zero: every value would be 0
    ids, mask = _rows(critic.body.config.vocab_size)
    response = mask[:, PROMPT:].bool()
    padded = response_values(critic, ids, mask, PROMPT)
    packed = response_values(critic, ids, mask, PROMPT, pack=True)
    torch.testing.assert_close(packed[response], padded[response], rtol=0, atol=1e-5)
    assert (packed[~response] == 0).all()


def test_packed_reference_logprobs_in_row_chunks_equal_padded(tiny_model):
    model = load_causal_lm(tiny_model).eval()
    ids, mask = _rows(model.config.vocab_size)
    batch = _Batch(ids, mask)
    response = mask[:, PROMPT:].bool()
    padded = in_row_chunks(response_logprobs, model, batch, 2, "cpu", 1.0, what="reference logprobs")
    packed = in_row_chunks(response_logprobs, model, batch, "auto", "cpu", 1.0, what="reference logprobs",
                           pack=True)
    torch.testing.assert_close(packed[response], padded[response], rtol=0, atol=1e-5)


class _Batch:
    """What in_row_chunks reads of a rollout."""

    def __init__(self, ids, mask):
        self.input_ids, self.attention_mask, self.prompt_length = ids, mask, PROMPT

    def __len__(self):
        return self.input_ids.shape[0]


# -- micro_batch_size: auto -------------------------------------------------------------------
def _trainable(tiny_model) -> Trainable:
    return Trainable(lambda: load_causal_lm(tiny_model), lr=1e-3, strategy="none", device="cpu")


def _step_gradients(trainable: Trainable, experience: Experience, max_rows) -> tuple[dict, list[int]]:
    """The summed gradient of one optimizer step (recorded instead of applied) and the rows of
    each micro-batch it ran."""
    step = PolicyStep(clip_ratio=0.2, kl_coef_in_loss=0.0, temperature=1.0, micro_batch_size=max_rows, epochs=1,
                      is_cap=2.0, normalizers=(float(experience.response_mask.sum()),), next_version=1,
                      snapshot_dir="", pack_sequences=True)
    seen, grads = [], {}
    role = types.SimpleNamespace(device="cpu")

    def loss(model, chunk):
        seen.append(len(chunk[0]))
        return ActorRole._loss(role, model, chunk, step, step.normalizers[0], None, True)

    trainable.optimizer.step = lambda: grads.update(
        {name: p.grad.clone() for name, p in trainable.model.named_parameters()})
    trainable.optimizer_step(lambda rows: (experience.select(rows), None), len(experience), loss,
                             max_rows=max_rows, tokens_per_row=experience.input_ids.shape[1],
                             row_tokens=computed_tokens(experience, True))
    return grads, seen


def _long_experience(vocab: int, rows: int = 40) -> Experience:
    generator = torch.Generator().manual_seed(3)
    prompts = torch.randint(1, PROMPT + 1, (rows,), generator=generator).tolist()
    responses = torch.randint(1, RESPONSE + 1, (rows,), generator=generator).tolist()
    return _experience(vocab, prompt_lengths=prompts, response_lengths=responses)


def test_auto_on_a_cpu_runs_16_rows(tiny_model):
    trainable = _trainable(tiny_model)
    experience = _long_experience(trainable.model.config.vocab_size)
    _, seen = _step_gradients(trainable, experience, "auto")
    assert trainable.micro_batch_rows == AUTO_ROWS and trainable.micro_batch_tokens is None
    assert seen == [14, 13, 13]      # 40 rows in ceil(40 / 16) near-equal micro-batches


def test_the_gradient_does_not_depend_on_the_token_budget(tiny_model, monkeypatch):
    """A GPU's reading, simulated: the budget is headroom x free / bytes per token."""
    trainable = _trainable(tiny_model)
    experience = _long_experience(trainable.model.config.vocab_size)
    whole, seen = _step_gradients(trainable, experience, 40)
    assert seen == [40]
    monkeypatch.setattr(trainable, "_free_bytes", lambda: 1000)
    trainable.allocator = MicroBatchAllocator(headroom=0.5, bytes_per_token=1.0)   # a budget of 500 tokens
    for free, expected_count in ((1000, 1), (100, None), (30, None)):
        monkeypatch.setattr(trainable, "_free_bytes", lambda free=free: free)
        grads, seen = _step_gradients(trainable, experience, "auto")
        budget = free // 2
        assert trainable.micro_batch_tokens == budget and sum(seen) == 40
        counts = computed_tokens(experience, True)
        assert len(seen) == micro_batch_count(counts, budget) and len(seen) == (expected_count or len(seen))
        for name, grad in whole.items():
            torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-6, msg=f"{free}: {name}")


# -- config ---------------------------------------------------------------------------------
def test_micro_batch_size_config():
    assert TrainConfig().micro_batch_size == "auto" and TrainConfig().pack_sequences is True
    assert make_train_config({"micro_batch_size": 8}).micro_batch_size == 8
    assert make_train_config({"micro_batch_size": "auto", "pack_sequences": False}).pack_sequences is False
    for bad in (0, -3, "big", 2.5, True, None, 2**40):
        with pytest.raises(TrainConfigError) as error:
            make_train_config({"micro_batch_size": bad})
        assert f"train.micro_batch_size: {bad!r} is not allowed" in str(error.value)
        assert "Fix: use a positive number of rows or auto" in str(error.value)
    with pytest.raises(TrainConfigError, match="pack_sequences"):
        make_train_config({"pack_sequences": "yes"})
