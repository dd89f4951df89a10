"""An update on two actor workers (one gloo group, ddp or fsdp) equals the update on one,
also when the ranks hold different numbers of rows."""

from __future__ import annotations


import functools
import sys

import cloudpickle
import pytest
import torch

from pipeline import weights
from pipeline.engines.hf import HFEngine
from pipeline.models import load_causal_lm, load_tokenizer
from pipeline.records import Experience, GenerationRequest, rank_shards
from pipeline.roles import actor
from pipeline.roles.host import RoleHost, plugin_name, role_state
from pipeline.roles.training import GroupInfo
from pipeline.fleet.tasks import submit
from pipeline.fleet.groups import free_port
from resources.cluster import live_workers

cloudpickle.register_pickle_by_value(sys.modules[__name__])   # the counting recipe runs on the workers


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


def _step(experience: Experience, mini_batches: int, snapshot_dir: str, pack: bool = True) -> actor.PolicyStep:
    blocks = torch.arange(len(experience)).tensor_split(mini_batches)
    return actor.PolicyStep(clip_ratio=0.2, kl_coef_in_loss=0.1, temperature=1.0, micro_batch_size=2, epochs=2,
                            is_cap=2.0, normalizers=tuple(float(experience.response_mask[b].sum()) for b in blocks),
                            next_version=1, snapshot_dir=snapshot_dir, pack_sequences=pack)


def _one_rank(experience: Experience, tiny_model: str, mini_batches: int, snapshot_dir: str,
              pack: bool = True) -> dict:
    """The reference: the whole update on one rank, in this process; its published weights."""
    single = actor.ActorRole(tiny_model, device="cpu", lr=1e-2, strategy="none")
    one_rank = GroupInfo(rank=0, world_size=1, init_method="", backend="gloo", generation=0, timeout_seconds=60)
    rows = rank_shards(len(experience), 1, mini_batches)[0]
    _, handle = single.update([experience.select(r) for r in rows], one_rank,
                              _step(experience, mini_batches, snapshot_dir, pack))
    return weights.load_snapshot(handle)


def _two_ranks(cluster, recipe, experience: Experience, mini_batches: int, strategy: str, snapshot_dir: str,
               step: actor.PolicyStep | None = None):
    """The update on the two actor workers, each a fresh `recipe()` role; (rank 0's
    weights, rank 1's handle). `step`: the update's settings (default: _step's)."""
    client = cluster.client
    client.register_plugin(RoleHost("actor", recipe, torch_threads=1), name=plugin_name("actor"))
    workers = [w["address"] for w in cluster.workers_of("actor")]
    port = client.run(free_port, workers=[workers[0]])[workers[0]]
    host = live_workers(client)[workers[0]]["host"]
    shards = rank_shards(len(experience), 2, mini_batches)
    step = step or _step(experience, mini_batches, snapshot_dir)
    futures = [submit(client, "actor", actor.update, [experience.select(r) for r in shards[rank]],
                      GroupInfo(rank, 2, f"tcp://{host}:{port}", "gloo", 0, 60, strategy=strategy), step, workers=[address])
               for rank, address in enumerate(workers)]
    (_, handle), (_, handle_r1) = client.gather(futures)
    return weights.load_snapshot(handle), handle_r1


def _assert_same_update(two: dict, one: dict, tiny_model: str, atol: float = 1e-4) -> None:
    """The same sums in another order: one rank's micro-batches hold other rows than two
    ranks' do, and packed rows (train.pack_sequences) compute a row's tokens beside other
    rows', so the gradients agree to float32 rounding. Adam's first steps move each weight by
    about lr x sign(gradient), so the few weights whose gradient is near 0 (about AdamW's
    eps) amplify that rounding: some of the 8k weights of a matrix end up to 1e-4 apart
    (measured on one rank: 72 of 80k weights past 1e-6 between 1- and 2-row padded
    micro-batches, 231 between packed ones), all others within 1e-6."""
    initial = load_causal_lm(tiny_model).state_dict()
    assert any(not torch.equal(one[name], initial[name]) for name in one)  # the update did something
    for name in one:
        torch.testing.assert_close(two[name], one[name], rtol=1e-4, atol=atol, msg=name)
    differ = sum(int(((two[name] - one[name]).abs() > 1e-6).sum()) for name in one)
    assert differ <= 5e-3 * sum(t.numel() for t in one.values())


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_rank_update_matches_one_rank(strategy, shared_cluster, tiny_model, tmp_path):
    experience, mini_batches = _experience(tiny_model), 2
    one = _one_rank(experience, tiny_model, mini_batches, str(tmp_path / "one"))
    recipe = functools.partial(actor.ActorRole, tiny_model, device="cpu", lr=1e-2, strategy=strategy)
    two, handle_r1 = _two_ranks(shared_cluster, recipe, experience, mini_batches, strategy, str(tmp_path / "two"))
    assert handle_r1 is None  # only rank 0 publishes
    _assert_same_update(two, one, tiny_model)


def counting_actor(model_dir: str, strategy: str) -> actor.ActorRole:
    """Recipe: an actor role that notes the rows of every forward of its model."""
    role = actor.ActorRole(model_dir, device="cpu", lr=1e-2, strategy=strategy)
    role.forward_rows = []
    role.trainer.model.get_input_embeddings().register_forward_pre_hook(
        lambda module, args, kwargs: role.forward_rows.append((args[0] if args else kwargs["input"]).shape[0]),
        with_kwargs=True)
    return role


def forward_rows() -> list[int]:
    return role_state("actor").forward_rows


def test_fsdp_ranks_with_unequal_rows_run_as_many_micro_batches(shared_cluster, tiny_model, tmp_path):
    # 5 rows on 2 ranks: 3 and 2. At 2 rows per micro-batch rank 0 needs 2 micro-batches;
    # rank 1 runs as many (1 row each) instead of 1 of 2 rows, or rank 0 would wait in its
    # second forward's all-gather forever. Two epochs: the proximal logprobs are a forward
    # pass of their own, then one optimizer step per epoch. Unpacked: a packed micro-batch
    # would be one row whatever its rows.
    experience = _experience(tiny_model).select(slice(0, 5))
    one = _one_rank(experience, tiny_model, 1, str(tmp_path / "one"), pack=False)
    recipe = functools.partial(counting_actor, tiny_model, "fsdp")
    step = _step(experience, 1, str(tmp_path / "two"), pack=False)
    two, _ = _two_ranks(shared_cluster, recipe, experience, 1, "fsdp", str(tmp_path / "two"), step)
    client, workers = shared_cluster.client, [w["address"] for w in shared_cluster.workers_of("actor")]
    rows = [submit(client, "actor", forward_rows, workers=[address]).result() for address in workers]
    assert rows == [[2, 1] * 3, [1, 1] * 3]
    _assert_same_update(two, one, tiny_model)   # 3 micro-batches on one rank, 2 + 2 on two
