"""An update is applied exactly once, never with non-finite gradients, and a group that lost
a rank rebuilds from its last good state (tied embeddings included). Real tiny models, the
real actor and critic roles, in this process."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from pipeline import weights
from pipeline.records import Experience, Rollout
from pipeline.roles.actor import ActorRole, PolicyStep
from pipeline.roles.critic import CriticRole, CriticStep
from pipeline.roles.saved_state import Recovery
from pipeline.roles.training import GroupInfo

PROMPT, RESPONSE = 3, 4


def _group(generation: int = 0, **kwargs) -> GroupInfo:
    return GroupInfo(rank=0, world_size=1, init_method="", backend="gloo", generation=generation,
                     timeout_seconds=60, **kwargs)


def _experience(advantage: float = 1.0) -> Experience:
    input_ids = torch.randint(2, 30, (4, PROMPT + RESPONSE), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(4, RESPONSE)
    rollout = Rollout(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), response_mask=mask,
                      behavior_logprobs=torch.full((4, RESPONSE), -4.0), group_ids=torch.arange(4),
                      policy_version=0, prompt_length=PROMPT)
    return Experience(input_ids=rollout.input_ids, attention_mask=rollout.attention_mask, response_mask=mask,
                      behavior_logprobs=rollout.behavior_logprobs, ref_logprobs=rollout.behavior_logprobs,
                      advantages=mask * advantage, returns=mask, old_values=torch.zeros_like(mask),
                      prompt_length=PROMPT)


def _policy_step(version: int, snapshot_dir, recovery_path: str | None = None) -> PolicyStep:
    return PolicyStep(clip_ratio=0.2, kl_coef_in_loss=0.0, temperature=1.0, micro_batch_size=4, epochs=1,
                      is_cap=2.0, normalizers=(16.0,), next_version=version, snapshot_dir=str(snapshot_dir),
                      recovery_path=recovery_path)


def _params(role) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in role.trainer.model.state_dict().items()}


def test_a_redo_of_an_applied_update_returns_its_result_and_trains_nothing(tiny_model, tmp_path):
    role = ActorRole(tiny_model, device="cpu", lr=1e-2, strategy="none")
    first_stats, first_handle = role.update([_experience()], _group(), _policy_step(1, tmp_path))
    after_first = _params(role)

    again_stats, again_handle = role.update([_experience()], _group(), _policy_step(1, tmp_path))

    assert (again_stats, again_handle) == (first_stats, first_handle)   # the first result, not a new one
    assert all(torch.equal(after_first[n], t) for n, t in _params(role).items())
    assert sorted(p.name for p in tmp_path.glob("policy-v*")) == ["policy-v000001.safetensors"]
    # The next version is a new update.
    _, handle = role.update([_experience()], _group(), _policy_step(2, tmp_path))
    assert handle.version == 2


def test_a_non_finite_gradient_is_refused_and_nothing_is_published(tiny_model, tmp_path):
    role = ActorRole(tiny_model, device="cpu", lr=1e-2, strategy="none")
    before = _params(role)

    stats, handle = role.update([_experience(advantage=math.nan)], _group(), _policy_step(1, tmp_path))

    assert handle is None and stats["refused_steps"] == 1.0 and stats["grad_norm"] == 0.0
    assert all(torch.equal(before[n], t) for n, t in _params(role).items())
    assert role.trainer.version == 0 and not list(tmp_path.glob("policy-v*"))
    # The same version with good data is then applied (the refusal did not count as one).
    stats, handle = role.update([_experience()], _group(), _policy_step(1, tmp_path))
    assert handle.version == 1 and "refused_steps" not in stats


def test_a_lost_rank_rebuilds_from_the_published_weights_with_the_tie_intact(tiny_model, tmp_path):
    trained = ActorRole(tiny_model, device="cpu", lr=1e-2, strategy="none")
    _, handle = trained.update([_experience()], _group(), _policy_step(1, tmp_path))
    published = weights.load_tied_file(handle.path)
    assert published["lm_head.weight"] is published["model.embed_tokens.weight"]   # stored once, tied on load

    fresh = ActorRole(tiny_model, device="cpu", lr=1e-2, strategy="none")   # a replacement worker
    fresh.trainer.join(_group(1, recovery=Recovery(str(tmp_path / "actor-recovery.pt"), handle.path, 1)))

    model = fresh.trainer.model
    assert model.lm_head.weight is model.get_input_embeddings().weight   # still one tensor
    for name, tensor in trained.trainer.model.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name
    assert fresh.trainer.version == 1
    _, handle2 = fresh.update([_experience()], _group(1), _policy_step(2, tmp_path))
    assert handle2.version == 2


def test_the_recovery_state_brings_back_weights_optimizer_and_the_applied_result(tiny_model, tmp_path):
    recovery = str(tmp_path / "critic-recovery.pt")
    step = CriticStep(clip_range=0.2, micro_batch_size=4, epochs=1, normalizers=(16.0,), next_version=1,
                      recovery_path=recovery)
    trained = CriticRole(tiny_model, device="cpu", lr=1e-2, strategy="none")
    result = trained.update([_experience()], _group(), step)

    replacement = CriticRole(tiny_model, device="cpu", lr=1e-2, strategy="none")
    replacement.trainer.join(_group(1, recovery=Recovery(recovery)))

    for name, tensor in trained.trainer.model.state_dict().items():
        assert torch.equal(replacement.trainer.model.state_dict()[name], tensor), name
    moments = [s["exp_avg"] for s in replacement.trainer.optimizer.state.values()]
    expected = [s["exp_avg"] for s in trained.trainer.optimizer.state.values()]
    assert len(moments) == len(expected) > 0 and all(torch.equal(a, b) for a, b in zip(moments, expected))
    assert replacement.update([_experience()], _group(1), step) == result   # applied already: no second time
    # A worker process restarted mid-run (same recovery path) serves the trained values at once.
    restarted = CriticRole(tiny_model, device="cpu", lr=1e-2, strategy="none", recovery_path=recovery)
    assert restarted.trainer.version == 1


def test_a_recovery_state_older_than_the_published_weights_gives_way_to_them(tiny_model, tmp_path):
    recovery = str(tmp_path / "actor-recovery.pt")
    trained = ActorRole(tiny_model, device="cpu", lr=1e-2, strategy="none")
    trained.update([_experience()], _group(), _policy_step(1, tmp_path, recovery_path=recovery))
    _, newer = trained.update([_experience()], _group(), _policy_step(2, tmp_path))   # no recovery save

    fresh = ActorRole(tiny_model, device="cpu", lr=1e-2, strategy="none")
    fresh.trainer.join(_group(1, recovery=Recovery(recovery, newer.path, 2)))

    assert fresh.trainer.version == 2
    for name, tensor in trained.trainer.model.state_dict().items():
        assert torch.equal(fresh.trainer.model.state_dict()[name], tensor), name


@pytest.mark.parametrize("value", [math.inf, -math.inf])
def test_an_infinite_advantage_is_refused_too(tiny_model, tmp_path, value):
    role = CriticRole(tiny_model, device="cpu", lr=1e-2, strategy="none")
    experience = _experience()
    experience = dataclasses.replace(experience, returns=experience.returns * value)
    before = _params(role)
    stats = role.update([experience], _group(), CriticStep(clip_range=0.2, micro_batch_size=4, epochs=1,
                                                          normalizers=(16.0,), next_version=1))
    assert stats["refused_steps"] == 1.0
    assert all(torch.equal(before[n], t) for n, t in _params(role).items())
