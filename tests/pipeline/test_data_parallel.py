"""An update on two actor workers (one gloo group, ddp or fsdp) equals the update on one."""

from __future__ import annotations

import functools

import pytest
import torch

from pipeline import weights
from pipeline.engines.hf import HFEngine
from pipeline.models import load_causal_lm, load_tokenizer
from pipeline.records import Experience, GenerationRequest, rank_shards
from pipeline.roles import actor
from pipeline.roles.host import RoleHost, plugin_name
from pipeline.roles.training import GroupInfo
from pipeline.fleet.tasks import submit
from pipeline.fleet.groups import free_port
from resources.cluster import live_workers


def _experience(model_dir: str) -> Experience:
    """Eight real samples from the tiny model with fixed pseudo-random advantages."""
    tokenizer = load_tokenizer(model_dir)
    engine = HFEngine(load_causal_lm(model_dir), pad_id=tokenizer.pad_token_id, eos_id=tokenizer.eos_token_id,
                      device="cpu")
    prompts = [tokenizer(f"what is {i} plus 1? ")["input_ids"] for i in range(4)]
    rollout = engine.generate(GenerationRequest(prompts, [0, 1, 2, 3], 2, 6, 1.0, seed=7), policy_version=0)
    generator = torch.Generator().manual_seed(0)
    mask = rollout.response_mask
    return Experience(
        input_ids=rollout.input_ids, attention_mask=rollout.attention_mask, response_mask=mask,
        behavior_logprobs=rollout.behavior_logprobs, ref_logprobs=rollout.behavior_logprobs.clone(),
        advantages=torch.randn(mask.shape, generator=generator) * mask, returns=torch.zeros_like(mask),
        old_values=torch.zeros_like(mask),
        prompt_length=rollout.prompt_length)


def _step(experience: Experience, mini_batches: int, snapshot_dir: str) -> actor.PolicyStep:
    blocks = torch.arange(len(experience)).tensor_split(mini_batches)
    return actor.PolicyStep(clip_ratio=0.2, kl_coef_in_loss=0.1, temperature=1.0, micro_batch_size=2, epochs=2,
                            is_cap=2.0, normalizers=tuple(float(experience.response_mask[b].sum()) for b in blocks),
                            next_version=1, snapshot_dir=snapshot_dir)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_rank_update_matches_one_rank(strategy, shared_cluster, tiny_model, tmp_path):
    experience, mini_batches = _experience(tiny_model), 2

    # One rank, in this process: the reference result.
    single = actor.ActorRole(tiny_model, device="cpu", lr=1e-2, strategy="none")
    one_rank = GroupInfo(rank=0, world_size=1, init_method="", backend="gloo", generation=0, timeout_seconds=60)
    rows = rank_shards(len(experience), 1, mini_batches)[0]
    stats_one, handle_one = single.update([experience.select(r) for r in rows], one_rank,
                                          _step(experience, mini_batches, str(tmp_path / "one")))

    # Two ranks on the two actor workers, starting from the same initial weights.
    client = shared_cluster.client
    recipe = functools.partial(actor.ActorRole, tiny_model, device="cpu", lr=1e-2, strategy=strategy)
    client.register_plugin(RoleHost("actor", recipe, torch_threads=1), name=plugin_name("actor"))
    workers = [w["address"] for w in shared_cluster.workers_of("actor")]
    port = client.run(free_port, workers=[workers[0]])[workers[0]]
    host = live_workers(client)[workers[0]]["host"]
    shards = rank_shards(len(experience), 2, mini_batches)
    step = _step(experience, mini_batches, str(tmp_path / "two"))
    futures = [submit(client, "actor", actor.update, [experience.select(r) for r in shards[rank]],
                      GroupInfo(rank, 2, f"tcp://{host}:{port}", "gloo", 0, 60, strategy=strategy), step, workers=[address])
               for rank, address in enumerate(workers)]
    (stats_r0, handle_two), (_, handle_r1) = client.gather(futures)

    assert handle_r1 is None  # only rank 0 publishes
    one, two = weights.load_snapshot(handle_one), weights.load_snapshot(handle_two)
    initial = load_causal_lm(tiny_model).state_dict()
    assert any(not torch.equal(one[name], initial[name]) for name in one)  # the update did something
    for name in one:
        torch.testing.assert_close(two[name], one[name], rtol=1e-4, atol=1e-5, msg=name)
