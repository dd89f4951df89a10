"""Checkpoints: the atomic on-disk format, and resuming a run on real workers."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from pipeline import checkpoint, weights
from pipeline.checkpoint import CheckpointError
from pipeline.rewards import digit_fraction
from pipeline.trainer import HybridTrainer
from resources import load_resource_config
from tests.conftest import role_cluster

SMALL = dict(prompts_per_step=8, max_new_tokens=8, actor_lr=1e-3, critic_lr=1e-3, micro_batch_size=8,
             show_progress=False, log_samples=0)


def _save(root, step: int, payload: bytes = b"weights") -> None:
    staging = checkpoint.staging_dir(root, step)
    (staging / "actor.pt").write_bytes(payload)
    checkpoint.commit(staging, {"step": step, "policy_version": step})


def test_a_checkpoint_is_renamed_into_place_only_when_complete(tmp_path):
    _save(tmp_path, 2)
    # A save that crashed before its commit leaves only a hidden staging directory...
    (checkpoint.staging_dir(tmp_path, 4) / "actor.pt").write_bytes(b"half")
    path, state = checkpoint.find(tmp_path)
    assert path.name == "step-000002" and state == {"step": 2, "policy_version": 2}
    # ...which the next save removes.
    _save(tmp_path, 4)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000002", "step-000004"]
    manifest = json.loads((tmp_path / "step-000004" / "manifest.json").read_text())
    assert set(manifest) == {"actor.pt", "rng.pt", "trainer.json"}
    assert manifest["actor.pt"]["bytes"] == len(b"weights")


@pytest.mark.parametrize("damage", ["truncate", "flip", "remove_manifest", "remove_file"])
def test_a_damaged_checkpoint_is_refused_and_the_previous_one_used(tmp_path, damage, caplog):
    _save(tmp_path, 1, b"first")
    _save(tmp_path, 2, b"second-state")
    newest = tmp_path / "step-000002"
    if damage == "truncate":
        (newest / "actor.pt").write_bytes(b"second")
    elif damage == "flip":
        (newest / "actor.pt").write_bytes(b"SECOND-state")
    elif damage == "remove_manifest":
        (newest / "manifest.json").unlink()
    else:
        (newest / "actor.pt").unlink()
    reason = {"truncate": "truncated", "flip": "checksum", "remove_manifest": "did not finish",
              "remove_file": "missing"}[damage]
    with pytest.raises(CheckpointError, match=reason):  # named directly: refused, with the reason
        checkpoint.find(newest)
    path, state = checkpoint.find(tmp_path)             # a directory of them: the newest valid one
    assert path.name == "step-000001" and state["step"] == 1
    assert reason in caplog.text


def test_no_valid_checkpoint_is_an_error_naming_the_refused_ones(tmp_path):
    _save(tmp_path, 3)
    (tmp_path / "step-000003" / "trainer.json").write_text("{}")
    with pytest.raises(CheckpointError, match=r"no usable checkpoint .*step-000003 refused"):
        checkpoint.find(tmp_path)


def test_keep_last_prunes_the_oldest(tmp_path):
    for step in (1, 2, 3):
        _save(tmp_path, step)
    checkpoint.prune(tmp_path, keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000002", "step-000003"]


def _figures(record):
    return (record.step, record.policy_version, record.reward_mean, record.kl_mean, record.tokens, record.losses)


def test_a_resumed_run_repeats_the_uninterrupted_run_step_for_step(shared_cluster, shared_config, tiny_model,
                                                                   prompts, tmp_path):
    """On-policy PPO with a critic and a reference: the run resumed from the checkpoint after
    step 2 gives the same figures at steps 3 and 4 as the run that went on, its learning-rate
    schedule (2 warmup updates, then linear decay over the other 2) included."""
    schedule = dict(lr_warmup_steps=2, lr_schedule="linear", weight_decay=0.01)
    common = dict(algorithm="ppo", prompts=prompts, cluster=shared_cluster, **schedule, **SMALL)
    with HybridTrainer(tiny_model, digit_fraction, shared_config, output_dir=str(tmp_path / "a"), steps=4,
                       checkpoint={"every_n_steps": 2, "keep_last": 3}, **common) as uninterrupted:
        straight = uninterrupted.train()
    assert sorted(p.name for p in (tmp_path / "a" / "checkpoints").iterdir()) == ["step-000002", "step-000004"]
    with HybridTrainer(tiny_model, digit_fraction, shared_config, output_dir=str(tmp_path / "b"), steps=4,
                       resume=str(tmp_path / "a" / "checkpoints" / "step-000002"), **common) as resumed:
        assert (resumed.version, resumed.first_step) == (2, 2)
        again = resumed.train()
    assert [_figures(r) for r in again] == [_figures(r) for r in straight[2:]]
    # factors: warmup (0 + 1) / 2, (1 + 1) / 2; then 1 - p for p = 0 / 2, 1 / 2
    vocab = json.loads((Path(tiny_model) / "config.json").read_text())["vocab_size"]
    assert all(0 < r.losses["entropy"] < math.log(vocab) for r in straight)  # nats, below a uniform draw
    for role in ("actor_lr", "critic_lr"):
        assert [r.losses[role] for r in straight] == pytest.approx([5e-4, 1e-3, 1e-3, 5e-4], rel=1e-12)


@pytest.mark.slow  # a long end-to-end drill: CI runs it in the slow suite
def test_resume_after_a_resize_starts_from_the_saved_weights(shared_cluster, shared_config, tiny_model, prompts,
                                                             tmp_path):
    """Saved with 2 actor and 2 rollout workers, resumed with 1 of each."""
    common = dict(algorithm="grpo", prompts=prompts, samples_per_prompt=2, kl_coef=0.0, **SMALL)
    with HybridTrainer(tiny_model, digit_fraction, shared_config, cluster=shared_cluster,
                       output_dir=str(tmp_path), steps=2, checkpoint={"every_n_steps": 2}, **common) as first:
        first.train()
    saved = torch.load(tmp_path / "checkpoints" / "step-000002" / "actor.pt", weights_only=False)
    small = load_resource_config({"actor": {"device_type": "cpu", "workers": 1},
                                  "reward": {"device_type": "cpu", "workers": 1},
                                  "rollout": {"device_type": "cpu", "workers": 1}, "timeout_seconds": 120})
    with role_cluster(small) as cluster:
        with HybridTrainer(tiny_model, digit_fraction, small, cluster=cluster, output_dir=str(tmp_path),
                           steps=3, resume=True, **common) as resumed:
            restored = weights.load_snapshot(resumed.weights)  # what the rollout worker samples from
            assert resumed.version == 2
            for name, tensor in saved["model"].items():
                assert torch.equal(restored[name], tensor), name
            (record,) = resumed.train()
    assert (record.step, record.policy_version, record.staleness) == (2, 3, 0.0)
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [0, 1, 2]
