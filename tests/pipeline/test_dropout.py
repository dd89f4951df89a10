"""Dropout stays off in every forward of the actor, the critic and the reference.

The proximal log-probs and the critic's old values are computed in eval mode; if the
training forward ran with dropout, a model with dropout would see ratios != 1 (and values
!= old values) on the very first, fully on-policy step. A tiny GPT-2 with dropout 0.5
everywhere makes any such difference large.
"""

from __future__ import annotations

import pytest
import torch

from pipeline.models import load_causal_lm
from pipeline.records import Experience, Rollout
from pipeline.roles.actor import ActorRole, PolicyStep
from pipeline.roles.critic import CriticRole, CriticStep
from pipeline.roles.forward import response_logprobs
from pipeline.roles.reference import ReferenceRole
from pipeline.roles.training import GroupInfo

ONE_RANK = GroupInfo(rank=0, world_size=1, init_method="", backend="gloo", generation=0, timeout_seconds=60)
PROMPT, RESPONSE = 3, 4


@pytest.fixture(scope="module")
def dropout_model(tmp_path_factory) -> str:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=16, n_positions=16, n_embd=16, n_layer=2, n_head=2,
                        resid_pdrop=0.5, embd_pdrop=0.5, attn_pdrop=0.5)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("gpt2-dropout")
    GPT2LMHeadModel(config).save_pretrained(path)
    return str(path)


def _rollout() -> Rollout:
    """4 rows: row 1 has a left-padded prompt, row 3 a 2-token response."""
    input_ids = torch.randint(2, 16, (4, PROMPT + RESPONSE), generator=torch.Generator().manual_seed(1))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 0] = 0
    input_ids[1, 0] = 0
    response_mask = torch.ones(4, RESPONSE)
    response_mask[3, 2:] = 0
    attention_mask[3, PROMPT + 2:] = 0
    return Rollout(input_ids=input_ids, attention_mask=attention_mask, response_mask=response_mask,
                   behavior_logprobs=torch.zeros(4, RESPONSE), group_ids=torch.arange(4), policy_version=0,
                   prompt_length=PROMPT)


def _experience(rollout: Rollout, **fields) -> Experience:
    zeros = torch.zeros_like(rollout.response_mask)
    base = dict(input_ids=rollout.input_ids, attention_mask=rollout.attention_mask,
                response_mask=rollout.response_mask, behavior_logprobs=rollout.behavior_logprobs,
                ref_logprobs=rollout.behavior_logprobs, advantages=zeros, returns=zeros, old_values=zeros,
                prompt_length=rollout.prompt_length)
    return Experience(**{**base, **fields})


def test_first_on_policy_actor_step_has_ratio_and_importance_weight_one(dropout_model, tmp_path):
    role = ActorRole(dropout_model, device="cpu", lr=1e-3, strategy="none")
    rollout = _rollout()
    mask = rollout.response_mask
    # On-policy: the behaviour log-probs are the current policy's (what a rollout worker
    # holding these weights reports), computed as one micro-batch like the proximal ones.
    with torch.no_grad():
        behavior = response_logprobs(role.trainer.model.eval(), rollout.input_ids, rollout.attention_mask,
                                     PROMPT, 1.0)
    tokens = float(mask.sum())  # 14
    experience = _experience(rollout, behavior_logprobs=behavior, ref_logprobs=behavior, advantages=mask.clone())
    step = PolicyStep(clip_ratio=0.2, kl_coef_in_loss=0.0, temperature=1.0, micro_batch_size=4, epochs=1,
                      is_cap=2.0, normalizers=(tokens,), next_version=1, snapshot_dir=str(tmp_path))

    stats, handle = role.update([experience], ONE_RANK, step)

    assert tokens == 14.0 and stats["tokens"] == 14.0
    assert stats["is_weight_sum"] == 14.0   # w = exp(proximal - behaviour) = 1 on every token
    assert stats["clip_tokens"] == 0.0
    # loss = -sum(A * ratio * w) / N with A = 1, ratio = 1, w = 1: exactly -1.
    assert stats["policy_loss"] == -1.0
    assert handle is not None and handle.version == 1


def test_first_critic_step_sees_the_values_it_estimated(dropout_model):
    role = CriticRole(dropout_model, device="cpu", lr=1e-3, strategy="none")
    with torch.no_grad():  # a trained head: the zero-initialised one outputs 0 whatever dropout does
        role.trainer.model.head.weight.normal_(generator=torch.Generator().manual_seed(2))
    rollout = _rollout()
    old_values = role.values(rollout, micro_batch_size=4)
    assert old_values.abs().sum() > 0
    # Returns one above the old values: with values == old values, (v - R)^2 = 1 per token.
    experience = _experience(rollout, old_values=old_values, returns=old_values + rollout.response_mask)
    step = CriticStep(clip_range=0.2, micro_batch_size=4, epochs=1, normalizers=(14.0,), next_version=1)

    stats = role.update([experience], ONE_RANK, step)

    assert stats["value_loss"] == 0.5         # 0.5 * 14 * 1 / 14
    assert stats["value_clip_tokens"] == 0.0


def test_reference_logprobs_are_the_eval_mode_ones(dropout_model):
    role = ReferenceRole(dropout_model, device="cpu", micro_batch_size=4)
    rollout = _rollout()
    with torch.no_grad():
        expected = response_logprobs(load_causal_lm(dropout_model).eval(), rollout.input_ids,
                                     rollout.attention_mask, PROMPT, 1.0) * rollout.response_mask
    first = role.logprobs(rollout, 1.0)
    # The role packs its rows, the expected values are padded: the same sums in another order
    # (transformers 5.25: one float32 ulp apart). Dropout 0.5 would move them by whole units.
    torch.testing.assert_close(first, expected, rtol=0, atol=1e-6)
    assert torch.equal(role.logprobs(rollout, 1.0), first)   # no dropout noise from call to call
